import numpy as np
import pandas as pd
import pytest

from analysis.metrics import _overlap_ns, _union_ns, run_metrics
from analysis.summary import format_table, speedup_table
from sim.engine import simulate
from turnip.machine.profile import h100
from turnip.sched.testing import random_memgraph

pytestmark = pytest.mark.unit


def test_interval_helpers():
    a, b = _union_ns(np.array([0, 5, 2, 20]), np.array([3, 8, 4, 30]))
    assert a.tolist() == [0, 5, 20] and b.tolist() == [4, 8, 30]
    assert _overlap_ns(np.array([0, 10]), np.array([5, 20]), np.array([3, 12]), np.array([11, 13])) == 2 + 1 + 1


def test_run_metrics_on_a_trace():
    mg = random_memgraph(np.random.default_rng(1), 80, 2, p_edge=0.05)
    r = simulate(mg, h100(), "nondet", seed=0)
    m = run_metrics(r.trace(mg).spans, mg.n_gpus)
    assert m["makespan_ns"] == r.makespan_ns and 0 < m["gpu_busy_frac"] <= 1
    assert 0 <= m["idle_wait_ns"] <= 2 * r.makespan_ns
    assert m["offload_nbytes"] == mg.out_nbytes[mg.kind == 3].sum()


def _runs():
    rows = []
    for seed in range(4):
        for pol, ms in (("det", 110 + seed), ("nondet", 100)):
            rows.append(dict(model="m", seq=1024, gpus=1, budget="tight", budget_nbytes=1, policy=pol, seed=seed,
                             mean_only=False, makespan_ns=ms * 1e6, lower_bound_ns=90e6))  # fmt: skip
    rows += [dict(rows[0], mean_only=True, makespan_ns=105e6), dict(rows[1], mean_only=True, makespan_ns=100e6)]
    return pd.DataFrame(rows)


def test_speedup_table_paired_by_seed():
    t = speedup_table(_runs())
    assert len(t) == 1
    r = t.iloc[0]
    assert r.n_seeds == 4 and r.speedup_pct == pytest.approx(11.5)
    assert r.ci_low_pct < 11.5 < r.ci_high_pct and r.mean_only_speedup_pct == pytest.approx(5.0)
    assert "11.5%" in format_table(t)


def test_report_writes_csv_and_figures(tmp_path):
    from analysis.report import write_report

    _runs().assign(input_nbytes=0, offload_nbytes=0, reload_nbytes=0).to_csv(tmp_path / "runs.csv", index=False)
    (tmp_path / "traces").mkdir()
    mg = random_memgraph(np.random.default_rng(1), 40, 2, p_edge=0.05)
    for pol in ("det", "nondet"):
        spans, mem = simulate(mg, h100(), pol).trace(mg).to_frames()
        spans.to_csv(tmp_path / "traces" / f"{pol}.spans.csv", index=False)
        mem.to_csv(tmp_path / "traces" / f"{pol}.memory.csv", index=False)
    text = write_report(tmp_path, quiet=True)
    assert "speedup" in text and (tmp_path / "summary.csv").exists()
    for name in ("speedup", "makespan_distributions", "efficiency", "offload_volume", "gantt", "memory"):
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 1000


def test_table_compares_nondet_with_every_fixed_order_baseline():
    extra = []
    for seed in range(4):
        for pol, ms in (("det-kernels", 104), ("det-replay", 100 - seed)):
            extra.append(dict(model="m", seq=1024, gpus=1, budget="tight", budget_nbytes=1, policy=pol, seed=seed,
                              mean_only=False, makespan_ns=ms * 1e6, lower_bound_ns=90e6))  # fmt: skip
    t = speedup_table(pd.concat([_runs(), pd.DataFrame(extra)]))
    r = t.iloc[0]
    assert r.nondet_over_det == pytest.approx(np.mean([100 / (110 + s) for s in range(4)]))
    assert r["nondet_over_det-kernels"] == pytest.approx(100 / 104)
    assert r["nondet_over_det-replay"] == pytest.approx(np.mean([100 / (100 - s) for s in range(4)]))
    assert r["nondet_over_det-replay_ci_low"] < r["nondet_over_det-replay"] < r["nondet_over_det-replay_ci_high"]
    assert np.isnan(r["nondet_over_det-replay_mean_only"]) and r.speedup_pct == pytest.approx(11.5)
    text = format_table(t)
    assert all(f"nondet/{b}" in text for b in ("det", "det-kernels", "det-replay"))
    only_replay = speedup_table(pd.DataFrame(extra + [dict(extra[0], policy="nondet", makespan_ns=99e6)]))
    assert list(only_replay["nondet_over_det-replay"]) == [pytest.approx(0.99)]
    assert "speedup_pct" not in only_replay and "det-replay" in format_table(only_replay)
