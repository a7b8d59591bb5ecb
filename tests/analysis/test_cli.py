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
    out = tmp_path / "rep"
    argv = ["ablate", "--models", "llama-tiny", "--seqs", "64", "--gpus", "1", "2", "--budgets", "small=32KiB",
            "big=1MiB", "--seeds", "2", "--jobs", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "speedup" in text and (out / "runs.csv").exists() and (out / "figures" / "speedup.png").exists()
    assert main(["report", str(out)]) == 0
    assert main(["report", str(tmp_path / "missing")]) == 2
