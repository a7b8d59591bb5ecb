"""Memgraph build throughput: vertices, build seconds, vertices/s and peak RSS for the issue's configs.

Each configuration runs in a fresh process so peak RSS is its own. Ratios are printed against the targets
(20k vertices/s, 65B under 10 s) and against the original C++ compiler's published figure
(7B/4K/4 GPUs: ~22.5k vertices in 0.8 s).

    python benchmarks/compile_speed.py [--out benchmarks/results/compile_speed.csv] [--quick] [--fixed-tiles]
                                       [--no-reduce] [--train]

Plans use the tiles `turnip compile` picks for the budget; ``--fixed-tiles`` uses 2048-token tiles (about
2-6x more vertices), a harder throughput test. ``--no-reduce`` keeps every memory edge (no reduction at
emission): the cost of the reduction is the difference in build time. ``--train``: LoRA training steps
(rank 16 on q, k, v and the FFN, checkpointing as the budget picks) instead: 7B at 8 x 1K and 1 x 4K under
16 GiB, target: lower + build + verify of 8 x 1K within 10 s.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import resource
import sys
import time

CONFIGS = [
    ("llama-7b", 4096, 1, "6GiB"),
    ("llama-7b", 4096, 4, "4GiB"),
    ("llama-7b", 32768, 1, "8GiB"),
    ("llama-65b", 4096, 8, "20GiB"),
]
TRAIN_CONFIGS = [
    ("llama-7b", 1024, 1, "16GiB", 8),
    ("llama-7b", 4096, 1, "16GiB", 1),
]
TARGET_VPS = 20_000
CPP_VPS = 22_500 / 0.8


def one(cfg, q, budget_tiles=True, reduce=True):
    from turnip.compile import make_taskgraph, parse_nbytes
    from turnip.memgraph.build import BuildConfig, build_memgraph
    from turnip.memgraph.verify import verify

    model, seq, gpus, budget, *batch = cfg
    t0 = time.perf_counter()
    nbytes = parse_nbytes(budget)
    if batch:  # a LoRA training step, built as `turnip train` builds it
        from turnip.compile import build_with_resident
        from turnip.train import TrainSpec

        tg = make_taskgraph(model, seq, gpus, budget_nbytes=nbytes, train=TrainSpec(batch[0]))
        t1 = time.perf_counter()
        mg = build_with_resident(tg, nbytes, BuildConfig(reduce_memory_edges=reduce), "auto")
    else:
        tg = make_taskgraph(model, seq, gpus, budget_nbytes=nbytes if budget_tiles else None)
        t1 = time.perf_counter()
        mg = build_memgraph(tg, nbytes, BuildConfig(reduce_memory_edges=reduce))
    t2 = time.perf_counter()
    bad = len(verify(mg, tg))
    t3 = time.perf_counter()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    q.put(
        dict(
            model=model,
            batch=batch[0] if batch else 0,
            seq=seq,
            gpus=gpus,
            budget=budget,
            tg_vertices=tg.n,
            mg_vertices=mg.n,
            lower_s=round(t1 - t0, 3),
            build_s=round(t2 - t1, 3),
            verify_s=round(t3 - t2, 3),
            vertices_per_s=round(tg.n / (t2 - t1)),
            peak_rss_mib=round(rss / 2**20),
            violations=bad,
            n_offload=mg.stats["n_offload"],
            n_memory_edges=mg.stats["n_memory_edges"],
            n_memory_edges_dropped=mg.stats["n_memory_edges_dropped"],
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="CSV path")
    ap.add_argument("--quick", action="store_true", help="only the 7B/4K configs")
    ap.add_argument(
        "--fixed-tiles",
        action="store_true",
        help="2048-token tiles whatever the budget (larger plans) instead of the budget's defaults",
    )
    ap.add_argument("--no-reduce", action="store_true", help="keep memory edges that other paths imply")
    ap.add_argument("--train", action="store_true", help="LoRA training steps instead of prefills")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    configs = TRAIN_CONFIGS if a.train else CONFIGS
    for cfg in configs[:2] if a.quick else configs:
        q = ctx.Queue()
        p = ctx.Process(target=one, args=(cfg, q, not a.fixed_tiles, not a.no_reduce))
        p.start()
        r = q.get()
        p.join()
        r["ratio_vs_target"] = round(r["vertices_per_s"] / TARGET_VPS, 2)
        r["ratio_vs_cpp"] = round(r["vertices_per_s"] / CPP_VPS, 2)
        rows.append(r)
        batch = f"batch {r['batch']} " if r["batch"] else ""
        print(
            f"{r['model']:>10} {batch}seq {r['seq']:>6} gpus {r['gpus']} budget {r['budget']:>6}: "
            f"{r['tg_vertices']:>7} "
            f"vertices, lower {r['lower_s']:.2f} s, build {r['build_s']:.2f} s = {r['vertices_per_s']:,} v/s "
            f"(x{r['ratio_vs_target']} of target, x{r['ratio_vs_cpp']} of C++), verify {r['verify_s']:.2f} s, "
            f"peak RSS {r['peak_rss_mib']} MiB, memory edges {r['n_memory_edges']} (dropped "
            f"{r['n_memory_edges_dropped']}), violations {r['violations']}; lower + build + verify "
            f"{r['lower_s'] + r['build_s'] + r['verify_s']:.1f} s",
            flush=True,
        )
    if a.out:
        with open(a.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 1 if any(r["violations"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
