"""The simulator's GPU-wide effects (concurrency factor, power limit, host handling, per-op launch costs)
and their fit (``sim.fit``), on small plans."""

import json

import numpy as np
import pytest

from sim import Simulation, simulate
from sim.fit import fit_gpu_effects, simulated_ms
from sim.timing import TimingModel
from turnip.compile import build_with_resident, make_taskgraph
from turnip.machine.costs import launch_ns
from turnip.machine.profile import dump_json, h100, load_profile
from turnip.sched.testing import make_memgraph

pytestmark = pytest.mark.unit

QUIET = h100().replace(kernel_excess_mean=0.0, kernel_contended_excess_mean=0.0, stall_prob=0.0,
                       kernel_launch_ns=1000, gemm_launch_ns=1000, completion_ns=1000)  # fmt: skip


def quiet_doc() -> dict:
    """A profile document whose machine is QUIET's where the fit's simulations depend on it."""
    fields = ("kernel_excess_mean", "stall_prob", "kernel_launch_ns", "gemm_launch_ns", "completion_ns")
    machine = {"name": "fit"} | {k: getattr(QUIET, k) for k in fields}
    return {"format": "turnip-profile", "version": 1, "machine": machine}


def parallel(n: int, flops: float = 4e10):
    """n independent einsum kernels on one GPU."""
    return make_memgraph(["kernel"] * n, [[]] * n, flops=[flops] * n, nbytes=[1 << 10] * n, ops=["einsum"] * n)


def chain(n: int, flops: float = 4e10):
    return make_memgraph(["kernel"] * n, [[]] + [[i] for i in range(n - 1)], flops=[flops] * n,
                         nbytes=[1 << 10] * n, ops=["einsum"] * n)  # fmt: skip


def test_a_kernel_that_starts_behind_another_takes_the_concurrency_factor():
    mg = parallel(2, flops=1e12)
    floor = int(TimingModel(mg, QUIET).kernel_ns[0])
    assert floor > 1_000_000  # a long kernel: kernel_overlap_long applies
    for f in (1.0, 0.6, 1.2):
        prof = QUIET.replace(kernel_overlap_short=1.0, kernel_overlap_long=f)
        r = simulate(mg, prof, mean_only=True)
        durs = sorted((r.end_ns - r.start_ns).tolist())
        first, second = (durs[1], durs[0]) if f < 1 else (durs[0], durs[1])
        assert first == floor and abs(second - f * floor) <= 1  # the one alone keeps its floor
        assert r.makespan_ns >= r.lower_bound_ns  # floors below 1 enter the bound
    alone = simulate(chain(2, flops=1e12), QUIET.replace(kernel_overlap_long=0.6), mean_only=True)
    assert (alone.end_ns - alone.start_ns).tolist() == [floor, floor]  # a chain never queues


def test_the_power_limit_slows_sustained_work_and_spares_a_rested_gpu():
    mg = parallel(20)
    base = simulate(mg, QUIET, mean_only=True).makespan_ns
    lim = QUIET.replace(power_duty=0.8, power_burst_s=0.05)
    slow = simulate(mg, lim, mean_only=True).makespan_ns
    assert slow == pytest.approx(base / 0.8, rel=0.01)  # empty bucket, always busy: 1 / duty as long
    rested = simulate(mg, lim, mean_only=True, power_full=True).makespan_ns
    assert rested == base  # a full bucket (0.05 s at the limit) pays for this short burst at full clock
    short = simulate(mg, lim.replace(power_burst_s=0.0001), mean_only=True, power_full=True).makespan_ns
    assert base < short < slow  # a small one for part of it
    assert simulate(mg, QUIET.replace(power_duty=1.0), mean_only=True).makespan_ns == base
    sparse = make_memgraph(["kernel"] * 2, [[], [0]], flops=[4e10] * 2, nbytes=[1 << 10] * 2, ops=["einsum"] * 2)
    assert simulate(sparse, lim, mean_only=True).makespan_ns >= simulate(sparse, QUIET, mean_only=True).makespan_ns


