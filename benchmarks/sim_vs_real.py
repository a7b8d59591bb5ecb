"""Simulated against measured prefill time for the plans the CUDA runtime ran on the H100.

Reads the real runs recorded in ``benchmarks/results/`` (``runtime_7b_4096.csv``: the prefill benchmark,
nondet, budgets none / 6 GiB / 1 GiB; ``runtime_cli_7b_4096_6GiB{,_det}.csv``: ``turnip run`` with nondet
and det), rebuilds the same plans, simulates them on the ``h100`` profile and on ``h100-measured`` (the
same machine with the host costs the runtime measured), and prints simulated / measured ratios. Writes a
CSV and a PNG when ``--out`` is given. CPU only.

    python benchmarks/sim_vs_real.py --out benchmarks/results/sim_vs_real
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

RESULTS = Path(__file__).parent / "results"
GiB = 1 << 30


def real_runs() -> list[dict]:
    """(label, budget, resident, policy, measured ms samples) of the recorded H100 runs."""
    rows = []
    bench = pd.read_csv(RESULTS / "runtime_7b_4096.csv")
    for _, r in bench[bench.system == "turnip"].iterrows():
        none = r.budget == "none"
        rows.append(dict(source="llama_prefill.py", budget=r.budget, policy="nondet",
                         resident="all" if none else "auto", real_ms=json.loads(r.times_ms)))
    for pol, f in (("nondet", "runtime_cli_7b_4096_6GiB.csv"), ("det", "runtime_cli_7b_4096_6GiB_det.csv")):
        d = pd.read_csv(RESULTS / f)
        rows.append(dict(source="turnip run", budget="6GiB", policy=pol, resident="auto",
                         real_ms=(d.makespan_ns / 1e6).tolist()))
    return rows


def plan_for(budget: str, resident: str):
    from turnip.compile import build_with_resident, parse_nbytes
    from turnip.models import llama_prefill

    tg = llama_prefill("7b", 4096, 1, "fp16")
    if resident == "all":  # the benchmark's "none": every weight resident in a 24 GiB arena
        weights = int(tg.nbytes[tg.kind == 0].sum())
        return build_with_resident(tg, 24 * GiB, None, str(weights + (1 << 28)))
    return build_with_resident(tg, parse_nbytes(budget), None, resident)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="path prefix for .csv and .png")
    ap.add_argument("--seeds", type=int, default=10)
    a = ap.parse_args()
    from sim import simulate
    from sim.profile import load_profile
    from sim.timing import TimingModel

    profiles = {name: load_profile(name) for name in ("h100", "h100-measured")}
    plans, out = {}, []
    for run in real_runs():
        key = (run["budget"], run["resident"])
        if key not in plans:
            plans[key] = plan_for(*key)
        mg = plans[key]
        real = float(np.median(run["real_ms"]))
        row = dict(source=run["source"], budget=run["budget"], policy=run["policy"], vertices=mg.n, real_ms=real)
        for name, prof in profiles.items():
            tm = TimingModel(mg, prof)
            sims = [simulate(mg, prof, run["policy"], seed, False, tm).makespan_ns / 1e6 for seed in range(a.seeds)]
            row[f"sim_{name}_ms"] = float(np.median(sims))
            row[f"ratio_{name}"] = row[f"sim_{name}_ms"] / real
        out.append(row)
        print(f"{run['source']:>16} {run['budget']:>5} {run['policy']:>6}: real {real:7.1f} ms | "
              + " | ".join(f"{n} {row[f'sim_{n}_ms']:7.1f} ms (x{row[f'ratio_{n}']:.2f})" for n in profiles),
              flush=True)
    df = pd.DataFrame(out)
    if a.out:
        df.to_csv(f"{a.out}.csv", index=False)
        _plot(df, list(profiles), f"{a.out}.png")
    return 0


def _plot(df: pd.DataFrame, profiles: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.budget}\n{r.policy}\n{r.source}" for r in df.itertuples()]
    x = np.arange(len(df))
    w = 0.8 / (1 + len(profiles))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(x, df.real_ms, w, label="measured (H100)")
    for i, p in enumerate(profiles, 1):
        ax.bar(x + i * w, df[f"sim_{p}_ms"], w, label=f"simulated ({p})")
    ax.set_xticks(x + w * len(profiles) / 2, labels, fontsize=8)
    ax.set_ylabel("prefill ms (LLaMA-7B shape, 4096 tokens)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
