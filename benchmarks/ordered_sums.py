"""Cost of ordered sums in simulation: LLaMA-7B prefill makespans under ``nondet`` with each sum-into lock
handed to its members in compile order (the default, bitwise reproducible) against the order they finish in.

    python benchmarks/ordered_sums.py [--quick] [--runs N] [--profile NAME] [--model NAME]

Plans: 4K and 16K tokens on 1, 2, 4 and 8 GPUs, without a budget (60GiB) and at 6GiB (``--quick``: 4K on 4
GPUs). Per plan it prints the lock groups' largest membership (ordering changes nothing below 3 members: one
add per group), the mean ``nondet`` makespan over ``--runs`` seeds with ordered and with unordered sums, and
their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from sim.engine import simulate
from sim.timing import TimingModel
from turnip.compile import compile_model
from turnip.machine.profile import load_profile

PLANS = [(seq, gpus, budget) for seq in (4096, 16384) for gpus in (1, 2, 4, 8) for budget in ("60GiB", "6GiB")]
QUICK = [(4096, 4, "60GiB"), (4096, 4, "6GiB")]


def largest_group(mg) -> int:
    """Members of the largest sum-into lock group (0: none)."""
    lock = mg.lock_group[mg.lock_group >= 0]
    return int(np.bincount(lock).max()) if lock.size else 0


def mean_makespan_ms(mg, prof, tm, runs: int, ordered_sums: bool) -> float:
    """Mean ``nondet`` makespan (ms) over seeds 0..runs-1."""
    runs_ns = (simulate(mg, prof, "nondet", s, False, tm, ordered_sums=ordered_sums).makespan_ns for s in range(runs))
    return statistics.fmean(runs_ns) / 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4K tokens on 4 GPUs only")
    ap.add_argument("--runs", type=int, default=5, help="nondet seeds per plan and setting (default 5)")
    ap.add_argument("--profile", default="h100", help="machine profile (default: the h100 preset)")
    ap.add_argument("--model", default="llama-7b", help="model (default llama-7b)")
    a = ap.parse_args(argv)
    prof = load_profile(a.profile)
    rows = []
    print(f"{'plan':<28}{'vertices':>10}{'group':>7}{'ordered ms':>12}{'unordered ms':>14}{'ratio':>8}")
    for seq, gpus, budget in QUICK if a.quick else PLANS:
        t0 = time.perf_counter()
        mg = compile_model(a.model, seq, gpus, budget)[1]
        build_s = time.perf_counter() - t0
        tm = TimingModel(mg, prof)
        ordered = mean_makespan_ms(mg, prof, tm, a.runs, True)
        unordered = mean_makespan_ms(mg, prof, tm, a.runs, False)
        name = f"{a.model}/{seq // 1024}K/{gpus}g/{budget}"
        print(f"{name:<28}{mg.n:>10,}{largest_group(mg):>7}{ordered:>12.2f}{unordered:>14.2f}"
              f"{ordered / unordered:>8.3f}   (compiled in {build_s:.1f} s)")
        rows.append({"plan": name, "vertices": mg.n, "largest_group": largest_group(mg), "ordered_ms": ordered,
                     "unordered_ms": unordered})  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