def test_gemms_run_at_the_rate_sustained_at_the_power_limit_once_the_bucket_is_empty():
    mg = parallel(20)  # 4e10 flops each at 592 TFLOP/s (QUIET's roofline): GEMMs back to back
    base = simulate(mg, QUIET, mean_only=True)
    busy = sum((base.end_ns - base.start_ns).tolist())
    lim = QUIET.replace(power_gemm_flops_rate=400e12, power_burst_s=0.05)
    slow = simulate(mg, lim, mean_only=True)
    assert sum((slow.end_ns - slow.start_ns).tolist()) == pytest.approx(20 * 4e10 / 400e12 * 1e9, rel=0.001)
    assert slow.makespan_ns - base.makespan_ns == pytest.approx(20 * 4e10 / 400e12 * 1e9 - busy, rel=0.01)
    assert simulate(mg, lim, mean_only=True, power_full=True).makespan_ns == base.makespan_ns  # rested: a burst
    assert simulate(mg, QUIET.replace(power_gemm_flops_rate=600e12), mean_only=True).makespan_ns == base.makespan_ns
    assert simulate(mg, lim.replace(power_gemm_flops_rate=0.0, power_attn_flops_rate=100e12),
                    mean_only=True).makespan_ns == base.makespan_ns  # fmt: skip  # no attention here


def test_attention_runs_at_its_own_rate_and_each_gpu_has_its_own_bucket():
    attn = make_memgraph(["kernel"] * 10, [[]] * 10, flops=[4e10] * 10, nbytes=[1 << 10] * 10, ops=["sdpa"] * 10)
    quiet = QUIET.replace(attn_launch_ns=1000)  # kernels back to back, not behind the host
    base = simulate(attn, quiet, mean_only=True)
    slow = simulate(attn, quiet.replace(power_attn_flops_rate=300e12), mean_only=True)
    assert sum((slow.end_ns - slow.start_ns).tolist()) == pytest.approx(10 * 4e10 / 300e12 * 1e9, rel=0.001)
    assert simulate(attn, quiet.replace(power_gemm_flops_rate=300e12), mean_only=True).makespan_ns == base.makespan_ns
    # two GPUs: GEMMs back to back on GPU 0 drain its bucket; GPU 1 runs one GEMM at full clock
    two = make_memgraph(["kernel"] * 11, [[]] * 11, flops=[4e10] * 11, nbytes=[1 << 10] * 11, ops=["einsum"] * 11,
                        gpus=[0] * 10 + [1], n_gpus=2)  # fmt: skip
    lim = QUIET.replace(power_gemm_flops_rate=400e12, power_burst_s=0.0001)
    r = simulate(two, lim, mean_only=True)
    full = int(TimingModel(two, lim).kernel_ns[10])
    assert r.end_ns[10] - r.start_ns[10] == full
    assert sum((r.end_ns[:10] - r.start_ns[:10]).tolist()) > 10 * full


def test_the_gap_between_runs_refills_the_bucket():
    mg = parallel(20)
    lim = QUIET.replace(power_gemm_flops_rate=400e12, power_burst_s=0.05)
    back_to_back = simulate(mg, lim, mean_only=True).makespan_ns
    apart = simulate(mg, lim.replace(run_gap_ns=200_000), mean_only=True).makespan_ns  # 0.2 ms refilled
    assert back_to_back - apart == pytest.approx(200_000, rel=0.02)  # each token (ns at the limit) saves one ns


