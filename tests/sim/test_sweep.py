"""``run_sweep`` writes the same files whatever order its pool's runs finish in (as on a cluster)."""

import csv
from pathlib import Path

import pytest

from sim.sweep import TIMING_COLUMNS, Processes, SweepConfig, run_sweep

pytestmark = pytest.mark.sim

CFG = SweepConfig(models=("llama-tiny",), seqs=(16,), gpus=(1, 2), budgets={"s": "96KiB"},
                  policies=("nondet", "det", "det-replay"), seeds=2,
                  trace={"model": "llama-tiny", "seq": 16, "gpus": 1, "budget": "s"})  # fmt: skip


class LastFirst(Processes):
    """Local processes whose runs come back in the reverse of their order."""

    def run(self, out, tasks):
        return reversed(list(super().run(out, tasks)))


def runs_without_timing(out: Path) -> list[list[str]]:
    with open(out / "runs.csv", newline="") as f:
        table = list(csv.reader(f))
    keep = [i for i, c in enumerate(table[0]) if c not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in table]


def test_the_files_do_not_depend_on_the_order_runs_finish_in(tmp_path):
    run_sweep(CFG, tmp_path / "a", jobs=1, quiet=True)
    run_sweep(CFG, tmp_path / "b", quiet=True, pool=LastFirst(1, CFG.profile))
    a, b = tmp_path / "a", tmp_path / "b"
    assert runs_without_timing(a) == runs_without_timing(b)
    for name in ("summary.csv", "config.json", "traces/meta.json", "traces/nondet.trace.json",
                 "traces/det-replay.spans.csv"):  # fmt: skip
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
