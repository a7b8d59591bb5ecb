"""Host dispatch on one to several GPUs: the same plans under the CUDA backend's dispatch variants, in one
process, with where the host's time goes.

Variants (``--variants``, each a set of backend options against the first, the baseline):
  base      cuDNN attention called directly (about 70 µs of host time a call), events polled from Python
  graphs    cuDNN attention captured into per-slot CUDA graphs (``lib_graphs``)
  poll      end events scanned in compiled code (``native_poll``)
  both      both
  fold      graphs, on the plan compiled with sums folded into einsums (``turnip.fuse``; the other variants
            compile without): fewer vertices; outputs within rounding of the baseline's, not bitwise
  groups    graphs, with launch groups (``turnip.sched.groups``: runs of kernels on one GPU dispatched as one
            captured graph): fewer commands and completions for the host; outputs bitwise the baseline's
  groups1   groups, each group recording only its last member's end event (``group_events=False``)
  wide      groups, wide (``TURNIP_WIDE_GROUPS=1``: a head may wait for kernels of groups that start before it,
            transfers wait for a group's end): fewer units again
  wide1     wide, each group recording only its last member's end event
  lean      wide, on the plan compiled with ``TURNIP_LEAN_STEP=1`` (the data split's sums across GPUs as one
            add, a training step's adapters sent at its start): fewer units again
  lean1     lean, each group recording only its last member's end event
Every variant names its ``group_events``; the backend's default is ``graphs`` (with groups on several GPUs,
member end events off for training steps).
Rows are ``SEQ:BUDGET:GPUS[:T][:SPLIT]`` (prefill; ``none`` = a 60 GiB arena per GPU, every weight resident;
``T``: the token tile; ``SPLIT``: tensor (default), layers or data) or ``lora:BATCHxSEQ:BUDGET:GPUS[:SPLIT]``
(LoRA steps, ``lora_row``). Per row and variant: ``--repeat`` timed runs per policy after a warm-up, the median
makespan, the host's time per run split into issuing, completion handling and polling, the median host cost
per vertex, a launch group's issue cost as its head's plus a cost per other member (what a profile's
``group_member_launch_ns`` takes), and whether the variant's outputs equal the baseline's bitwise.

    PYTHONPATH=. python benchmarks/dispatch.py --rows 4096:none:1 4096:none:4 16384:none:4 --out res/

Results: ``<out>/dispatch<tag>.csv``; a table on stdout with each variant's time over the baseline's.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import numpy as np

VARIANTS = {
    "base": {"lib_graphs": False, "native_poll": False},
    "graphs": {"lib_graphs": True, "native_poll": False},
    "poll": {"lib_graphs": False, "native_poll": True},
    "both": {"lib_graphs": True, "native_poll": True},
    "fold": {"lib_graphs": True, "native_poll": False, "fold": True},
    "groups": {"lib_graphs": True, "native_poll": False, "groups": True, "group_events": True},
    "groups1": {"lib_graphs": True, "native_poll": False, "groups": True, "group_events": False},
    "wide": {"lib_graphs": True, "native_poll": False, "groups": True, "wide": True, "group_events": True},
    "wide1": {"lib_graphs": True, "native_poll": False, "groups": True, "wide": True, "group_events": False},
    "lean": {"lib_graphs": True, "native_poll": False, "groups": True, "wide": True, "lean": True,
             "group_events": True},
    "lean1": {"lib_graphs": True, "native_poll": False, "groups": True, "wide": True, "lean": True,
              "group_events": False},
}
PLAN_KEYS = ("fold", "wide", "lean")  # variant keys that are not backend options


def plan_key(name: str) -> tuple:
    """What the plan of variant ``name`` is compiled with (sums folded, lean step); sets ``TURNIP_LEAN_STEP``."""
    os.environ["TURNIP_LEAN_STEP"] = "1" if VARIANTS[name].get("lean") else "0"
    return VARIANTS[name].get("fold", False), VARIANTS[name].get("lean", False)


def backend_options(a, name: str) -> dict:
    """The backend options of variant ``name`` (none on the CPU backend); sets ``TURNIP_WIDE_GROUPS`` for it."""
    os.environ["TURNIP_WIDE_GROUPS"] = "1" if VARIANTS[name].get("wide") else "0"
    return {k: v for k, v in VARIANTS[name].items() if k not in PLAN_KEYS} if a.backend == "cuda" else {}


def rel_diff(ref: dict, out: dict) -> float:
    """Largest |out - ref| over max |ref| among the outputs both name."""
    worst = 0.0
    for k in ref.keys() & out.keys():
        r, x = ref[k].astype(np.float64), out[k].astype(np.float64)
        worst = max(worst, float(np.abs(x - r).max() / max(np.abs(r).max(), 1e-30)))
    return worst


def run_row(a, spec: str) -> list[dict]:
    from turnip.compile import compile_model
    from turnip.machine.bound import plan_bound
    from turnip.runtime import execute, open_loaded

    parts = spec.split(":")
    seq, budget, gpus = int(parts[0]), parts[1], int(parts[2])
    tile = next((int(x) for x in parts[3:] if x.isdigit()), None)
    split = next((x for x in parts[3:] if not x.isdigit()), "tensor")
    tiles = {"t": tile} if tile else None
    b = "60GiB" if budget == "none" else budget
    plans = {}
    rows, ref = [], None
    for name in a.variants:
        key = plan_key(name)
        if key not in plans:
            plans[key] = compile_model(fold=key[0], model=a.model, seq=seq, gpus=gpus, budget=b, resident="auto",
                                       tiles=tiles, n_layers=a.layers, split=split)  # fmt: skip
        tg, mg = plans[key]
        bound = plan_bound(mg, a.profile)["lower_bound_ns"] / 1e6
        t0 = time.perf_counter()
        opts = backend_options(a, name)
        with open_loaded(a.backend, tg, mg, seed=a.seed, **opts) as be:
            load_s = time.perf_counter() - t0
            for policy in a.policies:
                for i in range(a.warmup):
                    execute(mg, be, policy, seed=i, device_times=False)
                res = [execute(mg, be, policy, seed=100 + i, device_times=False) for i in range(a.repeat)]
                out = {tg.name[t]: x for t, x in be.read_outputs().items()}
                if ref is None:
                    ref = out
                same = ref.keys() == out.keys() and all(np.array_equal(ref[t], out[t]) for t in ref)
                rows.append({"model": a.model, "seq": seq, "budget": budget, "gpus": gpus,
                             "t": str(tile or "default") + ("" if split == "tensor" else f" {split}"), "variant": name,
                             "policy": policy}
                            | timings(res, mg, be) | {"bound_ms": bound, "equal_to_first": same,
                                                       "rel_diff": rel_diff(ref, out),
                                                       "load_s": round(load_s, 2)})  # fmt: skip
                print(_fmt(rows[-1], rows), flush=True)
    return rows


def group_fit(res: list, gr) -> tuple[float, float]:
    """(µs, µs): a launch group's issue time in runs ``res`` as a line in its number of members beyond the
    head (``turnip.calibrate.line_fit`` over every group of every run): the head's launch and the cost of each
    other member, what a profile's ``group_member_launch_ns`` (or ``..._noevent_...``) takes; NaN without
    groups."""
    from turnip.calibrate import line_fit

    if gr is None or not gr.members:
        return float("nan"), float("nan")
    heads = np.fromiter(gr.members, dtype=np.int64)
    extra = np.array([len(m) - 1 for m in gr.members.values()], dtype=np.int64)
    ys = np.concatenate([(r.issue_ns - r.host_start_ns)[heads] for r in res])
    icpt, slope = line_fit(ys, np.tile(extra, len(res)))
    return icpt / 1e3, slope / 1e3


def timings(res: list, mg, be) -> dict:
    """Median and fastest makespan of runs ``res``, and the host's time per run: issuing, completion handling,
    polling; the median host cost per vertex; a launch group's issue cost (``group_fit``)."""
    ms = sorted(r.makespan_ns / 1e6 for r in res)
    k = len(res)
    hc = np.concatenate([r.command_host_cost_ns() for r in res])
    gr = getattr(be, "groups", None)
    head_us, member_us = group_fit(res, gr)
    return {"ms_median": ms[k // 2], "ms_min": ms[0], "vertices": mg.n, "units": gr.n_units if gr else mg.n,
            "issue_ms": sum(int((r.issue_ns - r.host_start_ns).sum()) for r in res) / k / 1e6,
            "handle_ms": sum(int(r.handle_ns.sum()) for r in res) / k / 1e6,
            "poll_ms": sum(r.poll_ns for r in res) / k / 1e6, "host_us_p50": float(np.median(hc)) / 1e3,
            "group_head_us": head_us, "group_member_us": member_us,
            "capture_failures": len(getattr(be, "capture_failures", []))}  # fmt: skip


def lora_row(a, spec: str) -> list[dict]:
    """``lora:BATCHxSEQ:BUDGET:GPUS[:SPLIT]``: LoRA steps (rank 16 on q, k, v and the FFN; split ``layers`` by
    default), ``--repeat`` timed steps after ``--warmup`` per variant; the loss of the last step of each
    variant must equal the baseline's (the same batches, the same start)."""
    from turnip.compile import compile_model
    from turnip.runtime import open_backend
    from turnip.runtime.weights import random_embedding, vocab_size, write_random_inputs
    from turnip.train import AdapterState, LoraConfig, Stepper, TrainSpec, next_token_targets

    parts = spec.split(":")[1:]
    batch, seq = (int(x) for x in parts[0].split("x"))
    budget, gpus = parts[1], int(parts[2])
    split = parts[3] if len(parts) > 3 else "layers"
    train = TrainSpec(batch, LoraConfig(), "auto")
    plans = {}
    rows, ref = [], None
    for name in a.variants:
        key = plan_key(name)
        if key not in plans:
            plans[key] = compile_model(fold=key[0], model=a.model, seq=seq, gpus=gpus, budget=budget,
                                       resident="auto", train=train, split=split, n_layers=a.layers)  # fmt: skip
        tg, mg = plans[key]
        if ref is None:
            rng = np.random.default_rng(a.seed)
            ids = [rng.integers(0, vocab_size(tg), (batch, seq)) for _ in range(a.warmup + a.repeat)]
            embed = random_embedding(tg, a.seed)
        opts = backend_options(a, name)
        t0 = time.perf_counter()
        with open_backend(a.backend, mg, 5, **opts) as be:
            state = AdapterState.init(tg, a.seed)
            write_random_inputs(be, tg, a.seed, skip=set(state.inputs()) | {"x0", "targets"})
            stepper = Stepper(tg, mg, be, state)
            load_s = time.perf_counter() - t0
            res, loss = [], None
            for i, x in enumerate(ids):
                loss, r, _ = stepper.step(embed(x.reshape(-1)), next_token_targets(x), "nondet", 5, a.seed + i)
                if i >= a.warmup:
                    res.append(r)
        ref = loss if ref is None else ref
        rows.append({"model": a.model, "seq": seq, "budget": budget, "gpus": gpus, "t": f"lora {batch}x{split}",
                     "variant": name, "policy": "nondet"}
                    | timings(res, mg, be) | {"bound_ms": 0.0, "equal_to_first": bool(loss == ref),
                                               "rel_diff": abs(float(loss) - float(ref)) / abs(float(ref)),
                                               "load_s": round(load_s, 2)})  # fmt: skip
        print(_fmt(rows[-1], rows), flush=True)
    return rows


def _fmt(r: dict, rows: list[dict]) -> str:
    base = next(x for x in rows if x["seq"] == r["seq"] and x["budget"] == r["budget"] and x["gpus"] == r["gpus"]
                and x["t"] == r["t"] and x["policy"] == r["policy"])  # fmt: skip
    return (f"{r['seq']:6d} {r['budget']:>6s} {r['gpus']} GPU t={r['t']!s:5s} {r['variant']:7s} {r['policy']:7s} "
            f"{r['ms_median']:8.1f} ms ({r['ms_median'] / base['ms_median']:.3f}x)  bound {r['bound_ms']:6.1f}  "
            f"host/run issue {r['issue_ms']:5.1f} handle {r['handle_ms']:5.1f} poll {r['poll_ms']:6.1f} ms  "
            f"p50 {r['host_us_p50']:5.1f} us x {r['vertices']}  group {r['group_head_us']:.1f} + "
            f"{r['group_member_us']:.1f} us/member  equal {r['equal_to_first']} (rel {r['rel_diff']:.1e})  "
            f"capture failures {r['capture_failures']}")  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--backend", default="cuda", help="cuda; cpu only checks the script (variants ignored)")
    ap.add_argument("--rows", nargs="+", default=["4096:none:1", "4096:none:4", "16384:none:4"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="auto",
                    help="profile of the bounds (auto: the shipped one of the GPU, h100-calibrated without one)")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    from turnip.runtime.driver import machine_profile

    a.profile = machine_profile(a.profile, a.backend, fallback="h100-calibrated")
    os.makedirs(a.out, exist_ok=True)
    rows: list[dict] = []
    for spec in a.rows:
        rows += lora_row(a, spec) if spec.startswith("lora:") else run_row(a, spec)
        with open(f"{a.out}/dispatch{a.tag}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
