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

    @property
    def host_nbytes(self) -> tuple[int, int]:
        return self.host_input_nbytes, self.host_offload_nbytes


def plan_layout(mg: MemGraph) -> Layout:
    n = mg.n
    input_tensors = set(mg.tensor[mg.kind == KIND_INPUT].tolist())
    tensor = mg.tensor.tolist()
    host_off = mg.host_offset.tolist()
    region = [-1 if host_off[v] < 0 else (HOST_INPUT if tensor[v] in input_tensors else HOST_OFFLOAD) for v in range(n)]
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
        host_input_nbytes=_round_up(int(mg.stats.get("host_input_nbytes", 0)) + ALIGN),
        host_offload_nbytes=_round_up(int(mg.host_nbytes) + ALIGN),
    )


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


__all__ = ["HOST_INPUT", "HOST_OFFLOAD", "NP_DTYPE", "Layout", "buffer_view", "input_vertices",
           "output_sources", "plan_layout", "row_range"]  # fmt: skip
