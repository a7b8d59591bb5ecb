"""LLaMA prefill and LoRA steps on 1, 2, 4 ... GPUs of one server, in one session: times, bounds, host cost,
reproducibility, exit status.

Prefill rows (``--rows SEQ:BUDGET``, ``none`` = a 60 GiB arena per GPU: every weight resident) run in this
process, one plan at a time, for each GPU count of ``--gpus``, split of ``--splits`` and policy of
``--policies``: random fp16 weights (seeded), ``--warmup`` untimed runs, ``--repeat`` timed runs (median),
the plan's lower bound on ``--profile`` and its busiest GPU's kernels at the clock the power limit sustains
(``sustained_ms``, an estimate), the host cost per vertex, and whether two nondeterministic runs gave bitwise
equal outputs. LoRA rows (``--lora BxS:BUDGET``) run `turnip train` in a subprocess per GPU count
(its CSV gives the step times; its exit code and stderr are checked: a run that aborts at exit is a failure).

    PYTHONPATH=. python benchmarks/multi_gpu.py --gpus 1 2 4 --rows 4096:none 4096:6GiB --out res/
    PYTHONPATH=. python benchmarks/multi_gpu.py --gpus 1 2 4 --rows --lora 8x1024:16GiB --out res/

Results: ``<out>/multi_gpu<tag>.csv`` (one row per configuration) and a table on stdout with each row's time
over the same row's one-GPU time, its bound and its sustained kernel time.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def prefill_row(a, seq: int, budget: str, gpus: int, split: str, batch: int = 1) -> list[dict]:
    from turnip.compile import compile_model
    from turnip.machine.bound import plan_bound, plan_sustained_ns
    from turnip.runtime import execute, open_loaded

    kw = {"split": split} if split != "default" else {}
    if batch > 1:
        kw["batch"] = batch
    t0 = time.perf_counter()
    b = "60GiB" if budget == "none" else budget
    tg, mg = compile_model(a.model, seq=seq, gpus=gpus, budget=b, resident="auto", n_layers=a.layers, **kw)
    t_compile = time.perf_counter() - t0
    bound = plan_bound(mg, a.profile)
    sustained = plan_sustained_ns(mg, a.profile) / 1e6
    t0 = time.perf_counter()
    rows = []
    with open_loaded("cuda", tg, mg, seed=a.seed, graph_events=a.graph_events) as be:
        t_load = time.perf_counter() - t0
        ph = dict(getattr(be, "load_phases_s", {}))
        ph = {"fill": t_load - sum(ph.values()), **ph}  # the writing threads; alloc, open, pin, resident: the backend
        phases = " ".join(f"{k}={v:.2f}" for k, v in ph.items())
        opened = " ".join(f"{k}={v:.2f}" for k, v in getattr(be, "open_phases_s", {}).items())
        outs = {}
        for policy in a.policies:
            for i in range(a.warmup):
                execute(mg, be, policy, seed=i, device_times=False)
            res = [execute(mg, be, policy, seed=100 + i, device_times=False) for i in range(a.repeat)]
            got = be.read_outputs()
            ms = sorted(r.makespan_ns / 1e6 for r in res)
            hc = np.concatenate([r.command_host_cost_ns() for r in res])
            outs[policy] = got
            same = None
            if policy.startswith("nondet"):
                execute(mg, be, policy, seed=999, device_times=False)
                again = be.read_outputs()
                same = all(np.array_equal(got[t], again[t]) for t in got)
            rows.append({"workload": "prefill", "model": a.model, "seq": seq, "batch": batch, "budget": budget,
                         "gpus": gpus,
                         "split": tg.meta.get("split_choice", tg.meta.get("split", split)), "policy": policy,
                         "ms_median": ms[len(ms) // 2],
                         "ms_min": ms[0], "bound_ms": bound["lower_bound_ns"] / 1e6,
                         "bound_parts": ";".join(f"{k}={v / 1e6:.2f}" for k, v in bound.items()),
                         "sustained_ms": sustained,
                         "vertices": mg.n, "host_us_p50": float(np.median(hc)) / 1e3,
                         "host_ms_per_run": float(hc.sum()) / 1e6 / len(res), "bitwise_repeat": same,
                         "compile_s": round(t_compile, 2), "load_s": round(t_load, 2), "load_phases": phases,
                         "open_phases": opened,
                         "load_gb_per_s": round(be.lay.host_input_nbytes / 1e9 / t_load, 2), "rc": 0})  # fmt: skip
            print(_fmt(rows[-1]), flush=True)
    return rows


def lora_row(a, spec: str, gpus: int, split: str) -> dict:
    bs, budget = spec.split(":")
    batch, seq = bs.split("x")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.csv"
        argv = ["train", "--model", a.model, "--batch", batch, "--seq", seq, "--budget", budget, "--gpus", str(gpus),
                "--backend", "cuda", "--steps", str(a.steps), "--csv", str(out)]  # fmt: skip
        if a.layers:
            argv += ["--layers", str(a.layers)]
        if split != "default":
            argv += ["--split", split]
        t0 = time.perf_counter()
        cli = "import sys; from turnip.cli import main; sys.exit(main(sys.argv[1:]))"
        p = subprocess.run([sys.executable, "-c", cli, *argv], capture_output=True, text=True, timeout=a.timeout)
        wall = time.perf_counter() - t0
        steps = [float(r["makespan_ms"]) for r in csv.DictReader(open(out))] if out.exists() else []
    later = sorted(steps[1:] or steps)  # the first step warms up
    split_line = next((ln for ln in p.stdout.splitlines() if ln.startswith("split")), "")
    row = {"workload": "lora", "model": a.model, "seq": int(seq), "batch": int(batch), "budget": budget, "gpus": gpus,
           "split": split_line or split, "policy": "nondet", "ms_median": later[len(later) // 2] if later else None,
           "ms_min": later[0] if later else None, "rc": p.returncode, "seconds": round(wall, 1),
           "stderr_tail": " | ".join(p.stderr.strip().splitlines()[-4:])[-800:]}  # fmt: skip
    print(_fmt(row), flush=True)
    if p.returncode:
        print("   stderr: " + row["stderr_tail"], flush=True)
    return row


def _fmt(r: dict) -> str:
    ms = f"{r['ms_median']:9.1f} ms" if r.get("ms_median") is not None else "   failed  "
    extra = f" bound {r['bound_ms']:.1f} host {r['host_us_p50']:.1f} us x {r['vertices']}" if "bound_ms" in r else ""
    rep = f" bitwise {r['bitwise_repeat']}" if r.get("bitwise_repeat") is not None else ""
    if r.get("load_phases"):
        rep += f" load {r['load_s']} s ({r['load_gb_per_s']} GB/s: {r['load_phases']}; open: {r.get('open_phases')})"
    return (f"{r['workload']:7s} {r['seq']:6d} {r['budget']:>6s} {r['gpus']} GPU {str(r['split'])[:40]:12s} "
            f"{r['policy']:8s} {ms}{extra}{rep} rc {r['rc']}")  # fmt: skip


def write_csv(path, rows: list[dict]) -> None:
    """``rows`` as a CSV with every key any row has (here after each configuration: a run stopped at its limit
    keeps what it measured; the other multi-GPU scripts write theirs with it too)."""
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rows", nargs="*", default=["4096:none", "4096:6GiB"],
                    help="prefill SEQ:BUDGET or SEQxBATCH:BUDGET rows")
    ap.add_argument("--graph-events", action="store_true", help="end events recorded inside the graphs")
    ap.add_argument("--lora", nargs="*", default=[], help="LoRA BATCHxSEQ:BUDGET rows")
    ap.add_argument("--splits", nargs="+", default=["default"], help="default, tensor, layers, auto")
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="LoRA steps (the first is not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="auto",
                    help="profile of the bounds (auto: the shipped one of the GPU, h100-calibrated without one)")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    from turnip.runtime.driver import machine_profile

    a.profile = machine_profile(a.profile, "cuda", fallback="h100-calibrated")
    rows: list[dict] = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    visible = int(os.environ.get("TURNIP_GPUS", "0")) or None
    for spec in a.rows:
        shape, budget = spec.split(":")
        seq, _, batch = shape.partition("x")
        for g in a.gpus:
            if visible and g > visible:
                continue
            for split in a.splits if g > 1 else ["default"]:
                try:
                    rows += prefill_row(a, int(seq), budget, g, split, int(batch or 1))
                except Exception as e:  # noqa: BLE001 - one failed configuration does not end the session
                    print(f"prefill {seq}:{budget} {g} GPUs {split}: {type(e).__name__}: {e}", flush=True)
                write_csv(out / f"multi_gpu{a.tag}.csv", rows)
    for spec in a.lora:
        for g in a.gpus:
            for split in a.splits if g > 1 else ["default"]:
                rows.append(lora_row(a, spec, g, split))
                write_csv(out / f"multi_gpu{a.tag}.csv", rows)
    if not rows:
        return 1
    print("\n| workload | seq | budget | GPUs | split | policy | ms | / 1 GPU | bound / ms | sustained / ms | rc |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    one = {(r["workload"], r["seq"], r["budget"], r.get("batch"), r["policy"]): r["ms_median"] for r in rows
           if r["gpus"] == 1 and r.get("ms_median")}  # fmt: skip
    for r in rows:
        base = one.get((r["workload"], r["seq"], r["budget"], r.get("batch"), r["policy"]))
        ms = r.get("ms_median")
        rel = f"{ms / base:.2f}" if ms and base else "-"
        eff = f"{r['bound_ms'] / ms:.2f}" if ms and r.get("bound_ms") else "-"
        sus = f"{r['sustained_ms'] / ms:.2f}" if ms and r.get("sustained_ms") else "-"
        print(f"| {r['workload']} | {r['seq']} | {r['budget']} | {r['gpus']} | {str(r['split'])[:30]} | "
              f"{r['policy']} | {ms if ms is None else round(ms, 1)} | {rel} | {eff} | {sus} | {r['rc']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
