"""An independent check of a MemGraph. It shares no code with the builder beyond the plan format.

Checks, each reported as a ``Violation``:
  cycle      the dependency graph is acyclic
  bounds     every GPU write lies inside [0, budget) of its GPU
  dataflow   every writer of a buffer happens before every reader of it; in-place writers after its creator
  taskgraph  every taskgraph vertex appears once, reads buffers of the right tensors, and every taskgraph
             dependency on a computed tensor is kept (directly or through offload→reload)
  host       a reload of a computed tensor depends on an offload of that tensor to the same host bytes, an
             offload copies a buffer of its own tensor, and host copies of different tensors never overlap
  race       buffers sharing bytes on one GPU are ordered: every access of the earlier one happens before
             the later one is created — so no valid order can interleave them (interval sweep over
             buffers in topological order of their creators, plus reachability); no vertex writes over
             bytes of a buffer it reads, and nothing writes over a plan output's buffer (read after the run)

Reachability is exact: queries that a direct edge or two hops do not settle are answered together at the
end with bitsets over a topological order (``_Reach``), so a plan with few, non-redundant edges verifies
as fast as one with many.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnip.memgraph.plan import KIND_INPUT, KIND_OFFLOAD, KIND_RELOAD, MemGraph


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    vertices: tuple[int, ...]
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


class _Reach:
    """Reachability queries on a DAG given by predecessor sets and a topological index. ``require(a, b,
    fail, *args)`` asks for a path a -> ... -> b (or a == b) and calls ``fail(*args)`` if there is none.
    A direct edge or two hops settle a query at once; the others wait in ``pending`` until ``resolve``,
    which answers them all exactly: sources in chunks of ``chunk``, one pass per chunk over the vertices in
    topological order between its first source and its last target, ORing bitsets of the chunk's sources
    that reach each vertex."""

    def __init__(self, mg: MemGraph, topo: np.ndarray, chunk: int = 1024):
        self.topo, self.chunk = topo, chunk
        self.preds = [set(mg.deps(v).tolist()) for v in range(mg.n)]
        self.pending: list[tuple] = []

    def require(self, a: int, b: int, fail, *args) -> None:
        if a == b or a in self.preds[b]:
            return
        if self.topo[a] >= self.topo[b]:
            fail(*args)
        elif not any(a in self.preds[d] for d in self.preds[b]):
            self.pending.append((int(self.topo[a]), int(self.topo[b]), fail, args))

    def resolve(self) -> None:
        """Answer every pending query (each at most once), calling ``fail`` for those with no path."""
        if not self.pending:
            return
        topo = self.topo
        order = np.empty(len(topo), dtype=np.int64)
        order[topo] = np.arange(len(topo))
        preds_t = [[int(topo[p]) for p in self.preds[v]] for v in order.tolist()]  # by topo position
        pending = sorted(self.pending, key=lambda q: q[0])
        self.pending = []
        i = 0
        while i < len(pending):
            bit: dict[int, int] = {}
            j = i
            while j < len(pending) and (pending[j][0] in bit or len(bit) < self.chunk):
                bit.setdefault(pending[j][0], len(bit))
                j += 1
            lo = pending[i][0]
            hi = max(q[1] for q in pending[i:j])
            reach = [0] * (hi - lo + 1)  # reach[t - lo]: the chunk's sources with a path to position t
            for t in range(lo, hi + 1):
                x = 0
                for p in preds_t[t]:
                    if p >= lo:
                        x |= reach[p - lo]
                k = bit.get(t)
                reach[t - lo] = x if k is None else x | (1 << k)
            for a, b, fail, args in pending[i:j]:
                if not (reach[b - lo] >> bit[a]) & 1:
                    fail(*args)
            i = j


def _toposort(mg: MemGraph) -> tuple[np.ndarray | None, list[int]]:
    """Topological index per vertex (None and the vertices on or after a cycle if there is none): vertex
    order itself when every edge points forward (as emitted, and best for reachability), else Kahn's."""
    n = mg.n
    if (mg.dep_src < np.repeat(np.arange(n), np.diff(mg.dep_ptr))).all():
        return np.arange(n, dtype=np.int64), []
    indeg = mg.indegree().astype(np.int64)
    sp, si = mg.successors()
    topo = np.full(n, -1, dtype=np.int64)
    stack = [int(v) for v in np.flatnonzero(indeg == 0)]
    k = 0
    while stack:
        u = stack.pop()
        topo[u] = k
        k += 1
        for w in si[sp[u] : sp[u + 1]]:
            indeg[w] -= 1
            if indeg[w] == 0:
                stack.append(int(w))
    if k < n:
        return None, [int(v) for v in np.flatnonzero(topo < 0)]
    return topo, []


