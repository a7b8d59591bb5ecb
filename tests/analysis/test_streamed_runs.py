"""``benchmarks/streamed_runs.py analyze`` on a recording of stand-in runs (no GPU: simulated runs of the same
plan with a slower host and host link than the profile's, written as ``measure`` writes real ones)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.benchscripts import load_script


def _bench():
    return load_script("streamed_runs")


def test_analyze_finds_the_runs_conditions_and_the_handling_line(tmp_path):
    from sim.engine import simulate
    from turnip.calibrate import run_link_gbps
    from turnip.machine.profile import load_profile

    sr = _bench()
    _tg, mg = sr.plan(1024, "6GiB")
    prof = load_profile("h100-calibrated")
    host, link = 1.3, 1.25
    rec = tmp_path / "rec"
    rec.mkdir()
    arrays, rows = {}, []
    for pol in ("nondet", "det-kernels"):
        for r in range(2):
            x = simulate(mg, prof, pol, seed=r, host=host, link=link)  # as a measured run
            key = f"1024_6GiB_{pol}_{r}"
            arrays[key] = np.stack([getattr(x, k) for k in sr.COLUMNS]).astype(np.int64)
            rows.append({"key": key, "seq": 1024, "budget": "6GiB", "policy": pol, "round": r,
                         "makespan_ms": x.makespan_ns / 1e6, "host_ms": x.host_cost_ns().sum() / 1e6,
                         "link_gbps": run_link_gbps(mg, x), "probe_ns": 25.0, "steal_ticks": 0,
                         "runqueue_us": 0.0})  # fmt: skip
    np.savez_compressed(rec / "runs.npz", **arrays)
    pd.DataFrame(rows).to_csv(rec / "runs.csv", index=False)
    out = tmp_path / "an"
    assert sr.main(["analyze", str(rec), "--profile", "h100-calibrated", "--out", str(out)]) == 0
    runs = pd.read_csv(f"{out}_runs.csv")
    assert len(runs) == 4 and (runs.host_factor.round(2) == host).all()
    assert (runs.link_factor.between(1.2, 1.27)).all()  # the link's rate over the copies' time on it
    assert (runs.error_at_host < -0.05).all()  # the slower link left in
    assert (runs.error_at_host_and_link.abs() < 0.01).all()  # both taken out: the model finds its own runs again
    hand = pd.read_csv(f"{out}_handover.csv")
    assert set(hand.run) == {"real", "sim"} and (hand.n > 300).all()
    parts = hand[list(sr.PARTS)].sum(axis=1)
    assert np.allclose(parts, hand.gap, rtol=1e-6)  # the parts add up to the link's idle time per hand-over
    real = hand[hand.run == "real"].set_index("policy")
    assert (real.handle > 1.1 * hand[hand.run == "sim"].set_index("policy").handle).all()  # the slower host
    h = pd.read_csv(f"{out}_handling.csv").set_index(["kind", "commands"]).handle_us
    step = (h[("input", 2)] - h[("input", 1)]) * 1e3
    assert step == pytest.approx(prof.handle_per_cmd_ns * host, abs=2)  # the profile's line at this host
    assert h[("kernel", 0)] * 1e3 == pytest.approx(prof.handle_ns * host, abs=2)
    md = Path(f"{out}.md").read_text()
    assert "at its own host time and host link rate: 4 (mean" in md and "Steal time over the runs: 0 ticks" in md
