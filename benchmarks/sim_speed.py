"""Simulator speed: simulated vertices per second on one core (target 200,000/s) from a 1.4K-vertex plan to a
125K-vertex one, and the scheduler core's own host cost per event (driven with no simulator at all).

    python benchmarks/sim_speed.py [--quick] [--profile NAME] [--baseline REV] [--rounds N] [--cache DIR]

Each plan is compiled as ``turnip compile`` does, once (the plan file is kept in ``--cache``). A rate counts
every ``sim.simulate`` call whole: its setup (scheduler, draws), the run and its result, and under a profile with
a power limit (``h100-calibrated``) every pass. Time is CPU time of the measuring process, the least of its runs
over all rounds (the run least disturbed by whatever else the machine runs); each round is a fresh process.
``--baseline REV``: the same measurement on the project at git revision REV (its tree from ``git archive``), its
rounds alternating with this tree's; ``x base`` is this tree's rate over REV's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_VERTICES_PER_S = 200_000
# name, `turnip compile` arguments, policies timed
PLANS = [
    ("7b/1K/1g/4GiB", ["--seq", "1024", "--budget", "4GiB"], ("nondet", "det")),
    ("7b/32K/1g/8GiB", ["--seq", "32768", "--budget", "8GiB"], ("nondet", "det")),
    ("65b/4K/8g/16GiB", ["--model", "llama-65b", "--seq", "4096", "--gpus", "8", "--budget", "16GiB"],
     ("nondet", "det")),
    ("7b/lora/8x1K/8GiB", ["--train", "lora", "--batch", "8", "--seq", "1024", "--budget", "8GiB"], ("nondet",)),
    ("7b/512K/1g/24GiB/h8", ["--seq", "524288", "--budget", "24GiB", "--tile", "h=8"], ("nondet",)),
]  # fmt: skip
SEEDS = 3  # runs per plan, policy and round


def plan_file(cache: Path, name: str, args: list[str]) -> Path:
    """The plan file of ``args``, compiled by ``turnip compile`` on first use."""
    path = cache / (name.replace("/", "_") + ".tplan")
    if not path.exists():
        from turnip.cli import main

        t0 = time.perf_counter()
        print(f"compiling {name} (kept in {path}) ...", file=sys.stderr, flush=True)
        if main(["compile", *args, "-o", str(path)]) != 0:
            raise SystemExit(f"turnip compile {' '.join(args)} failed")
        print(f"  compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return path


def measure(paths: list[str], policies: list[list[str]], profile: str) -> list[dict]:
    """CPU seconds of each ``simulate`` call and the core's cost per event, per plan and policy."""
    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.machine.profile import load_profile
    from turnip.memgraph.io import load_plan

    prof = load_profile(profile)
    out = []
    for path, pols in zip(paths, policies, strict=True):
        mg = load_plan(path)[0]
        tm = TimingModel(mg, prof)
        for policy in pols:
            simulate(mg, prof, policy, 0, False, tm)  # first use: what a run of the plan builds once
            cpu, makespans = [], []
            for seed in range(SEEDS):
                t0 = time.process_time()
                r = simulate(mg, prof, policy, seed, False, tm)
                cpu.append(time.process_time() - t0)
                makespans.append(int(r.makespan_ns))
            out.append({"n": mg.n, "cpu_s": cpu, "core_us": core_cost_us(mg, policy), "makespans": makespans})
    return out


def core_cost_us(mg, policy: str) -> float:
    """Host CPU time per completion event of the bare core (FIFO completion order, commands as the runtime
    takes them)."""
    from turnip.sched import Scheduler

    s = Scheduler(mg, policy)
    t0 = time.process_time()
    todo = s.start(0)
    i = 0
    while i < len(todo):
        c = todo[i]
        i += 1
        todo += s.complete(c.v, i)
    return (time.process_time() - t0) / max(mg.n, 1) * 1e6


def baseline_tree(rev: str, where: str) -> Path:
    """The project at git revision ``rev``, extracted under ``where``."""
    root = Path(__file__).resolve().parent.parent
    dst = Path(where) / "base"
    dst.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst


def run_worker(tree: Path, paths: list[str], policies: list[list[str]], profile: str) -> list[dict]:
    """``measure`` in a fresh process on the project in ``tree``."""
    job = json.dumps({"paths": paths, "policies": policies, "profile": profile})
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", job]
    res = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the two 7B prefill plans only")
    ap.add_argument("--profile", default="h100", help="machine profile (default: the h100 preset)")
    ap.add_argument("--baseline", metavar="REV", help="also measure the project at git revision REV")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of runs (alternating with the baseline's)")
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "turnip-sim-speed"),
                    help="directory of the compiled plans")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:  # a baseline's measurement, run in its own tree
        job = json.loads(a.worker)
        print(json.dumps(measure(job["paths"], job["policies"], job["profile"])))
        return
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    plans = PLANS[:2] if a.quick else PLANS
    paths = [str(plan_file(cache, name, args)) for name, args, _ in plans]
    policies = [list(p) for _, _, p in plans]
    rows = [(name, p) for name, _, pols in plans for p in pols]
    cur: list[list[float]] = [[] for _ in rows]
    base: list[list[float]] = [[] for _ in rows]
    here = Path(__file__).resolve().parent.parent
    core: list[list[float]] = [[] for _ in rows]
    with tempfile.TemporaryDirectory() as tmp:
        tree = baseline_tree(a.baseline, tmp) if a.baseline else None
        for _ in range(a.rounds):
            now = run_worker(here, paths, policies, a.profile)
            for acc, c, m in zip(cur, core, now, strict=True):
                acc += m["cpu_s"]
                c.append(m["core_us"])
            if tree is not None:
                then = run_worker(tree, paths, policies, a.profile)
                for acc, m, m_now in zip(base, then, now, strict=True):
                    acc += m["cpu_s"]
                    if m["makespans"] != m_now["makespans"]:
                        print(f"note: makespans differ from {a.baseline}'s: {m_now['makespans']} vs {m['makespans']}")
    head = f"{'plan':<22}{'vertices':>10}{'policy':>8}{'sim v/s':>11}{'vs target':>10}{'core us/ev':>11}"
    print(f"profile {a.profile}; CPU time, the fastest of {a.rounds} rounds x {SEEDS} runs")
    print(head + (f"{'base v/s':>11}{'x base':>8}" if tree is not None else ""))
    for i, (name, policy) in enumerate(rows):
        n = now[i]["n"]
        rate = n / min(cur[i])
        line = f"{name:<22}{n:>10,}{policy:>8}{rate:>11,.0f}{rate / TARGET_VERTICES_PER_S:>9.2f}x{min(core[i]):>11.2f}"
        if tree is not None:
            b = n / min(base[i])
            line += f"{b:>11,.0f}{rate / b:>7.2f}x"
        print(line)


if __name__ == "__main__":
    main()
