"""Append-only construction of a MemGraph, in emission (= compile) order.

Per buffer (named by its creating memgraph vertex) it tracks ``writers`` (creator, then in-place sum_into
writers) and ``users`` (every vertex that touched it), which BuildMemgraph turns into data and memory
dependencies. Memory dependencies that other edges already imply are dropped as each vertex is emitted
(``turnip.memgraph.reduce``), unless ``reduce`` is off.
"""

from __future__ import annotations

import numpy as np

from turnip.memgraph.arena import aligned
from turnip.memgraph.plan import (
    DEP_DATA,
    DEP_MEMORY,
    KIND_OFFLOAD,
    KIND_RELOAD,
    KIND_TRANSFER,
    MemGraph,
    csr,
)
from turnip.memgraph.reduce import Ancestors
from turnip.taskgraph import TaskGraph


def ancestor_window(n_gpus: int) -> int:
    """Ancestor window (emitted vertices) of the memory-edge reduction. Emission interleaves the GPUs, so a
    memory edge spans more emitted vertices the more GPUs there are (LLaMA plans: about 100-500 on one or
    four GPUs, 2300-4300 on eight); the time spent barely depends on the window, the memory is about
    window^2 / 8 bytes."""
    return min(16384, max(4096, 768 * n_gpus))