def test_a_light_run_starts_in_the_steady_state_of_runs_back_to_back():
    # GEMMs (w = 592 / 500) with memory-bound kernels between them (w = power_memory_weight): the bucket gains
    # over a run, so runs back to back keep it full and never slow; a run from an empty bucket would
    n = 40
    ops = ["einsum" if i % 2 == 0 else "rmsnorm" for i in range(n)]
    flops = [4e10 if o == "einsum" else 0.0 for o in ops]
    nbytes = [(1 << 27) if o == "rmsnorm" else 1 << 10 for o in ops]
    mg = make_memgraph(["kernel"] * n, [[]] + [[i] for i in range(n - 1)], flops=flops, nbytes=nbytes, ops=ops)
    lim = QUIET.replace(power_gemm_flops_rate=500e12, power_burst_s=0.0001, power_memory_weight=0.2)
    base = simulate(mg, QUIET, mean_only=True).makespan_ns
    assert simulate(mg, lim, mean_only=True).makespan_ns == base
    cold = Simulation(mg, lim, mean_only=True).run().makespan_ns  # one run from an empty bucket
    assert cold > base


def test_every_seed_starts_where_the_noise_free_run_settles_whatever_ran_before(monkeypatch):
    """``simulate`` under a power limit: the start level is worked out once per timing model and options (where
    the noise-free run settles), so a seed's run is the same alone or after others, and a later seed's run
    settles in one pass."""
    n = 24  # GEMMs back to back on GPU 0 (its bucket drains), one on GPU 1
    two = make_memgraph(["kernel"] * n, [[]] * n, flops=[4e10] * n, nbytes=[1 << 10] * n, ops=["einsum"] * n,
                        gpus=[0] * (n - 1) + [1], n_gpus=2)  # fmt: skip
    lim = h100().replace(power_gemm_flops_rate=400e12, power_burst_s=0.001, power_slow_gemm=1.3,
                         run_gap_ns=1_000_000)  # fmt: skip
    alone = simulate(two, lim, "nondet", 3, False, TimingModel(two, lim))
    tm = TimingModel(two, lim)
    simulate(two, lim, "nondet", 1, False, tm)
    runs = []
    real_run = Simulation.run
    monkeypatch.setattr(Simulation, "run", lambda self: runs.append(self) or real_run(self))
    after = simulate(two, lim, "nondet", 3, False, tm)
    assert after.makespan_ns == alone.makespan_ns and np.array_equal(after.end_ns, alone.end_ns)
    assert len(runs) == 1 and list(tm._steady) == [("nondet", None, None, True, None)]
    assert simulate(two, lim, "nondet", 3, False, tm, power_full=True).makespan_ns < simulate(
        two, lim.replace(run_gap_ns=0), "nondet", 3).makespan_ns  # the limit binds without the gap's refill


def test_handling_a_completion_occupies_the_host():
    mg = chain(10, flops=1e6)  # short kernels: the host's hand-overs dominate
    a = simulate(mg, QUIET, mean_only=True).makespan_ns
    b = simulate(mg, QUIET.replace(handle_ns=5000), mean_only=True)
    assert b.makespan_ns - a == pytest.approx(9 * 5000, abs=10)  # every hand-over (the last is seen at done)
    assert b.makespan_ns >= b.lower_bound_ns and b.bound["host_ns"] >= 10 * 1000 + 9 * 5000


def test_launch_costs_per_op_from_the_profile_table(tmp_path):
    mg = make_memgraph(["kernel"] * 3, [[]] * 3, flops=[1e9] * 3, nbytes=[1 << 10] * 3,
                       ops=["einsum", "rmsnorm", "silu"])  # fmt: skip
    doc = {"format": "turnip-profile", "version": 1, "machine": {"kernel_launch_ns": 7000, "gemm_launch_ns": 9000},
           "launch": [{"op": "rmsnorm", "ns": 4000, "n": 10}, {"op": "einsum", "ns": 12000, "n": 10}]}  # fmt: skip
    p = tmp_path / "l.json"
    p.write_text(json.dumps(doc))
    prof = load_profile(p)
    assert launch_ns(mg, prof).tolist() == [12000, 4000, 7000]  # silu: no row, its class's cost
    assert json.loads(dump_json(prof))["launch"] == doc["launch"]
    doc["launch"].append({"op": "warp", "ns": 1, "n": 1})
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"launch\[2\].*'op'.*warp") as e:
        load_profile(p)
    assert "\n" not in str(e.value)