def verify(mg: MemGraph, tg=None, limit: int = 50) -> list[Violation]:
    """All violations found (at most ``limit`` per check); empty means the plan is correct."""
    out: list[Violation] = []
    n = mg.n
    if len(mg.dep_src) and (mg.dep_src.min() < 0 or mg.dep_src.max() >= n):
        return [Violation("cycle", (), "dependency on a vertex id out of range")]
    topo, stuck = _toposort(mg)
    if topo is None:
        return [
            Violation(
                "cycle",
                tuple(stuck[:20]),
                f"dependency cycle among {len(stuck)} vertices, e.g. {[mg.label(v) for v in stuck[:5]]}",
            )
        ]
    reach = _Reach(mg, topo)
    into = np.array([op == "sum_into" for op in mg.op], dtype=bool)
    writes_gpu = mg.kind != KIND_OFFLOAD

    def add(kind, vs, msg):
        if sum(1 for x in out if x.kind == kind) < limit:
            out.append(Violation(kind, tuple(int(v) for v in vs), msg))

    # bounds
    for v in np.flatnonzero(writes_gpu):
        b = mg.budget_nbytes[mg.gpu[v]]
        if mg.out_offset[v] < 0 or mg.out_offset[v] + mg.out_nbytes[v] > b:
            add(
                "bounds",
                [v],
                f"{mg.label(v)} writes [{mg.out_offset[v]}, {mg.out_offset[v] + mg.out_nbytes[v]})"
                f" outside the {b}-byte arena of gpu {mg.gpu[v]}",
            )
    # buffers: creators, in-place writers, readers
    creator = writes_gpu & ~into
    writers: dict[int, list[int]] = {int(b): [int(b)] for b in np.flatnonzero(creator)}
    readers: dict[int, list[int]] = {b: [] for b in writers}
    for v in range(n):
        r = mg.reads(v)
        for i, b in enumerate(r.tolist()):
            if b not in writers:
                add("dataflow", [v, b], f"{mg.label(v)} reads {b}, which creates no buffer")
                continue
            if into[v] and i == 0:
                writers[b].append(v)
                if mg.out_offset[v] != mg.out_offset[b] or mg.gpu[v] != mg.gpu[b]:
                    add("dataflow", [v, b], f"sum_into {v} writes elsewhere than its accumulator buffer {b}")
            else:
                readers[b].append(v)

    def early_write(b, w):
        add("dataflow", [b, w], f"in-place writer {mg.label(w)} not after buffer creator {mg.label(b)}")

    def early_read(w, r, b):
        add("dataflow", [w, r], f"{mg.label(r)} reads buffer {b} without waiting for its writer {mg.label(w)}")

    for b, ws in writers.items():
        for w in ws[1:]:
            reach.require(b, w, early_write, b, w)
        for r in readers[b]:
            for w in ws:
                reach.require(w, r, early_read, w, r, b)
    _check_host(mg, reach, add)
    if tg is not None:
        _check_taskgraph(mg, tg, reach, add)
    _check_races(mg, topo, writers, readers, reach, add)
    reach.resolve()
    return out


