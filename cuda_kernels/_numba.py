"""The one place that imports ``numba.cuda``: compatibility shim, lazy import, compiled-kernel handles.

``cuda()`` applies the numpy ``row_stack`` shim (numba-cuda 0.30 needs it with numpy >= 2.5) before
numba is imported, then returns the ``numba.cuda`` module. ``Compiled`` holds one kernel specialised for
one argument signature: on a device it is compiled once and launched without type dispatch; under the
CUDA simulator it falls back to the ordinary ``kernel[grid, block, stream](*args)`` call.
"""

from __future__ import annotations

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


def to_device(x: np.ndarray, stream=0):
    """``cuda().to_device(x)``; bfloat16 (``ml_dtypes``, which numba's host copies cannot take) moves as its
    uint16 bits and is viewed back as bfloat16 on the device."""
    if np.dtype(x.dtype).name == "bfloat16":
        return cuda().to_device(np.ascontiguousarray(x).view(np.uint16), stream=stream).view(x.dtype)
    return cuda().to_device(x, stream=stream)


def to_host(d) -> np.ndarray:
    """``d.copy_to_host()``, bfloat16 through its uint16 bits (see ``to_device``)."""
    if np.dtype(d.dtype).name == "bfloat16":
        return d.view(np.uint16).copy_to_host().view(d.dtype)
    return d.copy_to_host()


def _nbtypes():
    c = cuda()
    t = getattr(c, "types", None)
    if t is None or not hasattr(t, "Array"):
        from numba.core import types as t
    return t


def array_type(np_dtype, ndim: int):
    """numba type of a C-contiguous device array (bfloat16, which numba does not know, as its uint16 bits:
    the kernels convert with ``codegen``'s ``BF2F`` / ``F2BF``)."""
    t = _nbtypes()
    scalar = {
        "float16": t.float16, "float32": t.float32, "float64": t.float64,
        "int32": t.int32, "int64": t.int64, "uint16": t.uint16, "bfloat16": t.uint16,
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


def function_handle(kernel) -> int:
    """The handle of a compiled kernel's function, its module loaded once per process whatever the device.

    numba-cuda loads modules as context-independent libraries (``cuLibraryLoadData``) and its functions are
    ``CUkernel`` handles, which ``cuLaunchKernel`` takes in any context. Left to itself numba loads the
    module again for each device it launches on, and those per-device modules share the one library handle:
    at exit each unloads it, a double ``cuLibraryUnload`` that aborted multi-GPU processes after their last
    output ("double free or corruption"). So the first device's function serves every device: it is put in
    numba's per-device cache for the current device too, and numba never loads a second module."""
    from cuda_kernels.launch import current_device

    lib = kernel._codelibrary
    cache = lib._cufunc_cache  # device id -> numba Function
    dev = current_device()
    f = cache.get(dev) or next(iter(cache.values()), None)
    if f is None:
        with cuda().gpus[dev]:  # first load, in the device whose context is current (not numba's)
            f = lib.get_cufunc()
    cache.setdefault(dev, f)
    h = f.handle
    return int(getattr(h, "value", h)) if not isinstance(h, int) else h


class Compiled:
    """A kernel specialised for one signature; ``launch`` does no typing, compiling or allocation.

    On a device the kernel is compiled in ``__init__`` and launched through ``_Kernel.launch`` (no
    dispatch); if that internal interface is missing it falls back, with a warning, to the dispatcher.
    Under the simulator (or with ``argtypes=None``) the dispatcher is called directly.
    """

    __slots__ = ("dispatcher", "kernel", "grid", "block", "argtypes")

    def __init__(self, dispatcher, argtypes: tuple | None, grid, block):
        self.dispatcher = dispatcher
        self.grid = _dim3(grid)
        self.block = _dim3(block)
        self.kernel = None
        self.argtypes = tuple(argtypes) if argtypes is not None else None
        if argtypes is not None and not simulating():
            self.kernel = dispatcher.compile(tuple(argtypes))

    def bind(self, args: tuple):
        """A ``RawLaunch`` of this kernel with ``args`` fixed: parameters packed the way numba-cuda's
        ``_Kernel`` packs them (an array is meminfo, parent, size, itemsize, data, shape..., strides...;
        scalars at their own width), launched by one ``cuLaunchKernel`` on the kernel's handle."""
        import ctypes

        from cuda_kernels.launch import raw_launch

        if self.kernel is None or self.argtypes is None:
            raise RuntimeError("bind needs a kernel compiled for a device (not the simulator)")
        t = _nbtypes()
        vals: list = []
        for ty, a in zip(self.argtypes, args, strict=True):
            if isinstance(ty, t.Array):
                ptr = a.device_ctypes_pointer.value or 0
                vals += [0, 0, int(a.size), int(a.dtype.itemsize), ptr, *map(int, a.shape), *map(int, a.strides)]
            elif ty == t.float32:
                vals.append(ctypes.c_float(float(a)))
            elif ty == t.float64:
                vals.append(ctypes.c_double(float(a)))
            elif ty == t.int64:
                vals.append(ctypes.c_int64(int(a)))
            else:
                raise TypeError(f"cannot bind an argument of type {ty}")
        return raw_launch(function_handle(self.kernel), self.grid, self.block, vals)

    def launch(self, stream, args: tuple) -> None:
        k = self.kernel
        if k is not None:
            function_handle(k)  # numba's launch on this device then reuses the one loaded module
            try:
                k.launch(args, self.grid, self.block, _launch_stream(stream), 0)
                return
            except (AttributeError, TypeError) as e:  # internal API drift: dispatch instead
                import warnings

                warnings.warn(f"direct kernel launch unavailable ({e!r}); using the dispatcher", stacklevel=2)
                self.kernel = None
        self.dispatcher[self.grid, self.block, stream](*args)
