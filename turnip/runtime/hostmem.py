"""The CUDA backend's host regions (its input region: weights, inputs, cache blocks; its offload region).

Copies between host and GPU run asynchronously only from pinned memory. Two ways to get it:

- **allocated pinned** (the default): ``cuMemHostAlloc`` at plan load, before anything is written. On the lent
  H100 hosts it pins 2.4 GB/s write-combined (1.8 without), whether from one thread or eight: a 7B model's
  13.5 GB of weights take 5.6 s before the first copy (``benchmarks/pinned_alloc.py``,
  ``benchmarks/results/generate/generate_prefill_tiles_h100.md``);
- **registered** (``TURNIP_HOST_REGISTER=1``, off until timed in a run): plain memory at plan load (no page
  touched), filled by the writing threads (which fault its pages in, in parallel), then pinned in place by
  ``cuMemHostRegister`` at the first run: 0.29 s for 8 GiB of touched memory on the same hosts. Pages nothing
  wrote are touched first, by threads. Registered memory is not write-combined (the host reads the offload
  region anyway; for the input region the difference is the host's writes, cached instead of combined).

A region is released as it was made (``cuMemFreeHost``, or ``cuMemHostUnregister`` and the memory dropped) and
can be handed to the next plan's backend (``turnip.runtime.layout.HostInputs``) with its release.
"""

from __future__ import annotations

import bisect
import ctypes
import os

import numpy as np

from turnip.runtime._cudadrv import SUCCESS
from turnip.runtime.loader import thread_map

HOST_REGISTER_SWITCH = "TURNIP_HOST_REGISTER"
PAGE = 4096
REGISTER_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE: pinned for every context (several GPUs)
TOUCH_CHUNK = 1 << 28  # bytes per thread task when touching pages
PIN_PIECES_SWITCH = "TURNIP_PIN_PIECES"
MIN_PIECE = 1 << 28  # bytes: no piece of a pinned region smaller, where the cuts allow


def host_register_on() -> bool:
    """Whether the CUDA backend registers plain memory instead of allocating pinned memory:
    ``TURNIP_HOST_REGISTER=1`` (off until timed in a run on a GPU)."""
    return os.environ.get(HOST_REGISTER_SWITCH) == "1"


class PinnedRegion:
    """``nbytes`` of host memory for GPU copies: ``array`` (uint8) at ``ptr``. ``register``: plain memory now,
    pinned by ``pin`` (the first run); else pinned memory now (``write_combined`` as asked)."""

    def __init__(self, drv, nbytes: int, write_combined: bool = False, register: bool = False, ctx=None):
        self.drv, self.nbytes, self.ctx = drv, int(nbytes), ctx
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
        r.ctx = None
        return r

    def pin(self, threads: int | None = None, cuts=()) -> None:
        """Pin a registered region in place (nothing for one already pinned): its untouched pages touched by
        ``threads`` threads (reading and writing back one byte a page keeps the bytes), then
        ``cuMemHostRegister``: once for the whole region, or with ``pin_pieces()`` > 1 in that many pieces on
        as many threads, each cut at one of ``cuts`` (byte offsets where a buffer starts and no copy spans:
        the backend's host offsets; only page multiples are used). A failed piece unregisters the others."""
        if self.pinned:
            return
        if self.nbytes:
            a = self.array
            spans = [(i, min(i + TOUCH_CHUNK, self.nbytes)) for i in range(0, self.nbytes, TOUCH_CHUNK)]

            def touch(span):
                i, j = span
                a[i:j:PAGE] = a[i:j:PAGE]

            thread_map(touch, spans, threads)
            pieces = register_spans(self.nbytes, cuts, pin_pieces())
            drv, ptr, ctx = self.drv, self.ptr, self.ctx

            def register(span):
                if len(pieces) > 1 and ctx is not None:  # a worker thread: the driver call needs a context
                    drv.check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent (pinning a host region)")
                return drv.cuMemHostRegister_v2(ptr + span[0], span[1] - span[0], REGISTER_PORTABLE)

            answers = thread_map(register, pieces, len(pieces))
            done = [ptr + i for (i, _), r in zip(pieces, answers, strict=True) if r == SUCCESS]
            for (i, j), r in zip(pieces, answers, strict=True):
                if r != SUCCESS:
                    for p in done:
                        drv.cuMemHostUnregister(p)
                    what = f"{j - i} bytes at offset {i} of {self.nbytes}" if len(pieces) > 1 else f"{j - i} bytes"
                    drv.check(r, f"cuMemHostRegister({what})")
            self._release = _unregisterer(drv, done)
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


def _unregisterer(drv, ptrs: list[int]):
    """The release of memory registered at ``ptrs`` (its pieces; the owner, the numpy buffer, drops it after)."""

    def release():
        for p in ptrs:
            drv.check(drv.cuMemHostUnregister(p), "cuMemHostUnregister")

    return release


def pin_pieces() -> int:
    """How many pieces a registered region is pinned in, on as many threads: ``TURNIP_PIN_PIECES`` (default 1,
    one ``cuMemHostRegister`` for the region, until pieces are timed on a GPU)."""
    return max(1, int(os.environ.get(PIN_PIECES_SWITCH, "1")))


def register_spans(nbytes: int, cuts, pieces: int, least: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``nbytes``, at most ``pieces`` of them, none under ``least`` bytes where it
    can be helped (default ``MIN_PIECE``), each cut at the page-multiple offset of ``cuts`` nearest an even share."""
    pieces = max(1, min(pieces, nbytes // max(MIN_PIECE if least is None else least, 1)))
    ok = sorted({int(c) for c in cuts if 0 < int(c) < nbytes and int(c) % PAGE == 0})
    starts = [0]
    for k in range(1, pieces):
        share = k * nbytes // pieces
        i = bisect.bisect_left(ok, share)
        near = [c for c in ok[max(i - 1, 0) : i + 1] if c > starts[-1]]
        if near:
            starts.append(min(near, key=lambda c: abs(c - share)))
    return list(zip(starts, [*starts[1:], nbytes], strict=True))
