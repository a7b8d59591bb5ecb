"""Random weights into a loaded plan's host input region: GB/s of the sequential stream (``write_streaming`` of
``iter_random_inputs``) and of the thread pool (``write_random_inputs``) with 1, 2 and all cores' threads, on
the CPU backend (its host input region is plain memory, touched once before timing as pinned memory is).
Every fill is checked against the stream's bytes (a 64-bit sum of the region). Ratios are against the
stream measured in the same run.

    PYTHONPATH=. python benchmarks/fill_speed.py [--model llama-7b] [--layers N] [--threads 1 2 16]

The full 7B needs ~14 GB of host memory for its input region (``--layers`` fewer decoder layers for less).
Seen (full 7B, 12.95 GB): a 64-core H100 host: stream 3.1 GB/s; pool 6.5 (1 thread), 13.1 (2), 19.1 (4),
26.7 (8), 32.3 GB/s (16 threads, 10.4x); the same 7B into the CUDA backend's pinned region: stream 2.2 GB/s,
pool 33 GB/s (16 threads). A shared 2-core VM: stream 0.95 GB/s; pool 2.8 GB/s (1 or 2 threads, 2.9x: its
copy bandwidth, ~4 GB/s, is the limit).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnip.compile import compile_model  # noqa: E402
from turnip.runtime import open_backend  # noqa: E402
from turnip.runtime.weights import iter_random_inputs, write_random_inputs, write_streaming  # noqa: E402


def fingerprint(region: np.ndarray) -> int:
    """A 64-bit sum of the region's bytes (as little-endian words; the tail bytes added one by one)."""
    n = region.size // 8 * 8
    return int(region[:n].view(np.uint64).sum(dtype=np.uint64)) + int(region[n:].sum())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=None, help="first N decoder layers only (default: all)")
    p.add_argument("--budget", default="2GiB", help="GPU budget of the plan (the CPU backend's arena)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1, 2 and all cores")
    a = p.parse_args(argv)
    cores = os.cpu_count() or 1
    threads = a.threads or sorted({1, 2, cores})
    t0 = time.perf_counter()
    tg, mg = compile_model(a.model, a.seq, 1, a.budget, n_layers=a.layers)
    with open_backend("cpu", mg, 1) as be:
        region = be.host_in
        region.fill(0)  # fault the pages in once, as pinned memory comes
        print(f"{a.model} ({a.layers or 'all'} layers), seq {a.seq}: input region {region.nbytes / 1e9:.2f} GB, "
              f"plan + load {time.perf_counter() - t0:.1f} s, {cores} cores")  # fmt: skip
        t = time.perf_counter()
        nbytes = write_streaming(be, tg, iter_random_inputs(tg, a.seed))
        base_s = time.perf_counter() - t
        want = fingerprint(region)
        base = nbytes / base_s / 1e9
        print(f"{'sequential stream':<24} {base_s:7.2f} s  {base:6.2f} GB/s  1.00x")
        for k in threads:
            region.fill(0)
            t = time.perf_counter()
            n = write_random_inputs(be, tg, a.seed, threads=k)
            dt = time.perf_counter() - t
            ok = n == nbytes and fingerprint(region) == want
            print(f"{f'thread pool, {k} threads':<24} {dt:7.2f} s  {n / dt / 1e9:6.2f} GB/s  {base_s / dt:4.2f}x"
                  f"{'' if ok else '  BYTES DIFFER'}")  # fmt: skip
            if not ok:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
