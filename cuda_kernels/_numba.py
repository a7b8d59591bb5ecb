"""The one place that imports ``numba.cuda``: compatibility shim, lazy import, compiled-kernel handles.

``cuda()`` applies the numpy ``row_stack`` shim (numba-cuda 0.30 needs it with numpy >= 2.5) before
numba is imported, then returns the ``numba.cuda`` module. ``Compiled`` holds one kernel specialised for
one argument signature: on a device it is compiled once and launched without type dispatch; under the
CUDA simulator it falls back to the ordinary ``kernel[grid, block, stream](*args)`` call.

``Compiled.bind`` goes further for launches repeated with the same arguments: it packs the kernel
parameters once, exactly as numba's own launch flattens them (each array as meminfo, parent, nitems,
itemsize, data, shape..., strides...; scalars as their C types), checks the packing against the
parameter sizes the driver reports, and returns closures that each make one ``cuLaunchKernel`` call
(through ctypes on ``libcuda``) on a fixed stream.
"""

from __future__ import annotations

import ctypes
import os
from types import ModuleType

import numpy as np

_CUDA: ModuleType | None = None


def apply_numpy_shim() -> None:
    """numba-cuda 0.30 references ``np.row_stack``, removed in numpy 2.5."""
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack


def cuda() -> ModuleType:
    """``numba.cuda``, imported on first use (after the numpy shim)."""
    global _CUDA
    if _CUDA is None:
        apply_numpy_shim()
        from numba import cuda as _c

        _CUDA = _c
    return _CUDA


def simulating() -> bool:
    """True under ``NUMBA_ENABLE_CUDASIM=1`` (read from numba's config once it is imported)."""
    if _CUDA is not None:
        from numba.core import config

        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def available() -> bool:
    """A CUDA device (or the simulator) is usable."""
    try:
        return bool(cuda().is_available())
    except Exception:
        return False


def _nbtypes():
    c = cuda()
    t = getattr(c, "types", None)
    if t is None or not hasattr(t, "Array"):
        from numba.core import types as t
    return t


def array_type(np_dtype, ndim: int):
    """numba type of a C-contiguous device array."""
    t = _nbtypes()
    scalar = {
        "float16": t.float16, "float32": t.float32, "float64": t.float64,
        "int32": t.int32, "int64": t.int64,
    }[np.dtype(np_dtype).name]
    return t.Array(scalar, ndim, "C")


def scalar_type(kind: str):
    t = _nbtypes()
    return {"i8": t.int64, "f4": t.float32, "f8": t.float64}[kind]


def _dim3(d) -> tuple:
    d = (d,) if isinstance(d, int) else tuple(d)
    return d + (1,) * (3 - len(d))


_CORE_STREAMS: dict[int, tuple] = {}


def _launch_stream(stream):
    """The stream object ``_Kernel.launch`` wants (numba-cuda >= 0.2x wraps streams in cuda.core)."""
    from numba.cuda.cudadrv import driver

    conv = getattr(driver, "_to_core_stream", None)
    if conv is None:
        return stream
    hit = _CORE_STREAMS.get(id(stream))
    if hit is None or hit[0] is not stream:
        hit = (stream, conv(stream))
        _CORE_STREAMS[id(stream)] = hit
    return hit[1]


class LaunchError(RuntimeError):
    """``cuLaunchKernel`` (or a bound cuBLAS call) returned an error code."""


_LIB: list = []  # [libcuda] once loaded


def libcuda():
    """``libcuda`` with the two entry points the bound launches use, argument types declared."""
    if not _LIB:
        lib = ctypes.CDLL("libcuda.so.1")
        P, U = ctypes.c_void_p, ctypes.c_uint
        lib.cuLaunchKernel.argtypes = [P, U, U, U, U, U, U, U, P, P, P]
        lib.cuLaunchKernel.restype = ctypes.c_int
        lib.cuKernelGetFunction.argtypes = [ctypes.POINTER(P), P]
        lib.cuKernelGetFunction.restype = ctypes.c_int
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(P)]
        lib.cuCtxGetCurrent.restype = ctypes.c_int
        _LIB.append(lib)
    return _LIB[0]


def current_context() -> int:
    """The driver's current ``CUcontext`` (0 when none)."""
    c = ctypes.c_void_p()
    libcuda().cuCtxGetCurrent(ctypes.byref(c))
    return int(c.value or 0)


def stream_handle(stream) -> int:
    """Raw ``CUstream`` of a numba stream (0 or None: the default stream; ints pass through)."""
    if not stream:
        return 0
    if isinstance(stream, int):
        return stream
    return int(stream.handle or 0)


