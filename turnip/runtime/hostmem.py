"""The CUDA backend's host regions (its input region: weights, inputs, cache blocks; its offload region).

Copies between host and GPU run asynchronously only from pinned memory. Two ways to get it:

- **allocated pinned** (``TURNIP_HOST_REGISTER=0``): ``cuMemHostAlloc`` at plan load, before anything is
  written. On the lent H100 hosts it pins 2.4 GB/s write-combined (1.8 without), whether from one thread or
  eight: a 7B model's 13.5 GB of weights take 5.6 s before the first copy (``benchmarks/pinned_alloc.py``,
  ``benchmarks/results/generate/generate_prefill_tiles_h100.md``);
- **registered** (the default): plain memory at plan load (no page touched), filled by the writing threads
  (which fault its pages in, in parallel), then pinned in place by ``cuMemHostRegister`` when the backend loads
  its resident inputs (the input region) or at the first run (the offload region): 0.29 s for 8 GiB of touched
  memory on the same hosts. Pages nothing wrote are touched first, by threads. A LLaMA-65B's 129.5 GB input
  region on four H200s loads in 17.2-19.1 s this way (fill 6.2-8.1 s, one registration 9.8-12.6 s) against
  59.9 s allocated pinned (allocation 52.1 s); registered in 4 or 16 pieces from as many threads it took
  9.8-10.3 s against 11.5 s as one call (the driver takes them one at a time; the pieces were dropped again:
  ``benchmarks/results/multi_gpu/README.md``). Registered memory is not write-combined (the host reads the
  offload region anyway; for the input region the difference is the host's writes, cached instead of combined).

A region is released as it was made (``cuMemFreeHost``, or ``cuMemHostUnregister`` and the memory dropped) and
can be handed to the next plan's backend (``turnip.runtime.layout.HostInputs``) with its release.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from turnip.runtime.loader import thread_map

HOST_REGISTER_SWITCH = "TURNIP_HOST_REGISTER"
PAGE = 4096
REGISTER_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every context (several GPUs)
TOUCH_CHUNK = 1 << 28  # bytes per thread task when touching pages


def host_register_on() -> bool:
    """Whether the CUDA backend registers plain memory instead of allocating pinned memory: yes unless
    ``TURNIP_HOST_REGISTER=0``."""
    return os.environ.get(HOST_REGISTER_SWITCH, "1") != "0"


class PinnedRegion:
    """``nbytes`` of host memory for GPU copies: ``array`` (uint8) at ``ptr``. ``register``: plain memory now,
    pinned by ``pin`` (the first run); else pinned memory now (``write_combined`` as asked)."""

    def __init__(self, drv, nbytes: int, write_combined: bool = False, register: bool = False):
        self.drv, self.nbytes = drv, int(nbytes)
        if register:
            buf = np.empty(self.nbytes + PAGE, dtype=np.uint8)  # no page touched yet
            off = -buf.ctypes.data % PAGE
            self.array = buf[off : off + self.nbytes]
            self.ptr, self.pinned, self._release = int(self.array.ctypes.data), False, None
        else:
            self.ptr = drv.host_alloc(self.nbytes, write_combined)
            self.array = np.frombuffer((ctypes.c_uint8 * self.nbytes).from_address(self.ptr), dtype=np.uint8)
            self.pinned, self._release = True, _freer(drv, self.ptr)

    @classmethod
    def adopted(cls, drv, array: np.ndarray, ptr: int, release) -> PinnedRegion:
        """A pinned region handed over by another backend (``HostInputs``), released by ``release``."""
        r = object.__new__(cls)
        r.drv, r.nbytes, r.array, r.ptr, r.pinned, r._release = drv, len(array), array, int(ptr), True, release
        return r

    def pin(self, threads: int | None = None) -> None:
        """Pin a registered region in place (nothing for one already pinned): its untouched pages touched by
        ``threads`` threads (reading and writing back one byte a page keeps the bytes), then one
        ``cuMemHostRegister``."""
        if self.pinned:
            return
        if self.nbytes:
            a = self.array
            spans = [(i, min(i + TOUCH_CHUNK, self.nbytes)) for i in range(0, self.nbytes, TOUCH_CHUNK)]

            def touch(span):
                i, j = span
                a[i:j:PAGE] = a[i:j:PAGE]

            thread_map(touch, spans, threads)
            r = self.drv.cuMemHostRegister_v2(self.ptr, self.nbytes, REGISTER_PORTABLE)
            self.drv.check(r, f"cuMemHostRegister({self.nbytes} bytes)")
            self._release = _unregisterer(self.drv, self.ptr)
        self.pinned = True

    def hand_over(self):
        """(array, ptr, release) for the next backend (``HostInputs``), pinned first; this region forgets them."""
        self.pin()
        out = (self.array, self.ptr, self._release)
        self.array, self.ptr, self._release = None, 0, None
        return out

    def release(self) -> None:
        """Free the memory as it was made (idempotent; the caller has no copy in flight)."""
        if self._release is not None:
            self._release()
            self._release = None
        self.array, self.ptr = None, 0


def _freer(drv, ptr: int):
    """The release of pinned memory allocated at ``ptr``."""
    return lambda: drv.cuMemFreeHost(ptr)


def _unregisterer(drv, ptr: int):
    """The release of memory registered at ``ptr`` (its owner, the numpy buffer, drops it after)."""
    return lambda: drv.check(drv.cuMemHostUnregister(ptr), "cuMemHostUnregister")
