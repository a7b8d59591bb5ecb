"""The host behind the GPUs' links: its caps in the simulator (``sim.engine.Simulation._share``) and in the lower
bound (``turnip.machine.bound``), and a bound no simulated run beats."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim import simulate
from sim.timing import TimingModel
from turnip.machine.bound import floor_estimate, host_rates, lower_bound
from turnip.machine.profile import HOST_TOTALS, h100
from turnip.memgraph.build import BudgetError, build_memgraph
from turnip.memgraph.verify import verify
from turnip.models import random_dag
from turnip.sched.testing import make_memgraph
from turnip.taskgraph import Builder

pytestmark = pytest.mark.sim

GiB = 1 << 30
NO_CAPS = dict.fromkeys(HOST_TOTALS, ())
QUIET = h100().replace(copy_latency_ns=0, h2d_excess_mean=0.0, d2h_excess_mean=0.0, stall_prob=0.0)
# 1 byte/ns links, no latency, no noise; the host: 1.5 B/ns for two GPUs, 2 B/ns for three or more
EXACT = h100().replace(
    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, pcie_both_bytes_per_s=1e9, copy_latency_ns=0, copy_launch_ns=1000,
    kernel_launch_ns=1000, gemm_launch_ns=None, attn_launch_ns=None, completion_ns=500, fp16_flops_per_s=1e9,
    hbm_bytes_per_s=1e18, kernel_efficiency=1.0, kernel_min_ns=0, kernel_slowdown_with_copies=1.0,
    kernel_excess_mean=0.0, kernel_contended_excess_mean=0.0, h2d_excess_mean=0.0, h2d_contended_excess_mean=0.0,
    d2h_excess_mean=0.0, d2h_contended_excess_mean=0.0, stall_prob=0.0,
    host_h2d_total_bytes_per_s=(1e9, 1.5e9, 2e9), host_d2h_total_bytes_per_s=(1e9, 1.5e9, 2e9),
    host_both_total_bytes_per_s=(1e9, 1.5e9, 2e9),
)  # fmt: skip


def loads(n_gpus: int, nbytes: int = GiB):
    """Every GPU loads one ``nbytes`` input from the host and reduces it to four values."""
    b = Builder(n_gpus)
    outs = [b.kernel("mix", [b.input((nbytes // 2,), "fp16", g, f"w{g}")], (4,), "fp16", g, {"n_out": 4})
            for g in range(n_gpus)]  # fmt: skip
    tg = b.build(outputs=outs)
    mg = build_memgraph(tg, nbytes + (1 << 20))
    assert verify(mg, tg) == []
    return mg


def load_span_ns(mg, r) -> int:
    """From the first host copy's start to the last one's end."""
    sel = mg.kind == mg.kind[0]  # the inputs
    return int(r.end_ns[sel].max() - r.start_ns[sel].min())


@pytest.mark.parametrize(("n_gpus", "total_bytes_per_s"), [(1, 54e9), (2, 104.0e9), (4, 159.2e9)])
def test_gpus_loading_at_once_share_the_host(n_gpus, total_bytes_per_s):
    """One 1 GiB load per GPU at once: with the h100 host's caps they take all the bytes over the host's total
    for that many GPUs; each GPU on its own link takes one GiB over one link's rate, however many there are."""
    mg = loads(n_gpus)
    capped, own = simulate(mg, QUIET, mean_only=True), simulate(mg, QUIET.replace(**NO_CAPS), mean_only=True)
    assert load_span_ns(mg, capped) == pytest.approx(n_gpus * GiB / total_bytes_per_s * 1e9, rel=2e-3)
    assert load_span_ns(mg, own) == pytest.approx(GiB / 54e9 * 1e9, rel=2e-3)
    slow = simulate(mg, QUIET, mean_only=True, link=2.0)  # a slow host link is slow for every GPU
    assert load_span_ns(mg, slow) == pytest.approx(2 * load_span_ns(mg, capped), rel=2e-3)
    assert capped.lower_bound_ns <= capped.makespan_ns and slow.lower_bound_ns <= slow.makespan_ns
    if n_gpus == 1:  # one GPU: the caps are not even looked at
        assert (capped.end_ns == own.end_ns).all() and capped.bound == own.bound


def test_one_gpu_runs_as_it_did_whatever_the_host():
    """On one GPU the host's caps never apply: every run, drawn or not, equal vertex for vertex."""
    from turnip.sched.testing import random_memgraph

    for seed in range(4):
        mg = random_memgraph(np.random.default_rng(seed), 150, 1, p_edge=0.03)
        for mean_only in (False, True):
            a, b = (simulate(mg, p, "nondet", seed, mean_only) for p in (h100(), h100().replace(**NO_CAPS)))
            assert a.makespan_ns == b.makespan_ns and (a.end_ns == b.end_ns).all() and a.bound == b.bound


def test_the_bounds_link_part_grows_with_the_host():
    """Four GPUs loading 1 GiB each: the bound's link part is the host's (4 GiB at 159.2 GB/s), not one link's."""
    mg = loads(4)
    capped, own = lower_bound(TimingModel(mg, QUIET)), lower_bound(TimingModel(mg, QUIET.replace(**NO_CAPS)))
    assert own["link_ns"] == pytest.approx(GiB / 54e9 * 1e9, rel=1e-6)
    assert capped["link_ns"] == pytest.approx(4 * GiB / 159.2e9 * 1e9, rel=1e-6) and capped["link_ns"] > own["link_ns"]
    assert capped["lower_bound_ns"] <= simulate(mg, QUIET, mean_only=True).makespan_ns


