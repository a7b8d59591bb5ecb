"""The MemGraph: a taskgraph with every tensor placed at a fixed GPU address, plus offload/reload vertices
and memory-dependency edges.

State (all per memgraph vertex ``v``, index order = compile order; hot data in numpy arrays):
  kind[v]        KIND_INPUT | KIND_KERNEL | KIND_TRANSFER | KIND_OFFLOAD | KIND_RELOAD
  gpu[v]         GPU it runs on (a transfer's destination); src_gpu[v] is a transfer's source (else gpu[v])
  op[v], params[v], shape[v], dtype[v]   kernel op and tile shape/dtype of what v writes or moves
  tensor[v]      taskgraph tensor (= its producing taskgraph vertex) that v writes, moves or offloads
  tg_vertex[v]   taskgraph vertex v comes from (offload/reload: -1)
  out_offset[v]  arena byte offset written on gpu[v] (-1: offload, which writes host memory only)
  out_nbytes[v]  bytes written (offload: bytes copied to host)
  host_offset[v] host-arena byte offset (input / offload / reload: the tensor's host copy; else -1)
  reads          CSR in_ptr/in_idx: the memgraph vertices whose buffers v reads, in operand order.
                 A buffer is named by the vertex that created it (input, kernel, transfer or reload).
  deps           CSR dep_ptr/dep_src/dep_kind: v's incoming edges, DEP_DATA or DEP_MEMORY
  lock_group[v]  vertices sharing a group write one accumulator and must not overlap (-1: none)
  flops[v]       arithmetic work of a kernel (0 for copies)

Invariants (checked by ``turnip.memgraph.verify``): acyclic; taskgraph dependencies kept or replaced by
offload→reload; no two accesses to overlapping bytes, one a write, unordered (except within a lock group);
every write inside [0, budget) of its GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KIND_INPUT, KIND_KERNEL, KIND_TRANSFER, KIND_OFFLOAD, KIND_RELOAD = 0, 1, 2, 3, 4
KIND_NAMES = ("input", "kernel", "transfer", "offload", "reload")
DEP_DATA, DEP_MEMORY = 0, 1
DTYPE_NBYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "int32": 4}


def csr(lists: list[list[int]], dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Lists of ints -> (indptr int64, indices)."""
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    idx = np.fromiter((i for x in lists for i in x), dtype=dtype, count=int(ptr[-1]))
    return ptr, idx


@dataclass(slots=True)
class MemGraph:
    n_gpus: int
    budget_nbytes: np.ndarray
    kind: np.ndarray
    gpu: np.ndarray
    src_gpu: np.ndarray
    op: list[str]
    params: list[dict]
    shape: list[tuple]
    dtype: list[str]
    tensor: np.ndarray
    tg_vertex: np.ndarray
    out_offset: np.ndarray
    out_nbytes: np.ndarray
    host_offset: np.ndarray
    in_ptr: np.ndarray
    in_idx: np.ndarray
    dep_ptr: np.ndarray
    dep_src: np.ndarray
    dep_kind: np.ndarray
    lock_group: np.ndarray
    flops: np.ndarray
    outputs: np.ndarray
    host_nbytes: int = 0
    stats: dict = field(default_factory=dict)
    _succ: tuple | None = None

    @property
    def n(self) -> int:
        return len(self.kind)

    def reads(self, v: int) -> np.ndarray:
        return self.in_idx[self.in_ptr[v] : self.in_ptr[v + 1]]

    def deps(self, v: int) -> np.ndarray:
        return self.dep_src[self.dep_ptr[v] : self.dep_ptr[v + 1]]

    def successors(self) -> tuple[np.ndarray, np.ndarray]:
        """Out-edge CSR (succ_ptr, succ_idx), built once."""
        if self._succ is None:
            dst = np.repeat(np.arange(self.n, dtype=np.int32), np.diff(self.dep_ptr))
            order = np.argsort(self.dep_src, kind="stable")
            ptr = np.zeros(self.n + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(np.bincount(self.dep_src, minlength=self.n))
            self._succ = (ptr, dst[order].astype(np.int32))
        return self._succ

    def indegree(self) -> np.ndarray:
        return np.diff(self.dep_ptr).astype(np.int32)

    def io_nbytes(self) -> np.ndarray:
        """Bytes each vertex reads plus writes (for roofline timing of kernels)."""
        rd = np.zeros(self.n, dtype=np.int64)
        np.add.at(rd, np.repeat(np.arange(self.n), np.diff(self.in_ptr)), self.out_nbytes[self.in_idx])
        return rd + self.out_nbytes

    def preloaded(self) -> np.ndarray:
        """Resident inputs: loaded with the plan, before any run, and never moved again."""
        return (self.kind == KIND_INPUT) & np.array([bool(p.get("resident")) for p in self.params], dtype=bool)

    def count(self, kind: int) -> int:
        return int((self.kind == kind).sum())

    def label(self, v: int) -> str:
        return f"{KIND_NAMES[self.kind[v]]}#{v}({self.op[v]}, tensor {self.tensor[v]}, gpu {self.gpu[v]})"
