"""GPU bytes in use over a run, from the plan's buffers and the run's start/end times.

A buffer is created by the vertex that writes it (input, kernel, transfer, reload) and lives from that
vertex's device start until the device end of its last reader (offloads included); a buffer nobody reads
lives to the end of the run. A vertex that writes in place into a buffer it reads (sum-into) extends that
buffer instead of creating one. Because a verified memgraph never has two live buffers on overlapping
bytes, the total stays within the budget whenever the run respected every dependency.
"""

from __future__ import annotations

import numpy as np

from turnip.memgraph.plan import MemGraph


def buffer_intervals(mg: MemGraph, start_ns: np.ndarray, end_ns: np.ndarray, makespan_ns: int):
    """(gpu, nbytes, alloc_ns, free_ns) arrays, one row per buffer."""
    n = mg.n
    off, nb, gpu = mg.out_offset.tolist(), mg.out_nbytes.tolist(), mg.gpu.tolist()
    in_ptr, in_idx = mg.in_ptr.tolist(), mg.in_idx.tolist()
    root = list(range(n))
    for v in range(n):
        for i in range(in_ptr[v], in_ptr[v + 1]):
            r = root[in_idx[i]]
            if off[v] >= 0 and off[r] == off[v] and gpu[r] == gpu[v] and nb[r] == nb[v]:
                root[v] = r  # in-place write into a buffer it reads
                break
    alloc = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    free = np.full(n, -1, dtype=np.int64)
    roots = np.asarray(root)
    np.minimum.at(alloc, roots, start_ns)
    np.maximum.at(free, roots, end_ns)
    reader = np.repeat(np.arange(n), np.diff(mg.in_ptr))
    read_root = roots[mg.in_idx]
    np.maximum.at(free, read_root, end_ns[reader])
    has_reader = np.zeros(n, dtype=bool)
    has_reader[read_root] = True
    sel = (roots == np.arange(n)) & (mg.out_offset >= 0)
    free = np.where(has_reader, free, makespan_ns)
    return mg.gpu[sel].astype(np.int64), mg.out_nbytes[sel].astype(np.int64), alloc[sel], free[sel]


def memory_timeline(mg: MemGraph, start_ns, end_ns, makespan_ns: int) -> dict[str, np.ndarray]:
    """Step function per GPU: columns ``gpu``, ``t_ns``, ``bytes_in_use`` (value from t_ns on)."""
    g, nb, a, f = buffer_intervals(mg, np.asarray(start_ns), np.asarray(end_ns), makespan_ns)
    gpu = np.concatenate([g, g])
    t = np.concatenate([a, f])
    d = np.concatenate([nb, -nb])
    order = np.lexsort((d, t, gpu))  # frees before allocs at the same instant
    gpu, t, d = gpu[order], t[order], d[order]
    used = np.zeros_like(d)
    for k in np.unique(gpu):
        s = gpu == k
        used[s] = np.cumsum(d[s])
    last = np.ones(len(t), dtype=bool)
    last[:-1] = (t[1:] != t[:-1]) | (gpu[1:] != gpu[:-1])
    return {"gpu": gpu[last], "t_ns": t[last], "bytes_in_use": used[last]}


def peak_bytes(timeline: dict[str, np.ndarray], n_gpus: int) -> np.ndarray:
    out = np.zeros(n_gpus, dtype=np.int64)
    np.maximum.at(out, timeline["gpu"], timeline["bytes_in_use"])
    return out