class Emitter:
    def __init__(self, tg: TaskGraph, budget: list[int], reduce: bool = True):
        self.tg, self.budget = tg, budget
        w = ancestor_window(tg.n_gpus)
        self.anc = Ancestors(window=w, frame=max(1, min(1024, w // 4))) if reduce else None
        self.rows: list[tuple] = []  # (kind, gpu, src_gpu, op, params, shape, dtype, tensor, tg_vertex, flops)
        self.out_offset: list[int] = []
        self.out_nbytes: list[int] = []
        self.host_offset: list[int] = []
        self.reads: list[list[int]] = []
        self.dep_src: list[list[int]] = []
        self.dep_kind: list[list[int]] = []
        self.lock: list[int] = []
        self.writers: dict[int, list[int]] = {}
        self.users: dict[int, list[int]] = {}
        self.input_host_nbytes = 0
        self.n_offload = self.n_reload = 0
        self.offload_nbytes = self.reload_nbytes = 0

    def _new(self, kind, gpu, src, op, params, t, tgv, flops, off, nbytes, host, reads, data, memory, lock=-1):
        tg = self.tg
        v = len(self.rows)
        self.rows.append((kind, gpu, src, op, params, tg.shape[t], tg.dtype[t], t, tgv, flops))
        self.out_offset.append(off)
        self.out_nbytes.append(nbytes)
        self.host_offset.append(host)
        self.reads.append(reads)
        d = dict.fromkeys(data, DEP_DATA)
        for u in memory:
            d.setdefault(u, DEP_MEMORY)
        d.pop(v, None)
        if self.anc is None:
            self.dep_src.append(list(d))
            self.dep_kind.append(list(d.values()))
        else:
            srcs, kinds = self.anc.add(d)
            self.dep_src.append(srcs)
            self.dep_kind.append(kinds)
        self.lock.append(lock)
        return v

    def kernel(self, v: int, arg_bufs: list[int], off: int, memory: list[int], params: dict | None = None,
               gpu: int | None = None) -> int:  # fmt: skip
        """Emit taskgraph vertex v (input, kernel, transfer or sum_into) reading ``arg_bufs``; ``params``
        replaces the taskgraph's parameters when given; ``gpu``: an input loaded into another GPU's relay slot."""
        tg = self.tg
        into = tg.op[v] == "sum_into"
        data = [self.writers[arg_bufs[0]][0]] if into else []
        for b in arg_bufs[1:] if into else arg_bufs:
            data.extend(self.writers[b])
        t = int(tg.acc[v]) if into else v
        if into:
            off = self.out_offset[arg_bufs[0]]
        mv = self._new(
            int(tg.kind[v]),
            int(tg.gpu[v]) if gpu is None else int(gpu),
            int(tg.src_gpu[v]) if gpu is None else int(gpu),
            tg.op[v],
            tg.params[v] if params is None else params,
            t,
            v,
            float(tg.flops[v]),
            off,
            int(tg.nbytes[t]),
            -1,
            arg_bufs,
            data,
            memory,
            lock=t if into else -1,
        )
        for b in arg_bufs:
            self.users[b].append(mv)
        if into:
            self.writers[arg_bufs[0]].append(mv)
        else:
            self.writers[mv] = [mv]
            self.users[mv] = [mv]
        return mv

    def last_users(self, buf: int) -> list[int]:
        """The users of a buffer that later occupants must wait for: its readers (which already wait for
        its writers), or its writers when nothing read it."""
        w = self.writers[buf]
        readers = [u for u in self.users[buf] if u not in w]
        return readers or list(w)

    def input_host(self, v: int) -> int:
        off = self.input_host_nbytes
        self.input_host_nbytes += aligned(int(self.tg.nbytes[v]))
        return off

    def offload(self, t: int, buf: int, host_off: int) -> int:
        nb = int(self.tg.nbytes[t])
        o = self._new(
            KIND_OFFLOAD,
            self.rows[buf][1],
            self.rows[buf][1],
            "offload",
            {},
            t,
            -1,
            0.0,
            -1,
            nb,
            host_off,
            [buf],
            self.writers[buf],
            [],
        )
        self.users[buf].append(o)
        self.n_offload += 1
        self.offload_nbytes += nb
        return o

    def reload(self, t: int, off: int, host_off: int, host_src: int, memory: list[int], gpu: int | None = None) -> int:
        """Copy t's host bytes to ``off`` on its GPU (``gpu``: another GPU's relay slot, ``relay`` takes it on)."""
        nb = int(self.tg.nbytes[t])
        data = [host_src] if host_src >= 0 else []
        g = int(self.tg.gpu[t]) if gpu is None else int(gpu)
        r = self._new(
            KIND_RELOAD,
            g,
            g,
            "reload",
            {},
            t,
            -1,
            0.0,
            off,
            nb,
            host_off,
            [],
            data,
            memory,
        )
        self.writers[r] = [r]
        self.users[r] = [r]
        self.n_reload += 1
        self.reload_nbytes += nb
        return r

    def relay(self, t: int, r: int, gpu: int, off: int, memory: list[int]) -> int:
        """Copy t from the relay slot reload ``r`` filled on another GPU to ``off`` on ``gpu`` (a GPU<->GPU
        transfer of no taskgraph vertex)."""
        nb = int(self.tg.nbytes[t])
        src = self.rows[r][1]
        x = self._new(KIND_TRANSFER, int(gpu), src, "transfer", {}, t, -1, 0.0, off, nb, -1, [r], [r], memory)
        self.users[r].append(x)
        self.writers[x] = [x]
        self.users[x] = [x]
        return x

    def build(self, outputs: list[int], host_nbytes: int, stats: dict) -> MemGraph:
        cols = list(zip(*self.rows, strict=True))
        in_ptr, in_idx = csr(self.reads)
        dep_ptr, dep_src = csr(self.dep_src)
        _, dep_kind = csr(self.dep_kind, dtype=np.int8)
        kind = np.array(cols[0], dtype=np.int8)
        n_mem = int((dep_kind == DEP_MEMORY).sum())
        stats = dict(
            stats,
            n_offload=self.n_offload,
            n_reload=self.n_reload,
            offload_nbytes=self.offload_nbytes,
            reload_nbytes=self.reload_nbytes,
            n_data_edges=len(dep_src) - n_mem,
            n_memory_edges=n_mem,
            n_memory_edges_dropped=self.anc.n_dropped if self.anc is not None else 0,
        )
        return MemGraph(
            n_gpus=self.tg.n_gpus,
            budget_nbytes=np.array(self.budget, dtype=np.int64),
            kind=kind,
            gpu=np.array(cols[1], dtype=np.int16),
            src_gpu=np.array(cols[2], dtype=np.int16),
            op=list(cols[3]),
            params=list(cols[4]),
            shape=list(cols[5]),
            dtype=list(cols[6]),
            tensor=np.array(cols[7], dtype=np.int32),
            tg_vertex=np.array(cols[8], dtype=np.int32),
            out_offset=np.array(self.out_offset, dtype=np.int64),
            out_nbytes=np.array(self.out_nbytes, dtype=np.int64),
            host_offset=np.array(self.host_offset, dtype=np.int64),
            in_ptr=in_ptr,
            in_idx=in_idx,
            dep_ptr=dep_ptr,
            dep_src=dep_src,
            dep_kind=dep_kind,
            lock_group=np.array(self.lock, dtype=np.int32),
            flops=np.array(cols[9], dtype=np.float64),
            outputs=np.array(outputs, dtype=np.int32),
            host_nbytes=int(host_nbytes),
            stats=stats,
        )
