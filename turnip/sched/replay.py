"""Recorded issue orders, the input of the ``det-replay`` policy.

An issue order is the vertex ids of one run's commands in the order the scheduler issued them (a run of any
policy records one: ``turnip.runtime.execute(..., record_order=True)``, ``sim.simulate(...).order``). It
holds every vertex except the resident inputs (``MemGraph.preloaded``), each once, and since a vertex is
issued only after its dependencies completed, it is a topological order of the memgraph.

``det-replay`` splits it per engine queue (``engine_orders``: per GPU its kernels, its host→device and
device→host copies, and per directed link its GPU→GPU transfers) and issues each queue strictly in that
sequence; it hands each sum-into lock to its vertices in the recorded sequence too (``lock_turns``), so GPUs
sharing a lock never race for it and a replay repeats the recorded run's summation order. Any topological
order replays without deadlock: the first vertex of the order not yet issued heads its queue and its lock's
turn, and once everything before it has completed it is ready and its resources are free.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from turnip.memgraph.plan import KIND_KERNEL, KIND_OFFLOAD, KIND_TRANSFER, MemGraph


def issue_order(order: Iterable) -> np.ndarray:
    """Vertex ids (int64) of ``order``: commands (``Launch`` / ``Copy``, as ``execute`` records them) or ids."""
    if isinstance(order, np.ndarray):
        return order.astype(np.int64, copy=False)
    return np.fromiter((x if isinstance(x, int | np.integer) else x.v for x in order), dtype=np.int64)


def engine_key(mg: MemGraph, v: int) -> str:
    """The engine queue of vertex ``v``: ``gpu0 kernel``, ``gpu0 h2d``, ``gpu0 d2h`` or ``gpu0->gpu1 p2p``."""
    k, g = int(mg.kind[v]), int(mg.gpu[v])
    if k == KIND_KERNEL:
        return f"gpu{g} kernel"
    if k == KIND_TRANSFER:
        return f"gpu{int(mg.src_gpu[v])}->gpu{g} p2p"
    return f"gpu{g} {'d2h' if k == KIND_OFFLOAD else 'h2d'}"


def engine_orders(mg: MemGraph, order: Iterable) -> dict[str, list[int]]:
    """``order`` split per engine queue: {engine key: vertex ids in issue order}."""
    out: dict[str, list[int]] = {}
    for v in issue_order(order).tolist():
        out.setdefault(engine_key(mg, v), []).append(v)
    return out


def split_order(order: np.ndarray, key: np.ndarray, n: int) -> list[list[int]]:
    """``order`` (vertex ids) split into ``n`` lists by ``key`` (one per vertex of ``order``), each keeping
    the order: the scheduler's fixed-order lanes."""
    by_key = order[np.argsort(key, kind="stable")]
    return [x.tolist() for x in np.split(by_key, np.cumsum(np.bincount(key, minlength=n))[:-1])]


def lock_turns(order: np.ndarray, lock: list[int]) -> dict[int, list[int]]:
    """{lock group: its vertices in ``order``}: the sequence the scheduler hands each sum-into lock in (ordered
    sums: ``order`` is compile order; ``det-replay``: the recorded order)."""
    turns: dict[int, list[int]] = {}
    for v in order.tolist():
        if lock[v] >= 0:
            turns.setdefault(lock[v], []).append(v)
    return turns


def check_order(mg: MemGraph, order: Iterable) -> np.ndarray:
    """``order`` as vertex ids, checked replayable: every vertex but the resident inputs exactly once, after
    its dependencies. Raises ``ValueError`` naming the first vertex at fault."""
    ids = issue_order(order)
    pre = mg.preloaded()
    bad = ids[(ids < 0) | (ids >= mg.n)]
    if bad.size:
        raise ValueError(f"recorded order names vertex {int(bad[0])}, but the plan has {mg.n} vertices; "
                         "record the order on this plan")  # fmt: skip
    seen = np.zeros(mg.n, dtype=np.int64)
    np.add.at(seen, ids, 1)
    twice = np.flatnonzero(seen > 1)
    if twice.size:
        raise ValueError(f"recorded order issues {mg.label(int(twice[0]))} {int(seen[twice[0]])} times")
    if (seen[pre] > 0).any():
        v = int(np.flatnonzero(pre & (seen > 0))[0])
        raise ValueError(f"recorded order issues {mg.label(v)}, a resident input loaded with the plan; record "
                         "the order on this plan (same --resident)")  # fmt: skip
    missing = np.flatnonzero(~pre & (seen == 0))
    if missing.size:
        raise ValueError(f"recorded order lacks {missing.size} vertices, e.g. {mg.label(int(missing[0]))}; "
                         "record a complete run of this plan")  # fmt: skip
    pos = np.full(mg.n, -1, dtype=np.int64)
    pos[ids] = np.arange(ids.size)
    dst = np.repeat(np.arange(mg.n), np.diff(mg.dep_ptr))
    src = np.asarray(mg.dep_src, dtype=np.int64)
    late = np.flatnonzero(~pre[src] & (pos[src] > pos[dst]))
    if late.size:
        i = late[np.argmin(pos[dst[late]])]
        raise ValueError(f"recorded order issues {mg.label(int(dst[i]))} before its dependency "
                         f"{mg.label(int(src[i]))}; it is not the order of a run of this plan")  # fmt: skip
    return ids
