"""The CUDA backend: numba-cuda streams, one device arena per GPU, a pinned host arena, event polling.

State it owns, all built at plan load (the constructor); a run allocates nothing, builds no view and
compiles nothing:
  per GPU     one device arena of exactly ``budget_nbytes[g]`` bytes (the only device allocation of the
              plan), ``streams_per_gpu`` compute streams (stream slot k of the scheduler = stream k), one
              host→device and one device→host copy stream, one copy stream per peer GPU it sends to
  host        one pinned input region (portable) holding inputs and weights, one pinned offload region
              (portable) receiving offloads: with ``host_register`` (the default; ``TURNIP_HOST_REGISTER=0``
              for memory allocated pinned, write-combined for the input region) plain memory, pinned in
              place once written (``turnip.runtime.hostmem``)
  per slot    a ``StreamContext``: the stream, its workspace (the top of the arena holds one workspace
              per stream slot, ``workspace_slot_nbytes`` each: the plan's builder left it free) and the
              library handles bound to that stream (cuBLASLt, cuDNN), created here when a vertex needs them
  per vertex  typed device-array views of its output and operands (numba ``DeviceNDArray`` over the
              arena) and its bound launch (``Launcher.bind``: one ``cuLaunchKernel`` with packed
              parameters, or a prebound library call: cuBLASLt GEMM, cuDNN attention, device copies),
              captured into a CUDA graph where it can be (``graphs=True``: kernels and copies once, GEMMs
              once per stream slot with that slot's cuBLASLt handle; cuDNN calls stay direct), or the raw
              pointers of its copy; an end event
              (and a start event with ``device_start=True``)
A run enqueues the work with one driver call per vertex (``cuGraphLaunch``, ``cuLaunchKernel``, a copy),
records its end event, and the driver loop polls end events (``cuEventQuery``, about 1 µs from Python;
``native_poll=True``: one compiled scan over every in-flight event, ``turnip.runtime._poll``: no steady gain
measured, so off by default; no host callbacks: numba's ``add_callback`` is broken on the lent machines).
``lib_graphs`` (default) captures library calls that use their slot's workspace (cuDNN attention) as well, one
graph per slot: 7B prefill 2-12% faster (nondet) on 1-4 H100s, bitwise equal outputs
(``benchmarks/results/multi_gpu/README.md``). ``bound=False``
launches through numba launchers instead (slower, for comparison).
Sum-into groups are serialised by the scheduler's lock: the next writer launches only after the previous
one's end event was seen. Resident inputs are loaded by ``write_inputs``; the scheduler counts
them done before a run starts (were one issued, it would be a no-op).

Launch groups (``groups``; default ``launch_groups_on``: on for several GPUs; needs ``graphs`` and no start
events): each group of ``turnip.sched.groups`` is captured as one graph of its members in order (per stream
slot where a member uses its slot's library handle), each member recording its end event (``group_events=False``:
only the last does, and the others are placed between their neighbours in the trace; default
``group_events_on``: every member's, except in training steps); one ``cuGraphLaunch``
issues the group and its last member's event is the one polled. A group with a member that is not captured
launches its members one after another instead.

Errors: a launcher that raises, or a copy / event that returns a CUDA error, raises ``VertexFailed`` naming
the vertex (a sticky asynchronous error is reported on the first in-flight vertex whose event returns it).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import time

import numpy as np

from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL, KIND_OFFLOAD, KIND_RELOAD, KIND_TRANSFER, MemGraph
from turnip.runtime._cudadrv import NOT_READY, SUCCESS, CudaError, Driver
from turnip.runtime.backend import check_ready
from turnip.runtime.errors import BackendError, VertexFailed
from turnip.runtime.hostmem import (
    PIECE_NBYTES,
    PiecePinner,
    PinnedRegion,
    host_register_on,
    pin_while_filling_on,
    register_spans,
)
from turnip.runtime.layout import (
    HOST_INPUT,
    NP_DTYPE,
    carried_rows,
    input_vertices,
    output_sources,
    plan_layout,
    row_range,
)
from turnip.runtime.loader import thread_map
from turnip.sched.groups import group_events_on, launch_groups, launch_groups_on

_COPY_KINDS = (KIND_INPUT, KIND_RELOAD, KIND_OFFLOAD, KIND_TRANSFER)
PARALLEL_READS_SWITCH = "TURNIP_PARALLEL_READS"


def parallel_reads_on() -> bool:
    """Whether ``read_outputs`` copies the outputs left on several GPUs on a thread per GPU (into plain memory,
    the driver staging each copy): ``TURNIP_PARALLEL_READS=1`` (off until timed on GPUs)."""
    return os.environ.get(PARALLEL_READS_SWITCH) == "1"


def _untracked(v: int) -> None:
    """A launch group's member issued: its head is what the poll tracks."""