def _check_host(mg, reach, add):
    inputs = set(mg.tensor[mg.kind == KIND_INPUT].tolist())
    slots: dict[tuple, tuple[int, int]] = {}
    for v in np.flatnonzero((mg.kind == KIND_OFFLOAD) | (mg.kind == KIND_RELOAD) | (mg.kind == KIND_INPUT)):
        t, off, nb = int(mg.tensor[v]), int(mg.host_offset[v]), int(mg.out_nbytes[v])
        key = (t in inputs, t)
        if slots.setdefault(key, (off, nb)) != (off, nb):
            add("host", [v], f"{mg.label(v)} uses host bytes {off}+{nb}, tensor's copy is at {slots[key]}")
        if mg.kind[v] == KIND_OFFLOAD and any(mg.tensor[b] != t for b in mg.reads(v)):
            add("host", [v], f"{mg.label(v)} offloads a buffer of another tensor ({mg.reads(v).tolist()})")
        if mg.kind[v] == KIND_RELOAD and t not in inputs:
            srcs = [int(d) for d in mg.deps(v) if mg.kind[d] == KIND_OFFLOAD and mg.tensor[d] == t]
            if not srcs:
                add("host", [v], f"{mg.label(v)} reloads a computed tensor without depending on its offload")
    for region in (True, False):
        iv = sorted((o, o + nb, t) for (inp, t), (o, nb) in slots.items() if inp == region)
        for (_s0, e0, t0), (s1, _, t1) in zip(iv, iv[1:], strict=False):
            if s1 < e0:
                add("host", [], f"host copies of tensors {t0} and {t1} overlap")


def _check_taskgraph(mg, tg, reach, add):
    def lost(a, v, u, t):
        add("taskgraph", [a, v], f"taskgraph dependency {u} -> {t} lost: {mg.label(a)} does not precede {mg.label(v)}")

    mv = np.full(tg.n, -1, dtype=np.int64)
    for v in np.flatnonzero(mg.tg_vertex >= 0):
        t = int(mg.tg_vertex[v])
        if mv[t] >= 0:
            add("taskgraph", [v], f"taskgraph vertex {t} appears twice")
        mv[t] = v
    for t in np.flatnonzero(mv < 0):
        add("taskgraph", [], f"taskgraph vertex {t} ({tg.name[t]}) missing from the memgraph")
    for t in range(tg.n):
        v = int(mv[t])
        if v < 0:
            continue
        args, bufs = tg.args(t), mg.reads(v)
        if len(args) != len(bufs):
            add(
                "taskgraph",
                [v],
                f"{mg.label(v)} reads {len(bufs)} buffers, taskgraph vertex {t} has {len(args)} operands",
            )
            continue
        for a, b in zip(args.tolist(), bufs.tolist(), strict=True):
            if mg.tensor[b] != a:
                add(
                    "taskgraph",
                    [v, b],
                    f"{mg.label(v)} should read tensor {a} but reads buffer of tensor {mg.tensor[b]}",
                )
        for u in tg.deps(t):
            if tg.kind[u] != KIND_INPUT and mv[u] >= 0:
                reach.require(int(mv[u]), v, lost, int(mv[u]), v, int(u), t)


def _check_races(mg, topo, writers, readers, reach, add):
    def race(a, b, p, s, e):
        add(
            "race",
            [a, b],
            f"gpu {mg.gpu[b]} bytes [{s}, {e}): {mg.label(b)} may overwrite buffer {p} before {mg.label(a)} is done"
            " with it",
        )

    out_bufs = {int(o) for o in mg.outputs.tolist() if 0 <= o < mg.n and mg.kind[o] != KIND_OFFLOAD}

    for g in range(mg.n_gpus):
        bufs = [b for b in writers if mg.gpu[b] == g]
        bufs.sort(key=lambda b: topo[b])
        segs: list[tuple[int, int, int]] = []  # sorted disjoint (start, end, buffer): last occupant
        for b in bufs:
            s, e = int(mg.out_offset[b]), int(mg.out_offset[b] + mg.out_nbytes[b])
            keep, prev = [], set()
            for seg in segs:
                if seg[1] <= s or seg[0] >= e:
                    keep.append(seg)
                    continue
                prev.add(seg[2])
                if seg[0] < s:
                    keep.append((seg[0], s, seg[2]))
                if seg[1] > e:
                    keep.append((e, seg[1], seg[2]))
            for p in prev:
                if p in out_bufs:
                    add("race", [p, b], f"gpu {g} bytes [{s}, {e}): {mg.label(b)} writes over the buffer of plan "
                        f"output {mg.label(p)}, which is read after the run")  # fmt: skip
                for a in writers[p] + readers[p]:
                    if a == b:
                        add("race", [p, b], f"gpu {g} bytes [{s}, {e}): {mg.label(b)} writes over buffer {p}, "
                            "which it reads")  # fmt: skip
                    else:
                        reach.require(a, b, race, a, b, p, s, e)
            keep.append((s, e, b))
            keep.sort()
            segs = keep
