"""Sweep throughput on local processes against a local Dask cluster: configurations (one simulated run each:
plan x policy x seed) per second of one `turnip ablate` sweep run with ``--jobs N`` and with
``--scheduler local:N`` on the same machine, and their ratio (Dask over local processes; 1.0: no cost).

    python benchmarks/sweep_dask.py [--workers 2] [--seeds 20] [--repeat 2] [--quick] [--out DIR]

The default grid is small models and random DAGs (llama-tiny, llama-tiny-gqa, random x 3 lengths x 1, 2, 4
GPUs x 4 budgets: 108 plans) x nondet and det x (20 seeds + a noise-free run): 4,536 runs, each a few
milliseconds of simulation, so the per-task cost of either pool shows. Each sweep is timed end to end
(compiling its plans into a fresh directory, the runs, the CSVs and figures; for Dask, starting and
closing the cluster too, which is also timed alone), ``--repeat`` times each way in alternating order; the
fastest of each way counts (the least disturbed by other work on the machine). The CPU seconds of this
process and all its ended descendants (pool workers, the cluster's nannies and workers) are counted too,
the least of each way: less sensitive than the wall time to other work on the machine. Every ``runs.csv`` must
agree with the first apart from the timing columns, else the script fails.
"""

from __future__ import annotations

import argparse
import csv
import resource
import tempfile
import time
from pathlib import Path

from sim.cluster import ClusterSweep, DaskPool
from sim.sweep import TIMING_COLUMNS, SweepConfig, run_sweep

GRID = {"models": ("llama-tiny", "llama-tiny-gqa", "random"), "seqs": (16, 32, 64), "gpus": (1, 2, 4),
        "budgets": {"b48k": "48KiB", "b96k": "96KiB", "b256k": "256KiB", "b1m": "1MiB"},
        "policies": ("nondet", "det")}  # fmt: skip
QUICK = GRID | {"models": ("llama-tiny", "random"), "seqs": (16,), "budgets": {"b96k": "96KiB", "b1m": "1MiB"}}


def rows(path: Path) -> list[list[str]]:
    """runs.csv as text cells, the timing columns left out."""
    with open(path, newline="") as f:
        table = list(csv.reader(f))
    keep = [i for i, c in enumerate(table[0]) if c not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in table]


def cpu_s() -> float:
    """CPU seconds of this process and of every descendant that has ended (pool workers, Dask nannies and
    their workers, once closed)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed_sweep(cfg: SweepConfig, out: Path, **where) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, runs) of one sweep into ``out``."""
    t0, c0 = time.perf_counter(), cpu_s()
    run_sweep(cfg, out, quiet=True, **where)
    return time.perf_counter() - t0, cpu_s() - c0, len(rows(out / "runs.csv")) - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="local processes, and Dask workers (default 2)")
    ap.add_argument("--seeds", type=int, default=20, help="seeds per plan and policy (default 20)")
    ap.add_argument("--repeat", type=int, default=2, help="sweeps each way, in the order local, dask, dask, local, "
                    "...; the fastest of each counts (default 2)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a 12-plan grid (a smoke run, not a measurement)")
    ap.add_argument("--out", help="directory for the sweeps' reports (default: a temporary one)")
    a = ap.parse_args()
    grid = QUICK if a.quick else GRID
    trace = {"model": grid["models"][0], "seq": grid["seqs"][0], "gpus": 1, "budget": next(iter(grid["budgets"]))}
    cfg = SweepConfig(**grid, seeds=a.seeds, trace=trace)
    pools = {f"--jobs {a.workers}": {"jobs": a.workers}, f"--scheduler local:{a.workers}": None}
    walls: dict[str, list[tuple[float, float]]] = {k: [] for k in pools}
    with tempfile.TemporaryDirectory(prefix="sweep-dask-") as tmp:
        base = Path(a.out or tmp)
        t0 = time.perf_counter()
        with DaskPool(f"local:{a.workers}"):
            pass
        start_s = time.perf_counter() - t0
        order = [name for r in range(a.repeat) for name in (list(pools) if r % 2 == 0 else list(pools)[::-1])]
        for k, name in enumerate(order):
            where = pools[name] or {"pool": ClusterSweep(f"local:{a.workers}", cfg.profile)}
            wall, cpu, n = timed_sweep(cfg, base / str(k), **where)
            walls[name].append((wall, cpu))
            print(f"  {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
            if rows(base / str(k) / "runs.csv") != rows(base / "0" / "runs.csv"):
                raise SystemExit(f"the sweeps' runs.csv differ beyond the timing columns ({base / str(k)})")
    print(f"{len(cfg.plans())} plans, {n} configurations (runs), {a.workers} workers; rows identical apart from "
          f"{', '.join(TIMING_COLUMNS)}")  # fmt: skip
    print(f"{'pool':<26}{'best wall s':>12}{'configs/s':>11}{'least CPU s':>13}{'configs/CPU s':>15}")
    best = {name: (min(x[0] for x in w), min(x[1] for x in w)) for name, w in walls.items()}
    for name, (wall, cpu) in best.items():
        print(f"{name:<26}{wall:>12.1f}{n / wall:>11.1f}{cpu:>13.1f}{n / cpu:>15.1f}")
    (local, local_cpu), (dask, dask_cpu) = best.values()
    print(f"ratio dask/local {local / dask:.3f} (configs/s), {local_cpu / dask_cpu:.3f} (configs per CPU s); a local "
          f"cluster alone starts and stops in {start_s:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
