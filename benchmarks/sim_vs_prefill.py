"""The simulator against measured prefill runs: for every turnip row of ``benchmarks/llama_prefill.py`` CSVs,
compile the same plan (same model, prompt, budget, tiles and resident set), simulate it on each profile
and policy, and write predicted vs measured makespans with the relative error.

    python benchmarks/sim_vs_prefill.py benchmarks/results/prefill_h100_a.csv benchmarks/results/prefill_h100_b.csv \\
        --out benchmarks/results/sim_vs_prefill_h100
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("measured", nargs="+", help="prefill CSVs")
    ap.add_argument("--profiles", nargs="+", default=["h100", "h100-measured"])
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--size", default="7b")
    ap.add_argument("--none-budget", default="40GiB", help="arena of the benchmark's 'none' rows")
    ap.add_argument("--out", required=True, help="path without suffix: writes .csv and .md")
    a = ap.parse_args(argv)
    from sim.engine import simulate
    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes
    from turnip.machine.profile import load_profile

    meas = pd.concat([pd.read_csv(f) for f in a.measured])
    rows = []
    for _, r in meas[meas.system == "turnip"].iterrows():
        seq, b = int(r.seq), str(r.budget)
        tg = make_taskgraph(f"llama-{a.size}", seq, 1, "fp16", None,
                            budget_nbytes=parse_nbytes(a.none_budget if b == "none" else b))  # fmt: skip
        budget = parse_nbytes(a.none_budget if b == "none" else b)
        resident = str(int(r.resident_nbytes) + (1 << 28)) if b == "none" else "auto"
        mg = build_with_resident(tg, budget, None, resident)
        for prof in a.profiles:
            p = load_profile(prof)
            for pol in a.policies:
                pred = float(np.mean([simulate(mg, p, pol, seed=s).makespan_ns / 1e6 for s in range(a.seeds)]))
                m = float(r[f"{pol}_ms"])
                rows.append({"seq": seq, "budget": b, "profile": prof, "policy": pol, "predicted_ms": round(pred, 1),
                             "measured_ms": round(m, 1), "error": round(pred / m - 1, 3)})  # fmt: skip
    df = pd.DataFrame(rows)
    df.to_csv(a.out + ".csv", index=False)
    cmd = "python " + " ".join(sys.argv)
    lines = [f"Command: `{cmd}`", "", "| seq | budget | policy | " + " | ".join(f"{p} (error)" for p in a.profiles)
             + " | measured ms |", "|---" * (4 + len(a.profiles)) + "|"]  # fmt: skip
    for (seq, b, pol), g in df.groupby(["seq", "budget", "policy"], sort=False):
        cells = [f"{g[g.profile == p].predicted_ms.iloc[0]:.1f} ({g[g.profile == p].error.iloc[0]:+.1%})"
                 for p in a.profiles]  # fmt: skip
        lines.append(f"| {seq} | {b} | {pol} | " + " | ".join(cells) + f" | {g.measured_ms.iloc[0]:.1f} |")
    open(a.out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