def test_the_fit_recovers_factors_that_made_the_measurements():
    tg = make_taskgraph("llama-tiny", 64, 1, "fp16", {"t": 16})
    mg = build_with_resident(tg, 1 << 26, None, str(1 << 25))
    doc = quiet_doc()
    truth = QUIET.replace(kernel_overlap_short=0.7, kernel_overlap_long=0.9)
    meas = simulated_ms([(mg, 0.0, "tiny")], truth)[0] * 1e6
    before = simulated_ms([(mg, meas, "tiny")], QUIET)[0]
    lines = []
    x = fit_gpu_effects(doc, log=lines.append, plans=[(mg, meas, "tiny")])
    after = simulated_ms([(mg, meas, "tiny")], QUIET.replace(**x))[0]
    assert abs(after / (meas / 1e6) - 1) < 0.01 < abs(before / (meas / 1e6) - 1)
    assert set(x) == {"kernel_overlap_short", "kernel_overlap_long", "power_gemm_flops_rate", "power_attn_flops_rate",
                      "power_duty"} and x["power_duty"] == 1.0  # fmt: skip
    assert x["power_gemm_flops_rate"] >= 592e12  # the truth has no power limit
    assert any("tiny" in s for s in lines)


def test_the_fit_recovers_the_gemm_rate_at_the_power_limit():
    mg = chain(30)  # a chain never queues: only the power limit changes it
    doc = quiet_doc()
    truth = QUIET.replace(power_gemm_flops_rate=450e12)
    meas = simulated_ms([(mg, 0.0, "chain")], truth)[0] * 1e6
    x = fit_gpu_effects(doc, log=lambda s: None, plans=[(mg, meas, "chain", 0)])
    assert x["power_gemm_flops_rate"] == pytest.approx(450e12, abs=6e12)  # 0.76 of 592 TFLOP/s (no tables)
    assert x["power_attn_flops_rate"] == x["power_gemm_flops_rate"]  # one fraction of the same best rate
    assert x["kernel_overlap_short"] == x["kernel_overlap_long"] == 1.0  # nothing here pins them: the start
    assert simulated_ms([(mg, meas, "chain")], QUIET.replace(**x))[0] == pytest.approx(meas / 1e6, rel=0.01)


def test_kernels_held_at_the_power_limit_take_their_energy_s_time_whatever_their_jitter():
    mg = parallel(20)
    noisy = QUIET.replace(kernel_excess_mean=0.05, kernel_excess_sd=0.05)
    free = [simulate(mg, noisy, seed=s).makespan_ns for s in (0, 1, 0)]
    assert free[0] == free[2] != free[1]  # jitter: seeds differ, a seed repeats
    held = [simulate(mg, noisy.replace(power_gemm_flops_rate=400e12), seed=s) for s in (0, 1)]
    assert held[0].makespan_ns == held[1].makespan_ns >= held[0].lower_bound_ns  # flops / rate, at any clock


def test_recorded_plans_carry_their_gap_between_runs():
    from sim.fit import recorded_plans

    row = {"model": "llama-tiny", "seq": 64, "tiles": {"t": 16}, "layers": 1, "nondet_ms": [1.0, 3.0, 2.0],
           "gap_ms": [0.5, 0.7, 0.6]}  # fmt: skip
    (mg, meas, label, gap), = recorded_plans({"calibration": {"plans": [row, row | {"nondet_ms": []}]}})
    assert meas == 2.0e6 and gap == pytest.approx(0.6e6) and "llama-tiny 64 L1" in label
    lim = QUIET.replace(power_gemm_flops_rate=100e12)
    by_row = simulated_ms([(mg, meas, label, gap)], lim)[0]
    assert by_row == simulated_ms([(mg, meas, label)], lim.replace(run_gap_ns=600_000))[0]


