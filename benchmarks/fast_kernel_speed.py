"""Fast CUDA C++ kernels (cuda_kernels/fast.py) vs the copy ceiling and the numba kernels, LLaMA-7B tiles.

For each tile and dtype: median device time of single bound launches (``launch_raw`` of a prebound
``RawLaunch``; CUDA events around each launch, the GPU kept behind the host by preceding fp16 GEMMs so host
launch cost does not show), GB/s (every input once + the output once; embed: ids + the gathered rows +
the output), the fraction of the device-to-device copy ceiling measured in the same run (CuPy memcpy of
1 GiB, read + write bytes) and of a memcpy moving the tile's own bytes (small tiles pay a fixed
launch/ramp cost that a 1 GiB copy hides), the same for the numba kernel of the op (``cuda_kernels.kernels.prepare``,
on the same buffers and stream), and the host time per launch of each (wall time of a back-to-back loop).
Memory-bound tiles rotate between up to 4 input sets so one pass touches > 200 MB (no L2 reuse).

    PYTHONPATH=. python benchmarks/fast_kernel_speed.py --tokens 4096 --out fast_kernels.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time

import numpy as np

import cuda_kernels  # noqa: F401 - numpy shim before numba is imported
from cuda_kernels import fast
from cuda_kernels.launch import launch_raw
from tests.cuda_kernels.cases import NP_DTYPE, Case, make_inputs

L2_BYTES = 200 << 20  # rotate input sets until one pass touches more than this


def tiles(t: int) -> list[Case]:
    """The 7B tiles (t tokens) of the task, then the remaining elementwise ops at 7B widths."""
    return [
        Case("rmsnorm", "rmsnorm", ((t, 4096), (4096,)), (t, 4096), {"eps": 1e-5}),
        Case("rotary", "rotary", ((t, 16, 128),), (t, 16, 128), {"pos_off": t, "theta": 10000.0}),
        Case("silu_mul", "silu_mul", ((t, 5504), (t, 5504)), (t, 5504)),
        Case("add_n", "add_n", ((t, 4096), (t, 4096)), (t, 4096)),
        Case("embed", "embed", ((t,), (32000, 4096)), (t, 4096), {}, ("ids:32000", "normal")),
        Case("silu", "silu", ((t, 5504),), (t, 5504)),
        Case("mul", "mul", ((t, 5504), (t, 5504)), (t, 5504)),
        Case("scale", "scale", ((t, 4096),), (t, 4096), {"alpha": 0.125}),
        Case("add_n3", "add_n", ((t, 4096),) * 3, (t, 4096)),
        Case("sum_into", "sum_into", ((t, 4096), (t, 4096)), (t, 4096)),
    ]


class Timer:
    """Median device time (CUDA events around each call) and host time per call, on one CuPy stream."""

    def __init__(self, cp, reps: int, warmup: int, pad_n: int):
        self.cp, self.reps, self.warmup = cp, reps, warmup
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.sptr = self.stream.ptr
        self.pad_us = 0.0
        if pad_n:
            a = cp.random.standard_normal((pad_n, pad_n), dtype=cp.float32).astype(cp.float16)
            self._pad_args = (a, a.copy(), cp.empty_like(a))
            self.pad_us = self.time(lambda i: self.pad())[0]

    def pad(self):
        a, b, c = self._pad_args
        with self.stream:
            self.cp.matmul(a, b, out=c)

    def time(self, fn, n_sets: int = 1) -> tuple[float, float]:
        """(median device us, host us per call); ``fn(set_index)`` enqueues one call on ``self.stream``."""
        cp, s = self.cp, self.stream
        for i in range(self.warmup):
            fn(i % n_sets)
        s.synchronize()
        t0 = time.perf_counter()
        for i in range(self.reps):
            fn(i % n_sets)
        host_us = (time.perf_counter() - t0) / self.reps * 1e6
        s.synchronize()
        if self.pad_us:  # keep the GPU behind the host: the events then time the kernel alone
            for _ in range(min(50, max(1, math.ceil(self.reps * (host_us + 10) / self.pad_us)))):
                self.pad()
        evs = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(self.reps)]
        for i, (e0, e1) in enumerate(evs):
            e0.record(s)
            fn(i % n_sets)
            e1.record(s)
        s.synchronize()
        dev = [cp.cuda.get_elapsed_time(e0, e1) * 1e3 for e0, e1 in evs]
        return statistics.median(dev), host_us


def bench(tm: Timer, case: Case, dtype: str, rng, copy_gbps: float, numba_too: bool) -> dict:
    cp = tm.cp
    fk = fast.fast_kernel(case.op, list(case.in_shapes), case.out_shape, dtype, case.params)
    if fk is None:
        raise RuntimeError(f"not covered / unavailable: {fast.last_error()}")
    nbytes = fk.nbytes()
    n_sets = max(1, min(4, math.ceil(L2_BYTES / nbytes)))
    sets = []
    for _ in range(n_sets):
        ins = [cp.asarray(x) for x in make_inputs(case, dtype, rng)]
        out = ins[0] if case.op == "sum_into" else cp.empty(case.out_shape, dtype=NP_DTYPE[dtype])
        sets.append((out, ins))
    t0 = time.perf_counter()
    raws = [fk.bind(o.data.ptr, [x.data.ptr for x in ins]) for o, ins in sets]
    bind_us = (time.perf_counter() - t0) / n_sets * 1e6
    plan = fk.plan(sets[0][0].data.ptr, [x.data.ptr for x in sets[0][1]])
    cp.cuda.Device().synchronize()
    sptr = tm.sptr
    us, host_us = tm.time(lambda i: launch_raw(raws[i], sptr), n_sets)
    gbps = nbytes / us / 1e3
    # a device-to-device copy moving the same bytes (read + write), rotated the same way: small tiles pay
    # a fixed launch/ramp cost that the 1 GiB ceiling does not show
    half = nbytes // 2
    cbufs = [cp.empty(half, dtype=cp.uint8) for _ in range(2 * n_sets)]
    cptr = [b.data.ptr for b in cbufs]
    rt = cp.cuda.runtime
    same_us, _ = tm.time(lambda i: rt.memcpyAsync(cptr[2 * i], cptr[2 * i + 1], half, rt.memcpyDeviceToDevice, sptr),
                         n_sets)
    cbufs.clear()
    same_gbps = 2 * half / same_us / 1e3
    row = dict(op=case.name, dtype=dtype,
               shapes=" ".join("x".join(map(str, s)) for s in case.in_shapes) + " -> "
               + "x".join(map(str, case.out_shape)),
               kernel=plan.name, grid=plan.grid[0], block=plan.block[0], mbytes=round(nbytes / 1e6, 1),
               fast_us=round(us, 2), fast_gbps=round(gbps), fast_of_copy=round(gbps / copy_gbps, 3),
               same_copy_gbps=round(same_gbps), fast_of_same_copy=round(gbps / same_gbps, 3),
               fast_host_us=round(host_us, 2), bind_us=round(bind_us, 1),
               numba_us="", numba_gbps="", numba_of_copy="", numba_host_us="", speedup="")
    if numba_too:
        try:
            from cuda_kernels._numba import cuda
            from cuda_kernels.kernels import prepare

            lau = prepare(case.op, list(case.in_shapes), case.out_shape, dtype, case.params)
            nstream = cuda().external_stream(sptr)
            nsets = [(cuda().as_cuda_array(o), [cuda().as_cuda_array(x) for x in ins]) for o, ins in sets]
            nus, nhost = tm.time(lambda i: lau(nstream, nsets[i][0], nsets[i][1]), n_sets)
            ng = nbytes / nus / 1e3
            row.update(numba_us=round(nus, 2), numba_gbps=round(ng), numba_of_copy=round(ng / copy_gbps, 3),
                       numba_host_us=round(nhost, 2), speedup=round(nus / us, 2))
        except Exception as e:  # noqa: BLE001 - report and keep the fast-kernel row
            print(f"{case.name} {dtype}: numba kernel failed: {e!r}", file=sys.stderr, flush=True)
    del sets
    cp.get_default_memory_pool().free_all_blocks()
    return row


def fmt(r: dict) -> str:
    nb = (f"  numba {r['numba_us']:>8} us {r['numba_of_copy']:>5} of copy  fast/numba speedup {r['speedup']:>5}x"
          f"  numba host {r['numba_host_us']:>6} us") if r["numba_us"] != "" else ""
    return (f"{r['op']:<9} {r['dtype']}  {r['fast_us']:>8.1f} us {r['fast_gbps']:>5} GB/s "
            f"{r['fast_of_copy']:>5.3f} of copy ({r['fast_of_same_copy']:.3f} of a same-size copy)"
            f"  host {r['fast_host_us']:>5.2f} us/launch{nb}  [{r['kernel']}]")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--ops", default="", help="comma-separated tile names (default: all)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-numba", action="store_true")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the device-to-device copy ceiling")
    ap.add_argument("--pad", type=int, default=8192, help="fp16 GEMM size that keeps the GPU busy (0: none)")
    ap.add_argument("--out", default="", help="CSV path")
    a = ap.parse_args(argv)
    import cupy as cp

    rng = np.random.default_rng()
    tm = Timer(cp, a.reps, a.warmup, a.pad)
    n = a.copy_mib << 20
    bufs = [cp.empty(n, dtype=cp.uint8) for _ in range(2)]
    dst, src = (b.data.ptr for b in bufs)
    rt = cp.cuda.runtime
    copy_us, _ = tm.time(lambda i: rt.memcpyAsync(dst, src, n, rt.memcpyDeviceToDevice, tm.sptr))
    copy_gbps = 2 * n / copy_us / 1e3
    del bufs
    cp.get_default_memory_pool().free_all_blocks()
    dev = cp.cuda.Device()
    print(f"device {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, "
          f"{dev.attributes['MultiProcessorCount']} SMs; D2D copy ceiling {copy_gbps:.0f} GB/s (read + write, "
          f"{a.copy_mib} MiB); tokens {a.tokens}; pad GEMM {tm.pad_us:.0f} us", flush=True)
    want = set(filter(None, a.ops.split(",")))
    rows = []
    for dtype in a.dtypes.split(","):
        for case in tiles(a.tokens):
            if want and case.name not in want:
                continue
            try:
                rows.append(bench(tm, case, dtype, rng, copy_gbps, not a.no_numba))
                print(fmt(rows[-1]), flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{case.name} {dtype}: FAILED {e!r}", file=sys.stderr, flush=True)
    print(f"\nratios (copy ceiling {copy_gbps:.0f} GB/s):")
    print(f"{'op':<9} {'dtype':<5} {'MB':>6} {'fast/copy':>9} {'fast/same-size copy':>19} {'numba/copy':>10} "
          f"{'fast speedup':>12} {'host us':>8}")
    for r in rows:
        print(f"{r['op']:<9} {r['dtype']:<5} {r['mbytes']:>6} {r['fast_of_copy']:>9} {r['fast_of_same_copy']:>19} "
              f"{r['numba_of_copy']:>10} {r['speedup']:>12} {r['fast_host_us']:>8}")
    if a.out and rows:
        with open(a.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=[*rows[0], "copy_gbps"])
            w.writeheader()
            w.writerows([{**r, "copy_gbps": round(copy_gbps)} for r in rows])
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
