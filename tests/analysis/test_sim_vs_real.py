"""``benchmarks/sim_vs_real.py compare`` on a measured grid file, with and without recorded traces (no GPU:
the stand-in for a real trace is a simulated run of the same plan on another profile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.benchscripts import load_script


def _bench():
    return load_script("sim_vs_real")


def test_compare_reports_each_cell_and_overlays_recorded_traces(tmp_path):
    from sim.engine import simulate
    from turnip.machine.profile import load_profile

    svr = _bench()
    _tg, mg = svr.plan(1024, "none")
    real = simulate(mg, load_profile("h100"), "nondet", seed=3)  # stand-in for a measured run
    ms = real.makespan_ns / 1e6
    grid = tmp_path / "grid.csv"
    pd.DataFrame([{"seq": 1024, "budget": "none", "policy": pol, "gpus": 1, "model": "llama-7b", "vertices": mg.n,
                   "times_ms": json.dumps([ms, ms * 1.02]), "mean_ms": ms * 1.01, "issue_us": json.dumps([7.0, 9.0])}
                  for pol in ("nondet", "det")]
                 ).to_csv(grid, index=False)  # fmt: skip
    traces = tmp_path / "traces"
    traces.mkdir()
    real.trace(mg, {"seq": 1024}).write_chrome(traces / "1024-none-g1-nondet.json")  # det: no trace recorded
    out = tmp_path / "cmp"
    assert svr.main(["compare", str(grid), "--profile", "h200-calibrated", "--runs", "2", "--out", f"{out}.csv",
                     "--traces", str(traces)]) == 0  # fmt: skip
    assert sorted(p.name for p in tmp_path.glob("cmp*")) == ["cmp.csv", "cmp.md"]  # --out x.csv: x.csv, not x.csv.csv
    d = pd.read_csv(f"{out}.csv")
    assert list(d.policy) == ["nondet", "det"] and d.predicted_ms.gt(0).all()
    assert (d.error - (d.predicted_ms / d.measured_ms - 1)).abs().max() < 1e-9
    # the host's speed per cell: the measured runs' median issue time against the simulated runs' (the profile's)
    prof = load_profile("h200-calibrated")
    assert (d.measured_issue_us == 8.0).all()
    assert d.predicted_issue_us.between(prof.kernel_launch_ns / 1e3 * 0.5, prof.gemm_launch_ns / 1e3 * 2).all()
    ov = traces / "overlay-1024-none-g1-nondet"
    assert (ov / "overlay.png").stat().st_size > 0
    table = pd.read_csv(ov / "overlay.csv")
    assert len(table) > 0
    assert not (traces / "overlay-1024-none-g1-det").exists()
    md = Path(f"{out}.md").read_text()
    assert "overlay-1024-none-g1-nondet" in md and "Cells within ±5%: " in md and "host issue us measured" in md


def _fake_execute(calls):
    """A stand-in for ``turnip.runtime.execute`` that logs (policy, timed or not) and returns run-like objects:
    recorded nondet runs get makespans 30, 20, 25 ms and an order naming their seed; three kernels and a copy of
    2000 bytes from the host that is on the link for 1000 ns (2 GB/s)."""
    from types import SimpleNamespace

    def execute(mg, be, policy, streams, seed=None, order=None, record_order=False):
        calls.append((policy, seed, order))
        ms = {200: 30.0, 201: 20.0, 202: 25.0}.get(seed, 10.0 + len(calls)) if record_order else 10.0 + len(calls)
        issue = np.array([1000, 1000 + 1000 * len(calls), 900_000, 5000], dtype=np.int64)  # the kernels' median: 2nd
        return SimpleNamespace(makespan_ns=int(ms * 1e6), order=[f"rec{seed}"] if record_order else [],
                               issue_ns=issue, host_start_ns=np.zeros(4, dtype=np.int64), start_ns=issue,
                               end_ns=issue + np.array([10, 10, 10, 1000]),
                               host_cost_ns=lambda: np.array([1_000_000, 500_000 * len(calls)]))

    return execute


def test_timed_runs_interleave_policies_after_every_warm_up(monkeypatch):
    from types import SimpleNamespace

    import turnip.runtime
    from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL

    bench = _bench()
    pols = ["nondet", "det", "det-replay"]
    for sequential in (False, True):
        calls: list = []
        monkeypatch.setattr(turnip.runtime, "execute", _fake_execute(calls))
        a = SimpleNamespace(policies=pols, repeat=3, warmup=1, heat=0.0, sequential=sequential)
        mg = SimpleNamespace(kind=np.array([KIND_KERNEL, KIND_KERNEL, KIND_KERNEL, KIND_INPUT]), n=4,
                             out_nbytes=np.array([64, 64, 64, 2000]), gpu=np.zeros(4, dtype=np.int32))  # fmt: skip
        out = bench._timed_runs(a, mg, None)
        assert list(out) == pols and all(len(v) == 3 for v in out.values())
        timed = [(p, s) for p, s, _ in calls if s in (0, 1, 2)]
        if sequential:  # each policy's warm-up, then its three runs
            assert timed == [(p, s) for p in pols for s in range(3)]
            assert [p for p, s, _ in calls][:4] == ["nondet", "nondet", "nondet", "nondet"]
        else:  # every warm-up first, then rounds of one run per policy
            assert timed == [(p, s) for s in range(3) for p in pols]
            first_timed = next(i for i, (p, s, _) in enumerate(calls) if s == 0)
            assert all(s not in (0, 1, 2) for _, s, _ in calls[:first_timed])
            assert [p for p, s, _ in calls if s == 100] == pols  # the warm-up: one round of every policy
        # det-replay replays the fastest recorded nondet run's order, in its warm-up and timed runs
        assert {str(o) for p, _, o in calls if p == "det-replay"} == {"['rec201']"}
        # the makespans, kernel issue times (us), host times (ms) and host link rates (GB/s) returned are the
        # timed runs', in round order
        idx = {p: [i for i, (q, s, _) in enumerate(calls) if q == p and s in (0, 1, 2)] for p in pols}
        assert out == {p: [(10.0 + i + 1, 1.0 + i + 1, 1.0 + 0.5 * (i + 1), 2.0) for i in idx[p]] for p in pols}


def test_compare_at_the_runs_own_host_time_takes_the_host_out_of_the_error(tmp_path):
    """Stand-in runs with a host 1.8 times slower than the profile's: the plain prediction misses them, the
    prediction at each run's own host time (the simulated host as long issuing and handling) finds them again.
    Their host time is summed as the runtime sums a real run's (``RunResult.host_cost_ns``)."""
    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.machine.costs import host_busy_ns
    from turnip.machine.profile import load_profile
    from turnip.runtime.driver import RunResult

    svr = _bench()
    _tg, mg = svr.plan(1024, "none")
    prof = load_profile("h100-calibrated")
    tm = TimingModel(mg, prof)
    runs = [simulate(mg, prof, "nondet", seed=s, tm=tm, host=1.8) for s in (7, 8)]  # not the seeds compare uses
    host_ms = []
    for r in runs:
        real = RunResult("nondet", r.seed, "stand-in", r.makespan_ns, mg.n, 0.0, r.host_start_ns, r.issue_ns,
                         r.start_ns, r.end_ns, r.done_ns, r.stream, r.handle_ns)  # fmt: skip
        host_ms.append(float(real.host_cost_ns().sum()) / 1e6)
        # the formula compare inverts (counting the commands handed back at least: within 0.1%)
        assert host_ms[-1] == pytest.approx(host_busy_ns(tm, 1.8) / 1e6, rel=1e-3)
        assert (r.host_cost_ns() == real.host_cost_ns()).all()
    assert host_busy_ns(tm, 1.8) == pytest.approx(1.8 * host_busy_ns(tm, 1.0), rel=1e-4)
    # exact when every completion costs the same
    flat = prof.replace(handle_per_cmd_ns=0)
    tf = TimingModel(mg, flat)
    for pol in ("nondet", "det"):
        r = simulate(mg, flat, pol, seed=3, tm=tf, host=1.8)
        assert r.host_cost_ns().sum() == host_busy_ns(tf, 1.8)
    row = {"seq": 1024, "budget": "none", "policy": "nondet", "gpus": 1, "model": "llama-7b", "vertices": mg.n,
           "times_ms": json.dumps([r.makespan_ns / 1e6 for r in runs]), "mean_ms": 0.0}  # fmt: skip
    grid = tmp_path / "grid.csv"
    pd.DataFrame([row | {"issue_us": json.dumps([9.0, 9.0]), "host_ms": json.dumps(host_ms)},
                  row | {"policy": "det"}]).to_csv(grid, index=False)  # a row of an older grid: no host figures
    out = tmp_path / "cmp"
    assert svr.main(["compare", str(grid), "--profile", "h100-calibrated", "--runs", "2", "--out", str(out),
                     "--at-host-time"]) == 0  # fmt: skip
    d = pd.read_csv(f"{out}.csv")
    assert d.error[0] < -0.08  # the profile's host is faster than these runs'
    assert abs(d.error_at_run[0]) < 0.01 and d.measured_host_ms[0] == pytest.approx(np.mean(host_ms))
    assert d.measured_issue_us[0] == 9.0 and np.isnan(d.measured_issue_us[1]) and np.isnan(d.error_at_run[1])
    md = Path(f"{out}.md").read_text()
    assert "At the runs' own host time: cells within ±5%: 1 of 1; mean |error|" in md and "1 cells without" in md
    # a grid without host times cannot be compared so
    pd.read_csv(grid).drop(columns=["host_ms"]).to_csv(grid, index=False)
    with pytest.raises(SystemExit, match="no host_ms column"):
        svr.main(["compare", str(grid), "--profile", "h100-calibrated", "--out", str(out), "--at-host-time"])


