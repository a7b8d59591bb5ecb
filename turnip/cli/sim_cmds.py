"""``turnip simulate``, ``turnip ablate`` and ``turnip report``: what-if runs on a laptop."""

from __future__ import annotations

import argparse
import sys

POLICY_HELP = (
    "nondet: launch anything ready whose resources are free (ties by compile order); "
    "nondet-cp: ties by critical path; det: each GPU issues everything in compile order (the paper's "
    "ablation); det-kernels: only kernels in fixed order"
)


def register(sub) -> None:
    from turnip.sched import POLICIES

    s = sub.add_parser(
        "simulate",
        help="replay a plan in the discrete-event simulator",
        description="Simulate a compiled plan on a virtual GPU server (SimPy), driving the same scheduler "
        "core as real runs. PLAN is a plan file from `turnip compile -o`, or MODEL:SEQ:GPUS:BUDGET "
        "(e.g. llama-7b:4096:1:6GiB) to compile on the fly.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("plan", metavar="PLAN")
    s.add_argument("--policy", default="nondet", choices=POLICIES, help=POLICY_HELP)
    s.add_argument("--runs", type=int, default=20, help="replications (seeds seed..seed+runs-1)")
    s.add_argument("--seed", type=int, default=0, help="first seed")
    s.add_argument("--profile", default="h100", help="machine profile: preset name or .toml/.json file")
    s.add_argument("--mean-only", action="store_true", help="no timing variance: every duration at its mean")
    s.add_argument("--trace", metavar="OUT.json", help="write the first run as a Chrome/Perfetto trace")
    s.add_argument("--csv", metavar="OUT.csv", help="write one row per run")
    s.set_defaults(func=cmd_simulate)

    a = sub.add_parser(
        "ablate",
        help="sweep models x seq lens x GPUs x budgets x policies x seeds; write CSVs, PNGs, a trace",
        description="Run an ablation sweep on all local cores. Without options: LLaMA-7B prefill at 1K, 4K "
        "and 16K tokens, 1 and 4 GPUs, a tight (1 GiB) and a roomy (16 GiB) budget per GPU, det vs nondet, "
        "10 seeds (+ one noise-free run each), on the h100 profile. Plans are compiled once and cached in "
        "OUT/plans. Options override the config file, which overrides the defaults.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a.add_argument("--config", metavar="FILE.toml", help="sweep config ([ablate] table with the keys below)")
    a.add_argument("--models", nargs="+", help="e.g. llama-7b llama-13b (default llama-7b)")
    a.add_argument("--seqs", nargs="+", type=int, help="sequence lengths (default 1024 4096 16384)")
    a.add_argument("--gpus", nargs="+", type=int, help="GPU counts (default 1 4)")
    a.add_argument("--budgets", nargs="+", metavar="NAME=SIZE", help="default tight=1GiB roomy=16GiB")
    a.add_argument("--policies", nargs="+", choices=POLICIES, help="default det nondet")
    a.add_argument("--seeds", type=int, help="seeds per configuration and policy (default 10)")
    a.add_argument("--no-mean-only", action="store_true", help="skip the noise-free runs")
    a.add_argument("--profile", help="machine profile (default h100)")
    a.add_argument("--jobs", type=int, default=None, help="processes (default: all cores)")
    a.add_argument("--out", default="reports", help="output directory")
    a.set_defaults(func=cmd_ablate)

    r = sub.add_parser(
        "report",
        help="rebuild summary.csv and figures from a report directory",
        description="Read DIR/runs.csv (and DIR/traces/) and write DIR/summary.csv and DIR/figures/*.png; "
        "print the nondet-over-det speedup table.",
    )
    r.add_argument("dir", metavar="DIR")
    r.set_defaults(func=cmd_report)


def _plan(spec: str):
    from pathlib import Path

    if Path(spec).exists():
        from turnip.memgraph.io import load_plan

        return load_plan(spec)[0], {"plan": spec}
    parts = spec.split(":")
    if len(parts) != 4:
        raise SystemExit(f"turnip simulate: {spec!r} is neither a file nor MODEL:SEQ:GPUS:BUDGET")
    from turnip.compile import compile_model

    model, seq, gpus, budget = parts
    mg = compile_model(model, int(seq), int(gpus), budget)[1]
    return mg, {"model": model, "seq": int(seq), "gpus": int(gpus), "budget": budget}


def cmd_simulate(a) -> int:
    import numpy as np

    from sim.engine import simulate
    from sim.profile import load_profile
    from sim.timing import TimingModel
    from turnip.progress import Progress

    mg, meta = _plan(a.plan)
    prof = load_profile(a.profile)
    tm = TimingModel(mg, prof)
    rows, bar = [], Progress(a.runs, "simulate")
    for i in range(a.runs):
        r = simulate(mg, prof, a.policy, a.seed + i, a.mean_only, tm)
        if i == 0 and a.trace:
            r.trace(mg, meta).write_chrome(a.trace)
        rows.append({"seed": r.seed, "makespan_ns": r.makespan_ns, "lower_bound_ns": r.lower_bound_ns,
                     "wall_s": r.wall_s})  # fmt: skip
        bar.update(i + 1)
    bar.close()
    ms = np.array([x["makespan_ns"] for x in rows]) / 1e6
    lb = rows[0]["lower_bound_ns"] / 1e6
    rate = mg.n * len(rows) / sum(x["wall_s"] for x in rows)
    print(f"{mg.n} vertices, {mg.n_gpus} GPU(s), policy {a.policy}, profile {prof.name}, {a.runs} run(s)")
    print(f"makespan  mean {ms.mean():.3f} ms  sd {ms.std():.3f}  min {ms.min():.3f}  max {ms.max():.3f}")
    print(f"lower bound {lb:.3f} ms ({', '.join(f'{k} {v / 1e6:.1f}' for k, v in r.bound.items())})")
    print(f"efficiency {lb / ms.mean():.3f}; simulated {rate:,.0f} vertices/s")
    if a.trace:
        print(f"trace: {a.trace} (open in https://ui.perfetto.dev)")
    if a.csv:
        import pandas as pd

        pd.DataFrame(rows).assign(policy=a.policy, mean_only=a.mean_only, **meta).to_csv(a.csv, index=False)
    return 0


def cmd_ablate(a) -> int:
    from sim.sweep import SweepConfig, run_sweep

    budgets = None
    if a.budgets:
        try:
            budgets = dict(b.split("=", 1) for b in a.budgets)
        except ValueError:
            print("turnip ablate: --budgets takes NAME=SIZE items, e.g. tight=1GiB", file=sys.stderr)
            return 2
    over = {"models": a.models, "seqs": a.seqs, "gpus": a.gpus, "budgets": budgets, "policies": a.policies,
            "seeds": a.seeds, "profile": a.profile, "mean_only": False if a.no_mean_only else None}  # fmt: skip
    if a.config:
        cfg = SweepConfig.from_toml(a.config, **over)
    else:
        cfg = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in over.items() if v is not None})
    if cfg.trace.get("budget") not in cfg.budgets:
        cfg = SweepConfig(**{**cfg.__dict__, "trace": {**cfg.trace, "budget": next(iter(cfg.budgets))}})
    run_sweep(cfg, a.out, a.jobs)
    return 0


def cmd_report(a) -> int:
    from pathlib import Path

    from analysis.report import write_report

    if not (Path(a.dir) / "runs.csv").exists():
        print(f"turnip report: no runs.csv in {a.dir}; run `turnip ablate --out {a.dir}` first", file=sys.stderr)
        return 2
    write_report(a.dir)
    print(f"wrote {a.dir}/summary.csv and {a.dir}/figures/")
    return 0
