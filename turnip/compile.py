"""One call from a model name to a verified-ready plan: ``compile_model``; plus byte-size parsing."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from pathlib import Path

import numpy as np

from turnip.memgraph.build import BudgetError, BuildConfig, build_memgraph
from turnip.memgraph.plan import MemGraph
from turnip.models import LLAMA, llama_prefill, matmul_example, random_dag
from turnip.taskgraph import TaskGraph

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MODELS = [f"llama-{s}" for s in LLAMA] + ["paper-matmul", "random"]


@functools.cache
def compiler_fingerprint() -> str:
    """Short hash of the compiler's source: plan caches keyed on it never serve a plan built by other code."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted([*root.glob("graph*.py"), root / "models.py", root / "taskgraph.py", *root.glob("memgraph/*.py")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def parse_nbytes(text: str) -> int:
    """'6GiB', '512MiB', '1.5GB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read a byte size from {text!r}; use e.g. 6GiB, 512MiB, 4096")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def make_taskgraph(
    model: str,
    seq: int = 4096,
    gpus: int = 1,
    dtype: str = "fp16",
    tiles: dict | None = None,
    seed: int = 0,
    n_layers: int | None = None,
    budget_nbytes: int | None = None,
) -> TaskGraph:
    """The taskgraph of a named model; LLaMA tiles default from the budget when it is given."""
    if model.startswith("llama-"):
        return llama_prefill(model[6:], seq=seq, n_gpus=gpus, dtype=dtype, tiles=tiles, n_layers=n_layers,
                             budget_nbytes=budget_nbytes)
    if model == "paper-matmul":
        return matmul_example()
    if model == "random":
        return random_dag(np.random.default_rng(seed), n_kernels=200, n_gpus=gpus)
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


def auto_workspace(budget: int) -> int:
    """Workspace per stream slot for GPU runs (cuDNN attention asks for a few hundred bytes; GEMMs run
    without one): 1/256 of the budget in 256-byte units, at most 1 MiB (none below a 64 KiB budget:
    kernels that need scratch then take their workspace-free fallback)."""
    return min(1 << 20, budget // 256) // 256 * 256


def build_with_resident(
    tg: TaskGraph, budget: int, config: BuildConfig | None = None, resident="0", progress=None, workspace="auto"
) -> MemGraph:
    """Build with a resident input set: a byte size, or ``"auto"`` = a quarter of the budget, falling back to
    none when that leaves too little room for some vertex. ``workspace``: bytes per stream slot kept for
    kernels' scratch (``"auto"``: ``auto_workspace``)."""
    cfg = config or BuildConfig()
    ws = auto_workspace(budget) if str(workspace) == "auto" else parse_nbytes(str(workspace))
    cfg = dataclasses.replace(cfg, workspace_nbytes=ws)
    if str(resident) != "auto":
        return build_memgraph(
            tg, budget, dataclasses.replace(cfg, resident_nbytes=parse_nbytes(str(resident))), progress=progress
        )
    try:
        return build_memgraph(tg, budget, dataclasses.replace(cfg, resident_nbytes=budget // 4), progress=progress)
    except BudgetError:
        return build_memgraph(tg, budget, dataclasses.replace(cfg, resident_nbytes=0), progress=progress)


def compile_model(
    model: str,
    seq: int = 4096,
    gpus: int = 1,
    budget: int | str = "6GiB",
    dtype: str = "fp16",
    config: BuildConfig | None = None,
    tiles: dict | None = None,
    progress=None,
    n_layers: int | None = None,
    resident="0",
    workspace="auto",
) -> tuple[TaskGraph, MemGraph]:
    b = parse_nbytes(budget) if isinstance(budget, str) else budget
    tg = make_taskgraph(model, seq, gpus, dtype, tiles, n_layers=n_layers, budget_nbytes=b)
    return tg, build_with_resident(tg, b, config, resident, progress, workspace)
