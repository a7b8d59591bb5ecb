"""Fitting the simulator's GPU-wide effects to measured runs (``turnip calibrate``, ``--refit``).

``turnip calibrate`` runs each of its plans back to back on every stream slot under ``nondet`` and records
the makespans (``calibration.plans[i].nondet_ms``). Everything else the simulator needs for them was
measured apart: kernels alone, host costs, start latency. What remains is what a GPU does with many kernels
at once: how kernels that run at the same time share it, a factor on a kernel that starts behind another
(``kernel_overlap_short`` / ``kernel_overlap_long``, ``turnip.machine.costs.overlap_factor``), and how long
it keeps its clocks under sustained load: the GEMM and attention flop rates it sustains at its power limit
(``power_gemm_flops_rate``, ``power_attn_flops_rate``: one fraction of each class's best full-clock rate;
``sim.engine``), the kernel tables being measured at full clock. The fit picks the three (two factors, one
fraction) that minimise the mean absolute log error of the simulated (means only, no noise, runs in the
power bucket's steady state, each plan's recorded idle time between runs apart) against the measured median
makespans over every plan (absolute, not squared: one plan the model cannot follow does not steer it). A
field the plans do not pin down stays at its starting value: ties go to it. Under the shared clock
(``power_slow_gemm`` > 0) the fraction is ``power_clock_draw``; measured (``calibration.power``) it is kept
and only the factors are fitted, and attention's rate follows its measured draw (``attn_draw``).

The plans are rebuilt from their rows by ``turnip.calplans`` (what ``turnip.calibrate`` measured); the
measuring side never imports this module: the CLI hands ``fit_gpu_effects`` to ``turnip.calibrate.calibrate``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def recorded_plans(doc: dict) -> list[tuple[object, float, str, float | None]]:
    """(memgraph, median measured nondet makespan ns, label, median idle ns between its runs or None) of every
    recorded plan of a profile document."""
    from turnip.calplans import plan_graph, recorded_plan

    out = []
    for row in doc.get("calibration", {}).get("plans", []):
        ms = row.get("nondet_ms")
        if not ms:
            continue
        p = recorded_plan(row)
        _tg, mg = plan_graph(p, row.get("dtype", "fp16"))
        label = f"{Path(p.model).stem} {f'{p.batch}x' if p.batch else ''}{p.seq} L{p.layers}"
        gap = row.get("gap_ms")
        out.append((mg, float(np.median(ms)) * 1e6, label, float(np.median(gap)) * 1e6 if gap else None))
    return out


def simulated_ms(plans, prof) -> np.ndarray:
    """Means-only nondet makespans (ms) of ``plans`` (``recorded_plans``; a plan's own idle time between runs,
    where recorded, in place of ``prof.run_gap_ns``) on ``prof``."""
    from sim.engine import simulate

    out = []
    for mg, _, _, *gap in plans:
        p = prof.replace(run_gap_ns=int(gap[0])) if gap and gap[0] is not None else prof
        out.append(simulate(mg, p, "nondet", 0, mean_only=True).makespan_ns / 1e6)
    return np.array(out)


TF = 1e12
# field: (low, high, coarse step, fine step, value before the fit); power_fraction is not a profile field: the
# GEMM and attention rates at the power limit are that fraction of their class's best full-clock rate
GRID = {
    "kernel_overlap_short": (0.5, 1.3, 0.05, 0.01, 1.0),
    "kernel_overlap_long": (0.5, 1.3, 0.05, 0.01, 1.0),
    "power_fraction": (0.4, 1.0, 0.05, 0.01, 1.0),
}
FIELDS = tuple(GRID)
ROUNDS = 3  # coordinate-descent passes


def best_rates(prof, dtype: str = "fp16") -> dict[str, float]:
    """The best full-clock flop rate (flop/s) of each flop-bound class (``gemm``: einsum, ``attention``: sdpa,
    sdpa_bwd) in ``prof``'s tables: the median rate of its largest quarter of measured kernels (by flops; big
    kernels run at the class's best efficiency, and a median is not thrown by one odd point); the roofline at
    ``kernel_efficiency`` where none is measured."""
    from turnip.machine.costs import cost_class

    out = {}
    for cls in ("gemm", "attention"):
        pts = [k for k in (prof.tables.kernels if prof.tables else ()) if k.dtype == dtype and cost_class(k.op) == cls]
        top = sorted(pts, key=lambda k: k.work)[-max(1, len(pts) // 4):] if pts else []
        rates = [k.work / k.ns_mean * 1e9 for k in top]
        out[cls] = float(np.median(rates)) if rates else prof.fp16_flops_per_s * prof.kernel_efficiency
    return out


def attn_draw(power: dict, fraction: float) -> float | None:
    """Attention's full-clock draw (of the limit) under the shared-clock model from ``turnip calibrate``'s
    power measurements (``calibration.power``): the NVML reading of attention alone back to back where it
    kept its clock, else the draw that holds the limit at the throttle it settled at (its slowdown alone over
    its class's slowdown at throttle 1), ``fraction`` being ``power_clock_draw``. None: not measured."""
    a = power.get("attention") if power else None
    if not a:
        return None
    nvml = min(1.0, a["power_w"] / power["limit_w"]) if a.get("power_w") and power.get("limit_w") else 1.0
    slow = power.get("power_slow_attn", 1.0)
    if slow <= 1.001:  # attention does not slow with the clock: its throttle is unknown
        return nvml
    theta = (a["ns"][0] / power["full_ns"]["attention"] - 1.0) / (slow - 1.0)
    if theta <= 0.05:
        return nvml
    return 1.0 / (1.0 - min(theta, 2.0, 0.99 / (1.0 - fraction) if fraction < 1.0 else 2.0) * (1.0 - fraction))


def full_rate(power: dict, cls: str) -> float:
    """The full-clock flop rate (flop/s) of ``cls``'s kernel (``gemm``, ``attention``) in ``turnip calibrate``'s
    power measurements."""
    return power["flops"][cls] / power["full_ns"][cls] * 1e9


def fit_gpu_effects(doc: dict, log=print, plans=None) -> dict:
    """``kernel_overlap_short``, ``kernel_overlap_long``, ``power_gemm_flops_rate`` and ``power_attn_flops_rate``
    fitted to ``doc``'s recorded plans (``{}`` when it records none): coordinate descent over ``GRID``, each
    field in turn over its coarse grid, then its fine steps around the best, ``ROUNDS`` passes; ties go to the
    value before the fit. One fraction sets both rates (``best_rates``): plans that mix GEMMs and attention
    cannot tell a limit on one from a limit on the other (a ridge of equal error), a limit on power can. The
    fitted profile uses the rates, not the older ``power_duty`` (returned as 1.0)."""
    from turnip.machine.profile import DOC_KEYS, profile_from_data

    plans = recorded_plans(doc) if plans is None else plans
    if not plans:
        return {}
    base = profile_from_data({k: doc[k] for k in DOC_KEYS if k in doc}).replace(power_duty=1.0)
    peak = best_rates(base)
    power = doc.get("calibration", {}).get("power")
    clock = base.power_slow_gemm > 0.0
    fixed = {}
    if clock and power and power.get("power_clock_draw"):  # measured: the GEMMs' draw is not fitted
        fixed["power_fraction"] = float(power["power_clock_draw"])
    if clock and power and power.get("full_ns"):  # the reference GEMM's full-clock rate, as measured
        peak["gemm"] = full_rate(power, "gemm")
    meas = np.array([p[1] for p in plans]) / 1e6
    cache: dict = {}

    def fields_of(x: dict) -> dict:
        f = x["power_fraction"]
        out = {"kernel_overlap_short": x["kernel_overlap_short"], "kernel_overlap_long": x["kernel_overlap_long"],
               "power_gemm_flops_rate": round(f * peak["gemm"], -9),
               "power_attn_flops_rate": round(f * peak["attention"], -9)}  # fmt: skip
        if clock:  # the best GEMMs draw 1 / f of the limit at full clock; attention as measured
            wa = attn_draw(power, f)
            out["power_clock_draw"] = f
            if wa is not None:
                out["power_attn_flops_rate"] = round(full_rate(power, "attention") / wa, -9)
        return out

    def sim(x: dict) -> np.ndarray:
        key = tuple(float(x[f]) for f in FIELDS)
        if key not in cache:
            cache[key] = simulated_ms(plans, base.replace(**fields_of(x)))
        return cache[key]

    def err(x: dict) -> float:  # mean absolute log error: one plan the model cannot follow does not steer it
        return float(np.mean(np.abs(np.log(sim(x) / meas))))

    def steps(lo, hi, step):
        return [round(float(v), 6) for v in np.round(np.arange(lo, hi + step / 2, step) / step) * step]

    start = {f: g[4] for f, g in GRID.items()} | fixed
    x = dict(start)
    for _ in range(ROUNDS):
        for f, (lo, hi, coarse, fine, first) in GRID.items():
            if f in fixed:
                continue
            def best(cands, f=f, first=first):  # the least error; among equals, the nearest to the start
                return min(cands, key=lambda c: (round(err(x | {f: c}), 12), abs(c - first)))

            x[f] = best(steps(lo, hi, coarse))
            x[f] = best(steps(max(lo, x[f] - 4 * fine), min(hi, x[f] + 4 * fine), fine))
    before, after = sim(start), sim(x)
    for (_, m, label, *_), b, y in zip(plans, before, after, strict=True):
        log(f"  {label:<28} measured {m / 1e6:8.3f} ms  simulated {b:8.3f} ({b / (m / 1e6) - 1:+6.1%}) -> "
            f"{y:8.3f} ({y / (m / 1e6) - 1:+6.1%})")  # fmt: skip
    out = fields_of(x)
    log(f"concurrency factor {x['kernel_overlap_short']:.2f} (kernels of 10 us or less) to "
        f"{x['kernel_overlap_long']:.2f} (1 ms or more); at the power limit {x['power_fraction']:.2f} of the best "
        f"full-clock rates: GEMMs {out['power_gemm_flops_rate'] / TF:.0f} of {peak['gemm'] / TF:.0f}, attention "
        f"{out['power_attn_flops_rate'] / TF:.0f} of {peak['attention'] / TF:.0f} TFLOP/s: mean |log error| "
        f"{err(start):.3f} -> {err(x):.3f} over {len(plans)} plans")  # fmt: skip
    return out | {"power_duty": 1.0}


def refit(path: str, log=print) -> dict:
    """A profile document ``turnip calibrate`` wrote, its concurrency factor and power limit fitted again
    (``fit_gpu_effects``) to the plan makespans it recorded (``turnip calibrate --refit``); loads it first, so
    a bad file is a one-line error."""
    from turnip.machine.profile import load_profile

    load_profile(path)
    doc = json.loads(Path(path).read_text())
    if not doc.get("calibration", {}).get("plans") or not any(p.get("nondet_ms") for p in doc["calibration"]["plans"]):
        raise ValueError(f"{path}: records no plan makespans to fit to (written by an older `turnip calibrate`?)")
    doc["machine"] |= fit_gpu_effects(doc, log=log)
    return doc
