"""Sequential reference interpreters.

``evaluate_taskgraph`` computes every tensor directly (no memory limit). ``run_memgraph`` executes a
memgraph in a given (or random valid) order on real byte arrays: one arena per GPU of exactly the budget,
a host region for input data and one for offloaded copies — so a wrong address, a missing dependency or a
lost offload shows up as wrong numbers.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from turnip.memgraph.plan import (
    KIND_INPUT,
    KIND_KERNEL,
    KIND_OFFLOAD,
    KIND_RELOAD,
    KIND_TRANSFER,
    MemGraph,
)
from turnip.reference import run_reference

NP_DTYPE = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32, "int32": np.int32}


def random_inputs(tg, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Data for every input tensor: token ids below the embedding table size, small normal values else."""
    vocab = max((tg.shape[a][0] for v in range(tg.n) if tg.op[v] == "embed" for a in tg.args(v)[1:]), default=1)
    out = {}
    for v in np.flatnonzero(tg.kind == KIND_INPUT):
        shape, dt = tg.shape[v], NP_DTYPE[tg.dtype[v]]
        if dt == np.int32:
            out[int(v)] = rng.integers(0, vocab, size=shape, dtype=np.int32)
        else:
            out[int(v)] = (rng.standard_normal(shape) * 0.5).astype(dt)
    return out


def evaluate_taskgraph(tg, inputs: dict[int, np.ndarray], progress=None) -> dict[int, np.ndarray]:
    """Every tensor's final value, evaluating vertices in index order (``progress(done)`` every 64)."""
    val: dict[int, np.ndarray] = {}
    for v in range(tg.n):
        if progress is not None and v % 64 == 0:
            progress(v)
        k = tg.kind[v]
        if k == KIND_INPUT:
            val[v] = inputs[v]
        elif k == KIND_TRANSFER:
            val[v] = val[int(tg.args(v)[0])].copy()
        else:
            xs = [val[int(a)] for a in tg.args(v)]
            r = run_reference(tg.op[v], xs, tg.params[v])
            val[int(tg.acc[v]) if tg.op[v] == "sum_into" else v] = r.reshape(tg.shape[v])
    return val


def random_order(mg: MemGraph, rng: np.random.Generator) -> list[int]:
    """A uniformly random choice among ready vertices at every step: a random valid execution order."""
    indeg = mg.indegree().copy()
    sp, si = mg.successors()
    ready = list(np.flatnonzero(indeg == 0))
    order = []
    while ready:
        i = int(rng.integers(len(ready)))
        ready[i], ready[-1] = ready[-1], ready[i]
        u = int(ready.pop())
        order.append(u)
        for w in si[sp[u] : sp[u + 1]]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    if len(order) != mg.n:
        raise ValueError("memgraph has a cycle")
    return order


def _view(mem: np.ndarray, off: int, shape, dtype: str) -> np.ndarray:
    dt = NP_DTYPE[dtype]
    n = int(np.prod(shape)) * np.dtype(dt).itemsize
    return mem[off : off + n].view(dt).reshape(shape)


def run_memgraph(mg: MemGraph, tg, inputs: dict[int, np.ndarray], order=None) -> dict[int, np.ndarray]:
    """Execute ``mg`` in ``order`` (default: index order); returns each output tensor's final value."""
    arenas = [np.zeros(int(b), dtype=np.uint8) for b in mg.budget_nbytes]
    input_tensors = set(mg.tensor[mg.kind == KIND_INPUT].tolist())
    in_host = np.zeros(int(mg.stats.get("host_input_nbytes", 0)) + 256, dtype=np.uint8)
    off_host = np.zeros(int(mg.host_nbytes) + 256, dtype=np.uint8)
    for v in np.flatnonzero(mg.kind == KIND_INPUT):
        t = int(mg.tensor[v])
        _view(in_host, int(mg.host_offset[v]), mg.shape[v], mg.dtype[v])[...] = inputs[t]

    def buf(b: int) -> np.ndarray:
        return _view(arenas[mg.gpu[b]], int(mg.out_offset[b]), mg.shape[b], mg.dtype[b])

    for v in range(mg.n) if order is None else order:
        k, dst = mg.kind[v], None
        host = in_host if int(mg.tensor[v]) in input_tensors else off_host
        if k in (KIND_INPUT, KIND_RELOAD):
            src = _view(host, int(mg.host_offset[v]), mg.shape[v], mg.dtype[v])
            buf(v)[...] = src
        elif k == KIND_OFFLOAD:
            dst = _view(host, int(mg.host_offset[v]), mg.shape[v], mg.dtype[v])
            dst[...] = buf(int(mg.reads(v)[0]))
        elif k == KIND_TRANSFER:
            buf(v)[...] = buf(int(mg.reads(v)[0]))
        elif k == KIND_KERNEL:
            xs = [buf(int(b)) for b in mg.reads(v)]
            if mg.op[v] == "sum_into":
                run_reference("sum_into", xs, mg.params[v])
            else:
                buf(v)[...] = run_reference(mg.op[v], xs, mg.params[v]).reshape(mg.shape[v])
    out = {}
    for o in mg.outputs:
        o = int(o)
        if mg.kind[o] == KIND_OFFLOAD:
            out[int(mg.tensor[o])] = _view(off_host, int(mg.host_offset[o]), mg.shape[o], mg.dtype[o]).copy()
        else:
            out[int(mg.tensor[o])] = buf(o).copy()
    return out


def assemble(tg, values: dict[int, np.ndarray], name: str) -> np.ndarray:
    """Stitch a logical output back together from its blocks."""
    shape, blocks = tg.meta["output_blocks"][name]
    full = None
    for starts, v in blocks:
        x = values[v]
        if full is None:
            full = np.zeros(shape, dtype=x.dtype)
        full[tuple(slice(s, s + n) for s, n in zip(starts, x.shape, strict=True))] = x
    return full
