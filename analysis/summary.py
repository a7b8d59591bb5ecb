"""The paper's table, widened: nondeterministic dispatch against each fixed-order baseline per configuration.

Baselines (``BASELINES``): ``det`` (the paper's: every vertex in compile order per GPU), ``det-kernels``
(kernels in compile order, copies prefetched as nondet does) and ``det-replay`` (the order of the fastest
nondet run, replayed fixed): the last answers "does adapting at run time beat the best fixed order?".
Runs of different policies with the same seed share their random draws, so each comparison is paired: per
seed ``ratio = makespan(nondet) / makespan(baseline)`` (below 1: adapting at run time wins), reported as the
mean with a 95% Student-t interval over seeds, and the speedup ``mean(baseline / nondet) - 1``.

A configuration is (model, seq, gpus, budget, workload): a prefill, a LoRA training step and a decode step
(over a KV cache of ``seq`` tokens) of the same model, length, GPU count and budget are three rows, in
``WORKLOADS`` order, never pooled. Run tables written before workloads existed are prefills
(``with_workload``); where they have ``tokens_per_s`` (tokens a run processes per simulated second: one per
sequence for a decode step), each policy's mean is reported beside its makespan.
"""

from __future__ import annotations

import numpy as np

CONFIG = ["model", "seq", "gpus", "budget", "workload"]
WORKLOADS = ("prefill", "lora", "decode")  # report order; others after them by name
BASELINES = ("det", "det-kernels", "det-replay")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04}  # fmt: skip


def _t95(dof: int) -> float:
    if dof <= 0:
        return float("nan")
    if dof > 30:
        return 1.96
    return T95[max(k for k in T95 if k <= dof)]