class CudaBackend:
    name = "cuda"

    def __init__(self, mg: MemGraph, streams_per_gpu: int = 5, devices: list[int] | None = None,
                 gemm: str = "auto", fast: bool = True, bound: bool = True, graphs: bool = True,
                 graph_events: bool = False, device_start: bool = False, lib_graphs: bool = True,
                 native_poll: bool = False, groups: bool | None = None, group_events: bool | None = None,
                 host_first: list[int] | None = None, host_key: tuple = (), host_reserve: int = 0,
                 host_inputs=None, host_register: bool | None = None):  # fmt: skip
        from cuda_kernels._numba import cuda as numba_cuda
        from cuda_kernels.launch import driver as launch_driver

        t_open = time.perf_counter()
        self.cuda = cuda = numba_cuda()
        self.drv = drv = Driver()
        self._cu_launch = launch_driver().cuLaunchKernel
        self._graph_launch = launch_driver().cuGraphLaunch
        self.mg, self.k, self.gemm, self.fast, self.bound = mg, streams_per_gpu, gemm, fast, bound
        self.graphs = graphs and bound
        self.graph_events = graph_events and self.graphs and not device_start  # end event inside the graph
        self.lib_graphs = lib_graphs and self.graphs  # library calls using their slot's workspace (cuDNN) captured too
        self._graph_execs: list[int] = []
        self._cap_streams: list[int] = []
        self.capture_failures: list[str] = []
        self.device_start = device_start
        self.ws_slot = int(mg.stats.get("workspace_slot_nbytes", 0))
        slots = int(mg.stats.get("workspace_slots", 0))
        if self.ws_slot and streams_per_gpu > slots:
            raise BackendError(f"the plan reserves workspace for {slots} stream slots per GPU; run it with at most "
                               f"{slots} streams (asked {streams_per_gpu}) or recompile it")  # fmt: skip
        self.lay = lay = plan_layout(mg, host_first, host_reserve)
        self.open_phases_s = {}  # the open's parts: the plan's layout ("layout"), contexts, arenas, streams and
        # peer access ("devices"), an end event per vertex ("events"), each vertex bound and captured ("vertices"),
        # launch groups captured ("groups"), graph uploads waited for ("uploads")
        t_layout = self._open_phase("layout", t_open)
        G = mg.n_gpus
        self.devices = list(devices) if devices is not None else list(range(G))
        if len(cuda.gpus) < max(self.devices) + 1:
            raise BackendError(f"plan needs {G} GPU(s) (devices {self.devices}); {len(cuda.gpus)} visible")
        self.allocations = 0
        self.views_built = 0
        self._closed = False
        self.host_register = host_register_on() if host_register is None else bool(host_register)
        self._regions: list = []  # PinnedRegion: the input region, then the offload region
        self.load_phases_s: dict[str, float] = {}  # seconds: host regions made ("alloc"), the rest of the plan's
        # open ("open", in parts in ``open_phases_s``), pinning ("pin"), resident copies ("resident")
        self._events: list[int] = []
        self.ctx, self.arenas, self.base, self.streams, self.hstreams = [], [], [], [], []
        self._device_ptrs: list[tuple[int, int]] = []  # (context, pointer) of the arenas, freed at close
        self.copy_streams: list[dict] = []
        for g in range(G):
            with cuda.gpus[self.devices[g]]:
                self.ctx.append(drv.current_context())
                self.arenas.append(_arena(cuda, drv, int(mg.budget_nbytes[g]), self._device_ptrs))
                self.allocations += 1
                self.base.append(int(self.arenas[g].__cuda_array_interface__["data"][0]))
                ss = [cuda.stream() for _ in range(streams_per_gpu)]
                self.streams.append(ss)
                self.hstreams.append([int(s.handle) for s in ss])
                cs = {name: cuda.stream() for name in ("h2d", "d2h")}
                cs |= {("p2p", d): cuda.stream() for d in range(G) if d != g}
                self.copy_streams.append({k: (s, int(s.handle)) for k, s in cs.items()})
        self._enable_peers()
        from cuda_kernels.launch import StreamContext

        self.sctx = [
            [StreamContext(self.hstreams[g][s], self._ws_ptr(g, s), self.ws_slot, {}, self.streams[g][s])
             for s in range(streams_per_gpu)]
            for g in range(G)
        ]  # fmt: skip
        self.cur = -1
        self._set_ctx(0)
        t_alloc = self._open_phase("devices", t_layout)
        self.host_key = tuple(host_key)  # adopted: tensors whose host copies came with a handed-over region
        self.adopted = [] if host_inputs is None else host_inputs.adopt(self.host_key, lay, host_first or (), True)
        if self.adopted:  # a filled region of an earlier plan: its prefix kept, released by us as it was made
            region = PinnedRegion.adopted(drv, host_inputs.array, host_inputs.ptr, host_inputs.take(),
                                          host_inputs.pieces)  # fmt: skip
            self._regions.append(region)
            self.host_in = host_inputs.array
            t_mend = time.perf_counter()  # no buffer of ours may span two of its registered pieces
            spans = {(lay.host_offset[v], lay.nbytes[v]) for v in range(mg.n) if lay.host_region[v] == HOST_INPUT}
            if region.mend(spans):
                self.load_phases_s["mend"] = time.perf_counter() - t_mend
        else:
            self.host_in = self._host_alloc(lay.host_input_nbytes, write_combined=True)
        self.host_off = self._host_alloc(lay.host_offload_nbytes, write_combined=False)
        self.load_phases_s["alloc"] = time.perf_counter() - t_alloc
        self._host_base = [self._regions[0].ptr, self._regions[1].ptr]
        self._views: dict[int, object] = {}
        self._launchers: dict = {}
        n = mg.n
        t = time.perf_counter()
        self.owner = [lay.src_gpu[v] if lay.kind[v] == KIND_TRANSFER else lay.gpu[v] for v in range(n)]
        self.ev0, self.ev1 = [0] * n, [0] * n
        for v in range(n):
            self._set_ctx(self.owner[v])
            self.ev1[v] = drv.event()
            if device_start:
                self.ev0[v] = drv.event()
        self._events = [e for e in self.ev0 + self.ev1 if e]
        self.ref = []
        for g in range(G):
            self._set_ctx(g)
            self.ref.append(drv.event())
        if self.graphs:
            from cuda_kernels.launch import capture_stream

            for g in range(G):
                self._set_ctx(g)
                self._cap_streams.append(capture_stream())
        t = self._open_phase("events", t)
        self._work = [self._prepare(v) for v in range(n)]
        t = self._open_phase("vertices", t)
        self._pev = list(self.ev1)  # the event a vertex's completion is polled on (a group: its last member's)
        self.groups = None
        self.group_events = group_events_on(mg) if group_events is None else group_events
        self._untimed: set[int] = set()  # members of captured groups that record no end event of their own
        if (launch_groups_on(G) if groups is None else groups) and self.graphs and not device_start:
            self.groups = launch_groups(mg)
            for h, members in self.groups.members.items():
                self._work[h] = self._prepare_group(members)
                self._pev[h] = self.ev1[members[-1]]
        t = self._open_phase("groups", t)
        for g, cs in enumerate(self._cap_streams):  # graph uploads done before the first run
            self._set_ctx(g)
            drv.check(drv.cuStreamSynchronize(cs), "synchronizing graph uploads")
        self._open_phase("uploads", t)
        self._ref_host_ns = [0] * G
        self._in_flight: list[int] = []
        self._fl = None
        if native_poll:  # in flight at most: a vertex per compute stream, copy stream and peer link
            from turnip.runtime._poll import InFlight

            self._fl = InFlight(G * (streams_per_gpu + 2 + G) + 8, self._pev)
            self.poll = self._poll_native
        self._track = self._in_flight.append if self._fl is None else self._fl.add
        self._inputs = input_vertices(mg)
        self._written: set[int] = set()
        self.load_phases_s["open"] = time.perf_counter() - t_open - self.load_phases_s["alloc"]

    # ------------------------------------------------------------------ plan load
    def _open_phase(self, name: str, since: float) -> float:
        """Count the seconds from ``since`` to now as the open's part ``name`` (``open_phases_s``); now."""
        now = time.perf_counter()
        self.open_phases_s[name] = now - since
        return now

    def _ws_ptr(self, g: int, slot: int) -> int:
        """Slot ``slot``'s workspace on GPU ``g``: the top of the arena, one ``ws_slot`` range per slot, 256-byte
        aligned whatever the budget (cuBLASLt refuses a misaligned workspace: CUBLAS_STATUS_INVALID_VALUE)."""
        top = int(self.mg.budget_nbytes[g]) // 256 * 256  # tensors end below top - slots * ws_slot
        return self.base[g] + top - (slot + 1) * self.ws_slot if self.ws_slot else 0

    def _handles(self, g: int, lib: str | None) -> None:
        """Create the handles of library ``lib`` on every stream slot of GPU ``g`` (once)."""
        if lib is None or lib in self.sctx[g][0].handles:
            return
        self._set_ctx(g)
        for ctx in self.sctx[g]:
            if lib == "cudnn":
                from cuda_kernels.cudnn_sdpa import create_handle

                ctx.handles[lib] = create_handle(ctx.stream)
            else:
                from cuda_kernels.cublaslt import lt_handle_create

                ctx.handles[lib] = lt_handle_create()

    def _set_ctx(self, g: int) -> None:
        if g != self.cur:
            self.drv.check(self.drv.cuCtxSetCurrent(self.ctx[g]), f"cuCtxSetCurrent(gpu {g})")
            self.cur = g

    def _enable_peers(self) -> None:
        G, mg = self.mg.n_gpus, self.mg
        pairs = {(int(s), int(d)) for s, d, k in zip(mg.src_gpu, mg.gpu, mg.kind, strict=True) if k == KIND_TRANSFER}
        for s, d in pairs:
            if s == d or G < 2:
                continue
            for a, b in ((s, d), (d, s)):
                self.drv.enable_peer(self.ctx, self.devices, a, b)
        self.cur = -1

    def _host_alloc(self, nbytes: int, write_combined: bool) -> np.ndarray:
        """A host region (``turnip.runtime.hostmem``): pinned now, or plain memory pinned once written."""
        r = PinnedRegion(self.drv, nbytes, write_combined, self.host_register)
        self._regions.append(r)
        self.allocations += 1
        return r.array

    def view(self, b: int):
        """Typed device-array view of the buffer created by vertex ``b`` (built once, at load)."""
        x = self._views.get(b)
        if x is None:
            lay, mg = self.lay, self.mg
            g, off, nb = lay.gpu[b], lay.out_offset[b], lay.nbytes[b]
            self._set_ctx(g)
            x = _device_view(self.arenas[g], off, nb, mg.shape[b], NP_DTYPE[mg.dtype[b]])
            self.views_built += 1
            self._views[b] = x
        return x

    def _launcher(self, v: int):
        from cuda_kernels.kernels import prepare

        mg, lay = self.mg, self.lay
        in_shapes = tuple(tuple(mg.shape[b]) for b in lay.reads[v])
        dt = mg.dtype[v]
        # per GPU: a launcher holds function handles and library plans of the device it was prepared on
        key = (lay.gpu[v], mg.op[v], in_shapes, tuple(mg.shape[v]), dt, json.dumps(mg.params[v], sort_keys=True))
        lau = self._launchers.get(key)
        if lau is None:
            lau = self._launchers[key] = prepare(mg.op[v], in_shapes, mg.shape[v], dt, mg.params[v], gemm=self.gemm,
                                                 fast=self.fast, ws_nbytes=self.ws_slot)  # fmt: skip
        return lau

    def _prepare(self, v: int) -> tuple:
        """What ``submit`` needs for ``v``: ('r', cuLaunchKernel arguments...), ('l', library call),
        ('k', launcher, out, ins), ('h2d'|'d2h'|'p2p', args...), ('skip',)."""
        from cuda_kernels.launch import LibCall, RawLaunch

        lay = self.lay
        k, g = lay.kind[v], lay.gpu[v]
        if k == KIND_KERNEL:
            ins = [self.view(b) for b in lay.reads[v]]
            out = ins[0] if self.mg.op[v] == "sum_into" else self.view(v)
            self._set_ctx(g)
            lau = self._launcher(v)
            if not self.bound:
                if lau.path == "cublas" and self.mg.op[v] == "einsum":  # cuBLAS reads pointers only: cache them
                    out, ins = _Ptr(out), [_Ptr(x) for x in ins]
                return ("k", lau, out, ins)
            b = lau.bind(out, ins)
            if isinstance(b, LibCall):
                if b.ws_nbytes > self.ws_slot:
                    raise BackendError(f"{self.mg.label(v)} ({b.what}) needs {b.ws_nbytes} bytes of workspace; the "
                                       f"plan reserves {self.ws_slot} per stream slot: recompile with a larger "
                                       "workspace")  # fmt: skip
                self._handles(g, b.lib)
            raw = isinstance(b, RawLaunch)
            if self.graphs and (raw or b.capturable and (b.ws_nbytes == 0 or self.lib_graphs)):
                from cuda_kernels.launch import capture

                try:
                    ev = self.ev1[v] if self.graph_events else 0
                    tag = "G" if ev else "g"
                    if raw or b.lib is None and b.ws_nbytes == 0:
                        ex = capture(b, self.sctx[g][0], self._cap_streams[g], ev)
                        self._graph_execs.append(ex)
                        return (tag, ex, b)
                    # a library call uses its slot's handle, which may keep scratch of its own, and its
                    # slot's workspace: one graph per slot, so that a handle and a workspace only ever serve
                    # their own stream (as direct calls do)
                    execs = [capture(b, ctx, self._cap_streams[g], ev) for ctx in self.sctx[g]]
                    self._graph_execs.extend(execs)
                    return (tag + "s", execs, b)
                except RuntimeError as e:  # not capturable here: launch it directly
                    self.capture_failures.append(f"{self.mg.label(v)}: {e}")
            if isinstance(b, RawLaunch):
                return ("r", b.func, b.gx, b.gy, b.gz, b.bx, b.by, b.bz, b.shmem, b.params, b.keep)
            return ("l", b)
        nb = lay.nbytes[v]
        if k == KIND_INPUT and lay.resident[v]:
            return ("skip",)
        if k in (KIND_INPUT, KIND_RELOAD):
            host = self._host_base[lay.host_region[v]] + lay.host_offset[v]
            return ("h2d", self.base[g] + lay.out_offset[v], host, nb, self.copy_streams[g]["h2d"][1])
        if k == KIND_OFFLOAD:
            src = lay.reads[v][0]
            host = self._host_base[lay.host_region[v]] + lay.host_offset[v]
            return ("d2h", host, self.base[lay.gpu[src]] + lay.out_offset[src], nb, self.copy_streams[g]["d2h"][1])
        assert k == KIND_TRANSFER
        s, src = lay.src_gpu[v], lay.reads[v][0]
        return ("p2p", self.base[g] + lay.out_offset[v], self.ctx[g], self.base[s] + lay.out_offset[src],
                self.ctx[s], nb, self.copy_streams[s][("p2p", g)][1])  # fmt: skip

    def _prepare_group(self, members: list[int]) -> tuple:
        """What ``submit`` needs for a launch group: ('GG', graph, per slot?) when every member was captured
        (one graph of the members in order, each recording its end event; one per stream slot where a member
        uses its slot's library handle or workspace), else ('seq', members): each member's own launch in
        order on the head's slot, the last one's end event recorded after them."""
        from cuda_kernels.launch import capture_seq

        works = [self._work[m] for m in members]
        if not all(w[0] in ("g", "gs", "G", "Gs") for w in works):
            return ("seq", members, works[0])
        g = self.lay.gpu[members[0]]
        per_slot = any(w[0] in ("gs", "Gs") for w in works)
        self._set_ctx(g)
        tail = members[-1]
        evs = [self.ev1[m] if self.group_events or m == tail else 0 for m in members]
        try:
            execs = [capture_seq([(w[2], self.sctx[g][k], e) for w, e in zip(works, evs, strict=True)],
                                 self._cap_streams[g])
                     for k in (range(self.k) if per_slot else (0,))]  # fmt: skip
        except RuntimeError as e:
            self.capture_failures.append(f"launch group of {self.mg.label(members[0])}: {e}")
            return ("seq", members, works[0])
        self._graph_execs.extend(execs)
        self._untimed.update(m for m, e in zip(members, evs, strict=True) if not e)
        return ("GG", execs, per_slot)

    # ------------------------------------------------------------------ data
    def write_inputs(self, values: dict[int, np.ndarray], load_resident: bool = True) -> None:
        """Fill the pinned input region (by taskgraph input tensor); load resident inputs to the GPUs
        (``load_resident=False``: the host region only, safe from several threads; ``load_resident`` later)."""
        from turnip.runtime.layout import buffer_view

        mg, lay = self.mg, self.lay
        for t, vs in self._inputs.items():
            if t in values:
                v = vs[0]
                dst = buffer_view(self.host_in, lay.host_offset[v], mg.shape[v], mg.dtype[v])
                np.copyto(dst, np.asarray(values[t]).reshape(dst.shape), casting="same_kind")
                self._written.add(t)
        if load_resident:
            self.load_resident(values)

    def _copy_where(self, v: int) -> str:
        """For a failed copy's message: its bytes and host span (region, offset, the region's size and pieces)."""
        lay = self.lay
        r = lay.host_region[v]
        if r < 0 or r >= len(self._regions):
            return f" ({lay.nbytes[v]} bytes)"
        reg = self._regions[r]
        pieces = reg.pieces
        return (f" ({lay.nbytes[v]} bytes at byte {lay.host_offset[v]} of the host {'input' if r == 0 else 'offload'}"
                f" region of {reg.nbytes}, registered in {len(pieces) if pieces else 1} piece(s))")  # fmt: skip

    def pin_while_filling(self, writes) -> PiecePinner | None:
        """With a registered input region not yet pinned (unless ``TURNIP_PIN_WHILE_FILLING=0``): a ``PiecePinner``
        that pins it in pieces of about ``PIECE_NBYTES`` (cut where buffers start) while the caller's threads
        write ``writes`` ((byte offset in the region, bytes) each, announced to it as written); else None."""
        r = self._regions[0]
        if r.pinned or not pin_while_filling_on() or not writes:
            return None
        spans = register_spans(r.nbytes, [off for off, _ in writes], r.nbytes // PIECE_NBYTES)
        return PiecePinner(r, spans, writes, self.ctx[0], self.load_phases_s) if len(spans) > 1 else None

    def load_resident(self, tensors) -> None:
        """Taskgraph input ``tensors`` have their host copies filled (``host_in``): count them written and copy
        the resident ones to their GPUs (synchronous). A registered input region is pinned first, at its first
        written tensors (the load then counts the pinning, and the copies run at the link's speed, not the
        pageable path's); the GPUs' copies run on a thread per GPU (the driver call releases the GIL), so several
        GPUs load at once. Unknown tensors are ignored. Seconds spent pinning and copying add up in
        ``load_phases_s``."""
        mg, lay = self.mg, self.lay
        jobs: dict[int, list] = {}
        known = False
        for t in tensors:
            vs = self._inputs.get(t)
            if vs is None:
                continue
            known = True
            self._written.add(t)
            for v in vs:
                if lay.resident[v]:
                    jobs.setdefault(lay.gpu[v], []).append(v)
        if not known:
            return
        t0 = time.perf_counter()
        self._regions[0].pin()
        t1 = time.perf_counter()
        drv, host = self.drv, self._host_base[HOST_INPUT]

        def copy(g: int) -> None:
            for v in jobs[g]:
                drv.check(drv.cuMemcpyHtoD_v2(self.base[g] + lay.out_offset[v], host + lay.host_offset[v],
                                              lay.nbytes[v]), f"loading resident input {mg.label(v)}")  # fmt: skip

        self._each_gpu(jobs, copy)
        ph = self.load_phases_s
        ph["pin"] = ph.get("pin", 0.0) + t1 - t0
        ph["resident"] = ph.get("resident", 0.0) + time.perf_counter() - t1

    def read_outputs(self, only=None, views: bool = False) -> dict[int, np.ndarray]:
        """Every output tensor's value (``only``: just these tensors); ``views``: an offloaded one as a view of the
        pinned offload region (no copy: valid until the next run or ``close``). Outputs on the GPUs are copied
        one after another, or with ``TURNIP_PARALLEL_READS=1`` (off until timed on GPUs) on a thread per GPU."""
        from cuda_kernels._numba import to_host
        from turnip.runtime.layout import buffer_view

        out, jobs = {}, {}
        parallel = parallel_reads_on() and self.mg.n_gpus > 1
        for t, o, on_host in output_sources(self.mg):
            if only is not None and t not in only:
                continue
            if on_host:
                x = buffer_view(self.host_off, self.lay.host_offset[o], self.mg.shape[o], self.mg.dtype[o])
                out[t] = x if views else x.copy()
            elif parallel:
                out[t] = x = np.empty(self.mg.shape[o], NP_DTYPE[self.mg.dtype[o]])
                jobs.setdefault(self.lay.gpu[o], []).append((o, x))
            else:
                self._set_ctx(self.lay.gpu[o])
                out[t] = to_host(self.view(o))
        drv, lay = self.drv, self.lay

        def copy(g: int) -> None:
            for o, x in jobs[g]:
                drv.check(drv.cuMemcpyDtoH_v2(x.ctypes.data, self.base[g] + lay.out_offset[o], x.nbytes),
                          f"reading output {self.mg.label(o)}")  # fmt: skip

        self._each_gpu(jobs, copy)
        return out

    def _each_gpu(self, jobs: dict, fn) -> None:
        """``fn(g)`` for every GPU ``g`` of ``jobs``, in that GPU's context: on this thread for one GPU (its
        context set as the backend tracks it), else on a thread per GPU (the driver's copies release the GIL)."""
        if len(jobs) <= 1:
            for g in jobs:
                self._set_ctx(g)
                fn(g)
            return
        drv = self.drv

        def run(g: int) -> None:
            drv.check(drv.cuCtxSetCurrent(self.ctx[g]), f"cuCtxSetCurrent(gpu {g})")
            fn(g)

        thread_map(run, sorted(jobs), len(jobs))

    def carry(self, pairs, rows: tuple[int, int] | None = None) -> None:
        """Between runs: each (output tensor, input tensor) pair's output becomes that input's value for the
        next run: one device copy into its resident GPU buffer (a host copy when the output was offloaded or
        the input streams from the host). A training step's new adapters and moments never leave the GPU.
        ``rows``: (first, count) of the leading dimension, the only rows that differ (a decode step's cache
        block: its one written slot): just those are copied."""
        from turnip.runtime.layout import HOST_OFFLOAD

        lay, drv = self.lay, self.drv
        src = {t: (o, on_host) for t, o, on_host in output_sources(self.mg)}
        for t_out, t_in in pairs:
            o, on_host = src[t_out]
            vs = self._inputs[t_in]
            nb = int(lay.nbytes[vs[0]])
            whole = rows is not None and carried_rows(self.mg, o, vs[0], rows)  # o holds just those rows
            if nb != int(lay.nbytes[o]) and not whole:
                raise BackendError(f"carry: output {self.mg.label(o)} has {lay.nbytes[o]} bytes, input "
                                   f"{self.mg.label(vs[0])} {nb}")  # fmt: skip
            skip, nb = row_range(self.mg.shape[vs[0]], nb, rows)
            at = 0 if whole else skip  # where the rows start in the output
            if on_host:
                host = self._host_base[HOST_OFFLOAD] + lay.host_offset[o] + at
            else:
                self._set_ctx(lay.gpu[o])
                dev = self.base[lay.gpu[o]] + lay.out_offset[o] + at
            for v in vs:
                if lay.resident[v]:
                    dst = self.base[lay.gpu[v]] + lay.out_offset[v] + skip
                    self._set_ctx(lay.gpu[v])
                    r = drv.cuMemcpyHtoD_v2(dst, host, nb) if on_host else drv.cuMemcpyDtoD_v2(dst, dev, nb)
                    drv.check(r, f"carrying {self.mg.label(o)} into {self.mg.label(v)}")
            if not all(lay.resident[v] for v in vs):
                dst = self._host_base[HOST_INPUT] + lay.host_offset[vs[0]] + skip
                if on_host:
                    ctypes.memmove(dst, host, nb)
                else:
                    drv.check(drv.cuMemcpyDtoH_v2(dst, dev, nb), f"carrying {self.mg.label(o)} to the host")
        for g in range(self.mg.n_gpus):  # device-to-device copies do not wait for the host: finish them here
            self._set_ctx(g)
            drv.check(drv.cuCtxSynchronize(), "synchronizing after carry")

    # ------------------------------------------------------------------ runs
    def begin_run(self, seed: int | None = None) -> None:
        check_ready(self)
        for r in self._regions:  # registered regions are pinned in place once, after their first writes
            r.pin()
        drv = self.drv
        for g in range(self.mg.n_gpus):
            self._set_ctx(g)
            drv.check(drv.cuCtxSynchronize(), f"synchronizing gpu {g}")
            drv.check(drv.cuEventRecord(self.ref[g], self.hstreams[g][0]), "cuEventRecord")
            while drv.cuEventQuery(self.ref[g]) == NOT_READY:  # spin: a blocking wait wakes up late
                pass
            self._ref_host_ns[g] = time.perf_counter_ns()
        self._forget_in_flight()

    def set_device_start(self, on: bool) -> None:
        """Record a start event before each vertex from the next run on (``on``), or not (runs then cost the
        host one driver call less per vertex and start times are issue times). Only a plan loaded with
        ``device_start=True`` has the events."""
        if on and not any(self.ev0):
            raise BackendError("this plan was loaded without start events; open it with device_start=True")
        self.device_start = bool(on)

    def submit(self, cmd, w=None) -> None:
        """Issue ``cmd`` (its vertex's prepared work, or ``w``)."""
        v = cmd.v
        g = cmd.gpu
        if g != self.cur:
            self.drv.cuCtxSetCurrent(self.ctx[g])
            self.cur = g
        if w is None:
            w = self._work[v]
        tag = w[0]
        if tag == "GG":  # a launch group captured whole: its graph records every member's end event
            s = cmd.stream
            r = self._graph_launch(w[1][s] if w[2] else w[1][0], self.hstreams[g][s])
            if r:
                raise VertexFailed(v, self.mg.label(v), CudaError(f"cuGraphLaunch: {self.drv.error_name(r)}"))
            self._track(v)
            return
        if tag == "seq":
            return self._submit_seq(cmd, w[1], w[2])
        if tag == "G" or tag == "Gs":  # the graph records the end event itself: one driver call
            s = cmd.stream
            r = self._graph_launch(w[1] if tag == "G" else w[1][s], self.hstreams[g][s])
            if r:
                raise VertexFailed(v, self.mg.label(v), CudaError(f"cuGraphLaunch: {self.drv.error_name(r)}"))
            self._track(v)
            return
        drv = self.drv
        if tag == "g" or tag == "gs":
            h = self.hstreams[g][cmd.stream]
            r = drv.cuEventRecord(self.ev0[v], h) if self.device_start else SUCCESS
            if r == SUCCESS:
                r = self._graph_launch(w[1] if tag == "g" else w[1][cmd.stream], h)
            if r != SUCCESS:
                raise VertexFailed(v, self.mg.label(v), CudaError(f"cuGraphLaunch: {drv.error_name(r)}"))
        elif tag == "r":
            h = self.hstreams[g][cmd.stream]
            r = drv.cuEventRecord(self.ev0[v], h) if self.device_start else SUCCESS
            if r == SUCCESS:
                r = self._cu_launch(w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], h, w[9], None)
            if r != SUCCESS:
                raise VertexFailed(v, self.mg.label(v), CudaError(f"cuLaunchKernel: {drv.error_name(r)}"))
        elif tag == "l" or tag == "k":
            h = self.hstreams[g][cmd.stream]
            r = drv.cuEventRecord(self.ev0[v], h) if self.device_start else SUCCESS
            try:
                if tag == "l":
                    w[1](self.sctx[g][cmd.stream])
                else:
                    w[1](self.streams[g][cmd.stream], w[2], w[3])
            except Exception as e:
                raise VertexFailed(v, self.mg.label(v), e) from e
            if r != SUCCESS:
                raise VertexFailed(v, self.mg.label(v), CudaError(f"cuEventRecord: {drv.error_name(r)}"))
        else:
            h = w[-1] if tag != "skip" else self.hstreams[g][cmd.stream]
            r = drv.cuEventRecord(self.ev0[v], h) if self.device_start else SUCCESS
            if r != SUCCESS:
                pass
            elif tag == "h2d":
                r = drv.cuMemcpyHtoDAsync_v2(w[1], w[2], w[3], h)
            elif tag == "d2h":
                r = drv.cuMemcpyDtoHAsync_v2(w[1], w[2], w[3], h)
            elif tag == "p2p":
                r = drv.cuMemcpyPeerAsync(w[1], w[2], w[3], w[4], w[5], h)
            if r != SUCCESS:
                raise VertexFailed(v, self.mg.label(v) + self._copy_where(v), CudaError(drv.error_name(r)))
        if r == SUCCESS:
            r = drv.cuEventRecord(self.ev1[v], h)
        if r != SUCCESS:
            raise VertexFailed(v, self.mg.label(v), CudaError(f"cuEventRecord: {drv.error_name(r)}"))
        self._track(v)

    def _submit_seq(self, cmd, members: list[int], head_work: tuple) -> None:
        """A launch group not captured whole: each member's own launch, in order on the head's slot (each
        records its end event), tracked as the head, whose completion is polled on the last member's event."""
        from turnip.sched.events import Launch

        track, self._track = self._track, _untracked
        try:
            for m in members:
                self.submit(Launch(m, cmd.gpu, cmd.stream), head_work if m == cmd.v else None)
        finally:
            self._track = track
        track(cmd.v)

    def poll(self, timeout_s: float) -> list[int]:
        query, ev1, fl = self.drv.cuEventQuery, self._pev, self._in_flight
        deadline = 0
        while True:
            done = None
            for v in fl:
                r = query(ev1[v])
                if r == SUCCESS:
                    if done is None:
                        done = [v]
                    else:
                        done.append(v)
                elif r != NOT_READY:
                    raise VertexFailed(v, self.mg.label(v), CudaError(self.drv.error_name(r)))
            if done is not None:
                for v in done:
                    fl.remove(v)
                return done
            t = time.perf_counter_ns()
            if not deadline:
                deadline = t + int(timeout_s * 1e9)
            elif t > deadline:
                return []

    def _poll_native(self, timeout_s: float) -> list[int]:
        """``poll`` with the event queries in compiled code (``turnip.runtime._poll``)."""
        scan, deadline = self._fl.scan, 0
        while True:
            done, bad, code = scan()
            if done:
                return done
            if bad >= 0:
                raise VertexFailed(bad, self.mg.label(bad), CudaError(self.drv.error_name(code)))
            t = time.perf_counter_ns()
            if not deadline:
                deadline = t + int(timeout_s * 1e9)
            elif t > deadline:
                return []

    def _forget_in_flight(self) -> None:
        self._in_flight.clear()
        if self._fl is not None:
            self._fl.clear()

    def in_flight(self) -> list[int]:
        return list(self._in_flight) if self._fl is None else self._fl.tolist()

    def abort(self) -> None:
        """Wait for everything enqueued to finish (errors ignored); forget the in-flight vertices."""
        for g in range(self.mg.n_gpus):
            self.drv.cuCtxSetCurrent(self.ctx[g])
            self.drv.cuCtxSynchronize()
        self.cur = -1
        self._forget_in_flight()

    def end_run(self, t0_ns: int) -> tuple[np.ndarray, np.ndarray]:
        """Device start/end of every vertex from its events (-1 where the driver gives no time: the loop
        then uses its host times); ``timing_failures`` lists (vertex, CUDA error) for those."""
        n, drv = self.mg.n, self.drv
        start, end = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        ms = ctypes.c_float()
        ref_ms = ctypes.byref(ms)
        self.timing_failures = []
        resident = self.lay.resident
        untimed = self._untimed
        for v in range(n):
            if resident[v] or v in untimed:  # loaded with the plan (done before the run starts); a group member
                continue  # without an end event of its own (``group_events=False``): the loop places it
            g = self.owner[v]
            base = self._ref_host_ns[g] - t0_ns
            for ev, out in ((self.ev0[v] if self.device_start else 0, start), (self.ev1[v], end)):
                if not ev:  # no start event: the driver loop uses the issue time
                    continue
                r = drv.cuEventElapsedTime(ref_ms, self.ref[g], ev)
                if r == SUCCESS:
                    out[v] = base + int(ms.value * 1e6)
                elif len(self.timing_failures) < 100:
                    self.timing_failures.append((v, drv.error_name(r)))
        return start, end

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release everything the plan holds, in an order that never frees what queued work could still
        touch: wait for every GPU; destroy the graphs, the library handles, the events and the capture
        streams; drop the views and bound launches; free the arenas (numba's pending deallocations are
        flushed now, not at interpreter exit) and finally the pinned host regions. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort()
        from cuda_kernels.launch import destroy_graph, driver

        for ex in self._graph_execs:
            destroy_graph(ex)
        self._graph_execs = []
        for g, row in enumerate(self.sctx):
            self._set_ctx(g)
            for ctx in row:
                for lib, hd in ctx.handles.items():
                    _destroy_handle(lib, hd)
                ctx.handles.clear()
        for e in self._events + self.ref:
            self.drv.cuEventDestroy_v2(e)
        self._events, self.ref = [], []
        for g, cs in enumerate(self._cap_streams):
            self._set_ctx(g)
            driver().cuStreamDestroy_v2(cs)
        self._cap_streams = []
        self._work, self._views, self._launchers, self.sctx = [], {}, {}, []
        self.host_in = self.host_off = None
        gc.collect()  # views caught in reference cycles would keep an arena alive past the flush below
        for g in range(len(self.arenas)):
            with self.cuda.gpus[self.devices[g]]:
                self.arenas[g] = None
                self.cuda.current_context().deallocations.clear()
        for ctx, ptr in self._device_ptrs:  # every GPU is idle (abort synchronised them): free the arenas
            self.drv.cuCtxSetCurrent(ctx)
            self.drv.cuMemFree_v2(ptr)
        self._device_ptrs = []
        self.arenas, self.streams, self.copy_streams = [], [], []
        self.cur = -1
        for r in self._regions:  # a detached region has nothing left to release
            r.release()
        self._regions = []

    def detach_host_inputs(self):
        """The pinned input region, handed over (``HostInputs``) for the next backend to adopt (it then frees
        it; else whoever holds it calls ``free``): its prefix (``host_first``) keeps its values. Waits for
        every GPU first; this backend runs no more (close it)."""
        from turnip.runtime.layout import HostInputs

        self.abort()
        array, ptr, release, pieces = self._regions[0].hand_over()
        self.host_in = None
        return HostInputs(array, self.host_key, ptr, release, pieces)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _destroy_handle(lib: str, handle) -> None:
    if lib == "cudnn":
        import cudnn

        cudnn.destroy_handle(handle)
    elif lib == "cublaslt":
        from cuda_kernels.cublaslt import lt_handle_destroy

        lt_handle_destroy(handle)


