"""matplotlib (Agg) figures from run tables and trace span/memory tables. Each function writes one PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from analysis.summary import CONFIG, policy_order, present_baselines, with_workload, workload_label

_COLORS = {"kernel": "tab:blue", "h2d": "tab:green", "d2h": "tab:red", "p2p": "tab:purple"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """PNG written atomically (a temporary file renamed into place), so no figure is left half-written."""
    from turnip.fileio import atomic_write

    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _seq(seq) -> str:
    """A length for a label: 4K for 4096, 100 for 100."""
    seq = int(seq)
    return f"{seq // 1024}K" if seq >= 1024 and seq % 1024 == 0 else str(seq)


def _label(row) -> str:
    w = workload_label(row.get("workload", "prefill"))
    return f"{row['model']} {_seq(row['seq'])} {int(row['gpus'])}g {row['budget']}{w}"


def speedup(table, path: Path, other: str = "nondet") -> None:
    """Per configuration, ``other``'s makespan over each baseline's (det, det-kernels, det-replay: paired by
    seed, 95% interval) as bars, the noise-free ratio as a marker; below 1 adapting at run time wins."""
    plt = _plt()
    bls = present_baselines(table, other)
    fig, ax = plt.subplots(figsize=(max(6, (0.25 * len(bls) + 0.3) * len(table) + 2), 4.6))
    x = np.arange(len(table))
    w = 0.8 / max(1, len(bls))
    for j, bl in enumerate(bls):
        c = f"{other}_over_{bl}"
        y, lo, hi = (table[k].to_numpy(dtype=float) for k in (c, f"{c}_ci_low", f"{c}_ci_high"))
        err = np.vstack([y - lo, hi - y])
        pos = x + (j - (len(bls) - 1) / 2) * w
        ax.bar(pos, y, w * 0.9, yerr=np.nan_to_num(err), capsize=2, color=f"C{j}", label=f"{other} / {bl}")
        ax.plot(pos, table[f"{c}_mean_only"].to_numpy(dtype=float), "wo", ms=3, mec="k", mew=0.8,
                label="mean-only (no noise)" if j == 0 else None)  # fmt: skip
    ax.axhline(1, color="k", lw=0.8)
    floor = np.nanmin([table[f"{other}_over_{b}_ci_low"].min() for b in bls] + [1.0])
    ax.set_ylim(max(0.0, floor - 0.05), None)
    ax.set_xticks(x, [_label(r) for _, r in table.iterrows()], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel(f"makespan {other} / baseline\n(paired by seed; <1: {other} faster)", fontsize=9)
    ax.legend(fontsize=8, ncol=len(bls) + 1, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def makespan_distributions(runs, path: Path) -> None:
    """Makespan over seeds per configuration and policy, relative to the configuration's lower bound."""
    plt = _plt()
    runs = with_workload(runs)
    noisy = runs[~runs.mean_only.astype(bool)]
    groups = list(noisy.groupby(CONFIG, sort=True, observed=True))
    policies = policy_order(noisy.policy.unique())
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(groups) + 2), 4))
    w = 0.8 / max(1, len(policies))
    for j, pol in enumerate(policies):
        sel = [g[g.policy == pol] for _, g in groups]  # divide within the policy's rows (index-aligned)
        data = [(x.makespan_ns / x.lower_bound_ns).to_numpy() for x in sel]
        pos = np.arange(len(groups)) + (j - (len(policies) - 1) / 2) * w
        bp = ax.boxplot(data, positions=pos, widths=w * 0.9, patch_artist=True, showfliers=True)
        for b in bp["boxes"]:
            b.set_facecolor(f"C{j}")
        ax.plot([], [], color=f"C{j}", lw=6, label=pol)
    ax.set_xticks(np.arange(len(groups)), [_label(dict(zip(CONFIG, k, strict=True))) for k, _ in groups],
                  rotation=60, ha="right", fontsize=8)  # fmt: skip
    ax.set_ylabel("makespan / lower bound")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def efficiency(runs, path: Path) -> None:
    """Lower bound / makespan of every run, per policy (and per workload: other markers than prefill's)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    runs = with_workload(runs)
    noisy = runs[~runs.mean_only.astype(bool)]
    works = list(noisy.workload.cat.categories)
    for j, pol in enumerate(policy_order(noisy.policy.unique())):  # markers apart: policies often coincide
        for k, w in enumerate(works):
            g = noisy[(noisy.policy == pol) & (noisy.workload == w)]
            label = pol + (workload_label(w) if len(works) > 1 else "")
            ax.scatter(g.lower_bound_ns / 1e6, g.lower_bound_ns / g.makespan_ns, s=14, color=f"C{j}", label=label,
                       marker=("o+x^vsd", "D1*<>ph")[k % 2][j % 7], facecolors="none" if j == 0 else None)  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("lower bound (ms)")
    ax.set_ylabel("efficiency = bound / makespan")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def offload_volume(runs, path: Path) -> None:
    """Bytes offloaded + reloaded (and loaded as inputs) against the per-GPU budget."""
    plt = _plt()
    runs = with_workload(runs)
    one = runs[runs.policy == runs.policy.iloc[0]].drop_duplicates(CONFIG)
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = one.groupby(["model", "seq", "gpus", "workload"], observed=True)  # prefill and training apart
    for j, ((model, seq, gpus, work), g) in enumerate(lines):
        g = g.sort_values("budget_nbytes")
        moved = (g.offload_nbytes + g.reload_nbytes + g.input_nbytes) / 1e9
        ax.plot(g.budget_nbytes / 2**30, moved, "o-", color=f"C{j % 10}",
                label=f"{model} {_seq(seq)} {gpus}g{workload_label(work)}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget per GPU (GiB)")
    ax.set_ylabel("host<->GPU bytes moved (GB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def gantt(spans_by_policy: dict, path: Path, max_ms: float | None = None) -> None:
    """Engine activity per GPU (one row per engine), one panel per policy."""
    plt = _plt()
    fig, axes = plt.subplots(len(spans_by_policy), 1, figsize=(11, 1.2 + 1.6 * len(spans_by_policy)),
                             squeeze=False, sharex=True)  # fmt: skip
    for ax, (pol, s) in zip(axes[:, 0], spans_by_policy.items(), strict=True):
        pid = np.where(s["engine"] == "h2d", s["dst_gpu"], s["gpu"])
        rows = sorted({(int(p), e) for p, e in zip(pid, s["engine"], strict=True)})
        for i, (g, e) in enumerate(rows):
            sel = (pid == g) & (s["engine"] == e)
            t0 = s["start_ns"][sel] / 1e6
            dur = (s["end_ns"][sel] - s["start_ns"][sel]) / 1e6
            ax.broken_barh(list(zip(t0, dur, strict=True)), (i - 0.4, 0.8), color=_COLORS[e], lw=0)
        ax.set_yticks(range(len(rows)), [f"gpu{g} {e}" for g, e in rows], fontsize=7)
        ax.set_title(f"{pol}: makespan {s['done_ns'].max() / 1e6:.1f} ms", fontsize=9)
        if max_ms:
            ax.set_xlim(0, max_ms)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def memory(memory_by_policy: dict, budget_nbytes: np.ndarray, path: Path) -> None:
    """GPU bytes in use over time (step functions) per policy, with the budget."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, (pol, m) in enumerate(memory_by_policy.items()):
        for g in np.unique(m["gpu"]):
            sel = m["gpu"] == g
            ax.step(m["t_ns"][sel] / 1e6, m["bytes_in_use"][sel] / 2**30, where="post", color=f"C{j}",
                    lw=0.8, alpha=0.8, label=f"{pol}" if g == 0 else None)  # fmt: skip
    ax.axhline(float(np.max(budget_nbytes)) / 2**30, color="k", ls="--", lw=1, label="budget")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("GPU bytes in use (GiB)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
