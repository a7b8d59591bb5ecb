"""Host-to-device copy rate by how the host pages were made: does a region filled by many threads copy slower?

A plan's host input region is plain memory whose pages the weight-writing threads touch first
(``turnip.runtime.loader.write_arrays``, up to 16 threads), registered in pieces of 1 GiB while it is filled
(``turnip.runtime.hostmem.PiecePinner``). Two traced decode steps of one plan on one H100 copied the same 8.41 GB
at 54.6 and 51.6 GB/s (``benchmarks/results/generate/generate_rows_h100.md``). This copies ``--gib`` GiB to the
GPU in chunks of ``--mib`` MiB on one stream, from:

- ``torch`` pinned memory (``cudaHostAlloc``);
- plain memory touched by one thread, registered whole;
- plain memory touched by ``--threads`` threads (each a contiguous share, as the loader's jobs), registered whole;
- the same, registered in pieces of 1 GiB (each chunk inside one piece);

and prints the machine's NUMA nodes and the GPU's, one line per row (the best of ``--reps``) and a JSON line.

    PYTHONPATH=. python benchmarks/h2d_pages.py [--gib 8] [--mib 32 90] [--threads 16] [--reps 2]

Needs a CUDA device and torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

GiB, PAGE = 1 << 30, 4096


def numa() -> dict:
    """The NUMA nodes' CPU lists (``/sys/devices/system/node``; empty where there is none)."""
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {p.name: (p / "cpulist").read_text().strip() for p in nodes if (p / "cpulist").is_file()}


def gpu_node(torch) -> str:
    """The GPU's NUMA node from sysfs (-1: none reported; '?' where it cannot be read)."""
    try:
        bus = torch.cuda.get_device_properties(0).pci_bus_id.lower()  # e.g. 0000:1b:00.0
        return Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text().strip()
    except (AttributeError, OSError):
        return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0, help="GiB copied per measurement")
    ap.add_argument("--mib", type=int, nargs="+", default=[32, 90], help="copy sizes in MiB")
    ap.add_argument("--threads", type=int, default=16, help="threads touching the pages of the threaded rows")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per row (the fastest is reported)")
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    n = int(a.gib * GiB) // PAGE * PAGE
    cudart = torch.cuda.cudart()
    print(f"NUMA nodes {numa() or 'none'}; GPU 0 on node {gpu_node(torch)}", flush=True)

    def plain(threads: int) -> np.ndarray:
        buf = np.empty(n + PAGE, dtype=np.uint8)
        x = buf[-buf.ctypes.data % PAGE :][:n]
        share = -(-n // threads) // PAGE * PAGE or PAGE
        spans = [(i, min(i + share, n)) for i in range(0, n, share)]

        def touch(span):
            x[span[0] : span[1]] = 1

        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(touch, spans))
        return x

    def register(x: np.ndarray, piece: int) -> list[int]:
        ptrs = []
        for i in range(0, len(x), piece):
            p = x.ctypes.data + i
            r = cudart.cudaHostRegister(p, min(piece, len(x) - i), 1)  # portable
            if int(r) != 0:
                raise RuntimeError(f"cudaHostRegister: {r}")
            ptrs.append(p)
        return ptrs

    def rate(host: torch.Tensor, chunk: int, piece: int) -> float:
        k = n // chunk
        starts = [i * chunk for i in range(k)]
        if piece < n:  # each copy inside one registered piece
            starts = [s for s in range(0, n - chunk + 1, chunk) if s // piece == (s + chunk - 1) // piece][:k]
        dst = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        best = 0.0
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for s in starts:
                    dst.copy_(host[s : s + chunk], non_blocking=True)
            stream.synchronize()
            best = max(best, len(starts) * chunk / (time.perf_counter() - t0) / 1e9)
        return best

    rows: dict[str, dict[int, float]] = {}
    sources = [("torch pinned", None, n), ("plain, 1 thread, registered whole", 1, n),
               (f"plain, {a.threads} threads, registered whole", a.threads, n),
               (f"plain, {a.threads} threads, registered in 1 GiB pieces", a.threads, GiB)]  # fmt: skip
    for name, threads, piece in sources:
        if threads is None:
            host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            ptrs = []
        else:
            x = plain(threads)
            ptrs = register(x, piece)
            host = torch.from_numpy(x)
        rows[name] = {m: rate(host, m << 20, piece) for m in a.mib}
        print(f"{name:52s} " + "  ".join(f"{m} MiB {g:5.1f} GB/s" for m, g in rows[name].items()), flush=True)
        for p in ptrs:
            cudart.cudaHostUnregister(p)
        del host
    print(json.dumps({"gib": a.gib, "numa": numa(), "rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
