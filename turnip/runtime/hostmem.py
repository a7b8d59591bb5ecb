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

The input region filled by ``write_random_inputs`` or ``turnip.runtime.loader.write_arrays`` (checkpoints, a
generation's weights) is registered in pieces of about ``PIECE_NBYTES`` by a thread of its own while the fill
runs (``PiecePinner``; ``TURNIP_PIN_WHILE_FILLING=0``: one registration after the fill): a piece once every
tile the fill announced for it is written, the rest when the fill ends. On two H100 quads LLaMA-65B's region
loaded in 13.3-14.3 s this way (9.1-9.8 GB/s: fill 6.5-7.4 s, then 6.3-7.1 s of registration left) against
17.8-18.7 s registered after the fill. Transparent huge pages (the region an anonymous mapping advised
``MADV_HUGEPAGE``) were tried and dropped: on those hosts (defrag ``madvise``) the fill took 36.7 s, not 7, and
the registration no less.

A region is released as it was made (``cuMemFreeHost``, or ``cuMemHostUnregister`` and the memory dropped) and
can be handed to the next plan's backend (``turnip.runtime.layout.HostInputs``) with its release.
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import time

import numpy as np

from turnip.runtime._cudadrv import SUCCESS
from turnip.runtime.loader import thread_map

HOST_REGISTER_SWITCH = "TURNIP_HOST_REGISTER"
PIN_WHILE_FILLING_SWITCH = "TURNIP_PIN_WHILE_FILLING"
PIECE_NBYTES = 1 << 30  # a piece of a region pinned while it is filled, about
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
        self.pieces: list[tuple[int, int]] | None = None  # registered: the [start, end) spans registered apart
        # (a copy must lie inside one); None for allocated pinned memory (one allocation)
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
    def adopted(cls, drv, array: np.ndarray, ptr: int, release, pieces=None) -> PinnedRegion:
        """A pinned region handed over by another backend (``HostInputs``), released by ``release``; ``pieces``:
        its registered spans (None: allocated pinned memory)."""
        r = object.__new__(cls)
        r.drv, r.nbytes, r.array, r.ptr, r.pinned, r._release = drv, len(array), array, int(ptr), True, release
        r.pieces = None if pieces is None else [(int(i), int(j)) for i, j in pieces]
        return r

    def mend(self, buffers) -> int:
        """Make every buffer of ``buffers`` ((byte offset, bytes) each) lie inside one registered piece: a copy
        whose host range spans two registrations fails (CUDA_ERROR_INVALID_VALUE). Pieces that a buffer spans
        are unregistered and registered again as one (a region handed to a plan that lays out its other inputs
        where the plan before had pieces cut at its own buffers). Returns the bytes registered again."""
        if not self.pieces or len(self.pieces) < 2 or not self.pinned:
            return 0
        starts = [i for i, _ in self.pieces]
        joined = [False] * len(self.pieces)  # piece k joins piece k - 1: a buffer spans the boundary between them
        for off, nb in buffers:
            if nb > 0:
                a = bisect.bisect_right(starts, int(off)) - 1
                b = bisect.bisect_right(starts, int(off) + int(nb) - 1) - 1
                for k in range(a + 1, b + 1):
                    joined[k] = True
        if not any(joined):
            return 0
        groups: list[list[int]] = []
        for k, j in enumerate(joined):
            if j:
                groups[-1].append(k)
            else:
                groups.append([k])
        drv, again, new = self.drv, 0, []
        for ks in groups:
            i, j = self.pieces[ks[0]][0], self.pieces[ks[-1]][1]
            if len(ks) > 1:
                for k in ks:
                    drv.check(drv.cuMemHostUnregister(self.ptr + self.pieces[k][0]), "cuMemHostUnregister")
                drv.check(drv.cuMemHostRegister_v2(self.ptr + i, j - i, REGISTER_PORTABLE),
                          f"cuMemHostRegister({j - i} bytes at offset {i} of {self.nbytes})")  # fmt: skip
                again += j - i
            new.append((i, j))
        self.pieces = new
        self._release = _unregisterer(drv, [self.ptr + i for i, _ in new])
        return again

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
            self._release = _unregisterer(self.drv, [self.ptr])
            self.pieces = [(0, self.nbytes)]
        self.pinned = True

    def hand_over(self):
        """(array, ptr, release, pieces) for the next backend (``HostInputs``), pinned first; this region forgets
        them."""
        self.pin()
        out = (self.array, self.ptr, self._release, self.pieces)
        self.array, self.ptr, self._release, self.pieces = None, 0, None, None
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
    """The release of memory registered (in one piece or several) at ``ptrs`` (its owner, the numpy buffer,
    drops it after)."""

    def release():
        for p in ptrs:
            drv.check(drv.cuMemHostUnregister(p), "cuMemHostUnregister")

    return release


def pin_while_filling_on() -> bool:
    """Whether a registered input region is pinned in pieces while the writing threads fill it
    (``PiecePinner``): yes unless ``TURNIP_PIN_WHILE_FILLING=0``."""
    return os.environ.get(PIN_WHILE_FILLING_SWITCH, "1") != "0"


def register_spans(nbytes: int, cuts, pieces: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans covering ``nbytes``: at most ``pieces``, each cut at the page-multiple offset of
    ``cuts`` (where a buffer starts: no copy spans two pieces) nearest an even share."""
    ok = sorted({int(c) for c in cuts if 0 < int(c) < nbytes and int(c) % PAGE == 0})
    starts = [0]
    for k in range(1, max(1, pieces)):
        share = k * nbytes // pieces
        i = bisect.bisect_left(ok, share)
        near = [c for c in ok[max(i - 1, 0) : i + 1] if c > starts[-1]]
        if near:
            starts.append(min(near, key=lambda c: abs(c - share)))
    return list(zip(starts, [*starts[1:], nbytes], strict=True))


class PiecePinner:
    """A registered region pinned in pieces on a thread of its own while other threads fill it: a piece is
    registered once every byte the fill announced for it is written (``written``; the lowest such piece
    first), the rest when the fill ends (``finish``), which leaves the region pinned (released piece by
    piece) or, if a registration failed, unregisters the others and raises. The driver registers one piece
    at a time (pieces from several threads were measured no faster than one call), so what this buys is the
    registration running beside the fill instead of after it. ``abandon``: the fill failed; nothing stays
    registered. ``ctx``: the driver context the thread works in; ``phases``: a dict whose ``"pin"`` adds the
    seconds ``finish`` waits (the registration's tail, after the fill: a backend's ``load_phases_s``)."""

    def __init__(self, region: PinnedRegion, spans: list[tuple[int, int]], writes, ctx=None, phases=None):
        self.region, self.spans, self.ctx, self.phases = region, spans, ctx, phases
        self._starts = [i for i, _ in spans]
        self._left = [0] * len(spans)  # bytes announced and not yet written, per piece
        for off, nb in writes:
            self._left[self._piece(off)] += int(nb)
        self._cv = threading.Condition()
        self._filled = False
        self._done: list[int] = []  # registered pieces' pointers
        self._failed: tuple | None = None  # (answer, start, end) of the piece that failed
        self._error: BaseException | None = None  # what stopped the pinning thread otherwise
        self._thread = threading.Thread(target=self._run, name="turnip-pin", daemon=True)
        self._thread.start()

    def _piece(self, off: int) -> int:
        return bisect.bisect_right(self._starts, int(off)) - 1

    def written(self, off: int, nbytes: int) -> None:
        """``nbytes`` announced at byte ``off`` are written."""
        with self._cv:
            k = self._piece(off)
            self._left[k] -= int(nbytes)
            if self._left[k] <= 0:
                self._cv.notify()

    def _run(self) -> None:
        try:
            self._register_pieces()
        except BaseException as e:  # noqa: BLE001 - handed to the filling thread by finish
            self._error = e

    def _register_pieces(self) -> None:
        drv, ptr = self.region.drv, self.region.ptr
        if self.ctx is not None:
            drv.check(drv.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent (pinning a host region)")
        todo = list(range(len(self.spans)))
        while todo:
            with self._cv:
                while not self._filled and all(self._left[k] > 0 for k in todo):
                    self._cv.wait()
                k = todo[0] if self._filled else next(k for k in todo if self._left[k] <= 0)
            todo.remove(k)
            i, j = self.spans[k]
            r = drv.cuMemHostRegister_v2(ptr + i, j - i, REGISTER_PORTABLE)
            if r != SUCCESS:
                self._failed = (r, i, j)
                return
            self._done.append(ptr + i)

    def _stop(self) -> None:
        with self._cv:
            self._filled = True
            self._cv.notify()
        self._thread.join()

    def finish(self) -> None:
        """The fill is over: the remaining pieces registered; the region pinned, or an error raised."""
        t0 = time.perf_counter()
        self._stop()
        if self.phases is not None:
            self.phases["pin"] = self.phases.get("pin", 0.0) + time.perf_counter() - t0
        drv, r = self.region.drv, self.region
        if self._error is not None:
            self._unregister()
            raise self._error
        if self._failed is not None:
            self._unregister()
            answer, i, j = self._failed
            drv.check(answer, f"cuMemHostRegister({j - i} bytes at offset {i} of {r.nbytes})")
        r._release, r.pinned, r.pieces = _unregisterer(drv, list(self._done)), True, list(self.spans)

    def abandon(self) -> None:
        """The fill failed: the thread stopped, every registered piece unregistered (the region stays plain)."""
        self._stop()
        self._unregister()

    def _unregister(self) -> None:
        for p in self._done:
            self.region.drv.cuMemHostUnregister(p)
        self._done = []
