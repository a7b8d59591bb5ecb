import numpy as np
import pytest

from sim import fastest_run, simulate
from sim.timing import TimingModel
from turnip.machine.bound import floor_estimate, lower_bound
from turnip.machine.profile import h100
from turnip.memgraph.timeline import memory_timeline, peak_bytes
from turnip.sched import POLICIES
from turnip.sched.testing import chain, make_memgraph, random_memgraph

pytestmark = pytest.mark.sim

# 1 flop/ns kernels, 1 byte/ns copies, no latency, no noise: makespans by hand
EXACT = h100().replace(
    fp16_flops_per_s=1e9, hbm_bytes_per_s=1e18, kernel_efficiency=1.0, kernel_min_ns=0,
    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, pcie_both_bytes_per_s=1e9, copy_latency_ns=0,
    p2p_bytes_per_s=1e9, p2p_latency_ns=0, kernel_launch_ns=1000, gemm_launch_ns=None, attn_launch_ns=None,
    copy_launch_ns=1000, completion_ns=500,
    kernel_slowdown_with_copies=1.0, kernel_excess_mean=0.0, kernel_contended_excess_mean=0.0,
    h2d_excess_mean=0.0, h2d_contended_excess_mean=0.0, d2h_excess_mean=0.0, d2h_contended_excess_mean=0.0,
    p2p_excess_mean=0.0, stall_prob=0.0, peak_fp16_flops_per_s=1e9, peak_hbm_bytes_per_s=1e18,
)  # fmt: skip


def run_policy(mg, policy, seed=0, mean_only=False, prof=None):
    """One simulated run under any policy; det-replay replays the fastest of 3 nondet runs."""
    prof = prof or h100()
    order = fastest_run(mg, prof, range(3), mean_only).order if policy == "det-replay" else None
    return simulate(mg, prof, policy, seed, mean_only, order=order)


def test_chain_makespan_by_hand():
    r = simulate(chain(3, flops=1000), EXACT, mean_only=True)
    assert r.makespan_ns == 3 * (1000 + 1000 + 500)
    assert floor_estimate(TimingModel(chain(3, flops=1000), EXACT))["estimate_ns"] == r.makespan_ns  # host costs in
    assert r.lower_bound_ns == r.bound["critical_path_ns"] == 3 * 1000  # the bound: the kernels alone


def test_a_completion_costs_its_handling_and_more_per_command_it_hands_back():
    """handle_ns 300 + 200 per command: k0 -> {k1, k2}; k0's completion hands back two commands (700 ns of
    handling before k1 is issued), k1's and k2's none (300 ns each)."""
    prof = EXACT.replace(handle_ns=300, handle_per_cmd_ns=200)
    mg = make_memgraph(["kernel", "kernel", "kernel"], [[], [0], [0]], flops=[1000, 1000, 1000])
    r = simulate(mg, prof, mean_only=True)
    assert r.handle_ns.tolist() == [700, 300, 300]
    # k0 issued 1000, ends 2000, seen 2500, handled until 3200; k1 issued 4200, k2 5200 (one engine: ends 6200)
    assert r.issue_ns.tolist() == [1000, 4200, 5200] and r.done_ns.tolist() == [2500, 5700, 6700]
    assert r.host_cost_ns().tolist() == [1700, 1300, 1300]
    b, est = lower_bound(TimingModel(mg, prof)), floor_estimate(TimingModel(mg, prof))
    assert est["critical_path_ns"] == 1000 + 1000 + 500 + 500 + 1000 + 1000 + 500  # one hand-over: 300 + 200
    assert b["critical_path_ns"] == 2000  # two kernels one after the other, no host costs
    assert b["host_ns"] == est["host_ns"] == 3000 + 3 * 300 + 2 * 200 - 300
    assert b["lower_bound_ns"] == 3000 <= r.makespan_ns  # one engine: three kernels


@pytest.mark.parametrize("policy", POLICIES)
def test_lower_bound_below_every_makespan_with_per_command_handling(policy):
    """Large per-command handling, with and without resident inputs (they complete nothing in a run, so a
    kernel that reads only them is issued at the start, not handed back by a completion)."""
    prof = h100().replace(handle_ns=1000, handle_per_cmd_ns=100_000)
    for seed in range(6):
        mg = random_memgraph(np.random.default_rng(seed), 120, 1 + seed % 3, p_edge=0.03)
        if seed % 2:
            for v in np.flatnonzero(mg.kind == 0)[::2]:
                mg.params[v]["resident"] = True
        r = run_policy(mg, policy, seed, prof=prof)
        assert 0 < r.lower_bound_ns <= r.makespan_ns, r.bound