def test_compare_at_the_runs_own_host_link_rate_takes_a_slow_link_out_of_the_error(tmp_path):
    """Stand-in runs of a streamed plan whose host link moved bytes 1.4 times slower than the profile's (and
    whose host was 1.3 times slower): at their host time alone they are still missed; at their host time and
    link rate (``run_link_gbps``, as ``measure`` records it) they are found again."""
    from sim.engine import simulate
    from turnip.calibrate import run_link_gbps
    from turnip.machine.profile import load_profile

    svr = _bench()
    _tg, mg = svr.plan(1024, "6GiB")
    prof = load_profile("h100-calibrated")
    runs = [simulate(mg, prof, "nondet", seed=s, host=1.3, link=1.4) for s in (7, 8)]
    base = run_link_gbps(mg, simulate(mg, prof, "nondet", seed=7))
    gbps = [run_link_gbps(mg, r) for r in runs]
    assert all(1.3 < base / g < 1.45 for g in gbps)  # the link's bytes over the time a copy was on it
    row = {"seq": 1024, "budget": "6GiB", "policy": "nondet", "gpus": 1, "model": "llama-7b", "vertices": mg.n,
           "times_ms": json.dumps([r.makespan_ns / 1e6 for r in runs]), "mean_ms": 0.0,
           "issue_us": json.dumps([9.0, 9.0]), "host_ms": json.dumps([r.host_cost_ns().sum() / 1e6 for r in runs]),
           "link_gbps": json.dumps(gbps)}  # fmt: skip
    grid = tmp_path / "grid.csv"
    pd.DataFrame([row]).to_csv(grid, index=False)
    out = tmp_path / "cmp"
    args = ["compare", str(grid), "--profile", "h100-calibrated", "--runs", "2", "--out", str(out), "--at-host-time"]
    assert svr.main(args) == 0
    assert pd.read_csv(f"{out}.csv").error_at_run[0] < -0.2  # the link's slowness is left in
    assert svr.main([*args, "--at-link-rate"]) == 0
    d = pd.read_csv(f"{out}.csv")
    assert abs(d.error_at_run[0]) < 0.01 and d.measured_link_gbps[0] == pytest.approx(np.mean(gbps))
    assert "At the runs' own host time and host link rate: cells within ±5%: 1 of 1" in Path(f"{out}.md").read_text()
    # at the link rate alone, runs without one (they offload) keep the profile's link and their drawn host
    g = pd.read_csv(grid)
    g["link_gbps"] = json.dumps([None, None])
    g.to_csv(grid, index=False)
    assert svr.main([*args[:-1], "--at-link-rate"]) == 0
    d = pd.read_csv(f"{out}.csv")
    assert d.predicted_at_run_ms[0] == d.predicted_ms[0] and np.isnan(d.measured_link_gbps[0])
    # a grid without link rates cannot be compared so
    pd.read_csv(grid).drop(columns=["link_gbps"]).to_csv(grid, index=False)
    with pytest.raises(SystemExit, match="no link_gbps column"):
        svr.main([*args, "--at-link-rate"])


