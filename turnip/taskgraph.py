"""The taskgraph: input, kernel and GPU→GPU transfer vertices, each writing one tile of a known size.

State (per vertex ``v``; index order is a valid topological order once ``validate`` passes):
  kind[v]      KIND_INPUT | KIND_KERNEL | KIND_TRANSFER (the codes shared with ``turnip.memgraph.plan``)
  gpu[v]       GPU that holds v's output (a transfer's destination); src_gpu[v] is a transfer's source
  op/params/shape/dtype      kernel op ("input", "transfer" for the other kinds) and output tile
  nbytes[v]    bytes of v's output tensor (0 for ``sum_into``, which writes its accumulator in place)
  flops[v]     arithmetic work of a kernel
  operands     CSR arg_ptr/arg_idx: the tensors v reads, in operand order. A tensor is named by the vertex
               that created it. ``sum_into`` reads (accumulator, partial) and adds the partial in place.
  acc[v]       for ``sum_into`` the accumulator tensor, else -1; all sum_into vertices of one accumulator
               form a lock group. A tensor is *complete* once its creator and all its sum_into vertices ran.
  is_output[v] tensor is a result of the computation (kept on GPU, never freed)

Derived: ``writers(t)`` = [t] + sum_into vertices of t. Dependencies of v: for each operand t, every writer
of t — except that a ``sum_into`` depends only on its accumulator's creator (its group peers are unordered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from turnip import ops
from turnip.memgraph.plan import DTYPE_NBYTES, KIND_INPUT, KIND_KERNEL, KIND_TRANSFER, csr

KNOWN_OPS = frozenset(ops.OPS)


class TaskGraphError(ValueError):
    """A malformed taskgraph; the message names the offending vertex."""


class CycleError(TaskGraphError):
    def __init__(self, cycle: list[int]):
        self.cycle = cycle
        super().__init__(f"taskgraph has a cycle through vertices {' -> '.join(map(str, cycle))}")


class UnknownOpError(TaskGraphError):
    pass


class ShapeError(TaskGraphError):
    pass


class SizeError(TaskGraphError):
    pass


class GpuRangeError(TaskGraphError):
    pass


@dataclass(slots=True)
class TaskGraph:
    n_gpus: int
    kind: np.ndarray
    gpu: np.ndarray
    src_gpu: np.ndarray
    op: list[str]
    params: list[dict]
    shape: list[tuple]
    dtype: list[str]
    nbytes: np.ndarray
    flops: np.ndarray
    arg_ptr: np.ndarray
    arg_idx: np.ndarray
    acc: np.ndarray
    is_output: np.ndarray
    name: list[str]
    meta: dict = field(default_factory=dict)
    _writers: dict | None = None

    @property
    def n(self) -> int:
        return len(self.kind)

    def args(self, v: int) -> np.ndarray:
        return self.arg_idx[self.arg_ptr[v] : self.arg_ptr[v + 1]]

    def sum_intos(self) -> dict[int, list[int]]:
        """accumulator tensor -> its sum_into vertices, in index order."""
        if self._writers is None:
            w: dict[int, list[int]] = {}
            for v in np.flatnonzero(self.acc >= 0):
                w.setdefault(int(self.acc[v]), []).append(int(v))
            self._writers = w
        return self._writers

    def writers(self, t: int) -> list[int]:
        return [t, *self.sum_intos().get(t, ())]

    def deps(self, v: int) -> list[int]:
        """Vertices v must wait for (see module docstring)."""
        if self.acc[v] >= 0:
            return [int(t) for t in self.args(v)]
        out: list[int] = []
        for t in self.args(v):
            out.extend(self.writers(int(t)))
        return out

    def tensor_of(self, v: int) -> int:
        """Tensor a vertex writes: its own, or its accumulator's."""
        return int(self.acc[v]) if self.acc[v] >= 0 else v

    def total_flops(self) -> float:
        return float(self.flops.sum())

    def validate(self) -> None:
        """Raise a ``TaskGraphError`` subclass naming the first bad vertex."""
        n = self.n
        for v in range(n):
            k, op = int(self.kind[v]), self.op[v]
            if k == KIND_KERNEL and op not in KNOWN_OPS:
                raise UnknownOpError(f"vertex {v} ({self.name[v]}): unknown op {op!r}; known: {sorted(KNOWN_OPS)}")
            if k not in (KIND_INPUT, KIND_KERNEL, KIND_TRANSFER):
                raise TaskGraphError(f"vertex {v} ({self.name[v]}): bad kind {k}")
            for g in (self.gpu[v], self.src_gpu[v]):
                if not 0 <= g < self.n_gpus:
                    raise GpuRangeError(f"vertex {v} ({self.name[v]}): gpu {g} outside 0..{self.n_gpus - 1}")
            if self.nbytes[v] <= 0 and op != "sum_into":
                raise SizeError(f"vertex {v} ({self.name[v]}): output size {self.nbytes[v]} bytes must be > 0")
            expect = int(np.prod(self.shape[v])) * DTYPE_NBYTES[self.dtype[v]] if op != "sum_into" else 0
            if expect != self.nbytes[v]:
                raise ShapeError(
                    f"vertex {v} ({self.name[v]}): shape {self.shape[v]} {self.dtype[v]} is {expect} bytes, "
                    f"nbytes says {self.nbytes[v]}"
                )
            args = self.args(v)
            if np.any((args < 0) | (args >= n)):
                raise TaskGraphError(f"vertex {v} ({self.name[v]}): operand out of range {args.tolist()}")
            if k == KIND_TRANSFER:
                a = int(args[0])
                if self.shape[a] != self.shape[v]:
                    raise ShapeError(f"transfer {v}: moves {self.shape[a]} into {self.shape[v]}")
                if self.gpu[a] != self.src_gpu[v]:
                    raise GpuRangeError(
                        f"transfer {v}: source tensor {a} is on gpu {self.gpu[a]}, not {self.src_gpu[v]}"
                    )
            elif k == KIND_KERNEL:
                bad = ops.check_shapes(op, [self.shape[int(a)] for a in args], self.shape[v], self.params[v])
                if bad:
                    raise ShapeError(f"vertex {v} ({self.name[v]}): {bad}")
                for a in args:
                    if self.gpu[a] != self.gpu[v]:
                        raise GpuRangeError(
                            f"vertex {v} ({self.name[v]}) on gpu {self.gpu[v]} reads tensor {a} on gpu "
                            f"{self.gpu[a]} without a transfer"
                        )
                if op == "sum_into" and (len(args) != 2 or args[0] != self.acc[v]):
                    raise TaskGraphError(f"sum_into {v}: operands must be (accumulator, partial)")
                if op == "sum_into" and self.kind[int(args[0])] == KIND_INPUT:
                    raise TaskGraphError(f"sum_into {v}: accumulator {args[0]} is an input; inputs are immutable")
                if op == "sum_into" and self.shape[int(args[0])] != self.shape[int(args[1])]:
                    raise ShapeError(
                        f"sum_into {v}: partial {self.shape[int(args[1])]} vs accumulator {self.shape[int(args[0])]}"
                    )
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        n = self.n
        preds = [self.deps(v) for v in range(n)]
        ptr, idx = csr(preds)
        succ: list[list[int]] = [[] for _ in range(n)]
        for v in range(n):
            for u in preds[v]:
                succ[u].append(v)
        indeg = np.diff(ptr)
        stack = [v for v in range(n) if indeg[v] == 0]
        seen = 0
        indeg = indeg.copy()
        while stack:
            u = stack.pop()
            seen += 1
            for w in succ[u]:
                indeg[w] -= 1
                if indeg[w] == 0:
                    stack.append(w)
        if seen < n:
            raise CycleError(_find_cycle(preds, [v for v in range(n) if indeg[v] > 0]))
        bad = [v for v in range(n) if any(u >= v for u in preds[v])]
        if bad:
            raise TaskGraphError(f"vertex {bad[0]} depends on a later vertex; index order must be topological")