def pack_params(argtypes, args) -> list:
    """ctypes values of the kernel parameters, flattened as numba's ``_Kernel._prepare_args`` does."""
    t = _nbtypes()
    vals: list = []
    for ty, v in zip(argtypes, args, strict=True):
        if isinstance(ty, t.Array):
            if v.ndim != ty.ndim or v.dtype.itemsize != ty.dtype.bitwidth // 8:
                raise TypeError(f"array argument {v.shape} {v.dtype} does not match {ty}")
            ptr = v.device_ctypes_pointer.value or 0
            vals += [ctypes.c_void_p(0), ctypes.c_void_p(0), ctypes.c_int64(int(v.size)),
                     ctypes.c_int64(int(v.dtype.itemsize)), ctypes.c_void_p(ptr)]
            vals += [ctypes.c_int64(int(e)) for e in v.shape]
            vals += [ctypes.c_int64(int(e)) for e in v.strides]
        elif isinstance(ty, t.Integer):
            vals.append(getattr(ctypes, f"c_{ty}")(int(v)))
        elif ty == t.float32:
            vals.append(ctypes.c_float(float(v)))
        elif ty == t.float64:
            vals.append(ctypes.c_double(float(v)))
        else:
            raise TypeError(f"bound launch does not pack arguments of type {ty}")
    return vals


def _param_sizes(cufunc) -> list[int] | None:
    """Byte size of each kernel parameter as the driver reports it (None when it cannot say)."""
    try:
        info = cufunc.kernel.arguments_info
    except Exception:  # noqa: BLE001 - older cuda.core or driver
        return None
    return [int(getattr(p, "size", None) or p[1]) for p in info]


def _cufunction(cufunc) -> int:
    """The ``CUfunction`` of numba's loaded kernel in the current context."""
    h = int(getattr(cufunc, "handle", 0) or 0)
    f = ctypes.c_void_p()
    if libcuda().cuKernelGetFunction(ctypes.byref(f), h) == 0 and f.value:
        return int(f.value)
    return h  # a CUmodule-loaded CUfunction already


class Compiled:
    """A kernel specialised for one signature; ``launch`` does no typing, compiling or allocation.

    On a device the kernel is compiled in ``__init__`` and launched through ``_Kernel.launch`` (no
    dispatch); if that internal interface is missing it falls back, with a warning, to the dispatcher.
    Under the simulator (or with ``argtypes=None``) the dispatcher is called directly. ``bind`` returns
    zero-argument launches through the driver (see the module docstring).
    """

    __slots__ = ("dispatcher", "kernel", "grid", "block", "_funcs")

    def __init__(self, dispatcher, argtypes: tuple | None, grid, block):
        self.dispatcher = dispatcher
        self.grid = _dim3(grid)
        self.block = _dim3(block)
        self.kernel = None
        self._funcs: dict = {}  # context -> (CUfunction, parameter sizes or None)
        if argtypes is not None and not simulating():
            self.kernel = dispatcher.compile(tuple(argtypes))

    def launch(self, stream, args: tuple) -> None:
        k = self.kernel
        if k is not None:
            try:
                k.launch(args, self.grid, self.block, _launch_stream(stream), 0)
                return
            except (AttributeError, TypeError) as e:  # internal API drift: dispatch instead
                import warnings

                warnings.warn(f"direct kernel launch unavailable ({e!r}); using the dispatcher", stacklevel=2)
                self.kernel = None
        self.dispatcher[self.grid, self.block, stream](*args)

    def bind(self, streams: list, args: tuple) -> list:
        """One zero-argument callable per stream, each launching ``args`` on it with one driver call.

        Everything is computed here (in the current context, which the launches must share); under
        the simulator, or if the packing cannot be checked against the driver, the callables fall back
        to ``launch`` (with a warning in the second case). The arrays in ``args`` must stay alive as
        long as the callables."""
        k = self.kernel
        if k is None or simulating():
            return [_later(self.launch, s, args) for s in streams]
        ctx = current_context()
        hit = self._funcs.get(ctx)
        if hit is None:
            cufunc = k._codelibrary.get_cufunc()
            hit = self._funcs[ctx] = (_cufunction(cufunc), _param_sizes(cufunc))
        f, sizes = hit
        vals = pack_params(k.argument_types, args)
        if sizes is not None and sizes != [ctypes.sizeof(x) for x in vals]:
            import warnings

            warnings.warn(f"kernel parameter sizes {sizes} differ from the packing "
                          f"{[ctypes.sizeof(x) for x in vals]} ({k.argument_types}); launching through numba",
                          stacklevel=2)  # fmt: skip
            return [_later(self.launch, s, args) for s in streams]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(x) for x in vals])
        fn = libcuda().cuLaunchKernel
        (gx, gy, gz), (bx, by, bz) = self.grid, self.block
        keep = (vals, params)
        return [_driver_launch(fn, (f, gx, gy, gz, bx, by, bz, 0, stream_handle(s), params, None), keep)
                for s in streams]


def _later(launch, stream, args):
    return lambda: launch(stream, args)


def _driver_launch(fn, a: tuple, keep):
    def go():
        r = fn(*a)
        if r:
            raise LaunchError(f"cuLaunchKernel returned CUDA error {r}")

    go.keep = keep  # the packed parameters live as long as the launch
    return go