def _mean_ci(x: np.ndarray) -> tuple[float, float, float]:
    half = _t95(len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else np.nan
    return x.mean(), x.mean() - half, x.mean() + half


def with_workload(runs):
    """``runs`` with a ``workload`` column (``prefill`` where it has none), ordered as ``WORKLOADS`` (a
    categorical: group-bys sort prefill before lora)."""
    import pandas as pd

    w = runs["workload"].astype(str) if "workload" in runs else pd.Series("prefill", index=runs.index)
    cats = [x for x in WORKLOADS if x in set(w)] + sorted(set(w) - set(WORKLOADS))
    return runs.assign(workload=pd.Categorical(w, categories=cats, ordered=True))


def workload_label(workload) -> str:
    """`` lora`` and the like for a plot label or a table cell; empty for a prefill."""
    return "" if str(workload) == "prefill" else f" {workload}"


def speedup_table(runs, base: str = "det", other: str = "nondet"):
    """One row per configuration with ``other`` and at least one baseline (``base`` and ``BASELINES``):
    n seeds, lower bound, mean makespan and efficiency (lower bound / makespan) of every policy, and per
    baseline ``b``: ``{other}_over_{b}`` (mean paired ratio) with ``_ci_low`` / ``_ci_high`` and
    ``_mean_only``, ``speedup_over_{b}_pct``. Against ``base`` also the paper's columns: ``speedup_pct``
    with ``ci_low_pct`` / ``ci_high_pct`` and ``mean_only_speedup_pct``."""
    import pandas as pd

    runs = with_workload(runs)
    mean_only = runs.mean_only.astype(bool)
    noisy, mo_runs = runs[~mean_only], runs[mean_only]
    baselines = [base] + [b for b in BASELINES if b != base]
    rows = []
    for key, grp in noisy.groupby(CONFIG, sort=True, observed=True):
        key = (*key[:-1], str(key[-1]))
        b_ms = grp[grp.policy == other].set_index("seed").makespan_ns
        mo = mo_runs
        for k, v in zip(CONFIG, key, strict=True):
            mo = mo[(mo[k].astype(str) if k == "workload" else mo[k]) == v]
        mo_b = mo[mo.policy == other].makespan_ns
        # the plan's bound at the profile's median host and link (the mean-only run's; without one, the median
        # of the runs', each at its own drawn host and link factors)
        lb = mo.lower_bound_ns.iloc[0] if len(mo) else grp.lower_bound_ns.median()
        row = dict(zip(CONFIG, key, strict=True))
        row |= {"n_seeds": len(b_ms), "lower_bound_ms": lb / 1e6}
        if "resident_nbytes" in grp:  # inputs kept on the GPUs (loaded with the plan, not in the runs)
            row["resident_nbytes"] = int(grp.resident_nbytes.iloc[0])
        if len(b_ms):
            row |= {f"{other}_ms": b_ms.mean() / 1e6, f"{other}_efficiency": lb / b_ms.mean()}
            row |= _tokens_per_s(grp, other)
        for bl in baselines:
            a_ms = grp[grp.policy == bl].set_index("seed").makespan_ns
            seeds = a_ms.index.intersection(b_ms.index)
            if len(seeds) == 0:
                continue
            ratio = _mean_ci((b_ms[seeds] / a_ms[seeds]).to_numpy())
            speedup = _mean_ci((a_ms[seeds] / b_ms[seeds]).to_numpy() - 1)
            mo_a = mo[mo.policy == bl].makespan_ns
            mo_ratio = mo_b.iloc[0] / mo_a.iloc[0] if len(mo_a) and len(mo_b) else np.nan
            r = f"{other}_over_{bl}"
            row |= _tokens_per_s(grp, bl)
            row |= {f"{bl}_ms": a_ms[seeds].mean() / 1e6, f"{bl}_efficiency": lb / a_ms[seeds].mean(),
                    r: ratio[0], f"{r}_ci_low": ratio[1], f"{r}_ci_high": ratio[2], f"{r}_mean_only": mo_ratio,
                    f"speedup_over_{bl}_pct": speedup[0] * 100}  # fmt: skip
            if bl == base:
                row |= {"speedup_pct": speedup[0] * 100, "ci_low_pct": speedup[1] * 100,
                        "ci_high_pct": speedup[2] * 100, "mean_only_speedup_pct": (1 / mo_ratio - 1) * 100}  # fmt: skip
        if any(f"{other}_over_{bl}" in row for bl in baselines):
            rows.append(row)
    return pd.DataFrame(rows)


def _tokens_per_s(grp, policy: str) -> dict:
    """``{policy}_tokens_per_s``: the mean over ``policy``'s runs in ``grp`` (nothing without the column)."""
    if "tokens_per_s" not in grp:
        return {}
    return {f"{policy}_tokens_per_s": float(grp[grp.policy == policy].tokens_per_s.mean())}


def policy_order(policies) -> list[str]:
    """Policies in report order: nondet, the baselines (``BASELINES``), then any others by name."""
    known = ["nondet", *BASELINES]
    return [p for p in known if p in policies] + sorted(p for p in set(policies) if p not in known)


def present_baselines(df, other: str = "nondet") -> list[str]:
    """The baselines a ``speedup_table`` compares ``other`` with, in ``BASELINES`` order."""
    return [c[len(other) + 6 :] for c in df.columns if c.startswith(f"{other}_over_") and c.count("_") == 2]


def format_table(df, other: str = "nondet") -> str:
    """Plain-text table for the terminal: per configuration one line per baseline, then per baseline the
    range and geometric mean of ``other``/baseline over configurations (per workload when the table has
    more than prefills; the workload column too)."""
    if df.empty:
        return f"(no configuration has {other} and a baseline among {', '.join(BASELINES)})"
    bls = present_baselines(df, other)
    work = df["workload"].astype(str) if "workload" in df else None
    several = work is not None and bool((work != "prefill").any())
    wcol = f"{'workload':<9}" if several else ""
    lines = [f"{'model':<10}{'seq':>6}{'gpus':>5}  {'budget':<7}{wcol}{other + ' ms':>10}  {'baseline':<12}"
             f"{'its ms':>9}{other + '/it':>11}  {'95% CI':<16}{'mean-only':>10}{'speedup':>9}"
             f"{'bound ms':>10}"]  # fmt: skip
    for r in df.to_dict("records"):
        first = True
        w = f"{r['workload']!s:<9}" if several else ""
        for bl in bls:
            x = f"{other}_over_{bl}"
            if not np.isfinite(r.get(x, np.nan)):
                continue
            head = (f"{r['model']:<10}{r['seq']:>6}{r['gpus']:>5}  {r['budget']:<7}{w}{r[f'{other}_ms']:>10.1f}"
                    if first else " " * (40 + len(w)))  # fmt: skip
            ci = f"[{r[x + '_ci_low']:.3f}, {r[x + '_ci_high']:.3f}]"
            tail = f"{r['lower_bound_ms']:>10.1f}" if first else ""
            lines.append(f"{head}  {bl:<12}{r[f'{bl}_ms']:>9.1f}{r[x]:>11.3f}  {ci:<16}{r[x + '_mean_only']:>10.3f}"
                         f"{r[f'speedup_over_{bl}_pct']:>8.1f}%{tail}")  # fmt: skip
            first = False
    lines.append(f"\nmakespan ratios over configurations (below 1: {other}, adapting at run time, is faster):")
    indent = "    " if several else "  "
    for wl in dict.fromkeys(work) if several else [None]:
        part = df if wl is None else df[work == wl]
        if wl is not None:
            lines.append(f"  {wl}:")
        for bl in bls:
            x = part[f"{other}_over_{bl}"].dropna().to_numpy()
            if not len(x):
                continue
            what = {"det": "the paper's fixed order", "det-kernels": "fixed kernel order, copies prefetched",
                    "det-replay": "the best fixed order: the fastest nondet run's, replayed"}.get(bl, "")  # fmt: skip
            lines.append(f"{indent}{other + '/' + bl:<20}{x.min():.3f}..{x.max():.3f}, geometric mean "
                         f"{np.exp(np.log(x).mean()):.3f} over {len(x)}   {what}")  # fmt: skip
    return "\n".join(lines)
