"""The CPU backend: numpy kernels on byte arenas laid out exactly like the GPU arenas, real threads.

State it owns: per virtual GPU one ``uint8`` arena of exactly the budget; a host input region and a host
offload region (``turnip.runtime.layout``); per vertex a closure over prebuilt typed views (built here,
at plan load: a run creates no view and allocates no buffer); one worker thread per stream slot
(``streams_per_gpu`` per GPU), each with its own queue, so vertices on different slots really run at once;
one completion queue read by the driver loop. Tiles are typed fp16, bf16 (``ml_dtypes.bfloat16``), fp32 or
int32 (``weights.NP_OF``); the numpy references compute half precisions in float32.

``poison=True`` fills the arenas and the offload region with 0xFF bytes (NaN as floats) before every
run, so a vertex that reads bytes nothing wrote in this run gives NaN. Chaos (``chaos=p``): with
probability ``p`` a vertex sleeps a random time (up to ``chaos_max_s``) before running and/or before
reporting its completion, drawn per run from ``begin_run(seed)``. Different seeds give different valid
orders, so a memgraph with a missing dependency or an overlapping address gives wrong numbers here.
Every arena and host region lies between two guard regions of a fixed pattern that no view covers
(``guards_intact`` checks them).

Invariants: a slot's queue holds at most one vertex (the scheduler gives a slot to one vertex until its
completion); ``_n_in_flight`` counts submitted vertices whose completion the loop has not read.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL, KIND_OFFLOAD, KIND_RELOAD, KIND_TRANSFER, MemGraph
from turnip.reference import run_reference
from turnip.runtime.backend import check_ready
from turnip.runtime.errors import VertexFailed
from turnip.runtime.layout import HOST_INPUT, carried_rows, input_vertices, output_sources, plan_layout
from turnip.runtime.weights import NP_OF

GUARD_NBYTES = 4096  # before and after every arena and host region
GUARD_BYTE = 0xA5


class CpuBackend:
    name = "cpu"

    def __init__(
        self,
        mg: MemGraph,
        streams_per_gpu: int = 5,
        chaos: float = 0.0,
        chaos_max_s: float = 0.002,
        poison: bool = False,
        groups: bool | None = None,
        host_first: list[int] | None = None,
        host_key: tuple = (),
        host_reserve: int = 0,
        host_inputs=None,
    ):
        self.mg, self.k, self.chaos, self.chaos_max_s = mg, streams_per_gpu, chaos, chaos_max_s
        self.poison = poison
        from turnip.sched.groups import launch_groups, launch_groups_on

        on = launch_groups_on(mg.n_gpus) if groups is None else groups
        self.groups = launch_groups(mg) if on else None
        self._members = self.groups.members if self.groups is not None else {}
        self.allocations = 0
        self.views_built = 0
        self.lay = lay = plan_layout(mg, host_first, host_reserve)
        self._whole: list[np.ndarray] = []  # each allocation with its guard regions
        self.arenas = [self._alloc(int(b)) for b in mg.budget_nbytes]
        self.host_key = tuple(host_key)  # adopted: tensors whose host copies came with a handed-over region
        self.adopted = host_inputs.adopt(self.host_key, lay, host_first or ()) if host_inputs is not None else []
        host_in = host_inputs.array if self.adopted else self._alloc(lay.host_input_nbytes)
        self.host = [host_in, self._alloc(lay.host_offload_nbytes)]
        self._buf = {}
        self._fn = [self._closure(v) for v in range(mg.n)]
        n = mg.n
        self._pre, self._post = [0.0] * n, [0.0] * n
        self._start, self._end = [0] * n, [0] * n
        self._running = bytearray(n)
        self._n_in_flight = 0
        self._written: set[int] = set()
        self._inputs = input_vertices(mg)
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._queues = [queue.SimpleQueue() for _ in range(mg.n_gpus * streams_per_gpu)]
        k = streams_per_gpu
        self._threads = [
            threading.Thread(target=self._worker, args=(q,), name=f"turnip-cpu-{i // k}.{i % k}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    # ------------------------------------------------------------------ plan load
    def _alloc(self, nbytes: int) -> np.ndarray:
        """``nbytes`` zeros between two guard regions of ``GUARD_NBYTES`` filled with ``GUARD_BYTE`` (outside
        the returned view: every view the kernels use lies within it)."""
        self.allocations += 1
        whole = np.zeros(nbytes + 2 * GUARD_NBYTES, dtype=np.uint8)  # pages of zeros mapped lazily, as before
        whole[:GUARD_NBYTES] = whole[GUARD_NBYTES + nbytes :] = GUARD_BYTE
        self._whole.append(whole)
        return whole[GUARD_NBYTES : GUARD_NBYTES + nbytes]

    def guards_intact(self) -> bool:
        """No byte before or after an arena or host region was written (a test checks it after runs)."""
        return all((w[:GUARD_NBYTES] == GUARD_BYTE).all() and (w[len(w) - GUARD_NBYTES :] == GUARD_BYTE).all()
                   for w in self._whole)  # fmt: skip

    def _view(self, mem: np.ndarray, off: int, v: int) -> np.ndarray:
        self.views_built += 1
        return _typed_view(mem, off, self.mg.shape[v], self.mg.dtype[v])

    def buf(self, b: int) -> np.ndarray:
        """Typed view of the buffer created by vertex ``b`` in its GPU's arena (built once)."""
        x = self._buf.get(b)
        if x is None:
            x = self._buf[b] = self._view(self.arenas[self.lay.gpu[b]], self.lay.out_offset[b], b)
        return x

    def _host_view(self, v: int) -> np.ndarray:
        return self._view(self.host[self.lay.host_region[v]], self.lay.host_offset[v], v)

    def _closure(self, v: int):
        lay, mg = self.lay, self.mg
        k = lay.kind[v]
        if k == KIND_INPUT and lay.resident[v]:
            return None  # loaded once by write_inputs
        if k in (KIND_INPUT, KIND_RELOAD):
            return _Copy(self.buf(v), self._host_view(v))
        if k == KIND_OFFLOAD:
            return _Copy(self._host_view(v), self.buf(lay.reads[v][0]))
        if k == KIND_TRANSFER:
            return _Copy(self.buf(v), self.buf(lay.reads[v][0]))
        assert k == KIND_KERNEL
        ins = [self.buf(b) for b in lay.reads[v]]
        if mg.op[v] == "sum_into":
            return _Kernel("sum_into", ins, mg.params[v], None)
        return _Kernel(mg.op[v], ins, mg.params[v], self.buf(v))

    def inject(self, v: int, fn) -> None:
        """Run ``fn()`` instead of vertex ``v``'s work (a test hook: faults, slow vertices)."""
        self._fn[v] = fn

    # ------------------------------------------------------------------ data
    def write_inputs(self, values: dict[int, np.ndarray], load_resident: bool = True) -> None:
        """Fill the host input region (by taskgraph input tensor); then load resident inputs into arenas
        (``load_resident=False``: the host region only, safe from several threads; ``load_resident`` later)."""
        for t, vs in self._inputs.items():
            if t in values:
                v = vs[0]
                dst = _typed_view(self.host[HOST_INPUT], self.lay.host_offset[v], self.mg.shape[v], self.mg.dtype[v])
                dst[...] = np.asarray(values[t]).reshape(dst.shape)
                self._written.add(t)
        if load_resident:
            self.load_resident(values)

    @property
    def host_in(self) -> np.ndarray:
        """The host input region (bytes): ``weights.write_random_inputs`` fills it straight."""
        return self.host[HOST_INPUT]

    def load_resident(self, tensors) -> None:
        """Taskgraph input ``tensors`` have their host copies filled: count them written and copy the
        resident ones into their arenas (unknown tensors are ignored)."""
        for t in tensors:
            vs = self._inputs.get(t)
            if vs is not None:
                self._written.add(t)
                for v in vs:
                    if self.lay.resident[v]:
                        _Copy(self.buf(v), self._host_view(v))()

    def read_outputs(self, only=None, views: bool = False) -> dict[int, np.ndarray]:
        """Every output tensor's value (``only``: just these tensors); ``views``: an offloaded one as a view of the
        host region (no copy: valid until the next run or ``close``)."""
        out = {}
        for t, o, on_host in output_sources(self.mg):
            if only is None or t in only:
                x = self._host_view(o) if on_host else self.buf(o)
                out[t] = x if views and on_host else x.copy()
        return out

    def carry(self, pairs, rows: tuple[int, int] | None = None) -> None:
        """Between runs: each (output tensor, input tensor) pair's output becomes that input's value for the
        next run (copied into its resident GPU buffer, else its host copy), without a trip through Python
        arrays: a training step's new adapters and Adam moments feed the next step. ``rows``: (first, count)
        of the leading dimension, the only rows that differ: just those are copied (from an output of
        ``count`` rows, the whole output: a decode step's new rows into their cache block)."""
        src = {t: (o, on_host) for t, o, on_host in output_sources(self.mg)}
        sl = slice(None) if rows is None else slice(rows[0], rows[0] + rows[1])
        for t_out, t_in in pairs:
            o, on_host = src[t_out]
            whole = rows is not None and carried_rows(self.mg, o, self._inputs[t_in][0], rows)
            x = (self._host_view(o) if on_host else self.buf(o))[slice(None) if whole else sl]
            vs = self._inputs[t_in]
            for v in vs:
                if self.lay.resident[v]:
                    self.buf(v)[sl] = x
            self._host_view(vs[0])[sl] = x  # also the host copy: ``poison`` reloads resident inputs from it

    # ------------------------------------------------------------------ runs
    def begin_run(self, seed: int | None = None) -> None:
        check_ready(self)
        n = self.mg.n
        if self.chaos > 0:
            rng = np.random.default_rng(seed)
            hit = rng.random((2, n)) < self.chaos
            d = np.where(hit, rng.random((2, n)) * self.chaos_max_s, 0.0)
            self._pre, self._post = d[0].tolist(), d[1].tolist()
        if self.poison:  # every byte a run did not write reads as NaN (or a huge integer)
            for a in self.arenas:
                a.fill(0xFF)
            self.host[1].fill(0xFF)
            self.load_resident(list(self._written))  # the resident inputs again, from their host copies
        while not self._done.empty():  # stale completions of an aborted run
            self._done.get_nowait()

    def submit(self, cmd) -> None:
        v = cmd.v
        self._running[v] = 1
        self._n_in_flight += 1
        self._queues[cmd.gpu * self.k + cmd.stream].put(v)

    def poll(self, timeout_s: float) -> list[int]:
        q = self._done
        try:
            items = [q.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(q.get_nowait())
            except queue.Empty:
                break
        out, failed = [], None
        for v, err in items:
            self._running[v] = 0
            self._n_in_flight -= 1
            if err is not None and failed is None:
                failed = (v, err)
            out.append(v)
        if failed is not None:
            raise VertexFailed(failed[0], self.mg.label(failed[0]), failed[1])
        return out

    def in_flight(self) -> list[int]:
        return [v for v in range(self.mg.n) if self._running[v]]

    def abort(self, timeout_s: float = 30.0) -> None:
        """Wait for in-flight vertices to finish (their results are dropped)."""
        deadline = time.monotonic() + timeout_s
        while self._n_in_flight > 0 and time.monotonic() < deadline:
            try:
                v, _ = self._done.get(timeout=0.05)
            except queue.Empty:
                continue
            self._running[v] = 0
            self._n_in_flight -= 1

    def end_run(self, t0_ns: int) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self._start, dtype=np.int64) - t0_ns, np.asarray(self._end, dtype=np.int64) - t0_ns

    def _worker(self, q: queue.SimpleQueue) -> None:
        fns, done, clock, sleep, members = self._fn, self._done, time.perf_counter_ns, time.sleep, self._members
        start, end = self._start, self._end
        while True:
            v = q.get()
            if v is None:
                return
            if self._pre[v]:
                sleep(self._pre[v])
            err = None
            for u in members.get(v, (v,)):  # a launch group: its members one after another
                t = clock()
                try:
                    f = fns[u]
                    if f is not None:
                        f()
                except BaseException as e:  # reported to the loop, which stops the run naming v
                    err = e if u == v else RuntimeError(f"launch group member {self.mg.label(u)}: {e!r}")
                end[u] = clock()
                start[u] = t
                if err is not None:
                    break
            if self._post[v]:
                sleep(self._post[v])
            done.put((v, err))

    # ------------------------------------------------------------------ teardown
    def detach_host_inputs(self):
        """The host input region, handed over (``HostInputs``) for the next backend to adopt: its prefix
        (``host_first``) keeps its values; this backend runs no more (close it)."""
        from turnip.runtime.layout import HostInputs

        h = HostInputs(self.host[HOST_INPUT], self.host_key)
        self.host[HOST_INPUT] = None
        return h

    def close(self) -> None:
        """Stop and join every worker; drop the arenas. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort(timeout_s=5.0)
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self.arenas, self.host, self._buf, self._fn, self._whole = [], [], {}, [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _typed_view(mem: np.ndarray, off: int, shape, dtype: str) -> np.ndarray:
    """Typed view of ``mem[off:]`` (a uint8 arena or host region): ``layout.buffer_view`` with bf16 too."""
    dt = np.dtype(NP_OF[dtype])
    return mem[off : off + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)


class _Copy:
    __slots__ = ("dst", "src")

    def __init__(self, dst: np.ndarray, src: np.ndarray):
        self.dst, self.src = dst, src

    def __call__(self) -> None:
        np.copyto(self.dst, self.src)


class _Kernel:
    __slots__ = ("op", "ins", "params", "out")

    def __init__(self, op: str, ins: list, params: dict, out: np.ndarray | None):
        self.op, self.ins, self.params, self.out = op, ins, params, out

    def __call__(self) -> None:
        r = run_reference(self.op, self.ins, self.params)
        if self.out is not None:
            self.out[...] = r.reshape(self.out.shape)
