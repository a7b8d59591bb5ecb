"""The host side of a generation's bucket switch: a decode plan's KV-cache blocks written from the host copy
(``turnip.kvcache.HostCache``) into a host input region, the way it was (``HostCache.block_inputs`` as
contiguous tiles, written by one thread: each head slice copied twice) against ``write_tiles`` (the slices
themselves, copied once, by threads); alternating, CPU only.

    PYTHONPATH=. python benchmarks/cache_write.py [--batch 16] [--blocks 2] [--pairs 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    from turnip.decode import DecodeShape, decode_step
    from turnip.kvcache import HostCache
    from turnip.models import LLAMA
    from turnip.runtime.loader import HostRegion, write_tiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b", choices=sorted(LLAMA))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2, help="cache blocks per layer")
    ap.add_argument("--block", type=int, default=256, help="slots per block")
    ap.add_argument("--pairs", type=int, default=4, help="old/new pairs timed")
    a = ap.parse_args(argv)
    cfg = LLAMA[a.model]
    tg = decode_step(cfg, DecodeShape(batch=a.batch, n_blocks=a.blocks, block=a.block), 1, "fp16", 6 << 30)
    cache = HostCache(cfg, a.batch, a.block, "fp16")
    cache.ensure(a.blocks)
    region = HostRegion(tg, tensors=[int(c["input"]) for c in tg.meta["kv"]])  # the cache blocks alone
    nbytes = sum(int(tg.nbytes[t]) for t in region.input_offsets)
    rng = np.random.default_rng(0)
    for x in cache.blocks.values():  # values of their own in every block (a sample of rows: quick)
        x[:: max(1, a.block // 8), :, :, :4] = rng.standard_normal((x[:: max(1, a.block // 8)].shape[0], a.batch,
                                                                     cfg.kv_heads, 4))  # fmt: skip
    times: dict[str, list[float]] = {"one thread, contiguous first": [], "write_tiles": []}
    written = {}
    for _ in range(a.pairs):
        for way in times:
            region.host_in[:] = 0
            t0 = time.perf_counter()
            if way == "write_tiles":
                write_tiles(region, tg, cache.block_inputs(tg, views=True))
            else:
                region.write_inputs(cache.block_inputs(tg))
            times[way].append(time.perf_counter() - t0)
            written[way] = region.host_in[:: 1 + (1 << 12)].copy()  # every 4097th byte
    same = np.array_equal(*written.values())
    if not same:
        print("the two ways wrote different bytes")
    print(f"LLaMA-{a.model} shapes, batch {a.batch}, {a.blocks} blocks of {a.block} slots: {nbytes / 1e9:.2f} GB; "
          f"{'the same bytes' if same else 'DIFFERENT bytes'} (a sample of every 4,097th) both ways")  # fmt: skip
    for way, ts in times.items():
        print(f"{way:30s} {min(ts):.2f}-{max(ts):.2f} s, median {float(np.median(ts)):.2f} s "
              f"({nbytes / 1e9 / float(np.median(ts)):.1f} GB/s)")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