def test_kernels_reading_only_resident_inputs_go_at_the_start():
    """Eight resident inputs, each read by its own kernel: no kernel waits for a command, so only the three
    that find the GPU's five stream slots taken are handed back by a completion (the host's bound counts their
    per-command handling, no more); the chain bound counts no completion of a resident input."""
    mg = make_memgraph(["input"] * 8 + ["kernel"] * 8, [[]] * 8 + [[i] for i in range(8)], flops=[0] * 8 + [1000] * 8)
    for v in range(8):
        mg.params[v]["resident"] = True
    prof = EXACT.replace(handle_ns=1000, handle_per_cmd_ns=100_000)
    r = simulate(mg, prof, mean_only=True)
    b, est = lower_bound(TimingModel(mg, prof)), floor_estimate(TimingModel(mg, prof))
    assert (r.handle_ns[8:] - 1000).sum() == 3 * 100_000  # three commands handed back in the run
    # issue and handling of the 8 kernels (the last only seen) and the three commands handed back
    assert b["host_ns"] == est["host_ns"] == 8 * 1000 + 8 * 1000 - 1000 + 3 * 100_000
    assert est["critical_path_ns"] == 1000 + 1000 + 500  # one kernel's launch, run and completion
    assert b["critical_path_ns"] == 1000 and b["kernel_ns"] == 8 * 1000  # resident inputs cost nothing
    assert b["lower_bound_ns"] <= r.makespan_ns


def test_a_host_link_factor_slows_host_copies_only():
    """``link=2``: a 4000-byte load pushes for 8000 ns instead of 4000 (no latency in EXACT), the kernel after
    it keeps its time, the peer copy too; the bound follows the slower link."""
    mg = make_memgraph(["input", "kernel", "transfer"], [[], [0], [1]], n_gpus=2, gpus=[0, 0, 1],
                       src_gpus=[-1, 0, 0], flops=[0, 1000, 0], nbytes=[4000, 1000, 500])  # fmt: skip
    one, two = (simulate(mg, EXACT, mean_only=True, link=f) for f in (1.0, 2.0))
    dur = lambda r: (r.end_ns - r.start_ns).tolist()  # noqa: E731
    assert dur(one) == [4000, 1000, 500] and dur(two) == [8000, 1000, 500]
    assert two.makespan_ns == one.makespan_ns + 4000
    assert two.bound["link_ns"] == 2 * one.bound["link_ns"] == 8000 and two.lower_bound_ns <= two.makespan_ns
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="link factor"):
            simulate(mg, EXACT, link=bad)


