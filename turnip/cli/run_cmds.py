"""``turnip run``: execute a compiled plan for real, on GPUs (cuda) or on the CPU (cpu)."""

from __future__ import annotations

import argparse
import sys
import time

from turnip.cli import format_nbytes as _sz


def register(sub) -> None:
    from turnip.compile import MODELS
    from turnip.runtime import BACKENDS
    from turnip.sched import POLICIES

    p = sub.add_parser(
        "run",
        help="execute a plan on GPUs (cuda) or on the CPU (cpu) with the real runtime",
        description="Compile a model (or load PLAN, a file from `turnip compile -o` with its taskgraph) and "
        "run it for real with the same scheduler core the simulator drives. Weights are random (--seed) or "
        "read from --weights (a .safetensors file with turnip or Hugging Face LLaMA names; see "
        "docs/runtime.md). Prints time to first token (the prefill makespan), bytes moved, GPU busy "
        "fraction, host cost per vertex and the plan's lower bound next to the measured time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("plan", nargs="?", metavar="PLAN", help="plan file (default: compile --model ...)")
    p.add_argument("--model", default="llama-tiny", choices=MODELS)
    p.add_argument("--seq", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--budget", default="6GiB", help="GPU memory budget per GPU")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "fp32"])
    p.add_argument("--resident", default="0", help="bytes of inputs kept on the GPU across runs, or 'auto'")
    p.add_argument("--tile", action="append", default=[], metavar="DIM=SIZE", help="tile size override")
    p.add_argument("--backend", default="cpu", choices=BACKENDS)
    p.add_argument("--policy", default="nondet", choices=POLICIES)
    p.add_argument("--streams", type=int, default=5, help="stream slots per GPU")
    p.add_argument("--numba-kernels", action="store_true",
                   help="cuda: numba memory-bound kernels instead of the CUDA C++ ones (16-byte accesses, warp "
                   "reductions; those need CuPy)")
    p.add_argument("--graph-events", action="store_true",
                   help="cuda: record each vertex's end event inside its graph (one driver call per launch)")
    p.add_argument("--numba-launch", action="store_true",
                   help="cuda: launch through numba launchers instead of bound driver calls (slower)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (kernel modules, cuBLAS handles)")
    p.add_argument("--seed", type=int, default=0, help="weights / inputs seed (and chaos seeds)")
    p.add_argument("--weights", metavar="FILE.safetensors", help="read weights from this file")
    p.add_argument("--chaos", type=float, default=0.0, help="cpu: probability of a random delay per vertex")
    p.add_argument("--stall-s", type=float, default=60.0, help="watchdog: stop when nothing completes this long")
    p.add_argument("--check", action="store_true", help="compare outputs with the taskgraph evaluated in numpy")
    p.add_argument("--profile", default="h100", help="machine profile for the lower bound")
    p.add_argument("--trace", metavar="OUT.json", help="write the last timed run as a Chrome/Perfetto trace")
    p.add_argument("--csv", metavar="OUT.csv", help="write one row per timed run (the simulator's columns)")
    p.set_defaults(func=cmd_run)


def _plan(a):
    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes

    if a.plan:
        from turnip.memgraph.io import load_plan

        mg, tg = load_plan(a.plan)
        if tg is None:
            raise SystemExit(f"turnip run: {a.plan} holds no taskgraph (compile it again with this version)")
        return tg, mg, {"plan": a.plan, "model": tg.meta.get("model", "?")}
    tiles = {d: int(s) for d, _, s in (t.partition("=") for t in a.tile)}
    budget = parse_nbytes(a.budget)
    tg = make_taskgraph(a.model, a.seq, a.gpus, a.dtype, tiles or None, seed=a.seed, budget_nbytes=budget)
    mg = build_with_resident(tg, budget, None, a.resident)
    return tg, mg, {"model": a.model, "seq": a.seq, "gpus": a.gpus, "budget": a.budget, "budget_nbytes": budget}


def _inputs(a, tg):
    import numpy as np

    from turnip.runtime.weights import load_weights, logical_inputs, random_inputs_for, tile_inputs

    if "ids" not in logical_inputs(tg):  # not a LLaMA: the test inputs of the reference interpreter
        from turnip.memgraph.interp import random_inputs

        return random_inputs(tg, np.random.default_rng(a.seed))
    logical = random_inputs_for(tg, a.seed)
    if a.weights:
        from turnip.models import LLAMA

        heads = LLAMA[tg.meta["model"].split("-", 1)[1]].n_heads
        logical |= load_weights(tg, a.weights, heads)
    return tile_inputs(tg, logical)


def cmd_run(a) -> int:
    from turnip.runtime import BackendError, RuntimeStall, VertexFailed, execute, open_backend

    t0 = time.perf_counter()
    tg, mg, meta = _plan(a)
    values = _inputs(a, tg)
    t_plan = time.perf_counter() - t0
    bound = _bound(mg, a.profile)
    opts = {"chaos": a.chaos} if a.backend == "cpu" else {"fast": not a.numba_kernels, "bound": not a.numba_launch,
                                                           "graph_events": a.graph_events}
    rows, res = [], None
    try:
        t1 = time.perf_counter()
        with open_backend(a.backend, mg, a.streams, **opts) as be:
            be.write_inputs(values)
            t_load = time.perf_counter() - t1
            print(f"{mg.n} vertices on {mg.n_gpus} GPU(s), backend {a.backend}, policy {a.policy}; "
                  f"plan {t_plan:.1f} s, load {t_load:.1f} s")  # fmt: skip
            for i in range(a.warmup + a.repeat):
                res = execute(mg, be, a.policy, a.streams, seed=a.seed + i, stall_s=a.stall_s)
                if i >= a.warmup:
                    rows.append(res.row(mg, meta, bound))
            outs = be.read_outputs()
    except (VertexFailed, RuntimeStall, BackendError) as e:
        print(f"turnip run: {e}", file=sys.stderr)
        return 1
    _report(rows, bound, res, int(mg.stats.get("resident_input_nbytes", 0)))
    ok = True
    if a.check:
        from turnip.memgraph.interp import evaluate_taskgraph

        ref = evaluate_taskgraph(tg, values)
        err = max(_rel(outs[t], ref[t]) for t in outs)
        ok = err <= (2e-2 if a.dtype == "fp16" else 1e-4)
        print(f"check     max relative error vs numpy taskgraph evaluation: {err:.2e} ({'ok' if ok else 'FAILED'})")
    if a.trace and res is not None:
        res.trace(mg, meta).write_chrome(a.trace)
        print(f"trace     {a.trace} (open in https://ui.perfetto.dev)")
    if a.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(a.csv, index=False)
        print(f"csv       {a.csv}")
    return 0 if ok else 1


def _rel(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _bound(mg, profile: str) -> dict:
    from turnip.runtime.driver import lower_bound

    return lower_bound(mg, profile)


def _report(rows: list[dict], bound: dict, res, resident_nbytes: int = 0) -> None:
    """Print the run summary; trace byte counts exclude resident inputs (moved when the plan loaded)."""
    import numpy as np

    if not rows:
        return
    ms = np.array([r["makespan_ns"] for r in rows]) / 1e6
    r = rows[-1]
    inputs = r["input_nbytes"]
    moved = inputs + r["reload_nbytes"] + r["offload_nbytes"] + r["transfer_nbytes"]
    lb = bound["lower_bound_ns"] / 1e6
    print(f"time to first token  median {np.median(ms):.3f} ms  min {ms.min():.3f}  max {ms.max():.3f} "
          f"({len(ms)} runs)")  # fmt: skip
    print(f"bytes moved          {_sz(moved)} (inputs {_sz(inputs)}, resident {_sz(resident_nbytes)} loaded "
          f"with the plan, reloads "
          f"{_sz(r['reload_nbytes'])}, offloads {_sz(r['offload_nbytes'])}, GPU->GPU "
          f"{_sz(r['transfer_nbytes'])})")  # fmt: skip
    print(f"GPU busy fraction    {np.median([x['gpu_busy_frac'] for x in rows]):.3f}")
    hc = res.host_cost_ns()[res.issue_ns > 0] / 1e3  # issued vertices (not resident inputs)
    print(f"host cost / vertex   median {np.median(hc):.1f} us, p90 {np.percentile(hc, 90):.1f} us "
          "(issue + completion handling)")  # fmt: skip
    parts = ", ".join(f"{k[:-3]} {v / 1e6:.2f}" for k, v in bound.items() if k != "lower_bound_ns")
    print(f"lower bound          {lb:.3f} ms ({parts}); efficiency {lb / np.median(ms):.3f}")
