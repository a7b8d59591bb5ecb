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
    library handles bound to this stream (created once by the runtime, on first need at plan load)."""

    stream: int  # CUstream as an int
    ws_ptr: int = 0  # this slot's workspace (device pointer) and its size
    ws_nbytes: int = 0
    handles: dict = field(default_factory=dict)  # library name -> handle bound to ``stream``
    numba_stream: object = None


class LibCall:
    """A prebound library call: ``call(ctx)``. ``ws_nbytes`` is the workspace it needs from its slot."""

    __slots__ = ("fn", "ws_nbytes", "what")

    def __init__(self, fn, ws_nbytes: int = 0, what: str = ""):
        self.fn, self.ws_nbytes, self.what = fn, int(ws_nbytes), what

    def __call__(self, ctx: StreamContext) -> None:
        self.fn(ctx)


_DRIVER = None


def driver():
    """``libcuda`` with ``cuLaunchKernel`` typed (loaded once)."""
    global _DRIVER
    if _DRIVER is None:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuLaunchKernel
        f.argtypes = [_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P]
        f.restype = ctypes.c_int
        _DRIVER = lib
    return _DRIVER


def launch_raw(raw: RawLaunch, stream: int) -> int:
    """Issue a bound kernel on ``stream``; returns the CUresult."""
    return driver().cuLaunchKernel(raw.func, raw.gx, raw.gy, raw.gz, raw.bx, raw.by, raw.bz, raw.shmem, stream,
                                   raw.params, None)  # fmt: skip
