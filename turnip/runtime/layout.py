"""Where every vertex's bytes live, computed once from a plan; shared by the CPU and CUDA backends.

Memory of a run (the same on every backend): per GPU one arena of exactly ``budget_nbytes[g]`` bytes;
on the host an *input* region (``stats["host_input_nbytes"]``: inputs and weights, written by the user
before a run) and an *offload* region (``host_nbytes``: offloaded copies). A vertex's buffer is named by
the vertex that creates it (input, kernel, transfer, reload) and lies at ``out_offset`` in its GPU's arena;
inputs, offloads and reloads also have a host copy at ``host_offset`` in the input region (a tensor the
taskgraph takes as input) or the offload region (anything computed).

``Layout`` holds plain Python lists (cheap to index from a driver loop). ``buffer_view`` is the numpy view
logic of the reference interpreter (``turnip.memgraph.interp``), reused here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnip.memgraph.interp import NP_DTYPE, _view
from turnip.memgraph.plan import KIND_INPUT, KIND_OFFLOAD, MemGraph

HOST_INPUT, HOST_OFFLOAD = 0, 1
ALIGN = 256


@dataclass(slots=True)
class Layout:
    kind: list[int]
    gpu: list[int]
    src_gpu: list[int]
    out_offset: list[int]
    nbytes: list[int]
    host_offset: list[int]
    host_region: list[int]  # HOST_INPUT / HOST_OFFLOAD, -1 where no host copy
    resident: list[bool]  # input vertices loaded once at plan load, skipped by runs
    reads: list[list[int]]
    host_input_nbytes: int
    host_offload_nbytes: int
    host_reserve_nbytes: int = 0  # spare bytes at the input region's end, for a later plan (in host_input_nbytes)

    @property
    def host_nbytes(self) -> tuple[int, int]:
        return self.host_input_nbytes, self.host_offload_nbytes


def plan_layout(mg: MemGraph, first: list[int] | None = None, reserve: int = 0) -> Layout:
    """The plan's layout. ``first``: taskgraph input tensors whose host copies open the input region, in this
    order, each at an ``ALIGN``-ed offset (the others follow in plan order): two plans given the same tensors
    (the same sizes, in the same order) lay them out alike, so one plan's filled input region can serve the
    next (``HostInputs``); ``reserve``: spare bytes at the region's end (a later plan's larger region)."""
    n = mg.n
    input_tensors = set(mg.tensor[mg.kind == KIND_INPUT].tolist())
    tensor = mg.tensor.tolist()
    host_off = mg.host_offset.tolist()
    region = [-1 if host_off[v] < 0 else (HOST_INPUT if tensor[v] in input_tensors else HOST_OFFLOAD) for v in range(n)]
    in_nbytes = int(mg.stats.get("host_input_nbytes", 0))
    if first is not None or reserve:
        host_off, in_nbytes = _inputs_first(mg, tensor, host_off, region, first or [])
        in_nbytes += reserve
    kind = mg.kind.tolist()
    resident = mg.preloaded().tolist()
    ip, ii = mg.in_ptr.tolist(), mg.in_idx.tolist()
    return Layout(
        kind=kind,
        gpu=mg.gpu.tolist(),
        src_gpu=mg.src_gpu.tolist(),
        out_offset=mg.out_offset.tolist(),
        nbytes=mg.out_nbytes.tolist(),
        host_offset=host_off,
        host_region=region,
        resident=resident,
        reads=[ii[ip[v] : ip[v + 1]] for v in range(n)],
        host_input_nbytes=_round_up(in_nbytes + ALIGN),
        host_offload_nbytes=_round_up(int(mg.host_nbytes) + ALIGN),
        host_reserve_nbytes=reserve,
    )


def _inputs_first(mg: MemGraph, tensor: list, host_off: list, region: list, first: list[int]) -> tuple:
    """Host offsets with the input tensors ``first`` at the region's start (each ALIGN-ed, in that order), the
    other input tensors after them in plan order; (offsets, the region's bytes)."""
    size: dict[int, int] = {}
    old: dict[int, int] = {}
    nb = mg.out_nbytes.tolist()
    for v, r in enumerate(region):
        if r == HOST_INPUT:
            size[tensor[v]] = max(size.get(tensor[v], 0), nb[v])
            old.setdefault(tensor[v], host_off[v])
    unknown = [t for t in first if t not in size]
    if unknown:
        raise ValueError(f"the host prefix names tensor {unknown[0]}, which is no input with a host copy of this plan")
    if len(set(first)) != len(first):
        raise ValueError("the host prefix names a tensor twice")
    new: dict[int, int] = {}
    end = 0
    for t in first + sorted(set(size) - set(first), key=old.__getitem__):
        new[t] = end
        end = _round_up(end + size[t])
    out = [new[tensor[v]] if region[v] == HOST_INPUT else host_off[v] for v in range(len(host_off))]
    return out, end


def common_prefix(a, b) -> int:
    """How many leading entries two sequences share (two host-prefix keys: the tensors two plans lay out alike
    from offset 0)."""
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


@dataclass
class HostInputs:
    """A filled host input region handed from a closed backend to the next (``detach_host_inputs``): its bytes
    (``array``, at ``ptr`` where pinned) and the ``key`` of its prefix tensors (one entry per tensor, in layout
    order). Whoever holds it frees it (``free``) unless a backend adopts it (``adopt``)."""

    array: np.ndarray
    key: tuple
    ptr: int = 0
    release: object = None  # callable freeing the memory (pinned host memory), or None
    pieces: list | None = None  # registered memory: the [start, end) spans registered apart (None: allocated)

    def free(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None
        self.array = None

    def adoptable(self, key: tuple, lay: Layout) -> int:
        """The leading prefix tensors a backend of layout ``lay`` (prefix ``key``) finds filled in this region
        if it takes the region as its own; 0: it cannot (nothing in common, or the region is too small)."""
        if self.array is None or len(self.array) < lay.host_input_nbytes - lay.host_reserve_nbytes:
            return 0  # (an adopted region is as large as it is: its own reserve is what the next plans share)
        return common_prefix(self.key, key)

    def adopt(self, key: tuple, lay: Layout, first, pinned: bool = False) -> list[int]:
        """A backend of layout ``lay`` (prefix tensors ``first``, their ``key``) takes this region as its own:
        the tensors it finds filled (its ``array`` is then the backend's, and its release, ``take``, too; for a
        ``pinned`` backend only a pinned region serves); [] when it cannot, the region freed."""
        k = 0 if pinned and not self.ptr else self.adoptable(key, lay)
        if not k:
            self.free()
            return []
        return list(first)[:k]

    def take(self):
        """The release of an adopted region, for its new owner (who calls it); this holder releases nothing."""
        release, self.release = self.release, None
        return release


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def buffer_view(mem: np.ndarray, off: int, shape, dtype: str) -> np.ndarray:
    """Typed view of ``mem[off:]`` (a uint8 arena or host region) with the given tile shape and dtype."""
    return _view(mem, off, shape, dtype)


def input_vertices(mg: MemGraph) -> dict[int, list[int]]:
    """Taskgraph input tensor -> the memgraph input vertices loading it (all share one host copy)."""
    out: dict[int, list[int]] = {}
    for v in np.flatnonzero(mg.kind == KIND_INPUT).tolist():
        out.setdefault(int(mg.tensor[v]), []).append(v)
    return out


def output_sources(mg: MemGraph) -> list[tuple[int, int, bool]]:
    """(tensor, vertex, on_host) per plan output: read the host copy of an offload, else the arena."""
    return [(int(mg.tensor[o]), int(o), int(mg.kind[o]) == KIND_OFFLOAD) for o in mg.outputs.tolist()]


def row_range(shape, nbytes: int, rows: tuple[int, int] | None) -> tuple[int, int]:
    """(byte offset, byte count) of rows [first, first + count) of the leading dimension of a tensor of
    ``shape`` and ``nbytes`` (``rows`` None: the whole tensor). ``ValueError`` for rows outside the tensor."""
    if rows is None:
        return 0, nbytes
    first, count = rows
    n0 = int(shape[0]) if len(shape) else 1
    if first < 0 or count < 0 or first + count > n0:
        raise ValueError(f"rows [{first}, {first + count}) outside a tensor of {n0} rows (shape {tuple(shape)})")
    row = nbytes // n0
    return first * row, count * row


def carried_rows(mg: MemGraph, o: int, v: int, rows: tuple[int, int]) -> bool:
    """Whether a carry of ``rows`` from output vertex ``o`` into input vertex ``v`` copies all of ``o`` into those
    rows of ``v`` (``o`` holds just ``count`` rows of ``v``'s shape) rather than the same rows of an output
    shaped as ``v``; ``ValueError`` for an output shaped as neither."""
    so, si = tuple(int(x) for x in mg.shape[o]), tuple(int(x) for x in mg.shape[v])
    if so == si:
        return False
    if so == (rows[1], *si[1:]):
        return True
    raise ValueError(f"carry: output {mg.label(o)} of shape {so} is neither input {mg.label(v)}'s shape {si} nor "
                     f"{rows[1]} of its rows")  # fmt: skip


__all__ = ["HOST_INPUT", "HOST_OFFLOAD", "NP_DTYPE", "HostInputs", "Layout", "buffer_view", "common_prefix",
           "carried_rows", "input_vertices", "output_sources", "plan_layout", "row_range"]  # fmt: skip