def test_run_factors_give_a_runs_host_and_link_or_leave_them_drawn():
    """``run_factors``: the host factor that reproduces a run's host time, the link factor that reproduces its
    link rate (a secant step: close on a simulated stand-in), None for each figure the run does not have
    (the simulator then draws it: the link given the run's host)."""
    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.calibrate import run_link_gbps
    from turnip.machine.costs import host_busy_ns
    from turnip.machine.profile import load_profile

    svr = _bench()
    _tg, mg = svr.plan(1024, "1GiB")
    prof = load_profile("h100-calibrated")
    tm = TimingModel(mg, prof)
    x = simulate(mg, prof, "nondet", seed=3, host=1.4, link=1.3)
    host_ms = host_busy_ns(tm, 1.4) / 1e6
    host, link = svr.run_factors(mg, prof, tm, "nondet", None, 3, host_ms, run_link_gbps(mg, x))
    assert host == pytest.approx(1.4, rel=1e-3) and link == pytest.approx(1.3, rel=0.02)
    assert svr.run_factors(mg, prof, tm, "nondet", None, 3, None, None) == (None, None)
    assert svr.run_factors(mg, prof, tm, "nondet", None, 3, host_ms, float("nan"))[1] is None


def test_compare_rebuilds_the_plan_each_cell_was_measured_on(tmp_path):
    """A grid's ``resident_limit`` column (the size per GPU its plan was built with) rebuilds that plan, checked
    against its vertex count and resident bytes; grids without it get what ``--resident auto`` built when they
    were measured (a quarter of the budget); a cell whose rebuilt plan differs stops ``compare`` naming it."""
    from turnip.cli import format_nbytes
    from turnip.compile import parse_nbytes

    svr = _bench()
    b = parse_nbytes("256KiB")
    _tg, quarter = svr.plan(256, "256KiB", "llama-tiny", 1, svr.QUARTER)
    _tg, auto = svr.plan(256, "256KiB", "llama-tiny", 1)
    assert quarter.stats["resident_input_nbytes"] > 0 and auto.stats["resident_input_nbytes"] == 0
    assert quarter.n != auto.n  # this cell's plan changed with --resident auto
    assert (quarter.stats["resident_limit_nbytes"], auto.stats["resident_limit_nbytes"]) == (b // 4, 0)
    _tg, again = svr.plan(256, "256KiB", "llama-tiny", 1, str(b // 4))
    assert again.n == quarter.n

    def grid(path, mg, **extra):
        pd.DataFrame([{"seq": 256, "budget": "256KiB", "policy": "nondet", "gpus": 1, "model": "llama-tiny",
                       "vertices": mg.n, "times_ms": json.dumps([1.0, 1.1]), "mean_ms": 1.05} | extra]
                     ).to_csv(path, index=False)  # fmt: skip

    def compare(name):
        return svr.main(["compare", str(tmp_path / f"{name}.csv"), "--profile", "h100", "--runs", "1",
                         "--out", str(tmp_path / f"cmp_{name}")])  # fmt: skip

    kept = int(quarter.stats["resident_input_nbytes"])
    cases = (("old", quarter, {}), ("new", auto, {"resident_limit": 0, "resident_nbytes": 0}),
             ("kept", quarter, {"resident_limit": b // 4, "resident_nbytes": kept}))  # fmt: skip
    for name, mg, extra in cases:
        grid(tmp_path / f"{name}.csv", mg, **extra)
        assert compare(name) == 0
    both = pd.concat([pd.read_csv(tmp_path / f"{n}.csv") for n in ("new", "kept", "old")])
    both.to_csv(tmp_path / "both.csv", index=False)  # one cell, three rows, two plans: the old row as a quarter
    assert compare("both") == 0
    d = pd.read_csv(tmp_path / "cmp_both.csv")
    assert sorted(d.resident_nbytes) == [0, kept, kept] and d.predicted_ms.nunique() == 2
    md = (tmp_path / "cmp_both.md").read_text()
    assert "| 256KiB, 0 B resident |" in md and f"| 256KiB, {format_nbytes(kept)} resident |" in md
    grid(tmp_path / "stale.csv", auto)  # measured on today's plan, but no resident column: rebuilt as a quarter
    with pytest.raises(SystemExit, match="256:256KiB was measured on a plan with vertices"):
        compare("stale")
    grid(tmp_path / "moved.csv", quarter, resident_limit=b // 4, resident_nbytes=kept - 1)
    with pytest.raises(SystemExit, match="with resident_nbytes"):
        compare("moved")


def test_compare_says_what_is_wrong_with_its_input(tmp_path):
    import re

    svr = _bench()
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    for path, said in ((tmp_path / "nope.csv", "cannot read a measured grid (FileNotFoundError"),
                       (tmp_path / "notes.csv", "no budget, gpus, model, policy, seq, times_ms column(s)")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            svr.main(["compare", str(path), "--profile", "h100", "--out", str(tmp_path / "x")])
