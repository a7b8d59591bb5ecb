"""Write a report directory: ``summary.csv`` and figures from ``runs.csv`` (+ saved trace tables)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from analysis import figures
from analysis.summary import format_table, policy_order, speedup_table


def load_trace_tables(trace_dir: Path) -> tuple[dict, dict]:
    """{policy: spans columns}, {policy: memory columns} from ``<policy>.spans.csv`` / ``.memory.csv``."""
    import pandas as pd

    spans, mem = {}, {}
    found = {p.name[: -len(".spans.csv")]: p for p in trace_dir.glob("*.spans.csv")}
    for pol in policy_order(found):
        p = found[pol]
        spans[pol] = {c: s.to_numpy() for c, s in pd.read_csv(p).items()}
        m = p.with_name(f"{pol}.memory.csv")
        if m.exists():
            mem[pol] = {c: s.to_numpy() for c, s in pd.read_csv(m).items()}
    return spans, mem


def write_report(out: str | Path, quiet: bool = False) -> str:
    """Regenerate summary.csv and every figure in ``out``; return the summary table as text."""
    import pandas as pd

    out = Path(out)
    runs = pd.read_csv(out / "runs.csv")
    table = speedup_table(runs)
    from turnip.fileio import atomic_write

    with atomic_write(out / "summary.csv", newline="") as f:  # never left half-written
        table.to_csv(f, index=False)
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    if not table.empty:
        figures.speedup(table, figs / "speedup.png")
    figures.makespan_distributions(runs, figs / "makespan_distributions.png")
    figures.efficiency(runs, figs / "efficiency.png")
    figures.offload_volume(runs, figs / "offload_volume.png")
    spans, mem = load_trace_tables(out / "traces")
    if spans:
        figures.gantt(spans, figs / "gantt.png")
    if mem:
        meta_path = out / "traces" / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        budget = int(meta.get("budget_nbytes", runs.budget_nbytes.min()))
        figures.memory(mem, np.array([budget]), figs / "memory.png")
    text = format_table(table)
    if not quiet:
        print(text)
    return text
