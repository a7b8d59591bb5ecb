"""Overlay a simulated and a real trace of the same plan: one figure on a shared time axis, one error table.

Both traces are ``turnip.trace.Trace`` objects (``read_chrome`` of the files that ``turnip simulate --trace``
and ``turnip run --trace`` write). A *resource* is one track of the Perfetto view: each GPU's kernel engine
(``gpu g compute``), its copy engines (``gpu g h2d`` under the destination GPU, ``gpu g d2h``), each GPU-GPU
link (``gpu s p2p to gpu d``) and the host's launch thread (``host launch``, only when some launch span has
a length). The table (``overlay_table``) has one row per resource (busy time = the union of its spans, end =
when its last span ends), one ``makespan`` row (``max(done_ns)``) and one row per op (kernels by op name,
copies by kind: total span time, last end). Errors are relative, simulated against real:
``(sim - real) / real`` (0 when both are 0, NaN when only the real value is).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from analysis.metrics import _union_ns

COLUMNS = ("section", "name", "spans", "real_busy_ns", "sim_busy_ns", "busy_err", "real_end_ns", "sim_end_ns",
           "end_err")  # fmt: skip
KIND_COLORS = {"kernel": "tab:blue", "input": "tab:olive", "reload": "tab:green", "offload": "tab:red",
               "transfer": "tab:purple", "launch": "tab:gray"}  # fmt: skip
_ENGINE_ORDER = {"kernel": 0, "h2d": 1, "d2h": 2, "p2p": 3}
_PLAN_COLUMNS = ("kind", "op", "engine", "gpu", "dst_gpu")
HOST = "host launch"


class PlanMismatch(ValueError):
    """The two traces are not of the same plan; the message names the first vertex that differs."""


def check_same_plan(sim, real) -> None:
    """Same vertex ids, and per vertex the same kind, op, engine, issuing and destination GPU."""
    a, b = sim.spans, real.spans
    if len(a["v"]) != len(b["v"]):
        raise PlanMismatch(f"the simulated trace has {len(a['v'])} vertices, the real one {len(b['v'])}")
    if not np.array_equal(a["v"], b["v"]):
        i = int(np.flatnonzero(a["v"] != b["v"])[0])
        raise PlanMismatch(f"vertex ids differ: the simulated trace has vertex {a['v'][i]} where the real one has "
                           f"{b['v'][i]}")  # fmt: skip
    bad = np.zeros(len(a["v"]), dtype=bool)
    for c in _PLAN_COLUMNS:
        bad |= np.asarray(a[c]) != np.asarray(b[c])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])

        def what(s):
            return f"{s['op'][i]} ({s['kind'][i]} on gpu {s['gpu'][i]})"

        raise PlanMismatch(f"vertex {a['v'][i]} is {what(a)} in the simulated trace but {what(b)} in the real "
                           f"one ({int(bad.sum())} of {len(bad)} vertices differ)")  # fmt: skip


def _resource_keys(s) -> list[tuple[int, int, int]]:
    """Per span (GPU it is drawn under, engine order, p2p destination or -1): the Perfetto track."""
    eng, gpu, dst = s["engine"], np.asarray(s["gpu"]), np.asarray(s["dst_gpu"])
    pid = np.where(eng == "h2d", dst, gpu)
    return [(int(p), _ENGINE_ORDER[e], int(d) if e == "p2p" else -1) for p, e, d in zip(pid, eng, dst, strict=True)]


def _resource_name(key: tuple[int, int, int]) -> str:
    g, e, d = key
    return f"gpu {g} " + ("compute", "h2d", "d2h", f"p2p to gpu {d}")[e]


def resources(sim, real) -> list[tuple[str, np.ndarray, str, str]]:
    """(name, span mask, start column, end column) per resource, host first, then by GPU, engine, link."""
    keys = _resource_keys(real.spans)
    out = []
    launch = [np.asarray(t.spans["issue_ns"]) > np.asarray(t.spans["host_start_ns"]) for t in (sim, real)]
    if launch[0].any() or launch[1].any():
        out.append((HOST, np.ones(len(keys), dtype=bool), "host_start_ns", "issue_ns"))
    arr = np.array(keys, dtype=np.int64).reshape(-1, 3)
    for k in sorted(set(keys)):
        out.append((_resource_name(k), (arr == k).all(axis=1), "start_ns", "end_ns"))
    return out


def rel_err(sim: float, real: float) -> float:
    """(sim - real) / real; 0 when both are 0, NaN when only real is."""
    if real == 0:
        return 0.0 if sim == 0 else math.nan
    return (sim - real) / real


def _busy_end(s, sel, c0: str, c1: str) -> tuple[int, int]:
    t0, t1 = np.asarray(s[c0])[sel], np.asarray(s[c1])[sel]
    a, b = _union_ns(t0, t1)
    return int((b - a).sum()), int(t1.max(initial=0))


def _total_end(s, sel) -> tuple[int, int]:
    t0, t1 = np.asarray(s["start_ns"])[sel], np.asarray(s["end_ns"])[sel]
    return int((t1 - t0).sum()), int(t1.max(initial=0))


def _row(section, name, n, real, sim) -> dict:
    (rb, re), (sb, se) = real, sim
    return {"section": section, "name": name, "spans": n, "real_busy_ns": rb, "sim_busy_ns": sb,
            "busy_err": rel_err(sb, rb) if rb is not None else None, "real_end_ns": re, "sim_end_ns": se,
            "end_err": rel_err(se, re)}  # fmt: skip


def overlay_table(sim, real):
    """The error table (pandas DataFrame with ``COLUMNS``): resource rows, the makespan row, op rows."""
    import pandas as pd

    check_same_plan(sim, real)
    s, r = sim.spans, real.spans
    rows = []
    for name, sel, c0, c1 in resources(sim, real):
        rows.append(_row("resource", name, int(sel.sum()), _busy_end(r, sel, c0, c1), _busy_end(s, sel, c0, c1)))
    rows.append(_row("run", "makespan", len(r["v"]), (None, int(np.max(r["done_ns"], initial=0))),
                     (None, int(np.max(s["done_ns"], initial=0)))))  # fmt: skip
    ops = []
    for op in sorted(set(r["op"])):
        sel = r["op"] == op
        ops.append(_row("op", op, int(sel.sum()), _total_end(r, sel), _total_end(s, sel)))
    rows += sorted(ops, key=lambda x: (-x["real_busy_ns"], x["name"]))
    t = pd.DataFrame(rows, columns=list(COLUMNS))
    for c in ("real_busy_ns", "sim_busy_ns"):
        t[c] = t[c].astype("Int64")
    return t


def _missing(x) -> bool:
    import pandas as pd

    return x is None or bool(pd.isna(x))


def _pct(x) -> str:
    return "-" if _missing(x) else f"{round(100 * x, 1) + 0.0:+.1f}%"  # + 0.0: no "-0.0%"


def _ms(x) -> str:
    return "" if _missing(x) else f"{x / 1e6:.3f}"


def format_overlay(t) -> str:
    """The table as text: resources and the makespan, then ops (times in ms, errors sim vs real)."""
    w = max([24, *(len(str(x)) + 2 for x in t.name)])
    head = (f"{'resource':<{w}}{'spans':>7}{'busy real ms':>14}{'sim ms':>11}{'error':>9}{'end real ms':>14}"
            f"{'sim ms':>11}{'error':>9}")  # fmt: skip
    lines = [head]
    for x in t[t.section != "op"].itertuples():
        busy = (f"{_ms(x.real_busy_ns):>14}{_ms(x.sim_busy_ns):>11}{_pct(x.busy_err):>9}" if x.section == "resource"
                else " " * 34)  # fmt: skip
        lines.append(f"{x.name:<{w}}{x.spans:>7}{busy}{_ms(x.real_end_ns):>14}{_ms(x.sim_end_ns):>11}"
                     f"{_pct(x.end_err):>9}")  # fmt: skip
    lines += ["", f"{'op':<{w}}{'spans':>7}{'time real ms':>14}{'sim ms':>11}{'error':>9}"]
    for x in t[t.section == "op"].itertuples():
        lines.append(f"{x.name:<{w}}{x.spans:>7}{_ms(x.real_busy_ns):>14}{_ms(x.sim_busy_ns):>11}"
                     f"{_pct(x.busy_err):>9}")  # fmt: skip
    return "\n".join(lines)


def draw_overlay(sim, real, table, path: str | Path) -> None:
    """One PNG: per resource a real lane above a simulated lane on one time axis (ms), spans colored by
    vertex kind (at least ~1 pixel wide); each resource's busy and end errors on the right; both makespans as
    vertical lines."""
    from matplotlib.colors import to_rgb

    from analysis.figures import _plt
    from turnip.fileio import atomic_write

    plt = _plt()
    res = resources(sim, real)
    n_lanes = 2 * len(res)
    lane_in = min(0.32, 28 / max(n_lanes, 1))
    fig, ax = plt.subplots(figsize=(13, 1.6 + lane_in * n_lanes))
    errs = table[table.section == "resource"].set_index("name")
    mk = table[table.section == "run"].iloc[0]
    min_ms = max(mk.real_end_ns, mk.sim_end_ns) / 1e6 / 1000  # about one pixel: short spans stay visible
    ticks, labels, right = [], [], []
    for i, (name, sel, c0, c1) in enumerate(res):
        for j, (tr, light) in enumerate(((real, 0.0), (sim, 0.4))):
            s, y = tr.spans, 2 * i + j
            t0, t1 = np.asarray(s[c0])[sel], np.asarray(s[c1])[sel]
            kinds = np.full(len(t0), "launch", dtype=object) if name == HOST else np.asarray(s["kind"])[sel]
            for kind in np.unique(kinds):
                k = (kinds == kind) & (t1 > t0)
                bars = list(zip(t0[k] / 1e6, np.maximum((t1[k] - t0[k]) / 1e6, min_ms), strict=True))
                rgb = np.array(to_rgb(KIND_COLORS.get(kind, "k"))) * (1 - light) + light  # lighter, opaque
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=tuple(rgb), lw=0)
            ticks.append(y)
            labels.append(f"{name}  real" if j == 0 else "sim")
        if i:
            ax.axhline(2 * i - 0.5, color="0.8", lw=0.6)
        e = errs.loc[name]
        right.append(f"busy {_pct(e.busy_err)}  end {_pct(e.end_err)}")
    ax.axvline(mk.real_end_ns / 1e6, color="k", lw=1, label=f"real makespan {mk.real_end_ns / 1e6:.3f} ms")
    ax.axvline(mk.sim_end_ns / 1e6, color="k", lw=1, ls="--", label=f"sim makespan {mk.sim_end_ns / 1e6:.3f} ms")
    ax.set_ylim(n_lanes - 0.5, -0.5)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax2 = ax.twinx()
    ax2.set_ylim(ax.get_ylim())
    ax2.set_yticks([2 * i + 0.5 for i in range(len(res))], right, fontsize=7)
    ax.set_xlim(0, max(mk.real_end_ns, mk.sim_end_ns) / 1e6 * 1.01 or 1)
    ax.set_xlabel("time from the start of the run (ms)")
    present = {k for t in (sim, real) for k in t.spans["kind"]} | ({"launch"} if res and res[0][0] == HOST else set())
    for kind, color in KIND_COLORS.items():
        if kind in present:
            ax.plot([], [], color=color, lw=6, label=kind)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=9, frameon=False)
    ax.set_title(f"real (upper lane) vs simulated (lower lane), {len(real.spans['v'])} vertices: makespan "
                 f"error {_pct(mk.end_err)} (errors: sim vs real)", fontsize=9, pad=20)  # fmt: skip
    with atomic_write(path, "wb") as f:  # never left half-written
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_overlay(sim, real, out_dir: str | Path):
    """``overlay.csv`` and ``overlay.png`` in ``out_dir`` (written atomically); returns the table."""
    from turnip.fileio import atomic_write

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = overlay_table(sim, real)
    with atomic_write(out / "overlay.csv", newline="") as f:
        table.to_csv(f, index=False)
    draw_overlay(sim, real, table, out / "overlay.png")
    return table