def test_the_link_factor_is_drawn_per_run_from_the_profile_and_a_given_one_replaces_it():
    """``link_excess_sd`` > 0: each run draws its own link factor (median 1) after every other draw; with
    ``host_link_corr`` 1 it moves with the host factor, exp(sd_link / sd_host x log host), and so it does when
    the host factor is given; a given ``link`` overrides it; mean-only runs take 1; with no link spread nothing
    else changes, draw for draw."""
    mg = make_memgraph(["input", "kernel", "transfer"], [[], [0], [1]], n_gpus=2, gpus=[0, 0, 1],
                       src_gpus=[-1, 0, 0], flops=[0, 1000, 0], nbytes=[4000, 1000, 500])  # fmt: skip
    both = EXACT.replace(host_excess_sd=0.2, link_excess_sd=0.1, host_link_corr=1.0)
    tm = TimingModel(mg, both)
    for s in range(5):
        d0 = TimingModel(mg, EXACT.replace(host_excess_sd=0.2)).draws(np.random.default_rng(s))
        d = tm.draws(np.random.default_rng(s))
        assert d0.link_z == 0.0 and d.host == d0.host and (d.factor == d0.factor).all()
        r = simulate(mg, both, seed=s)
        assert r.host_factor == d.host and np.log(r.link_factor) == pytest.approx(0.5 * np.log(d.host))
        assert r.makespan_ns == simulate(mg, both, seed=s, link=r.link_factor).makespan_ns
        assert abs((r.end_ns - r.start_ns)[0] - 4000 * r.link_factor) <= 1  # the load pushes its bytes slower
        assert r.lower_bound_ns <= r.makespan_ns
        slow = simulate(mg, both, seed=s, host=2.0)  # a given host factor: the link follows it
        assert slow.host_factor == 2.0 and slow.link_factor == pytest.approx(np.sqrt(2.0))
    assert simulate(mg, both, seed=3, link=1.0).makespan_ns == simulate(mg, both.replace(link_excess_sd=0.0),
                                                                        seed=3).makespan_ns  # fmt: skip
    m = simulate(mg, both, mean_only=True)
    assert (m.host_factor, m.link_factor) == (1.0, 1.0)
    assert m.makespan_ns == simulate(mg, EXACT, mean_only=True).makespan_ns
    apart = TimingModel(mg, EXACT.replace(host_excess_sd=0.2, link_excess_sd=0.1, host_link_corr=0.0))
    d = [apart.draws(np.random.default_rng(s)) for s in range(400)]
    h, k = np.log([x.host for x in d]), np.log([apart.link_factor(x.host, x.link_z) for x in d])
    assert abs(np.corrcoef(h, k)[0, 1]) < 0.2 and k.std() == pytest.approx(0.1, rel=0.15)
    only = TimingModel(mg, EXACT.replace(link_excess_sd=0.1, host_link_corr=1.0))  # no host spread: the link alone
    x, y = (t.draws(np.random.default_rng(1)) for t in (only, TimingModel(mg, EXACT)))
    assert x.host == 1.0 and x.link_z != 0.0 and only.link_factor(1.0, x.link_z) == np.exp(0.1 * x.link_z)
    assert (x.factor == y.factor).all() and y.link_z == 0.0


@pytest.mark.parametrize("link", [0.5, 2.0])
def test_lower_bound_below_every_makespan_at_a_link_factor(link):
    for seed in range(4):
        mg = random_memgraph(np.random.default_rng(seed), 120, 1 + seed % 3, p_edge=0.03)
        for pol in ("nondet", "det"):
            r = simulate(mg, h100(), pol, seed, link=link)
            assert 0 < r.lower_bound_ns <= r.makespan_ns


def test_kernels_share_one_compute_engine():
    mg = make_memgraph(["kernel", "kernel"], [[], []], flops=[1000, 1000])
    r = simulate(mg, EXACT, mean_only=True)
    # host issues at 1000 and 2000; the second kernel queues behind the first until 2000
    assert r.start_ns.tolist() == [1000, 2000] and r.end_ns.tolist() == [2000, 3000]
    assert r.makespan_ns == 3500


def test_both_link_directions_share_bandwidth():
    # k0 tiny kernel; i1 loads 4000 B; o2 offloads 1000 B after k0.
    # i1 alone 2000..3500 (1500 B), shared at 0.5 B/ns with o2 3500..5500, alone again 5500..7000.
    mg = make_memgraph(["kernel", "input", "offload"], [[], [], [0]], flops=[1000, 0, 0],
                       nbytes=[1000, 4000, 1000])  # fmt: skip
    r = simulate(mg, EXACT, mean_only=True)
    assert r.start_ns.tolist() == [1000, 2000, 3500]
    assert r.end_ns.tolist() == [2000, 7000, 5500]
    assert r.makespan_ns == 7500


def test_transfer_uses_p2p_link():
    mg = make_memgraph(["kernel", "transfer"], [[], [0]], n_gpus=2, gpus=[0, 1], src_gpus=[0, 0],
                       flops=[1000, 0], nbytes=[500, 500])  # fmt: skip
    r = simulate(mg, EXACT, mean_only=True)
    assert r.end_ns[1] - r.start_ns[1] == 500 and r.makespan_ns == 2500 + 1000 + 500 + 500


