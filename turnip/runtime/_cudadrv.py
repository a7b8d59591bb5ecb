"""The few CUDA driver calls the CUDA backend makes itself, through ctypes on ``libcuda``.

Raw handles are plain ints; every call returns a ``CUresult`` (0 = success). ctypes costs well under a
microsecond per call, less than a wrapper object per call would. Kernels and GEMMs are launched by
``cuda_kernels`` (numba-cuda, cuBLAS through CuPy), not here.
"""

from __future__ import annotations

import ctypes

SUCCESS, NOT_READY, PEER_ACCESS_ALREADY_ENABLED = 0, 600, 704
HOSTALLOC_PORTABLE, HOSTALLOC_WRITECOMBINED = 0x01, 0x04
EVENT_DEFAULT = 0

_P, _U64, _SZ, _U32, _I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int
_SIGS = {
    "cuEventCreate": [ctypes.POINTER(_P), _U32],
    "cuEventRecord": [_P, _P],
    "cuEventQuery": [_P],
    "cuEventSynchronize": [_P],
    "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), _P, _P],
    "cuEventDestroy_v2": [_P],
    "cuMemcpyHtoDAsync_v2": [_U64, _P, _SZ, _P],
    "cuMemcpyDtoHAsync_v2": [_P, _U64, _SZ, _P],
    "cuMemcpyPeerAsync": [_U64, _P, _U64, _P, _SZ, _P],
    "cuMemcpyHtoD_v2": [_U64, _P, _SZ],
    "cuMemcpyDtoH_v2": [_P, _U64, _SZ],
    "cuMemcpyDtoD_v2": [_U64, _U64, _SZ],
    "cuMemHostAlloc": [ctypes.POINTER(_P), _SZ, _U32],
    "cuMemAlloc_v2": [ctypes.POINTER(_U64), _SZ],
    "cuMemFree_v2": [_U64],
    "cuMemFreeHost": [_P],
    "cuMemHostRegister_v2": [_P, _SZ, _U32],
    "cuMemHostUnregister": [_P],
    "cuCtxGetCurrent": [ctypes.POINTER(_P)],
    "cuCtxSetCurrent": [_P],
    "cuCtxSynchronize": [],
    "cuCtxEnablePeerAccess": [_P, _U32],
    "cuDeviceCanAccessPeer": [ctypes.POINTER(_I), _I, _I],
    "cuStreamSynchronize": [_P],
    "cuGetErrorName": [_I, ctypes.POINTER(ctypes.c_char_p)],
}


class Driver:
    """``libcuda`` with argument types declared; ``check(r, what)`` raises ``CudaError`` on failure."""

    def __init__(self):
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        for name, args in _SIGS.items():
            f = getattr(lib, name)
            f.argtypes, f.restype = args, _I
            setattr(self, name, f)

    def error_name(self, r: int) -> str:
        s = ctypes.c_char_p()
        self.cuGetErrorName(r, ctypes.byref(s))
        return f"{(s.value or b'CUDA error').decode()} ({r})"

    def check(self, r: int, what: str) -> None:
        if r != SUCCESS:
            raise CudaError(f"{what}: {self.error_name(r)}")

    def event(self) -> int:
        e = _P()
        self.check(self.cuEventCreate(ctypes.byref(e), EVENT_DEFAULT), "cuEventCreate")
        return int(e.value)

    def current_context(self) -> int:
        c = _P()
        self.check(self.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return int(c.value or 0)

    def host_alloc(self, nbytes: int, write_combined: bool) -> int:
        p = _P()
        flags = HOSTALLOC_PORTABLE | (HOSTALLOC_WRITECOMBINED if write_combined else 0)
        self.check(self.cuMemHostAlloc(ctypes.byref(p), nbytes, flags), f"cuMemHostAlloc({nbytes} bytes)")
        return int(p.value)

    def device_alloc(self, nbytes: int) -> int:
        """``nbytes`` of device memory in the current context (the caller frees it with ``cuMemFree_v2``)."""
        p = _U64()
        self.check(self.cuMemAlloc_v2(ctypes.byref(p), nbytes), f"cuMemAlloc({nbytes} bytes)")
        return int(p.value)

    def elapsed_ms(self, a: int, b: int) -> float:
        ms = ctypes.c_float()
        self.check(self.cuEventElapsedTime(ctypes.byref(ms), a, b), "cuEventElapsedTime")
        return float(ms.value)

    def can_access_peer(self, dev: int, peer: int) -> bool:
        ok = _I()
        self.check(self.cuDeviceCanAccessPeer(ctypes.byref(ok), dev, peer), "cuDeviceCanAccessPeer")
        return bool(ok.value)

    def enable_peer(self, ctx: list, devices, a: int, b: int) -> None:
        """Let GPU ``a``'s context (``ctx[a]``, device ``devices[a]``) reach GPU ``b``'s memory where the devices
        allow it; already enabled is fine. Leaves ``ctx[a]`` current when it calls."""
        if self.can_access_peer(devices[a], devices[b]):
            self.check(self.cuCtxSetCurrent(ctx[a]), "cuCtxSetCurrent")
            r = self.cuCtxEnablePeerAccess(ctx[b], 0)
            if r not in (SUCCESS, PEER_ACCESS_ALREADY_ENABLED):
                self.check(r, f"cuCtxEnablePeerAccess(gpu {a} -> gpu {b})")


class CudaError(RuntimeError):
    """A CUDA driver call failed."""
