"""The paper's table: speedup of nondeterministic over deterministic dispatch per configuration.

Runs of different policies with the same seed share their random draws, so the comparison is paired:
per seed ``ratio = makespan(det) / makespan(nondet)``; the speedup is ``mean(ratio) - 1`` with a 95%
Student-t interval over seeds.
"""

from __future__ import annotations

import numpy as np

CONFIG = ["model", "seq", "gpus", "budget"]
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04}  # fmt: skip


def _t95(dof: int) -> float:
    if dof <= 0:
        return float("nan")
    if dof > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= dof)]


def speedup_table(runs, base: str = "det", other: str = "nondet"):
    """One row per configuration: n seeds, mean makespans, speedup % with CI, mean-only speedup %,
    efficiency (lower bound / makespan) of both policies."""
    import pandas as pd

    noisy = runs[~runs.mean_only.astype(bool)]
    rows = []
    for key, grp in noisy.groupby(CONFIG, sort=True):
        a = grp[grp.policy == base].set_index("seed").makespan_ns
        b = grp[grp.policy == other].set_index("seed").makespan_ns
        seeds = a.index.intersection(b.index)
        if len(seeds) == 0:
            continue
        ratio = (a[seeds] / b[seeds]).to_numpy()
        half = _t95(len(ratio) - 1) * ratio.std(ddof=1) / np.sqrt(len(ratio)) if len(ratio) > 1 else np.nan
        row = dict(zip(CONFIG, key, strict=True))
        lb = grp.lower_bound_ns.iloc[0]
        row |= {
            "n_seeds": len(seeds),
            f"{base}_ms": a[seeds].mean() / 1e6,
            f"{other}_ms": b[seeds].mean() / 1e6,
            "speedup_pct": (ratio.mean() - 1) * 100,
            "ci_low_pct": (ratio.mean() - half - 1) * 100,
            "ci_high_pct": (ratio.mean() + half - 1) * 100,
            "lower_bound_ms": lb / 1e6,
            f"{base}_efficiency": lb / a[seeds].mean(),
            f"{other}_efficiency": lb / b[seeds].mean(),
        }
        mo = runs[runs.mean_only.astype(bool)]
        for k, v in zip(CONFIG, key, strict=True):
            mo = mo[mo[k] == v]
        ma, mb = mo[mo.policy == base].makespan_ns, mo[mo.policy == other].makespan_ns
        row["mean_only_speedup_pct"] = (ma.iloc[0] / mb.iloc[0] - 1) * 100 if len(ma) and len(mb) else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def format_table(df) -> str:
    """Plain-text table for the terminal."""
    if df.empty:
        return "(no configuration has both policies)"
    lines = [f"{'model':<10}{'seq':>6}{'gpus':>5}  {'budget':<7}{'det ms':>9}{'nondet ms':>10}"
             f"{'speedup':>9}  {'95% CI':<16}{'mean-only':>10}{'bound ms':>10}"]  # fmt: skip
    for r in df.itertuples():
        ci = f"[{r.ci_low_pct:+.1f}, {r.ci_high_pct:+.1f}]%"
        lines.append(
            f"{r.model:<10}{r.seq:>6}{r.gpus:>5}  {r.budget:<7}{r.det_ms:>9.1f}{r.nondet_ms:>10.1f}"
            f"{r.speedup_pct:>8.1f}%  {ci:<16}{r.mean_only_speedup_pct:>9.1f}%{r.lower_bound_ms:>10.1f}"
        )
    return "\n".join(lines)