def test_profiles_set_one_power_model():
    from turnip.machine.profile import profile_from_data

    with pytest.raises(ValueError, match="both set"):
        profile_from_data({"power_duty": 0.9, "power_gemm_flops_rate": 5e14})
    with pytest.raises(ValueError, match=r"power_duty = 0 is out of range"):
        profile_from_data({"power_duty": 0})
    assert profile_from_data({"power_duty": 0.9}).power_duty == 0.9


def test_refit_needs_recorded_plans(tmp_path):
    from sim.fit import refit

    p = tmp_path / "old.json"
    p.write_text(json.dumps({"format": "turnip-profile", "version": 1, "machine": {}, "calibration": {"plans": []}}))
    with pytest.raises(ValueError, match="records no plan makespans"):
        refit(str(p))


# ---------------------------------------------------------------- the shared clock (power_slow_gemm > 0)
def clocked(rate_of_full: float = 0.5, **kw):
    """QUIET under the shared-clock model: GEMMs of ``chain``/``parallel`` draw 1 / ``rate_of_full`` of the
    limit at full clock (``power_clock_draw`` the same), attention of the same flops exactly the limit (alone it
    never throttles), GEMMs alone slow 1.2x at throttle 1."""
    full = 4e10 / int(TimingModel(chain(1), QUIET).kernel_ns[0]) * 1e9  # the kernels' full-clock flop rate
    fields = {"power_slow_gemm": 1.2, "power_slow_attn": 1.4, "power_slow_memory": 1.05,
              "power_clock_draw": rate_of_full, "power_gemm_flops_rate": rate_of_full * full,
              "power_attn_flops_rate": full, "power_memory_weight": 0.9, "power_idle_weight": 0.0,
              "power_window_s": 1e-4, "power_burst_s": 1e-4, "attn_launch_ns": 1000}  # fmt: skip
    return QUIET.replace(**(fields | kw))


def test_gemms_alone_settle_at_throttle_one_and_take_its_slowdown():
    mg = chain(300)
    floor = int(TimingModel(mg, QUIET).kernel_ns[0])
    r = simulate(mg, clocked(), mean_only=True)
    late = (r.end_ns - r.start_ns)[150:]
    assert late.mean() == pytest.approx(1.2 * floor, rel=0.02)  # the clock where GEMMs alone hold the limit
    rested = simulate(chain(3), clocked(), mean_only=True, power_full=True)
    assert (rested.end_ns - rested.start_ns)[0] == floor  # a rested GPU starts at full clock


