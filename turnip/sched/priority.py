"""Static priorities over a memgraph: a topological order and critical-path lengths (pure numpy/Python)."""

from __future__ import annotations

import heapq

import numpy as np

from turnip.memgraph.plan import MemGraph


def topo_order(mg: MemGraph) -> np.ndarray:
    """Topological order that follows index (compile) order wherever the dependencies allow.

    Equals ``arange(n)`` when every dependency points to a lower index. Raises ``ValueError`` on a cycle.
    """
    n = mg.n
    if n == 0 or bool(np.all(mg.dep_src < np.repeat(np.arange(n), np.diff(mg.dep_ptr)))):
        return np.arange(n, dtype=np.int32)
    succ_ptr, succ_idx = (x.tolist() for x in mg.successors())
    missing = mg.indegree().tolist()
    heap = [v for v in range(n) if missing[v] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        v = heapq.heappop(heap)
        out.append(v)
        for i in range(succ_ptr[v], succ_ptr[v + 1]):
            s = succ_idx[i]
            missing[s] -= 1
            if missing[s] == 0:
                heapq.heappush(heap, s)
    if len(out) != n:
        raise ValueError(f"memgraph has a cycle: {n - len(out)} vertices never become ready")
    return np.asarray(out, dtype=np.int32)


def critical_path_ns(mg: MemGraph, dur_ns: np.ndarray) -> np.ndarray:
    """Longest path (sum of ``dur_ns``) from each vertex, itself included, to any sink."""
    order = topo_order(mg).tolist()
    succ_ptr, succ_idx = (x.tolist() for x in mg.successors())
    dur = np.asarray(dur_ns, dtype=np.int64).tolist()
    cp = [0] * mg.n
    for v in reversed(order):
        best = 0
        for i in range(succ_ptr[v], succ_ptr[v + 1]):
            c = cp[succ_idx[i]]
            if c > best:
                best = c
        cp[v] = best + dur[v]
    return np.asarray(cp, dtype=np.int64)


def rough_dur_ns(mg: MemGraph) -> np.ndarray:
    """Machine-agnostic duration guess for priorities when no timing model is given:
    kernels at 500 TFLOP/s (or 2 TB/s of bytes touched), copies at 50 GB/s, P2P at 300 GB/s."""
    from turnip.memgraph.plan import KIND_KERNEL, KIND_TRANSFER

    nbytes = mg.out_nbytes.astype(np.float64)
    kern = np.maximum(mg.flops / 500e3, mg.io_nbytes() / 2e3)
    copy = np.where(mg.kind == KIND_TRANSFER, nbytes / 300.0, nbytes / 50.0)
    return (np.where(mg.kind == KIND_KERNEL, kern, copy) + 5_000).astype(np.int64)
