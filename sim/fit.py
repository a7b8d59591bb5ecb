"""Fitting the simulator's GPU-wide effects to measured runs (``turnip calibrate``, ``--refit``).

``turnip calibrate`` runs each of its plans back to back on every stream slot under ``nondet`` and records
the makespans (``calibration.plans[i].nondet_ms``). Everything else the simulator needs for them was
measured apart: kernels alone, host costs, start latency. What remains is what a GPU does with many kernels
at once: how kernels that run at the same time share it, a factor on a kernel that starts behind another
(``kernel_overlap_short`` / ``kernel_overlap_long``, ``turnip.machine.costs.overlap_factor``), and how long
it keeps its clocks under sustained load (``power_duty``, the power limit: ``sim.engine``). The fit picks
the three that minimise the mean squared log error of the simulated (means only, no noise) against the
measured mean makespans over every plan.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _plan_of(row: dict):
    """The ``turnip.calibrate.KernelPlan`` a recorded plan row describes (a config file by its name, looked up
    in ``benchmarks/configs``)."""
    from turnip.calibrate import KernelPlan

    model = row["model"]
    if model.endswith(".json"):
        model = str(Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / model)
    return KernelPlan(model, int(row["seq"]), dict(row["tiles"]), int(row.get("layers", 1)), row.get("head", "none"),
                      int(row.get("batch", 0)))  # fmt: skip


def recorded_plans(doc: dict) -> list[tuple[object, float, str]]:
    """(memgraph, mean measured nondet makespan ns, label) of every recorded plan of a profile document."""
    from turnip.calibrate import plan_graph

    out = []
    for row in doc.get("calibration", {}).get("plans", []):
        ms = row.get("nondet_ms")
        if not ms:
            continue
        p = _plan_of(row)
        _tg, mg = plan_graph(p, row.get("dtype", "fp16"))
        label = f"{Path(p.model).stem} {f'{p.batch}x' if p.batch else ''}{p.seq} L{p.layers}"
        out.append((mg, float(np.mean(ms)) * 1e6, label))
    return out


def simulated_ms(plans, prof) -> np.ndarray:
    """Means-only nondet makespans (ms) of ``plans`` (``recorded_plans``) on ``prof``."""
    from sim.engine import simulate

    return np.array([simulate(mg, prof, "nondet", 0, mean_only=True).makespan_ns / 1e6 for mg, _, _ in plans])


FIELDS = ("kernel_overlap_short", "kernel_overlap_long", "power_duty")
RANGES = {"kernel_overlap_short": (0.5, 1.3), "kernel_overlap_long": (0.5, 1.3), "power_duty": (0.6, 1.0)}
ROUNDS = 3  # coordinate-descent passes


def fit_gpu_effects(doc: dict, log=print, plans=None) -> dict:
    """The profile fields ``kernel_overlap_short``, ``kernel_overlap_long`` and ``power_duty`` fitted to
    ``doc``'s recorded plans (``{}`` when it records none): coordinate descent, each field in turn over a
    grid of its range (steps of 0.05, then 0.01 around the best), ``ROUNDS`` passes."""
    from turnip.machine.profile import DOC_KEYS, profile_from_data

    plans = recorded_plans(doc) if plans is None else plans
    if not plans:
        return {}
    base = profile_from_data({k: doc[k] for k in DOC_KEYS if k in doc})
    meas = np.array([m for _, m, _ in plans]) / 1e6
    cache: dict = {}

    def sim(x: dict) -> np.ndarray:
        key = tuple(round(x[f], 3) for f in FIELDS)
        if key not in cache:
            cache[key] = simulated_ms(plans, base.replace(**dict(zip(FIELDS, key, strict=True))))
        return cache[key]

    def err(x: dict) -> float:
        return float(np.mean(np.log(sim(x) / meas) ** 2))

    start = {f: 1.0 for f in FIELDS}
    x = dict(start)
    for _ in range(ROUNDS):
        for f in FIELDS:
            lo, hi = RANGES[f]
            grid = np.round(np.arange(lo, hi + 1e-9, 0.05), 3)
            x[f] = min(grid, key=lambda c: err(x | {f: float(c)}))
            grid = np.round(np.arange(max(lo, x[f] - 0.04), min(hi, x[f] + 0.04) + 1e-9, 0.01), 3)
            x[f] = float(min(grid, key=lambda c: err(x | {f: float(c)})))
    before, after = sim(start), sim(x)
    for (_, m, label), b, y in zip(plans, before, after, strict=True):
        log(f"  {label:<28} measured {m / 1e6:8.3f} ms  simulated {b:8.3f} ({b / (m / 1e6) - 1:+6.1%}) -> "
            f"{y:8.3f} ({y / (m / 1e6) - 1:+6.1%})")  # fmt: skip
    log(f"concurrency factor {x['kernel_overlap_short']:.2f} (kernels of 10 us or less) to "
        f"{x['kernel_overlap_long']:.2f} (1 ms or more), power duty {x['power_duty']:.2f}: rms log error "
        f"{np.sqrt(err(start)):.3f} -> {np.sqrt(err(x)):.3f} over {len(plans)} plans")  # fmt: skip
    return x
