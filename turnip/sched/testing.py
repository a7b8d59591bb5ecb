"""Small memgraphs for tests and benchmarks: build one from edge lists, or draw a random one; drive a
scheduler to the end without a clock (``drive``), record a nondet issue order for ``det-replay``.

Buffers get disjoint arena ranges (a bump allocator per GPU) and the budget is their sum, so a
hand-built memgraph is race-free by construction whatever order the scheduler picks.
"""

from __future__ import annotations

import numpy as np

from turnip.memgraph.plan import (
    DEP_DATA,
    KIND_INPUT,
    KIND_KERNEL,
    KIND_NAMES,
    KIND_OFFLOAD,
    KIND_RELOAD,
    KIND_TRANSFER,
    MemGraph,
    csr,
)


def make_memgraph(
    kinds: list,
    deps: list[list[int]],
    *,
    n_gpus: int = 1,
    gpus: list[int] | None = None,
    src_gpus: list[int] | None = None,
    flops: list[float] | None = None,
    nbytes: list[int] | None = None,
    lock_groups: list[int] | None = None,
    ops: list[str] | None = None,
) -> MemGraph:
    """A MemGraph from per-vertex lists. ``kinds`` are names ('kernel', 'offload', ...) or KIND_* ints;
    ``deps[v]`` lists v's dependencies (all data edges; each is also read unless it is an offload)."""
    n = len(kinds)
    kind = np.array([KIND_NAMES.index(k) if isinstance(k, str) else int(k) for k in kinds], dtype=np.int8)
    gpu = np.array(gpus if gpus is not None else [0] * n, dtype=np.int32)
    src = np.array(src_gpus if src_gpus is not None else gpu, dtype=np.int32)
    nb = np.array(nbytes if nbytes is not None else [1 << 20] * n, dtype=np.int64)
    fl = np.array(flops if flops is not None else [0.0] * n, dtype=np.float64)
    fl = np.where(kind == KIND_KERNEL, fl, 0.0)
    reads = [[u for u in deps[v] if kind[u] != KIND_OFFLOAD] for v in range(n)]
    out_offset = np.full(n, -1, dtype=np.int64)
    used = np.zeros(n_gpus, dtype=np.int64)
    for v in range(n):
        if kind[v] != KIND_OFFLOAD:
            out_offset[v] = used[gpu[v]]
            used[gpu[v]] += nb[v]
    host = np.where(np.isin(kind, (KIND_INPUT, KIND_OFFLOAD, KIND_RELOAD)), np.cumsum(nb) - nb, -1)
    in_ptr, in_idx = csr(reads)
    dep_ptr, dep_src = csr(deps)
    op = ops or [("einsum" if k == KIND_KERNEL else KIND_NAMES[k]) for k in kind.tolist()]
    return MemGraph(
        n_gpus=n_gpus,
        budget_nbytes=np.maximum(used, 1),
        kind=kind,
        gpu=gpu,
        src_gpu=src,
        op=list(op),
        params=[{} for _ in range(n)],
        shape=[(int(b) // 2,) for b in nb],
        dtype=["fp16"] * n,
        tensor=np.arange(n, dtype=np.int32),
        tg_vertex=np.where(np.isin(kind, (KIND_OFFLOAD, KIND_RELOAD)), -1, np.arange(n)).astype(np.int32),
        out_offset=out_offset,
        out_nbytes=nb,
        host_offset=host.astype(np.int64),
        in_ptr=in_ptr,
        in_idx=in_idx,
        dep_ptr=dep_ptr,
        dep_src=dep_src,
        dep_kind=np.full(len(dep_src), DEP_DATA, dtype=np.int8),
        lock_group=np.array(lock_groups if lock_groups is not None else [-1] * n, dtype=np.int32),
        flops=fl,
        outputs=np.array([v for v in range(n) if kind[v] == KIND_KERNEL][-1:], dtype=np.int32),
        host_nbytes=int(nb.sum()),
    )


def chain(n: int, flops: float = 1e9) -> MemGraph:
    """n kernels in a line on GPU 0."""
    return make_memgraph(["kernel"] * n, [[v - 1] if v else [] for v in range(n)], flops=[flops] * n)


def random_memgraph(rng: np.random.Generator, n: int = 30, n_gpus: int = 2, p_edge: float = 0.1) -> MemGraph:
    """Random DAG (edges point to higher indices) mixing every vertex kind and a few lock groups."""
    kinds, gpus, srcs, deps, locks = [], [], [], [], []
    for v in range(n):
        choices = [1, 1, 1, 1, 2, 3, 4] if n_gpus > 1 else [1, 1, 1, 1, 3, 4]
        k = KIND_INPUT if v < 2 else int(rng.choice(choices))
        g = int(rng.integers(n_gpus))
        s = g
        if k == KIND_TRANSFER:
            s = int((g + 1 + rng.integers(n_gpus - 1)) % n_gpus)
        d = sorted({int(u) for u in np.nonzero(rng.random(v) < p_edge)[0]})
        if k in (KIND_OFFLOAD, KIND_TRANSFER, KIND_RELOAD) and not d and v:
            d = [int(rng.integers(v))]
        kinds.append(k)
        gpus.append(g)
        srcs.append(s)
        deps.append(d)
        locks.append(int(rng.integers(3)) if k == KIND_KERNEL and rng.random() < 0.3 else -1)
    return make_memgraph(
        kinds,
        deps,
        n_gpus=n_gpus,
        gpus=gpus,
        src_gpus=srcs,
        flops=rng.uniform(1e8, 1e11, n).tolist(),
        nbytes=rng.integers(1 << 12, 1 << 24, n).tolist(),
        lock_groups=locks,
    )


def drive(sched, rng: np.random.Generator | None = None) -> list:
    """Run ``sched`` to the end, completing one running command per step (a random one with ``rng``, else
    the oldest); return every command in issue order."""
    from turnip.sched.events import CopyDone, KernelDone, Launch

    issued = list(sched.start(0))
    running, t = list(issued), 0
    while running:
        c = running.pop(int(rng.integers(len(running))) if rng is not None else 0)
        t += 1
        cmds = sched.handle(KernelDone(c.v, t) if type(c) is Launch else CopyDone(c.v, t))
        issued += cmds
        running += cmds
    return issued


def recorded_order(
    mg: MemGraph, streams_per_gpu: int = 5, rng: np.random.Generator | None = None, ordered_sums: bool = True
) -> list[int]:
    """The issue order (vertex ids) of a nondet run of ``mg`` whose completions arrive as ``drive`` picks."""
    from turnip.sched.core import Scheduler

    return [c.v for c in drive(Scheduler(mg, "nondet", streams_per_gpu, ordered_sums=ordered_sums), rng)]


def scheduler(mg: MemGraph, policy: str = "nondet", streams_per_gpu: int = 5, rng=None, ordered_sums: bool = True):
    """A ``Scheduler`` for any policy; ``det-replay`` replays ``recorded_order`` of a nondet run (with
    ``ordered_sums`` as given, so an unordered recording hands the locks out in any order)."""
    from turnip.sched.core import Scheduler

    order = recorded_order(mg, streams_per_gpu, rng, ordered_sums) if policy == "det-replay" else None
    return Scheduler(mg, policy, streams_per_gpu, order=order, ordered_sums=ordered_sums)
