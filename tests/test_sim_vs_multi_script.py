"""``benchmarks/sim_vs_multi.py`` on a tiny measured row: a ``turnip.linkprobe --json`` file with its port flag and
relay rates is read (the profile's fields taken, the relay rates left out), the error and the CSV written."""

import csv
import json
import re

import pytest

from tests.benchscripts import load_script

pytestmark = pytest.mark.unit
FIELDS = ["workload", "model", "seq", "batch", "budget", "gpus", "split", "policy", "ms_median", "vertices"]


def write_rows(path, rows: list[dict]) -> str:
    """A measured CSV as ``benchmarks/multi_gpu.py`` writes it: tiny prefill rows on 2 GPUs at 1 MiB, each row's
    own fields over those."""
    base = {"workload": "prefill", "model": "llama-tiny", "seq": 64, "batch": 1, "budget": "1MiB", "gpus": 2,
            "split": "tensor", "vertices": ""}  # fmt: skip
    rows = [base | r for r in rows]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(FIELDS + [k for r in rows for k in r])))
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_links_file_with_ports_and_relay_rates(tmp_path, capsys):
    measured = [{"policy": "nondet", "ms_median": 1.0}, {"policy": "det", "ms_median": 1.2}]
    rows = write_rows(tmp_path / "rows.csv", measured)
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"host_h2d_total_bytes_per_s": [50e9, 90e9], "host_d2h_total_bytes_per_s": [50e9, 90e9],
                                 "host_both_total_bytes_per_s": [80e9, 120e9], "p2p_ports_serial": True,
                                 "relay_own_bytes_per_s": 50e9, "relay_relay_bytes_per_s": 50e9,
                                 "relay_staged_bytes_per_s": 90e9}))  # fmt: skip
    out = tmp_path / "sim.csv"
    mod = load_script("sim_vs_multi")
    assert mod.main([rows, "--profile", "h100-calibrated", "--links", str(links), "--runs", "1",
                     "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "| 0K | 1MiB | 2 | tensor |" in text and "links " + str(links) in text
    got = list(csv.DictReader(open(out)))
    assert len(got) == 2 and all(float(r["sim_ms"]) > 0 for r in got)


def test_at_its_own_host_time_a_slower_host_is_simulated_slower(tmp_path, capsys):
    """``--at-host-time``: each row simulated with its host costs scaled to its measured ``host_ms_per_run``: a row
    whose host took ten times as long is predicted slower, the summary line counts both."""
    from sim.timing import TimingModel
    from turnip.compile import compile_model
    from turnip.machine.costs import host_busy_ns
    from turnip.machine.profile import load_profile

    mg = compile_model("llama-tiny", seq=64, gpus=2, budget="1MiB", resident="auto", split="tensor")[1]
    base = host_busy_ns(TimingModel(mg, load_profile("h100-calibrated")), 1.0) / 1e6
    rows = write_rows(tmp_path / "rows.csv", [{"policy": p, "ms_median": 1.0, "vertices": mg.n, "host_ms_per_run": h}
                                               for p, h in (("nondet", base), ("det", 10 * base))])  # fmt: skip
    out = tmp_path / "sim.csv"
    mod = load_script("sim_vs_multi")
    args = [rows, "--profile", "h100-calibrated", "--runs", "1", "--at-host-time", "--out", str(out)]
    assert mod.main(args) == 0
    assert "at each row's own host time:" in capsys.readouterr().out
    nondet, det = list(csv.DictReader(open(out)))
    assert float(det["sim_ms_at_host"]) > 2 * float(nondet["sim_ms_at_host"]) > 0


def test_a_row_whose_plan_changed_since_is_not_compared(tmp_path, capsys):
    """A measured row whose vertex count the compiler no longer gives is named and left out; the others are
    compared; with none left the script fails."""
    rows = write_rows(tmp_path / "rows.csv", [{"policy": "nondet", "ms_median": 1.0, "vertices": ""},
                                               {"policy": "det", "ms_median": 1.0, "vertices": 7}])  # fmt: skip
    mod = load_script("sim_vs_multi")
    assert mod.main([rows, "--runs", "1"]) == 0
    text = capsys.readouterr().out
    assert "not compared: llama-tiny 64 x 1 at 1MiB on 2 GPUs (tensor, det)" in text
    assert "the measured plan had 7" in text and re.search(r"\d of 1 cells within", text) and "1 not compared" in text
    only = write_rows(tmp_path / "only.csv", [{"policy": "nondet", "ms_median": 1.0, "vertices": 7}])
    assert mod.main([only, "--runs", "1"]) == 1


def test_a_row_of_the_tile_choices_plan_is_compiled_with_its_tiles(tmp_path, capsys):
    """A row whose split names the tile choice's plan ('tensor t=16', as ``benchmarks/multi_gpu.py`` writes it) is
    simulated on the plan of those tiles: its vertex count is that plan's, not the default tiles'."""
    from turnip.compile import compile_model

    n = {t: compile_model("llama-tiny", seq=64, gpus=2, budget="1MiB", resident="auto", split="tensor",
                          tiles={"t": t})[1].n for t in (16, 32)}  # fmt: skip
    assert n[16] != n[32]
    rows = write_rows(tmp_path / "rows.csv", [{"split": "tensor t=16", "policy": "nondet", "ms_median": 1.0,
                                               "vertices": n[16]}])  # fmt: skip
    mod = load_script("sim_vs_multi")
    assert mod.main([rows, "--runs", "1"]) == 0
    assert "| tensor t=16 |" in capsys.readouterr().out
