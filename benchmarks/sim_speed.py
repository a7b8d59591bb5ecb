"""Simulator speed: simulated vertices per second (target 100,000/s on one core) for the LLaMA-7B/4K and
65B/4K/8-GPU plans, and the scheduler core's own host cost per event (driven with no simulator at all).

    python benchmarks/sim_speed.py [--quick] [--profile NAME]

A profile with a power limit (``h100-calibrated``) simulates each run until the power bucket's start level
settles (``sim.engine.simulate``): the rate counts every pass.
"""

from __future__ import annotations

import argparse
import time

from sim.engine import simulate
from sim.timing import TimingModel
from turnip.compile import compile_model
from turnip.machine.profile import load_profile
from turnip.sched import Scheduler

TARGET_VERTICES_PER_S = 100_000


def core_cost_us(mg, policy: str, reps: int = 3) -> float:
    """Best-of-reps host cost per completion event of the bare core (FIFO completion order)."""
    best = float("inf")
    for _ in range(reps):
        s = Scheduler(mg, policy)
        t0 = time.perf_counter()
        todo = s.start(0)
        i = 0
        while i < len(todo):
            c = todo[i]
            i += 1
            todo += s.complete(c.v, i)
        best = min(best, (time.perf_counter() - t0) / mg.n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="7B only")
    ap.add_argument("--profile", default="h100", help="machine profile (default: the h100 preset)")
    a = ap.parse_args()
    plans = [("llama-7b", 4096, 1, "6GiB")] + ([] if a.quick else [("llama-65b", 4096, 8, "16GiB")])
    prof = load_profile(a.profile)
    print(f"{'plan':<28}{'vertices':>10}{'policy':>8}{'sim v/s':>10}{'vs target':>10}{'core us/event':>15}")
    for model, seq, gpus, budget in plans:
        t0 = time.perf_counter()
        mg = compile_model(model, seq, gpus, budget)[1]
        build_s = time.perf_counter() - t0
        tm = TimingModel(mg, prof)
        for policy in ("nondet", "det"):
            walls = [simulate(mg, prof, policy, seed, False, tm).wall_s for seed in range(3)]
            rate = mg.n / min(walls)
            core = core_cost_us(mg, policy)
            name = f"{model}/{seq // 1024}K/{gpus}g/{budget}"
            print(f"{name:<28}{mg.n:>10,}{policy:>8}{rate:>10,.0f}{rate / TARGET_VERTICES_PER_S:>9.2f}x"
                  f"{core:>15.2f}")  # fmt: skip
        print(f"  (compiled in {build_s:.1f} s)")


if __name__ == "__main__":
    main()
