"""Per-run metrics from a trace's span table (numpy only): one ``runs.csv`` row per run."""

from __future__ import annotations

import numpy as np


def _union_ns(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge intervals [a, b) into disjoint sorted ones."""
    if len(a) == 0:
        return a, b
    o = np.argsort(a, kind="stable")
    a, b = a[o], b[o]
    run_end = np.maximum.accumulate(b)
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:] > run_end[:-1]
    idx = np.nonzero(new)[0]
    ends = np.append(run_end[idx[1:] - 1], run_end[-1])
    return a[idx], ends


def _overlap_ns(a0, a1, b0, b1) -> int:
    """Total length of (union A) ∩ (union B)."""
    a0, a1 = _union_ns(a0, a1)
    b0, b1 = _union_ns(b0, b1)
    total, j = 0, 0
    for s, e in zip(a0.tolist(), a1.tolist(), strict=True):
        while j < len(b0) and b1[j] <= s:
            j += 1
        k = j
        while k < len(b0) and b0[k] < e:
            total += min(e, b1[k]) - max(s, b0[k])
            k += 1
    return total


def run_metrics(spans: dict, n_gpus: int) -> dict:
    """makespan, GPU busy fraction, bytes moved per kind, and ``idle_wait_ns``: time GPUs' kernel engines
    sat idle while a copy into or out of that GPU was running (summed over GPUs)."""
    eng, kind = np.asarray(spans["engine"]), np.asarray(spans["kind"])
    start, end = np.asarray(spans["start_ns"]), np.asarray(spans["end_ns"])
    makespan = int(np.max(spans["done_ns"], initial=0))
    nbytes = np.asarray(spans["nbytes"])
    k = eng == "kernel"
    gpu = np.asarray(spans["gpu"])
    busy, idle_wait = 0, 0
    for g in range(n_gpus):
        kg = k & (gpu == g)
        k0, k1 = _union_ns(start[kg], end[kg])
        busy += int((k1 - k0).sum())
        touches = ~k & ((gpu == g) | (np.asarray(spans["dst_gpu"]) == g))
        idle0 = np.concatenate([[0], k1])
        idle1 = np.concatenate([k0, [makespan]])
        idle_wait += _overlap_ns(idle0, idle1, start[touches], end[touches])
    return {
        "makespan_ns": makespan,
        "gpu_busy_frac": busy / (makespan * n_gpus) if makespan else 0.0,
        "idle_wait_ns": idle_wait,
        "input_nbytes": int(nbytes[kind == "input"].sum()),
        "offload_nbytes": int(nbytes[kind == "offload"].sum()),
        "reload_nbytes": int(nbytes[kind == "reload"].sum()),
        "transfer_nbytes": int(nbytes[kind == "transfer"].sum()),
    }
