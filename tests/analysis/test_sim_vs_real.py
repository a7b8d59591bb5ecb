"""``benchmarks/sim_vs_real.py compare`` on a measured grid file, with and without recorded traces (no GPU:
the stand-in for a real trace is a simulated run of the same plan on another profile)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("sim_vs_real", ROOT / "benchmarks" / "sim_vs_real.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_reports_each_cell_and_overlays_recorded_traces(tmp_path):
    from sim.engine import simulate
    from turnip.machine.profile import load_profile

    svr = _bench()
    _tg, mg = svr.plan(1024, "none")
    real = simulate(mg, load_profile("h100"), "nondet", seed=3)  # stand-in for a measured run
    ms = real.makespan_ns / 1e6
    grid = tmp_path / "grid.csv"
    pd.DataFrame([{"seq": 1024, "budget": "none", "policy": pol, "gpus": 1, "model": "llama-7b", "vertices": mg.n,
                   "times_ms": json.dumps([ms, ms * 1.02]), "mean_ms": ms * 1.01} for pol in ("nondet", "det")]
                 ).to_csv(grid, index=False)  # fmt: skip
    traces = tmp_path / "traces"
    traces.mkdir()
    real.trace(mg, {"seq": 1024}).write_chrome(traces / "1024-none-g1-nondet.json")  # det: no trace recorded
    out = tmp_path / "cmp"
    assert svr.main(["compare", str(grid), "--profile", "h200-calibrated", "--runs", "2", "--out", str(out),
                     "--traces", str(traces)]) == 0  # fmt: skip
    d = pd.read_csv(f"{out}.csv")
    assert list(d.policy) == ["nondet", "det"] and d.predicted_ms.gt(0).all()
    assert (d.error - (d.predicted_ms / d.measured_ms - 1)).abs().max() < 1e-9
    ov = traces / "overlay-1024-none-g1-nondet"
    assert (ov / "overlay.png").stat().st_size > 0
    table = pd.read_csv(ov / "overlay.csv")
    assert len(table) > 0
    assert not (traces / "overlay-1024-none-g1-det").exists()
    md = Path(f"{out}.md").read_text()
    assert "overlay-1024-none-g1-nondet" in md and "Cells within ±5%: " in md