def test_the_clock_slows_attention_that_gemms_throttled_though_attention_alone_draws_little():
    n = 200
    ops = ["einsum", "sdpa"] * (n // 2)
    mg = make_memgraph(["kernel"] * n, [[]] + [[i] for i in range(n - 1)], flops=[4e10] * n, nbytes=[1 << 10] * n,
                       ops=ops)  # fmt: skip
    tm = TimingModel(mg, QUIET)
    floor = tm.kernel_ns.astype(float)
    attn = [v for v in range(n // 2, n) if ops[v] == "sdpa"]
    clock = simulate(mg, clocked(), mean_only=True)
    slow = (clock.end_ns - clock.start_ns)[attn] / floor[attn]
    assert slow.mean() > 1.05  # throttled by the GEMMs' debt, by its own class's factor
    bucket = QUIET.replace(attn_launch_ns=1000, power_gemm_flops_rate=clocked().power_gemm_flops_rate,
                           power_attn_flops_rate=clocked().power_attn_flops_rate, power_burst_s=1e-4)  # fmt: skip
    own = simulate(mg, bucket, mean_only=True)
    assert ((own.end_ns - own.start_ns)[attn] == floor[attn]).all()  # the bucket model: its own draw only


def test_an_idle_gpu_draws_its_idle_weight_between_runs():
    mg = chain(40)
    a = simulate(mg, clocked(power_idle_weight=0.0).replace(run_gap_ns=200_000), mean_only=True).makespan_ns
    b = simulate(mg, clocked(power_idle_weight=0.9).replace(run_gap_ns=200_000), mean_only=True).makespan_ns
    assert a < b  # the gap refills less when idle draws most of the limit


def test_power_fields_recover_the_clock_from_synthetic_loops():
    from turnip.calibrate import power_fields

    sg, sa, sm, f, idle, tg, ta, tm = 1.2, 1.35, 1.05, 0.6, 0.2, 1e6, 4e6, 2e5

    def mix(theta, *items):  # each item's time at throttle theta
        slow = {"einsum": sg, "sdpa": sa, "silu_mul": sm}
        full = {"einsum": tg, "sdpa": ta, "silu_mul": tm}
        return [full[i] * (1 + theta * (slow[i] - 1)) for i in items]

    th = 0.5  # the sleep cycle's throttle; its sleep from the energy balance at that throttle
    g = mix(th, "einsum")[0]
    p = (1 / f) * (1 - th * (1 - f))
    sleep = (p - 1) * g / (1 - idle)
    pw = {"full_ns": {"gemm": tg, "attention": ta, "memory": tm}, "limit_w": 700.0, "idle_w": idle * 700,
          "gemm": {"items": ["einsum"], "ns": mix(1, "einsum")},
          "memory": {"items": ["silu_mul"], "ns": [tm], "power_w": 630.0},
          "mix_attention": {"items": ["einsum", "einsum", "sdpa"], "ns": mix(0.8, "einsum", "einsum", "sdpa")},
          "mix_memory": {"items": ["einsum", "einsum", "silu_mul", "silu_mul"],
                         "ns": mix(0.9, "einsum", "einsum", "silu_mul", "silu_mul")},
          "sleep_short": {"items": ["einsum", "sleep"], "ns": [g, sleep]},
          "sleep_long": {"items": ["einsum", "sleep"], "ns": [tg, 3 * tg]}}  # fmt: skip
    out = power_fields(pw)
    assert out["power_slow_gemm"] == pytest.approx(sg)
    assert out["power_slow_attn"] == pytest.approx(sa, abs=1e-3)
    assert out["power_slow_memory"] == pytest.approx(sm, abs=1e-3)
    assert out["power_clock_draw"] == pytest.approx(f, abs=1e-3)  # sleep_long never throttled: not used
    assert out["power_memory_weight"] == 0.9 and out["power_idle_weight"] == pytest.approx(idle)


def test_a_measured_clock_draw_is_kept_by_the_fit():
    mg = chain(30)
    doc = quiet_doc()
    doc["machine"] |= {"power_slow_gemm": 1.2, "power_window_s": 1e-4}
    doc["calibration"] = {"power": {"power_clock_draw": 0.55}}
    meas = simulated_ms([(mg, 0.0, "chain")], QUIET)[0] * 1e6
    x = fit_gpu_effects(doc, log=lambda s: None, plans=[(mg, meas, "chain", 0)])
    assert x["power_clock_draw"] == 0.55 and x["power_gemm_flops_rate"] == pytest.approx(0.55 * 592e12, rel=0.02)


@pytest.mark.parametrize("field,value", [("power_clock_draw", 0.0), ("power_clock_draw", 1.5),
                                         ("power_idle_weight", 1.0), ("power_slow_gemm", 0.5),
                                         ("host_excess_sd", -0.1), ("link_excess_sd", -0.1),
                                         ("host_link_corr", 1.5), ("host_link_corr", float("nan"))])  # fmt: skip
def test_bad_shared_clock_fields_are_one_line_errors(tmp_path, field, value):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({field: value}))
    with pytest.raises(ValueError, match=field) as e:
        load_profile(p)
    assert "\n" not in str(e.value)


def test_completions_reach_the_host_later_the_more_vertices_are_in_flight():
    mg = parallel(6)
    base = simulate(mg, QUIET, mean_only=True)
    slow = simulate(mg, QUIET.replace(completion_per_inflight_ns=20_000), mean_only=True)
    lag = lambda r: (r.done_ns - r.end_ns).max()  # noqa: E731
    assert lag(slow) >= lag(base) + 20_000 and slow.makespan_ns > base.makespan_ns
    one = chain(3)  # one in flight at a time: the delay per vertex in flight applies once
    a = simulate(one, QUIET, mean_only=True)
    b = simulate(one, QUIET.replace(completion_per_inflight_ns=5_000), mean_only=True)
    assert ((b.done_ns - b.end_ns) - (a.done_ns - a.end_ns) == 5_000).all()


def test_the_completion_fit_is_a_line_through_the_median_poll_delay_per_count():
    from turnip.calibrate import completion_fit

    rng = np.random.default_rng(0)
    n = rng.integers(1, 9, 4000)  # in flight at a kernel's end: itself and more
    poll = 300 + 450 * n + rng.normal(0, 100, n.size)
    c, per = completion_fit(poll.tolist(), n.tolist())
    assert abs(c - 300) < 40 and abs(per - 450) < 15
    assert completion_fit([5000, 6000, 7000], [3, 3, 3]) == (6000, 0)  # one count: the median, no slope
    c, per = completion_fit((500 * n - 300).tolist(), n.tolist())
    assert c == 0 and 420 < per < 500  # a line below zero at no vertices: through the origin instead
    assert completion_fit([], []) == (0, 0)
    c, per = completion_fit((9000 - 100 * n).tolist(), n.tolist())
    assert per == 0 and 8000 < c < 9000  # a falling line: no slope, the weighted mean level


def test_the_host_speed_factor_scales_every_host_cost_of_a_run():
    """host_excess_sd > 0: one factor per run on issue, handling and completion (a host-bound chain's makespan
    moves with it, its kernels do not); 0: the same runs as before, draw for draw."""
    mg = chain(40, flops=1e8)  # short kernels: the host's chain decides
    slowhost = QUIET.replace(handle_ns=3000, completion_per_inflight_ns=500)
    base = [simulate(mg, slowhost, seed=s) for s in range(6)]
    for s in range(6):  # the host factor is drawn after every other draw: those stay the same
        d0 = TimingModel(mg, slowhost).draws(np.random.default_rng(s))
        d1 = TimingModel(mg, slowhost.replace(host_excess_sd=0.3)).draws(np.random.default_rng(s))
        assert d0.host == 1.0 and d1.host != 1.0
        assert (d0.factor == d1.factor).all() and (d0.factor_contended == d1.factor_contended).all()
        assert (d0.stall_ns == d1.stall_ns).all()
    noisy = [simulate(mg, slowhost.replace(host_excess_sd=0.3), seed=s) for s in range(6)]
    assert all(r.makespan_ns >= r.lower_bound_ns for r in noisy)  # each run's bound at its own host speed
    issue = lambda r: np.median(r.issue_ns - r.host_start_ns)  # noqa: E731
    ratio = np.array([issue(n) / issue(b) for n, b in zip(noisy, base, strict=True)])
    assert ratio.std() > 0.1 and ratio.min() > 0.3 and ratio.max() < 3.0
    for n, b, x in zip(noisy, base, ratio, strict=True):  # the slower the host, the longer the run; kernels alike
        assert (n.makespan_ns > b.makespan_ns) == (x > 1.0)
        assert np.allclose(n.end_ns - n.start_ns, b.end_ns - b.start_ns, rtol=0.2)
    assert simulate(mg, slowhost.replace(host_excess_sd=0.3), mean_only=True).makespan_ns == \
        simulate(mg, slowhost, mean_only=True).makespan_ns  # the means: the median host


def test_host_spread_is_the_pooled_spread_of_per_run_issue_times():
    from turnip.calibrate import host_spread, run_issue_ns

    runs = [{"host_run_ns": [6000, 6000 * np.e ** 0.2]}, {"host_run_ns": [9000, 9000 * np.e ** -0.2]},
            {"host_run_ns": [7000]}, {}]  # fmt: skip
    # two plans, one degree of freedom each, deviations +-0.1 around each plan's mean log: sd sqrt(4 x 0.01 / 2)
    assert host_spread(runs) == pytest.approx(np.sqrt(0.02))
    assert host_spread([{"host_run_ns": [5000]}]) == 0.0
    mg = parallel(4)

    class R:
        issue_ns = np.array([5000, 7000, 0, 9000])
        host_start_ns = np.array([1000, 1000, 0, 1000])

    assert run_issue_ns(mg, R) == 6000  # kernels issued: 4000, 6000, 8000


def test_power_loops_keep_each_items_median_round():
    from turnip.calibrate import _median_loop, power_fields

    rounds = [{"items": ["einsum", "sdpa"], "ns": [1.0e6, 5.0e6], "power_w": 690.0, "sm_mhz": 1400.0},
              {"items": ["einsum", "sdpa"], "ns": [1.1e6, 4.0e6], "power_w": None, "sm_mhz": 1500.0},
              {"items": ["einsum", "sdpa"], "ns": [0.9e6, 4.5e6], "power_w": 700.0, "sm_mhz": 1300.0}]  # fmt: skip
    m = _median_loop(rounds)
    assert m["items"] == ["einsum", "sdpa"] and m["ns"] == [1.0e6, 4.5e6]  # per item, not one round's
    assert m["power_w"] == 695.0 and m["sm_mhz"] == 1400.0  # rounds without a reading left out
    assert m["rounds_ns"] == [r["ns"] for r in rounds]
    # a loop document of medians over rounds gives the fields power_fields reads, as one round does
    one = {"full_ns": {"gemm": 0.8e6, "attention": 4e6, "memory": 2e5}, "limit_w": 700.0, "idle_w": 140.0,
           "gemm": _median_loop([{"items": ["einsum"], "ns": [x], "power_w": 700.0, "sm_mhz": 1300.0}
                                 for x in (0.95e6, 0.96e6, 1.10e6)]),
           "memory": {"items": ["silu_mul"], "ns": [2e5], "power_w": 630.0},
           "mix_attention": {"items": ["einsum", "einsum", "sdpa"], "ns": [0.9e6, 0.9e6, 4.6e6]},
           "mix_memory": {"items": ["einsum", "einsum", "silu_mul", "silu_mul"], "ns": [0.9e6, 0.9e6, 2e5, 2e5]},
           "sleep_short": {"items": ["einsum", "sleep"], "ns": [0.88e6, 0.3e6]},
           "sleep_long": {"items": ["einsum", "sleep"], "ns": [0.8e6, 0.6e6]}}  # fmt: skip
    assert power_fields(one)["power_slow_gemm"] == pytest.approx(0.96 / 0.8)  # the GEMM's median over the rounds


def test_a_given_host_factor_replaces_the_drawn_one():
    """``simulate(..., host=F)``: every host cost of the run times F, whatever ``host_excess_sd`` would draw."""
    mg = chain(40, flops=1e8)
    slowhost = QUIET.replace(handle_ns=3000, completion_per_inflight_ns=500)
    noisy = slowhost.replace(host_excess_sd=0.3)
    one = simulate(mg, slowhost, seed=2)
    assert simulate(mg, noisy, seed=2, host=1.0).makespan_ns == one.makespan_ns  # the draw overridden
    two = simulate(mg, noisy, seed=2, host=2.0)
    issue = lambda r: (r.issue_ns - r.host_start_ns)[r.issue_ns > 0]  # noqa: E731
    assert np.array_equal(issue(two), 2 * issue(one))
    assert two.makespan_ns > 1.5 * one.makespan_ns and two.makespan_ns >= two.lower_bound_ns
    # the bound's host part is the run's: twice the host costs (it is reported, not in the bound: hosts beat it)
    assert two.bound["host_ns"] == 2 * one.bound["host_ns"] and two.lower_bound_ns == one.lower_bound_ns
    with pytest.raises(ValueError, match="host speed factor"):
        simulate(mg, slowhost, host=0.0)
