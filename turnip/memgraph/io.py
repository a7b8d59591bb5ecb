"""Saving and loading compiled plans (format described in docs/formats.md).

A plan file is a numpy ``.npz`` archive (zip): integer arrays of the memgraph (prefix ``mg.``) and of the
taskgraph it came from (prefix ``tg.``), a SHA-256 ``checksum`` of all arrays, and one JSON document
``header`` holding the format name and version, per-vertex ops/params/shapes/dtypes and build statistics.
Writes go to a temporary file renamed into place, so a failed save leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np

from turnip.memgraph.plan import MemGraph
from turnip.taskgraph import TaskGraph

FORMAT = "turnip-plan"
VERSION = 1
MG_ARRAYS = (
    "kind",
    "gpu",
    "src_gpu",
    "tensor",
    "tg_vertex",
    "out_offset",
    "out_nbytes",
    "host_offset",
    "in_ptr",
    "in_idx",
    "dep_ptr",
    "dep_src",
    "dep_kind",
    "lock_group",
    "flops",
    "outputs",
    "budget_nbytes",
)
TG_ARRAYS = ("kind", "gpu", "src_gpu", "nbytes", "flops", "arg_ptr", "arg_idx", "acc", "is_output")


class PlanFormatError(ValueError):
    """The file is not a readable plan of a supported version."""


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    return x


def _checksum(arrays: dict) -> np.ndarray:
    h = hashlib.sha256()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def save_plan(path: str | os.PathLike, mg: MemGraph, tg: TaskGraph | None = None) -> None:
    arrays = {f"mg.{k}": getattr(mg, k) for k in MG_ARRAYS}
    header = {
        "format": FORMAT,
        "version": VERSION,
        "n_gpus": mg.n_gpus,
        "host_nbytes": mg.host_nbytes,
        "stats": _jsonable(mg.stats),
        "op": mg.op,
        "params": _jsonable(mg.params),
        "shape": [list(s) for s in mg.shape],
        "dtype": mg.dtype,
        "taskgraph": tg is not None,
    }
    if tg is not None:
        arrays |= {f"tg.{k}": getattr(tg, k) for k in TG_ARRAYS}
        header["tg"] = {
            "n_gpus": tg.n_gpus,
            "op": tg.op,
            "params": _jsonable(tg.params),
            "shape": [list(s) for s in tg.shape],
            "dtype": tg.dtype,
            "name": tg.name,
            "meta": _jsonable(tg.meta),
        }
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    arrays["checksum"] = _checksum(arrays)
    from turnip.fileio import atomic_write

    with atomic_write(path, "wb") as f:  # a temporary file renamed into place: never half-written
        np.savez_compressed(f, **arrays)


def load_plan(path: str | os.PathLike) -> tuple[MemGraph, TaskGraph | None]:
    """Read a plan; raises ``PlanFormatError`` naming what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PlanFormatError(f"{path}: cannot read plan: {e.strerror}") from e
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        stored = arrays.pop("checksum")
        if not np.array_equal(stored, _checksum(arrays)):
            raise ValueError("checksum mismatch")
        header = json.loads(arrays.pop("header").tobytes())
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as e:
        why = "it holds Python objects" if "allow_pickle" in str(e) else f"{type(e).__name__}: {e}"
        raise PlanFormatError(f"{path}: not a turnip plan or corrupted ({why})") from e
    if header.get("format") != FORMAT:
        raise PlanFormatError(f"{path}: format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("version") != VERSION:
        raise PlanFormatError(f"{path}: plan format version {header.get('version')}, this turnip reads {VERSION}")
    missing = [k for k in MG_ARRAYS if f"mg.{k}" not in arrays]
    if missing:
        raise PlanFormatError(f"{path}: missing arrays {missing}")
    n = len(arrays["mg.kind"])
    if not (len(header["op"]) == len(header["params"]) == len(header["shape"]) == n):
        raise PlanFormatError(f"{path}: header describes {len(header['op'])} vertices, arrays {n}")
    mg = MemGraph(
        n_gpus=header["n_gpus"],
        op=header["op"],
        params=header["params"],
        shape=[tuple(s) for s in header["shape"]],
        dtype=header["dtype"],
        host_nbytes=header["host_nbytes"],
        stats=header["stats"],
        **{k: arrays[f"mg.{k}"] for k in MG_ARRAYS},
    )
    tg = None
    if header.get("taskgraph"):
        h = header["tg"]
        tg = TaskGraph(
            n_gpus=h["n_gpus"],
            op=h["op"],
            params=h["params"],
            shape=[tuple(s) for s in h["shape"]],
            dtype=h["dtype"],
            name=h["name"],
            meta=h["meta"],
            **{k: arrays[f"tg.{k}"] for k in TG_ARRAYS},
        )
    return mg, tg
