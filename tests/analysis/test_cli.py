import pandas as pd
import pytest

from turnip.cli import build_parser, main

pytestmark = pytest.mark.sim


def test_commands_registered():
    p = build_parser()
    for cmd in ("simulate", "ablate", "report"):
        assert p.parse_args([cmd, "x"] if cmd != "ablate" else [cmd]).func


def test_simulate_and_ablate_small(tmp_path, capsys):
    assert main(["simulate", "llama-tiny:64:2:64KiB", "--runs", "2", "--trace", str(tmp_path / "t.json")]) == 0
    assert "makespan" in capsys.readouterr().out and (tmp_path / "t.json").exists()
    argv = ["simulate", "llama-tiny:64:2:64KiB", "--runs", "2", "--policy", "det-replay", "--record-runs", "3"]
    assert main(argv) == 0
    assert "replaying the issue order of nondet seed" in capsys.readouterr().out
    assert main(["simulate", "llama-tiny:64:2:64KiB", "--record-runs", "3"]) == 2  # det-replay only
    out = tmp_path / "rep"
    argv = ["ablate", "--models", "llama-tiny", "--seqs", "64", "--gpus", "1", "2", "--budgets", "small=32KiB",
            "big=1MiB", "--seeds", "2", "--jobs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "speedup" in text and (out / "runs.csv").exists() and (out / "figures" / "speedup.png").exists()
    assert "nondet/det-replay" in text and "nondet/det-kernels" in text
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs.policy) == {"nondet", "det", "det-kernels", "det-replay"}
    assert len(runs) == 2 * 2 * 4 * 3  # configurations x policies x (2 seeds + 1 noise-free)
    resident = runs.groupby("budget").resident_nbytes.min()
    assert resident["big"] > 0 and resident["small"] == 0  # auto: a quarter of 1 MiB fits, of 32 KiB not
    big = runs[runs.budget == "big"]
    assert (big.input_nbytes + big.resident_nbytes == runs[runs.budget == "small"].input_nbytes.max()).all()
    replay = runs[runs.policy == "det-replay"]
    nondet = runs[(runs.policy == "nondet") & ~runs.mean_only]
    for (gpus, budget), grp in replay.groupby(["gpus", "budget"]):  # the fastest nondet seed's order
        nd = nondet[(nondet.gpus == gpus) & (nondet.budget == budget)]
        assert (grp.replayed_seed == nd.seed.iloc[nd.makespan_ns.argmin()]).all()
    summary = pd.read_csv(out / "summary.csv")
    for base in ("det", "det-kernels", "det-replay"):
        assert summary[f"nondet_over_{base}"].between(0.2, 5).all()
    assert main(["report", str(out)]) == 0
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_ablate_workloads(tmp_path, capsys):
    out = tmp_path / "rep"
    argv = ["ablate", "--models", "llama-tiny", "--seqs", "16", "--gpus", "1", "--budgets", "tight=96KiB",
            "--policies", "nondet", "det", "--seeds", "1", "--no-mean-only", "--jobs", "1", "--out", str(out),
            "--workloads", "prefill", "lora", "--train-batch", "2"]  # fmt: skip
    assert main(argv) == 0
    assert "lora" in capsys.readouterr().out
    assert pd.read_csv(out / "summary.csv").workload.tolist() == ["prefill", "lora"]
    assert main(["report", str(out)]) == 0
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[ablate]\nworkloads = ["serve"]\n')
    assert main(["ablate", "--config", str(cfg), "--out", str(out)]) == 2
    assert "workloads" in capsys.readouterr().err