def _find_cycle(preds: list[list[int]], rest: list[int]) -> list[int]:
    """Walk predecessors inside the unsorted remainder until a vertex repeats."""
    inside = set(rest)
    v, path, pos = rest[0], [], {}
    while v not in pos:
        pos[v] = len(path)
        path.append(v)
        v = next(u for u in preds[v] if u in inside)
    cyc = path[pos[v] :]
    return [*reversed(cyc), cyc[-1]]


class Builder:
    """Append-only taskgraph construction; vertices are added in a topological order."""

    def __init__(self, n_gpus: int):
        self.n_gpus = n_gpus
        self.rows: list[tuple] = []
        self.args: list[list[int]] = []

    def _add(self, kind, gpu, src, op, params, shape, dtype, flops, args, acc, name) -> int:
        nbytes = 0 if op == "sum_into" else int(np.prod(shape)) * DTYPE_NBYTES[dtype]
        self.rows.append((kind, gpu, src, op, params, tuple(shape), dtype, nbytes, flops, acc, name))
        self.args.append([int(a) for a in args])
        return len(self.rows) - 1

    def input(self, shape, dtype: str, gpu: int, name: str = "") -> int:
        return self._add(KIND_INPUT, gpu, gpu, "input", {}, shape, dtype, 0.0, [], -1, name)

    def kernel(self, op, args, shape, dtype, gpu, params=None, name="") -> int:
        """A kernel vertex; its flops come from the op registry (``turnip.ops``)."""
        params = params or {}
        work = ops.flops(op, [self.rows[a][5] for a in args], shape, params) if op in ops.OPS else 0.0
        return self._add(KIND_KERNEL, gpu, gpu, op, params, shape, dtype, work, args, -1, name)

    def sum_into(self, acc: int, partial: int, name: str = "") -> int:
        r = self.rows[acc]
        work = ops.flops("sum_into", [r[5], self.rows[partial][5]], r[5], {})
        return self._add(KIND_KERNEL, r[1], r[1], "sum_into", {}, r[5], r[6], work, [acc, partial], acc, name)

    def transfer(self, t: int, dst_gpu: int, name: str = "") -> int:
        r = self.rows[t]
        return self._add(KIND_TRANSFER, dst_gpu, r[1], "transfer", {}, r[5], r[6], 0.0, [t], -1, name)

    def to_gpu(self, t: int, gpu: int, cache: dict) -> int:
        """``t`` as seen from ``gpu``: itself, or a (cached) transfer of it."""
        if self.rows[t][1] == gpu:
            return t
        key = (t, gpu)
        if key not in cache:
            cache[key] = self.transfer(t, gpu, name=f"{self.rows[t][10]}@gpu{gpu}")
        return cache[key]

    def gpu_of(self, t: int) -> int:
        return self.rows[t][1]

    def shape_of(self, t: int) -> tuple:
        return self.rows[t][5]

    def build(self, outputs=(), meta=None) -> TaskGraph:
        cols = list(zip(*self.rows, strict=True)) if self.rows else [[]] * 11
        ptr, idx = csr(self.args)
        is_out = np.zeros(len(self.rows), dtype=bool)
        is_out[list(outputs)] = True
        return TaskGraph(
            n_gpus=self.n_gpus,
            kind=np.array(cols[0], dtype=np.int8),
            gpu=np.array(cols[1], dtype=np.int16),
            src_gpu=np.array(cols[2], dtype=np.int16),
            op=list(cols[3]),
            params=list(cols[4]),
            shape=list(cols[5]),
            dtype=list(cols[6]),
            nbytes=np.array(cols[7], dtype=np.int64),
            flops=np.array(cols[8], dtype=np.float64),
            arg_ptr=ptr,
            arg_idx=idx,
            acc=np.array(cols[9], dtype=np.int32),
            is_output=is_out,
            name=list(cols[10]),
            meta=dict(meta or {}),
        )