def test_host_rates_the_most_any_number_of_gpus_reaches():
    p = h100()
    assert host_rates(p, 1) == (54e9, 55e9, 84e9)  # one link: its own rates
    assert host_rates(p, 2) == (104.0e9, 106.7e9, 108.6e9)
    assert host_rates(p, 8) == (159.2e9, 123.9e9, 159.2e9)  # loads alone beat the host's both-ways total
    assert host_rates(p.replace(**NO_CAPS), 4) == (4 * 54e9, 4 * 55e9, 4 * 84e9)


def test_three_loads_share_the_host_by_hand():
    """Three 6000-byte loads issued 1000 ns apart on three GPUs: alone at 1 B/ns, two at 0.75 each (1.5 B/ns),
    three at 2/3 each (2 B/ns); as each ends the others speed up again."""
    mg = make_memgraph(["input"] * 3, [[], [], []], n_gpus=3, gpus=[0, 1, 2], nbytes=[6000] * 3)
    r = simulate(mg, EXACT, mean_only=True)
    assert r.start_ns.tolist() == [1000, 2000, 3000]
    # by 3000: 1750 and 750 bytes through; the first ends 4250 / (2/3) later, at 9375; then two at 0.75 each:
    # the second's last 1000 bytes end at 10708.3, the third's last 750 alone at 11458.3
    assert r.end_ns.tolist() == pytest.approx([9375, 10708, 11458], abs=2)
    own = simulate(mg, EXACT.replace(**NO_CAPS), mean_only=True)
    assert own.end_ns.tolist() == [7000, 8000, 9000]


def test_both_directions_share_the_host_total():
    """GPU 0 loads 8000 bytes from 1000 ns; GPU 1 offloads 3000 bytes from 4500 ns (after its kernel): two GPUs
    copying both ways at 1.5 B/ns together, 0.75 each, until the offload ends at 8500."""
    mg = make_memgraph(["input", "kernel", "offload"], [[], [], [1]], n_gpus=2, gpus=[0, 1, 1],
                       flops=[0, 1000, 0], nbytes=[8000, 1000, 3000])  # fmt: skip
    r = simulate(mg, EXACT, mean_only=True)
    assert r.start_ns.tolist() == [1000, 2000, 4500]
    assert r.end_ns.tolist() == pytest.approx([10000, 3000, 8500], abs=2)
    assert simulate(mg, EXACT.replace(**NO_CAPS), mean_only=True).end_ns.tolist() == [9000, 3000, 7500]


def slow_link(p):
    """``p`` with host links (and the host) 10,000 times slower: a random DAG's KiB-sized copies then weigh."""
    tables = {k: tuple(x * 1e-4 for x in getattr(p, k)) for k in HOST_TOTALS}
    return p.replace(h2d_bytes_per_s=p.h2d_bytes_per_s * 1e-4, d2h_bytes_per_s=p.d2h_bytes_per_s * 1e-4,
                     pcie_both_bytes_per_s=p.pcie_both_bytes_per_s * 1e-4, **tables)  # fmt: skip


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_gpus=st.integers(1, 4),
    kib=st.sampled_from([6, 8, 12, 24, 1024]),
    caps=st.booleans(),
    slow=st.booleans(),
    policy=st.sampled_from(["nondet", "det"]),
    link=st.sampled_from([None, 0.5, 2.0]),
    ports=st.booleans(),
)
def test_no_simulated_run_beats_the_bound(seed, n_gpus, kib, caps, slow, policy, link, ports):
    tg = random_dag(np.random.default_rng(seed), n_kernels=40, n_gpus=n_gpus)
    try:
        mg = build_memgraph(tg, kib * 1024)
    except BudgetError:
        return
    assert verify(mg, tg) == []
    prof = h100() if caps else h100().replace(**NO_CAPS)
    prof = (slow_link(prof) if slow else prof).replace(link_excess_sd=0.1, host_excess_sd=0.2, p2p_ports_serial=ports)
    for mean_only in (True, False):
        r = simulate(mg, prof, policy, seed, mean_only, link=link)
        assert 0 < r.lower_bound_ns <= r.makespan_ns, r.bound
    b, est = lower_bound(TimingModel(mg, prof)), floor_estimate(TimingModel(mg, prof))
    assert b["kernel_ns"] <= est["kernel_ns"] and b["critical_path_ns"] <= est["critical_path_ns"]
    assert b["host_ns"] == est["host_ns"]


def test_the_bound_holds_behind_the_calibrated_host():
    """Plans of 2-4 GPUs on the calibrated H100 (measured tables, power limit) and its host's caps."""
    from turnip.machine.profile import load_profile

    prof = load_profile("h100-calibrated")
    for n_gpus in (2, 4):
        mg = loads(n_gpus, 64 << 20)
        own = TimingModel(mg, prof.replace(**NO_CAPS))
        for seed in range(3):
            r = simulate(mg, prof, "nondet", seed)
            assert 0 < r.lower_bound_ns <= r.makespan_ns, r.bound
            own_ns = lower_bound(own, link=r.link_factor)["link_ns"]
            # the host's, not a link's: two of its GPUs load at full speed (109.5 GB/s), four do not (169.5)
            assert r.bound["link_ns"] > own_ns if n_gpus == 4 else r.bound["link_ns"] >= own_ns