def test_copies_out_of_a_gpu_queue_when_its_ports_are_serial():
    """k0 on GPU 0, then its result to GPUs 1 and 2 (issued 1000 ns apart): independent pairs overlap; with
    ``p2p_ports_serial`` the second copy out of GPU 0 waits for the first, and the bound adds them up."""
    mg = make_memgraph(["kernel", "transfer", "transfer"], [[], [0], [0]], n_gpus=3, gpus=[0, 1, 2],
                       src_gpus=[0, 0, 0], flops=[1000, 0, 0], nbytes=[500, 1500, 1500])  # fmt: skip
    free = simulate(mg, EXACT, mean_only=True)
    assert free.start_ns.tolist() == [1000, 3500, 4500] and free.end_ns.tolist()[1:] == [5000, 6000]
    serial = simulate(mg, EXACT.replace(p2p_ports_serial=True), mean_only=True)
    assert serial.start_ns.tolist() == [1000, 3500, 5000] and serial.end_ns.tolist()[1:] == [5000, 6500]
    assert lower_bound(TimingModel(mg, EXACT))["link_ns"] == 1500
    assert lower_bound(TimingModel(mg, EXACT.replace(p2p_ports_serial=True)))["link_ns"] == 3000
    into = make_memgraph(["kernel", "kernel", "transfer", "transfer"], [[], [], [0], [1]], n_gpus=3,
                         gpus=[1, 2, 0, 0], src_gpus=[1, 2, 1, 2], flops=[1000, 1000, 0, 0],
                         nbytes=[500, 500, 1500, 1500])  # fmt: skip
    r = simulate(into, EXACT.replace(p2p_ports_serial=True), mean_only=True)
    assert r.start_ns[3] == r.end_ns[2] or r.start_ns[2] == r.end_ns[3]  # one copy into GPU 0 at a time


def test_a_gpu_to_gpu_copy_slows_its_gpus_kernels_by_its_own_factor():
    """k0 on GPU 0 hands back a copy to GPU 1 and k1 on GPU 1, which runs while the copy does: slowed by
    ``kernel_slowdown_with_p2p`` (0: by ``kernel_slowdown_with_copies``, as any copy)."""
    mg = make_memgraph(["kernel", "transfer", "kernel"], [[], [0], [0]], n_gpus=2, gpus=[0, 1, 1],
                       src_gpus=[0, 0, 1], flops=[1000, 0, 1000], nbytes=[500, 5000, 500])  # fmt: skip
    durations = {}
    for p2p in (0.0, 2.0):
        r = simulate(mg, EXACT.replace(kernel_slowdown_with_copies=1.5, kernel_slowdown_with_p2p=p2p), mean_only=True)
        assert r.start_ns[2] < r.end_ns[1]  # k1 runs during the copy
        durations[p2p] = int(r.end_ns[2] - r.start_ns[2])
    assert durations == {0.0: 1500, 2.0: 2000}


@pytest.mark.parametrize("flops,hbm,want", [(1000, 4e9, 1250), (0, 1e9, 2000), (1000, 1e18, 1000)])
def test_by_memory_share_a_copy_slows_a_kernel_by_its_roofline_memory_share(flops, hbm, want):
    """``p2p_slowdown_memory_share``: k1 (1000 bytes read and written) beside a GPU<->GPU copy is slowed by 1 + (2 -
    1) x the memory share of its roofline: a quarter (1000 flops, 250 ns of bytes): 1250 ns; all of it (no flops,
    1000 ns of bytes): 2000; none (bytes free): 1000."""
    mg = make_memgraph(["kernel", "transfer", "kernel"], [[], [0], [0]], n_gpus=2, gpus=[0, 1, 1],
                       src_gpus=[0, 0, 1], flops=[1000, 0, flops], nbytes=[500, 5000, 500])  # fmt: skip
    prof = EXACT.replace(kernel_slowdown_with_p2p=2.0, p2p_slowdown_memory_share=True, hbm_bytes_per_s=hbm,
                         peak_hbm_bytes_per_s=hbm)  # fmt: skip
    r = simulate(mg, prof, mean_only=True)
    assert r.start_ns[2] < r.end_ns[1]  # k1 runs during the copy
    assert int(r.end_ns[2] - r.start_ns[2]) == want
    assert int(simulate(mg, prof.replace(p2p_slowdown_memory_share=False), mean_only=True).end_ns[2]
               - r.start_ns[2]) == 2 * max(flops, 1000 * 1e9 / hbm)  # fmt: skip


def test_a_kernel_issued_for_another_gpu_than_the_last_command_pays_the_switch():
    """Three kernels ready at the start on GPUs 0, 1, 1 (the host starts on GPU 0): the second pays
    ``gpu_switch_launch_ns``, the first and third do not; on one GPU nothing does."""
    mg = make_memgraph(["kernel"] * 3, [[], [], []], n_gpus=2, gpus=[0, 1, 1], flops=[1000] * 3)
    r = simulate(mg, EXACT.replace(gpu_switch_launch_ns=500), mean_only=True)
    assert r.issue_ns.tolist() == [1000, 2500, 3500]
    assert simulate(mg, EXACT, mean_only=True).issue_ns.tolist() == [1000, 2000, 3000]


