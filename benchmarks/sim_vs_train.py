"""The simulator on LoRA training steps against their measured makespans (``benchmarks/lora_peft.py``'s CSV):
each row's plan rebuilt as the benchmark built it, simulated on a profile, error per row and policy.

    PYTHONPATH=. python benchmarks/sim_vs_train.py benchmarks/results/lora_7b_h100_16g.csv \\
        benchmarks/results/lora_7b_h100_24g.csv --profile h100-calibrated --out benchmarks/results/sim_vs_train_h100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import pandas as pd

    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.compile import build_with_resident, parse_nbytes
    from turnip.machine.profile import load_profile
    from turnip.models import LLAMA
    from turnip.train import LoraConfig, lora_step

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", nargs="+", help="CSVs of benchmarks/lora_peft.py")
    ap.add_argument("--profile", default="h100-calibrated")
    ap.add_argument("--size", default="7b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    prof = load_profile(a.profile)
    real = pd.concat([pd.read_csv(f) for f in a.measured])
    real = real[real.kind == "turnip"]
    rows = []
    for (b, s, budget), cell in real.groupby(["batch", "seq", "budget"], sort=False):
        nbytes = parse_nbytes(budget)
        tg = lora_step(LLAMA[a.size], int(s), int(b), 1, "fp16", None, None, nbytes, LoraConfig(rank=16, alpha=32.0))
        mg = build_with_resident(tg, nbytes, None, "auto")
        tm = TimingModel(mg, prof)
        for _, r in cell.iterrows():
            sim = [simulate(mg, prof, r.policy, seed, False, tm).makespan_ns / 1e9 for seed in range(a.runs)]
            pred = float(np.mean(sim))
            rows.append({"batch": int(b), "seq": int(s), "budget": budget, "policy": r.policy,
                         "measured_s": float(r.makespan_s), "predicted_s": pred,
                         "error": pred / float(r.makespan_s) - 1.0})  # fmt: skip
            print(rows[-1], flush=True)
    d = pd.DataFrame(rows)
    d.to_csv(a.out.with_suffix(".csv"), index=False)
    lines = [f"# The simulator on LoRA training steps ({a.size}, fp16, rank 16), profile {a.profile}", "",
             "command: `python benchmarks/sim_vs_train.py " + " ".join(sys.argv[1:]) + "`", "",
             "| batch x seq | budget | policy | measured makespan (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} x {r['seq']} | {r['budget']} | {r['policy']} | {r['measured_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['error']:+.1%} |")
    within = int((d.error.abs() <= 0.05).sum())
    lines += ["", f"Within ±5%: {within} of {len(d)}; mean |error| {d.error.abs().mean():.1%}."]
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
