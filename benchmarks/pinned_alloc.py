"""Pinned host memory: how long allocating it takes, one call or several threads, and how fast it is filled.

A plan's backend allocates its host input region (weights, cache blocks) with ``cuMemHostAlloc``, write-combined,
in one call, and fills it with threads (``turnip.runtime.loader.write_arrays``). For a 7B model that is 13.5 GB
before the first token; generation allocates one region per plan. This times, for ``--gib`` GiB:

- ``cuMemHostAlloc`` as one call, write-combined and not;
- the same bytes as ``--threads`` allocations made by as many threads at once (separate regions);
- ``cuMemHostRegister`` of plain memory (``numpy.empty``, touched first) as one call;
- filling the one-call region with ``--threads`` threads (``numpy.copyto`` from a source buffer), GB/s.

    PYTHONPATH=. python benchmarks/pinned_alloc.py [--gib 16] [--threads 8] [--reps 2]

Needs a CUDA device (the driver library); prints one line per measurement (seconds and GB/s) and a JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 1 << 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="GiB per measurement")
    ap.add_argument("--threads", type=int, default=8, help="threads (and allocations) of the threaded rows")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per row (the fastest is reported)")
    a = ap.parse_args(argv)
    from numba import cuda

    from turnip.runtime._cudadrv import Driver

    cuda.select_device(0)
    drv = Driver()
    reg, unreg = drv.cuMemHostRegister_v2, drv.cuMemHostUnregister
    n = int(a.gib * GiB) // 4096 * 4096
    k = max(1, a.threads)
    res: dict[str, float] = {}

    def best(name: str, fn) -> None:
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        res[name] = min(ts)
        print(f"{name:34s} {min(ts):7.3f} s  {n / min(ts) / 1e9:6.1f} GB/s", flush=True)

    def one(wc: bool):
        def run():
            p = drv.host_alloc(n, wc)
            drv.check(drv.cuMemFreeHost(p), "cuMemFreeHost")

        return run

    ctx = drv.current_context()

    def alloc_in_thread(nbytes: int, wc: bool) -> int:
        drv.check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")  # a thread has no current context of its own
        return drv.host_alloc(nbytes, wc)

    def threaded(wc: bool):
        def run():
            with ThreadPoolExecutor(k) as ex:
                ps = list(ex.map(lambda _: alloc_in_thread(n // k // 4096 * 4096, wc), range(k)))
            for p in ps:
                drv.check(drv.cuMemFreeHost(p), "cuMemFreeHost")

        return run

    def register():
        buf = np.empty(n, dtype=np.uint8)
        buf[::4096] = 0  # touched, as a filled buffer would be
        t0 = time.perf_counter()
        drv.check(reg(buf.ctypes.data, n, 1), "cuMemHostRegister")  # portable
        res.setdefault("register_only", time.perf_counter() - t0)
        drv.check(unreg(buf.ctypes.data), "cuMemHostUnregister")

    best("alloc one call, write-combined", one(True))
    best("alloc one call", one(False))
    best(f"alloc {k} threads, write-combined", threaded(True))
    best("touch + register one call", register)
    p = drv.host_alloc(n, True)
    dst = np.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=np.uint8)
    src = np.ones(n // k, dtype=np.uint8)
    step = n // k

    def fill():
        with ThreadPoolExecutor(k) as ex:
            list(ex.map(lambda i: np.copyto(dst[i * step : (i + 1) * step], src[:step]), range(k)))

    best(f"fill {k} threads (write-combined)", fill)
    drv.check(drv.cuMemFreeHost(p), "cuMemFreeHost")
    print(json.dumps({"gib": a.gib, "threads": k, "seconds": res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