def test_same_seed_same_result_and_seeds_differ():
    mg = random_memgraph(np.random.default_rng(3), 200, 2, p_edge=0.02)
    a, b, c = (simulate(mg, h100(), "nondet", seed=s) for s in (7, 7, 8))
    assert a.makespan_ns == b.makespan_ns and (a.end_ns == b.end_ns).all()
    assert a.makespan_ns != c.makespan_ns


def test_mean_only_has_no_variance():
    mg = random_memgraph(np.random.default_rng(4), 200, 2, p_edge=0.02)
    assert len({simulate(mg, h100(), "nondet", seed=s, mean_only=True).makespan_ns for s in range(3)}) == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_lower_bound_below_every_makespan(policy):
    for seed in range(6):
        mg = random_memgraph(np.random.default_rng(seed), 120, 1 + seed % 3, p_edge=0.03)
        for mean_only in (False, True):
            r = run_policy(mg, policy, seed, mean_only)
            assert 0 < r.lower_bound_ns <= r.makespan_ns


def test_chain_without_variance_det_equals_nondet():
    mg = chain(30, flops=1e11)
    runs = {p: run_policy(mg, p, mean_only=True).makespan_ns for p in POLICIES}
    assert len(set(runs.values())) == 1


def test_bound_parts():
    mg = chain(4, flops=1000)
    b = lower_bound(TimingModel(mg, EXACT))
    assert b["kernel_ns"] == b["critical_path_ns"] == 4000 and b["host_ns"] == 4000 and b["link_ns"] == 0
    assert b["lower_bound_ns"] == max(b["critical_path_ns"], b["kernel_ns"], b["link_ns"])  # host_ns: reported
    fast = lower_bound(TimingModel(mg, EXACT.replace(peak_fp16_flops_per_s=4e9)))  # a kernel may beat the model
    assert fast["kernel_ns"] == fast["lower_bound_ns"] == 1000
    est = floor_estimate(TimingModel(mg, EXACT))
    assert est["estimate_ns"] == max(est["critical_path_ns"], est["kernel_ns"], est["host_ns"]) > 4000


def test_random_graph_memory_within_budget():
    for seed in range(5):
        mg = random_memgraph(np.random.default_rng(seed), 150, 2, p_edge=0.03)
        r = simulate(mg, h100(), "nondet", seed=seed)
        tl = memory_timeline(mg, r.start_ns, r.end_ns, r.makespan_ns)
        assert (tl["bytes_in_use"] >= 0).all()
        assert (peak_bytes(tl, mg.n_gpus) <= mg.budget_nbytes).all()


def test_plan_larger_than_machine():
    mg = make_memgraph(["kernel"], [[]], n_gpus=9, gpus=[8])
    with pytest.raises(ValueError, match="9 GPUs"):
        simulate(mg, h100())


def test_det_replay_repeats_the_recorded_run_and_keeps_its_order_under_other_seeds():
    from turnip.sched.replay import engine_orders

    for seed in range(8):
        mg = random_memgraph(np.random.default_rng(seed), 150, 1 + seed % 3, p_edge=0.03)
        for mean_only in (False, True):  # same seed: the very run that was recorded
            a = simulate(mg, h100(), "nondet", seed, mean_only)
            b = simulate(mg, h100(), "det-replay", seed, mean_only, order=a.order)
            assert (b.order == a.order).all() and (b.end_ns == a.end_ns).all()
        c = simulate(mg, h100(), "det-replay", seed + 100, order=a.order)
        assert engine_orders(mg, c.order) == engine_orders(mg, a.order)
        assert sorted(c.order.tolist()) == list(range(mg.n))


def test_fastest_run_is_the_fastest_seed():
    mg = random_memgraph(np.random.default_rng(5), 150, 2, p_edge=0.03)
    times = [simulate(mg, h100(), "nondet", s).makespan_ns for s in range(4)]
    best = fastest_run(mg, h100(), range(4))
    assert best.makespan_ns == min(times) and best.seed == int(np.argmin(times))
    with pytest.raises(ValueError, match="order="):
        simulate(mg, h100(), "det-replay")