class _Ptr:
    """A device array reduced to the one attribute a cuBLAS launcher reads, computed once."""

    __slots__ = ("device_ctypes_pointer", "shape", "dtype")

    def __init__(self, arr):
        self.device_ctypes_pointer = arr.device_ctypes_pointer
        self.shape, self.dtype = arr.shape, arr.dtype


class _DeviceMemory:
    """Device memory the backend allocates and frees itself (``cuMemAlloc``/``cuMemFree`` at close), shown to
    numba through the CUDA array interface: numba's arrays over it borrow it and never free it, so a view
    that outlives the plan (a reference cycle, a cache) cannot keep the arena's memory alive."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3,
                                         "strides": None}  # fmt: skip


def _arena(cuda, drv, nbytes: int, owned: list) -> object:
    """A uint8 device array of ``nbytes`` in the current context; (context, pointer) is appended to
    ``owned`` for ``close`` to free."""
    ptr = drv.device_alloc(max(1, nbytes))
    owned.append((drv.current_context(), ptr))
    return cuda.as_cuda_array(_DeviceMemory(ptr, nbytes))


def _device_view(arena, off: int, nbytes: int, shape, dtype):
    """A C-contiguous typed DeviceNDArray over ``arena[off:off+nbytes]`` (no copy)."""
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    strides, acc = [], dtype.itemsize
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    try:
        return DeviceNDArray(shape, tuple(reversed(strides)), dtype, gpu_data=arena.gpu_data.view(off, off + nbytes))
    except (AttributeError, TypeError):
        return arena[off : off + nbytes].view(dtype).reshape(shape)