def reordered(tg: TaskGraph, order) -> TaskGraph:
    """``tg`` with its vertices renumbered: new vertex ``i`` is old vertex ``order[i]`` (a permutation in which
    every vertex comes after its operands: ``TaskGraphError`` otherwise); ``meta``'s block maps follow."""
    order = np.asarray(order, dtype=np.int64)
    n = tg.n
    if len(order) != n or not np.array_equal(np.sort(order), np.arange(n)):
        raise TaskGraphError(f"reordered: not a permutation of the {n} vertices")
    new = np.empty(n, dtype=np.int64)
    new[order] = np.arange(n)
    args = [new[tg.args(int(v))].tolist() for v in order]
    bad = next((i for i, a in enumerate(args) if any(x >= i for x in a)), None)
    if bad is not None:
        raise TaskGraphError(f"reordered: vertex {int(order[bad])} ({tg.name[int(order[bad])]}) would come before "
                             "an operand")  # fmt: skip
    ptr, idx = csr(args)
    acc = np.where(tg.acc[order] >= 0, new[np.maximum(tg.acc[order], 0)], -1).astype(np.int32)
    meta = dict(tg.meta)
    for k in ("input_blocks", "output_blocks"):
        if k in meta:
            meta[k] = {name: (shape, [(c, int(new[x])) for c, x in blocks])
                       for name, (shape, blocks) in meta[k].items()}  # fmt: skip
    ix = order.tolist()
    return TaskGraph(n_gpus=tg.n_gpus, kind=tg.kind[order], gpu=tg.gpu[order], src_gpu=tg.src_gpu[order],
                     op=[tg.op[v] for v in ix], params=[tg.params[v] for v in ix], shape=[tg.shape[v] for v in ix],
                     dtype=[tg.dtype[v] for v in ix], nbytes=tg.nbytes[order], flops=tg.flops[order], arg_ptr=ptr,
                     arg_idx=idx, acc=acc, is_output=tg.is_output[order], name=[tg.name[v] for v in ix],
                     meta=meta)  # fmt: skip
