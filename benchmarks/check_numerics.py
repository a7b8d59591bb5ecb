"""Every intermediate tensor of a LLaMA-shaped plan on the CUDA backend against the numpy evaluation of its
taskgraph, for several launch modes: which vertex computes what it should not.

Compiles ``--layers`` layers of the model at ``--seq`` tokens, marks every tensor of the first layer (and the
output) as a plan output so that its final value can be read back, runs the plan on the GPU in each mode
(default; direct launches instead of graphs; numba kernels; numba launchers; the portable attention kernel
instead of cuDNN; deterministic dispatch) and prints, per logical tensor and mode, the worst relative error
of its blocks against ``turnip.memgraph.interp.evaluate_taskgraph`` (float32 numpy). Exit status 1 when
any error exceeds ``--tol``.

    PYTHONPATH=. python benchmarks/check_numerics.py --model llama-7b --seq 1024 --layers 1 --tile t=512 --tile kv=512
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--resident", default="auto")
    ap.add_argument("--tile", action="append", default=[], metavar="DIM=SIZE")
    ap.add_argument("--modes", nargs="+", default=["default", "direct", "numba-kernels", "numba-launch",
                                                     "portable-attention", "det"])
    ap.add_argument("--tol", type=float, default=2e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="cuda", help="cuda, or cpu to check the script itself")
    a = ap.parse_args(argv)

    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes
    from turnip.memgraph.interp import evaluate_taskgraph
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tiles = {d: int(s) for d, _, s in (t.partition("=") for t in a.tile)} or None
    budget = parse_nbytes(a.budget)
    tg = make_taskgraph(a.model, a.seq, 1, "fp16", tiles, n_layers=a.layers, budget_nbytes=budget)
    first = re.compile(r"^(x0|L0\.[^.\[]+)\[")
    for v in range(tg.n):
        if tg.kind[v] != 0 and tg.op[v] != "sum_into" and first.match(tg.name[v]):
            tg.is_output[v] = True
    mg = build_with_resident(tg, budget, None, a.resident)
    print(f"{tg.meta['tiles']}: {tg.n} taskgraph vertices, {mg.n} memgraph vertices, "
          f"{int(tg.is_output.sum())} outputs", flush=True)
    inputs = tile_inputs(tg, random_inputs_for(tg, a.seed))
    t0 = time.perf_counter()
    ref = evaluate_taskgraph(tg, inputs)
    print(f"numpy evaluation {time.perf_counter() - t0:.1f} s", flush=True)

    modes = {"default": {}, "direct": {"graphs": False}, "numba-kernels": {"fast": False},
             "numba-launch": {"bound": False}, "portable-attention": {}, "det": {}}  # fmt: skip
    errs: dict = {}
    for mode in a.modes:
        opts = modes[mode]
        restore = None
        if mode == "portable-attention":
            from cuda_kernels import cudnn_sdpa

            restore, cudnn_sdpa.supports = cudnn_sdpa.supports, lambda *args, **kw: False
        try:
            with open_backend(a.backend, mg, 5, **(opts if a.backend == "cuda" else {})) as be:
                be.write_inputs(inputs)
                for seed in range(2):
                    execute(mg, be, "det" if mode == "det" else "nondet", seed=seed)
                out = be.read_outputs()
        finally:
            if restore is not None:
                cudnn_sdpa.supports = restore
        for t, x in out.items():
            name = tg.name[t].split("[")[0]
            e = _rel(*(_values(tg, t, z) for z in (x, ref[t])))
            errs.setdefault(name, {})[mode] = max(e, errs.get(name, {}).get(mode, 0.0))
        print(f"mode {mode} done", flush=True)
    names = sorted(errs, key=lambda n: min(v for v in range(tg.n) if tg.name[v].split("[")[0] == n))
    print(f"{'tensor':<12}" + "".join(f"{m:>20}" for m in a.modes))
    bad = False
    for n in names:
        row = errs[n]
        bad |= any(row.get(m, 0) > a.tol for m in a.modes)
        print(f"{n:<12}" + "".join(f"{row.get(m, float('nan')):>20.2e}" for m in a.modes))
    return 1 if bad else 0


def _values(tg, t: int, x: np.ndarray) -> np.ndarray:
    """A tensor's values as float64; an attention partial as its output then its finite log-sum-exps."""
    if tg.op[t] == "sdpa" and tg.params[t].get("partial"):
        from turnip.reference import split_partial

        tq, h, dh = tg.shape[int(tg.args(t)[0])]
        o, lse = split_partial(x, tq, h, dh)
        return np.concatenate([o.ravel().astype(np.float64), np.where(np.isfinite(lse), lse, -1e30).ravel()])
    return x.astype(np.float64)


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    if not np.isfinite(x).all():
        return float("inf")
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


if __name__ == "__main__":
    sys.exit(main())
