"""Bound launches: everything a vertex's launch needs, computed once at plan load.

A launcher (``cuda_kernels.kernels.prepare``) binds to fixed device pointers (the vertex's output and
operands in the plan's arena) and returns one of:

``RawLaunch``  the arguments of one ``cuLaunchKernel`` call except the stream: function handle (a
               ``CUfunction`` or ``CUkernel`` as an int), grid, block, dynamic shared memory and the packed
               kernel parameters (a ``void*[]`` whose entries point at ctypes values kept alive in ``keep``).
               The runtime issues it with ``launch_raw(lib, raw, stream)``: one driver call, no Python
               objects created.
``LibCall``    a library call (cuBLASLt, cuDNN, memcpy chains) that needs per-stream state: called as
               ``call(ctx)`` with the stream slot's ``StreamContext`` (stream handle, library handles,
               workspace pointer and size).

Either can be captured once into a CUDA graph (``capture``) and replayed with one ``cuGraphLaunch``: a
few microseconds of host time whatever it holds (a ``cublasLtMatmul`` call alone costs 12-18 µs of host
time, a ctypes ``cuLaunchKernel`` about 8). A graph fixes everything it was captured with: pointers,
library handles, the workspace. Replays of one graph execute one after another.

Nothing here imports numba or CuPy; ``driver()`` opens ``libcuda`` through ctypes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import NamedTuple

_P = ctypes.c_void_p
_U = ctypes.c_uint


class RawLaunch(NamedTuple):
    func: int
    gx: int
    gy: int
    gz: int
    bx: int
    by: int
    bz: int
    shmem: int
    params: object  # ctypes array of void* (or None for a kernel without parameters)
    keep: object  # the ctypes values ``params`` points at


def pack_params(values: list) -> tuple[object, list]:
    """A ``void*[]`` pointing at each ctypes value (ints become 8-byte ``c_int64``)."""
    cvals = [v if isinstance(v, ctypes._SimpleCData) else ctypes.c_int64(int(v)) for v in values]
    arr = (_P * max(1, len(cvals)))(*[ctypes.addressof(c) for c in cvals])
    return arr, cvals


def raw_launch(func: int, grid, block, params: list, shmem: int = 0) -> RawLaunch:
    """Bind a kernel to fixed parameters. ``params``: ctypes values or ints (packed as 8 bytes)."""
    g = tuple(grid) + (1,) * (3 - len(tuple(grid)))
    b = tuple(block) + (1,) * (3 - len(tuple(block)))
    arr, keep = pack_params(params)
    return RawLaunch(int(func), *map(int, g), *map(int, b), int(shmem), arr, keep)


@dataclass(slots=True)
class StreamContext:
    """Per stream slot state a ``LibCall`` may use: raw stream, workspace inside the plan's arena, and
    library handles bound to this stream (created once by the runtime, on first need at plan load).
    ``handle_stream``: where the handles are bound to another stream than ``stream`` (a capture, ``capture``),
    that stream; a call whose library binds its handle to a stream (cuDNN) moves it to ``stream`` for the
    call and back after it."""

    stream: int  # CUstream as an int
    ws_ptr: int = 0  # this slot's workspace (device pointer) and its size
    ws_nbytes: int = 0
    handles: dict = field(default_factory=dict)  # library name -> handle bound to ``stream``
    numba_stream: object = None
    handle_stream: int = 0


class LibCall:
    """A prebound library call: ``call(ctx)``. ``ws_nbytes`` is the workspace it needs from its slot;
    ``capturable``: it enqueues on ``ctx.stream`` only (no handle bound to another stream), so ``capture``
    may record it; ``lib``: the library handle it takes from ``ctx.handles`` ('cudnn', 'cublaslt' or None)."""

    __slots__ = ("fn", "ws_nbytes", "what", "capturable", "lib")

    def __init__(self, fn, ws_nbytes: int = 0, what: str = "", capturable: bool = False, lib: str | None = None):
        self.fn, self.ws_nbytes, self.what, self.capturable, self.lib = fn, int(ws_nbytes), what, capturable, lib

    def __call__(self, ctx: StreamContext) -> None:
        self.fn(ctx)


_DRIVER = None
_PP = ctypes.POINTER(_P)
_SIGNATURES = {
    "cuLaunchKernel": [_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P],
    "cuStreamCreate": [_PP, _U],
    "cuStreamDestroy_v2": [_P],
    "cuStreamSynchronize": [_P],
    "cuStreamBeginCapture_v2": [_P, ctypes.c_int],
    "cuStreamEndCapture": [_P, _PP],
    "cuGraphInstantiateWithFlags": [_PP, _P, ctypes.c_ulonglong],
    "cuGraphUpload": [_P, _P],
    "cuGraphLaunch": [_P, _P],
    "cuGraphDestroy": [_P],
    "cuGraphExecDestroy": [_P],
    "cuMemcpyDtoDAsync_v2": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, _P],
    "cuEventRecordWithFlags": [_P, _P, _U],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
}
EVENT_RECORD_EXTERNAL = 1
CUDA_ERROR_INVALID_CONTEXT = 201  # no context current
CAPTURE_MODE_RELAXED, STREAM_NON_BLOCKING = 2, 1


def driver():
    """``libcuda`` with the calls of this module typed (loaded once)."""
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in _SIGNATURES.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def current_device() -> int:
    """The device (ordinal) of the calling thread's current CUDA context; 0 when none is current. Function
    handles, modules and library plans belong to one device: caches of them are keyed by it."""
    d = ctypes.c_int(0)
    r = driver().cuCtxGetDevice(ctypes.byref(d))
    if r == CUDA_ERROR_INVALID_CONTEXT:
        return 0
    _check(r, "cuCtxGetDevice")
    return int(d.value)


def _check(r: int, what: str) -> None:
    if r:
        raise RuntimeError(f"{what}: CUDA error {r}")


def capture_stream() -> int:
    """A new non-blocking stream of the current context for capturing graphs (nothing runs on it)."""
    h = _P()
    _check(driver().cuStreamCreate(ctypes.byref(h), STREAM_NON_BLOCKING), "cuStreamCreate")
    return int(h.value)


def capture(bound, ctx: StreamContext, stream: int, event: int = 0) -> int:
    """Capture one bound launch (``RawLaunch`` or ``LibCall`` called with ``ctx`` moved onto ``stream``)
    into an instantiated graph (``CUgraphExec`` as an int); with ``event``, the graph records that event
    after the work (an event record node: one ``cuGraphLaunch`` then both runs the work and marks its
    end). Nothing runs. Raises ``RuntimeError`` when the work cannot be captured (the capture is ended
    and discarded first)."""
    return capture_seq([(bound, ctx, event)], stream)


def capture_seq(items, stream: int) -> int:
    """``capture`` of several bound launches, ``(bound, ctx, event)`` each, one after another in one graph
    (a launch group: each launch then its event, if any)."""
    lib = driver()
    _check(lib.cuStreamBeginCapture_v2(stream, CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")
    graph, err = _P(), None
    try:
        for bound, ctx, event in items:
            if isinstance(bound, RawLaunch):
                _check(launch_raw(bound, stream), "cuLaunchKernel (capture)")
            else:
                bound(StreamContext(stream, ctx.ws_ptr, ctx.ws_nbytes, ctx.handles, ctx.numba_stream, ctx.stream))
            if event:
                _check(lib.cuEventRecordWithFlags(event, stream, EVENT_RECORD_EXTERNAL), "cuEventRecordWithFlags")
    except Exception as e:  # noqa: BLE001 - end the capture whatever happened, then report
        err = e
    r = lib.cuStreamEndCapture(stream, ctypes.byref(graph))
    if err is not None or r:
        if graph.value:
            lib.cuGraphDestroy(graph)
        raise RuntimeError(f"capture failed: {err or f'cuStreamEndCapture error {r}'}")
    ex = _P()
    try:
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(ex), graph, 0), "cuGraphInstantiateWithFlags")
    finally:
        lib.cuGraphDestroy(graph)
    _check(lib.cuGraphUpload(ex, stream), "cuGraphUpload")
    return int(ex.value)


def destroy_graph(ex: int) -> None:
    driver().cuGraphExecDestroy(ex)


def launch_raw(raw: RawLaunch, stream: int) -> int:
    """Issue a bound kernel on ``stream``; returns the CUresult."""
    return driver().cuLaunchKernel(raw.func, raw.gx, raw.gy, raw.gz, raw.bx, raw.by, raw.bz, raw.shmem, stream,
                                   raw.params, None)  # fmt: skip
