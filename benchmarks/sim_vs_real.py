"""Simulator against hardware on a grid the calibration never saw.

Grid: LLaMA-7B shapes (all 32 layers, fp16, random weights), prompt {1K, 4K, 8K, 16K, 32K} x budget
{none, 6 GiB, 1 GiB} x policy {nondet, det, det-kernels, det-replay} on one GPU (det-replay: the issue
order of the fastest of three recorded nondet runs, replayed fixed; the simulator records its own so),
default tiles, ``--resident auto`` (``none``: every weight resident in a 40 GiB arena). First, warm-up
rounds (one run of every policy each) back to back for at least ``--heat`` seconds (the steady state of the
GPU's clocks under its power limit, which the simulator predicts); then the timed rounds, one run of each
policy per round, so a drift of the host's speed within the cell (seen on the H100s: tens of percent over
seconds) does not land on one policy (``--sequential``: each policy's warm-up and runs in one block, as grids
before 2026-11-25 were measured). ``turnip calibrate`` runs one- and two-layer plans at other prompt lengths
and tile sizes, never these.

Two steps, so the model can be revised without the GPU:

    # on the GPU: measure every cell (warm-up + --repeat runs each), write the runs
    PYTHONPATH=. python benchmarks/sim_vs_real.py measure --out benchmarks/results/grid_h100.csv
    # anywhere: rebuild the same plans, simulate them on a profile, compare
    python benchmarks/sim_vs_real.py compare benchmarks/results/grid_h100.csv \\
        --profile turnip/machine/profiles/h100-calibrated.json --out benchmarks/results/sim_vs_real_h100

Per cell: measured and predicted mean time, error, run-to-run spread (coefficient of variation) measured
and predicted, and the nondet/det and nondet/det-kernels ratios measured and predicted; for grids measured
from 2026-11-25 on, the host's speed too (each run's median kernel issue time, ``issue_us``, against the
simulated runs'), and with ``compare --at-host-time`` each run predicted at its own host time (``host_ms``:
the simulated run's host costs scaled until its host thread is as busy as the measured run's), which takes the
host CPU's speed, the one thing a profile cannot know in advance, out of the error; grids measured from the
v16 round on also hold each run's host link rate (``link_gbps``: ``turnip.calibrate.run_link_gbps``), and
``compare --at-link-rate`` predicts each run at it too (on the lent H100s the link slows down with the host in
its slow phases: ``benchmarks/streamed_runs.py``).

Where a cell misses, ``measure --traces DIR`` also records one run per cell and policy with start events
(the plan loaded again with them, after the timed runs: they cost the host a driver call per vertex) as a
trace (``DIR/<seq>-<budget>-g<gpus>-<policy>.json``), and ``compare --traces DIR`` overlays a simulated run
of each on it (``DIR/overlay-<...>/overlay.png`` and ``overlay.csv``: busy time and end per GPU engine, link
and host thread, real against simulated: the resource that drives the error).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

GiB = 1 << 30
SEQS = (1024, 4096, 8192, 16384, 32768)
BUDGETS = ("none", "6GiB", "1GiB")
POLICIES = ("nondet", "det", "det-kernels", "det-replay")
RECORD_RUNS = 3  # det-replay: nondet runs recorded; the fastest one's issue order is replayed
NONE_ARENA = "40GiB"
QUARTER = "quarter"  # ``plan``: the resident set of grids measured before the ``resident`` column


def plan(seq: int, budget: str, model: str = "llama-7b", gpus: int = 1, resident: str = "auto"):
    """The cell's taskgraph and memgraph, built the same way on the GPU and in ``compare``. ``resident``:
    ``--resident`` of a sized budget (``auto`` or bytes per GPU; a measured grid's ``resident_limit`` column
    holds the size its plan was built with), or ``QUARTER``: what ``auto`` built before 2026-11-25, for grids
    without that column (a quarter of the budget, none where that did not compile)."""
    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes
    from turnip.memgraph.build import BudgetError

    if budget == "none":
        b = parse_nbytes(NONE_ARENA)
        tg = make_taskgraph(model, seq, gpus, "fp16")
        w = int(tg.nbytes[tg.kind == 0].sum())
        return tg, build_with_resident(tg, b, None, str(w + (1 << 20)))
    b = parse_nbytes(budget)
    tg = make_taskgraph(model, seq, gpus, "fp16", budget_nbytes=b)
    if resident != QUARTER:
        return tg, build_with_resident(tg, b, None, resident)
    try:
        return tg, build_with_resident(tg, b, None, str(b // 4))
    except BudgetError:
        return tg, build_with_resident(tg, b, None, "0")


def measure(a) -> int:
    from turnip.runtime import open_loaded

    rows = []
    cells = [(s, b) for s in a.seqs for b in a.budgets]
    for i, (seq, budget) in enumerate(cells):
        t0 = time.perf_counter()
        try:
            tg, mg = plan(seq, budget, a.model, a.gpus, a.resident)
        except Exception as e:  # noqa: BLE001 - a cell that cannot compile is reported, not fatal
            rows.append({"seq": seq, "budget": budget, "policy": "-", "error": f"{type(e).__name__}: {e}"})
            continue
        with open_loaded("cuda", tg, mg) as be:
            for pol, runs in _timed_runs(a, mg, be).items():
                ms, issue, host, link = zip(*runs, strict=True)
                rows.append({"seq": seq, "budget": budget, "policy": pol, "gpus": a.gpus, "model": a.model,
                             "vertices": mg.n, "resident_limit": int(mg.stats["resident_limit_nbytes"]),
                             "resident_nbytes": int(mg.stats["resident_input_nbytes"]),
                             "times_ms": json.dumps([round(x, 3) for x in ms]),
                             "mean_ms": float(np.mean(ms)),
                             "issue_us": json.dumps([round(x, 2) for x in issue]),
                             "host_ms": json.dumps([round(x, 3) for x in host]),
                             "link_gbps": json.dumps([None if x != x else round(x, 3) for x in link])})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        if a.traces:
            _record_traces(a, tg, mg, seq, budget)
        _write_rows(rows, a.out)  # after every cell: a grid cut short keeps the cells it measured
        print(f"cell {i + 1}/{len(cells)} {seq}:{budget} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    _write_rows(rows, a.out)
    return 0


def _write_rows(rows: list[dict], out: str) -> None:
    """The measured rows so far as ``out`` (CSV, replaced atomically: never half-written)."""
    import pandas as pd

    from turnip.fileio import atomic_write

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out, newline="") as f:
        pd.DataFrame(rows).to_csv(f, index=False)


def _timed_runs(a, mg, be) -> dict[str, list[tuple[float, float, float, float]]]:
    """{policy: (makespan ms, median kernel issue us, host ms, host link GB/s) of each of its ``--repeat`` timed
    runs}: the issue time is the run's host speed (``turnip.calibrate.run_issue_ns``), the host time its host
    thread's issue and completion-handling time (``RunResult.host_cost_ns``), the link rate its host-to-device
    copies' bytes over the time they were on the link (``turnip.calibrate.run_link_gbps``; NaN: no copies).
    Interleaved (the default): det-replay's order recorded, warm-up rounds of every policy (``_warm_up``), then
    timed rounds of one run per policy, so that a drift of the host's or the GPU's speed during the cell weighs
    on every policy alike; ``--sequential``: each policy's warm-up and runs in turn (the grids measured before
    2026-11-25)."""
    from turnip.calibrate import run_issue_ns, run_link_gbps
    from turnip.runtime import execute

    def run(pol, r, order):
        x = execute(mg, be, pol, 5, seed=r, order=order)
        return (x.makespan_ns / 1e6, run_issue_ns(mg, x) / 1e3, float(x.host_cost_ns().sum()) / 1e6,
                run_link_gbps(mg, x))  # fmt: skip

    if a.sequential:
        out = {}
        for pol in a.policies:
            orders = _replay_orders(mg, be, [pol])  # recorded right before det-replay's own warm-up, as before
            _warm_up(a, mg, be, [pol], orders)
            out[pol] = [run(pol, r, orders.get(pol)) for r in range(a.repeat)]
        return out
    orders = _replay_orders(mg, be, a.policies)
    _warm_up(a, mg, be, a.policies, orders)
    out = {pol: [] for pol in a.policies}
    for r in range(a.repeat):
        for pol in a.policies:
            out[pol].append(run(pol, r, orders.get(pol)))
    return out


def _replay_orders(mg, be, policies: list[str]) -> dict:
    """{"det-replay": its order} when ``policies`` has det-replay ({} otherwise): the order of the fastest of
    RECORD_RUNS recorded nondet runs, to be replayed fixed."""
    from turnip.runtime import execute

    if "det-replay" not in policies:
        return {}
    rec = [execute(mg, be, "nondet", 5, seed=200 + r, record_order=True) for r in range(RECORD_RUNS)]
    return {"det-replay": min(rec, key=lambda r: r.makespan_ns).order}


def _warm_up(a, mg, be, policies: list[str], orders: dict) -> None:
    """Warm-up rounds, one run of each of ``policies`` per round, back to back: at least ``--warmup`` rounds
    and ``--heat`` seconds, so the timed runs, taken in the same rounds, find the GPU's clocks where such runs
    keep them. ``orders``: det-replay's recorded order."""
    from turnip.runtime import execute

    w, t_heat = 0, time.perf_counter()
    while w < a.warmup or time.perf_counter() - t_heat < a.heat:
        for pol in policies:
            execute(mg, be, pol, 5, seed=100 + w, order=orders.get(pol))
        w += 1


def _trace_name(seq, budget, gpus, policy) -> str:
    return f"{seq}-{budget}-g{gpus}-{policy}"


def _record_traces(a, tg, mg, seq: int, budget: str) -> None:
    """One run per policy with start events, after the policy's warm-up, written as a trace to ``a.traces``."""
    from turnip.runtime import execute, open_loaded

    out = Path(a.traces)
    out.mkdir(parents=True, exist_ok=True)
    with open_loaded("cuda", tg, mg, device_start=True) as be:
        orders = _replay_orders(mg, be, a.policies)
        for pol in a.policies:
            _warm_up(a, mg, be, [pol], orders)
            res = execute(mg, be, pol, 5, seed=0, order=orders.get(pol))
            meta = {"seq": seq, "budget": budget, "gpus": a.gpus, "model": a.model, "start_events": True}
            res.trace(mg, meta).write_chrome(out / f"{_trace_name(seq, budget, a.gpus, pol)}.json")


def _overlays(a, mg, prof, tm, seq, budget, gpus, policies, order) -> list[str]:
    """Overlay a simulated run (seed 0) on every recorded real trace of this cell; one line per overlay."""
    from analysis.overlay import write_overlay
    from sim.engine import simulate
    from turnip.trace import read_chrome

    lines = []
    for pol in policies:
        name = _trace_name(seq, budget, gpus, pol)
        path = Path(a.traces) / f"{name}.json"
        if not path.exists():
            continue
        sim = simulate(mg, prof, pol, seed=0, tm=tm, order=order if pol == "det-replay" else None)
        t = write_overlay(sim.trace(mg), read_chrome(path), Path(a.traces) / f"overlay-{name}")
        lines.append(f"{name}: {Path(a.traces).name}/overlay-{name}/ ({len(t)} rows)")
    return lines


def compare(a) -> int:
    import pandas as pd

    from sim.engine import fastest_run, simulate
    from sim.timing import TimingModel
    from turnip.calibrate import run_issue_ns
    from turnip.fileio import atomic_write
    from turnip.machine.profile import load_profile

    prof = load_profile(a.profile)
    try:
        real = pd.read_csv(a.measured)
    except (OSError, ValueError) as e:  # missing, unreadable, not a CSV
        why = " ".join(str(e).split())
        raise SystemExit(f"{a.measured}: cannot read a measured grid ({type(e).__name__}: {why}); pass a CSV written "
                         "by `sim_vs_real.py measure`") from None  # fmt: skip
    lacking = {"seq", "budget", "policy", "gpus", "model", "times_ms"} - set(real.columns)
    if lacking:
        raise SystemExit(f"{a.measured}: no {', '.join(sorted(lacking))} column(s); pass a CSV written by "
                         "`sim_vs_real.py measure`")  # fmt: skip
    real = real[real.policy != "-"]
    if real.empty:
        raise SystemExit(f"{a.measured}: no measured cell (every row is a cell that failed to compile)")
    if "resident_limit" in real.columns:  # rows of older grids joined in: built as they were then
        real = real.assign(resident_limit=real.resident_limit.astype(object).where(real.resident_limit.notna(),
                                                                                   QUARTER))  # fmt: skip
    has_issue = "issue_us" in real.columns  # grids measured from 2026-11-25 on
    for flag, col, what in (("at_host_time", "host_ms", "host time"), ("at_link_rate", "link_gbps", "host link rate")):
        if getattr(a, flag) and col not in real.columns:
            raise SystemExit(f"{a.measured}: no {col} column (each run's {what}); --{flag.replace('_', '-')} needs a "
                             f"grid measured with it")  # fmt: skip
    at_run = a.at_host_time or a.at_link_rate
    keys = ["seq", "budget"] + (["resident_limit"] if "resident_limit" in real.columns else [])  # one plan
    out, overlays = [], []
    for key, cell in real.groupby(keys, sort=False):
        seq, budget = key[:2]
        kept = key[2] if len(key) > 2 else QUARTER  # as measured
        _tg, mg = plan(int(seq), str(budget), cell.model.iloc[0], int(cell.gpus.iloc[0]),
                       kept if kept == QUARTER else str(int(kept)))  # fmt: skip
        was = {"vertices": mg.n, "resident_nbytes": int(mg.stats["resident_input_nbytes"])}
        for col, now in was.items():
            if col in cell.columns and cell[col].notna().all() and int(cell[col].iloc[0]) != now:
                raise SystemExit(f"{a.measured}: cell {seq}:{budget} was measured on a plan with {col} "
                                 f"{int(cell[col].iloc[0])}; rebuilt here it has {now} (the compiler changed since): "
                                 "rebuild it as it was, or measure it again")  # fmt: skip
        tm = TimingModel(mg, prof)
        order = None
        if (cell.policy == "det-replay").any():  # as measured: the fastest of RECORD_RUNS nondet runs
            order = fastest_run(mg, prof, range(200, 200 + RECORD_RUNS), tm=tm).order
        for _, r in cell.iterrows():
            meas = np.array(json.loads(r.times_ms))
            o = order if r.policy == "det-replay" else None
            runs = [simulate(mg, prof, r.policy, seed=s, tm=tm, order=o) for s in range(a.runs)]
            sims = np.array([x.makespan_ns / 1e6 for x in runs])
            out.append({"seq": int(seq), "budget": budget, "resident_nbytes": was["resident_nbytes"]}
                       | ({"resident_limit": key[2]} if len(key) > 2 else {})
                       | {"policy": r.policy, "measured_ms": meas.mean(),
                        "predicted_ms": sims.mean(), "error": sims.mean() / meas.mean() - 1,
                        "measured_cv": meas.std(ddof=1) / meas.mean() if meas.size > 1 else float("nan"),
                        "predicted_cv": sims.std(ddof=1) / sims.mean() if sims.size > 1 else float("nan")})  # fmt: skip
            if has_issue:  # the host's speed: median kernel issue time, measured runs against simulated ones
                sim_issue = float(np.median([run_issue_ns(mg, x) for x in runs])) / 1e3
                meas_issue = float(np.median(json.loads(r.issue_us))) if isinstance(r.issue_us, str) else np.nan
                out[-1] |= {"measured_issue_us": meas_issue, "predicted_issue_us": sim_issue}
            if at_run:  # rows of older grids (no such figures) are left blank
                host = _per_run(r, "host_ms") if a.at_host_time else None
                link = _per_run(r, "link_gbps") if a.at_link_rate else None
                out[-1] |= _at_run(mg, prof, tm, r.policy, o, meas, host, link, a.at_host_time, a.at_link_rate)
        if a.traces:
            overlays += _overlays(a, mg, prof, tm, int(seq), str(budget), int(cell.gpus.iloc[0]),
                                  list(cell.policy), order)  # fmt: skip
    d = pd.DataFrame(out)
    others = [p for p in ("det", "det-kernels", "det-replay") if (d.policy == p).any()]
    for other in others:
        for col in ("measured_ms", "predicted_ms"):
            base = d[d.policy == "nondet"].set_index(keys)[col]
            alt = d[d.policy == other].set_index(keys)[col]
            d = d.merge((base / alt).rename(f"nondet_over_{other}_{col[:-3]}").reset_index(), on=keys, how="left")
    stem = a.out.removesuffix(".csv").removesuffix(".md")  # OUT.csv and OUT.md, whichever of the three given
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(f"{stem}.csv", newline="") as fh:
        d.to_csv(fh, index=False)
    lines = [f"# Simulated against measured: {Path(a.measured).name} on profile {Path(a.profile).name}", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"{a.runs} simulated runs per cell; measured: the runs in the CSV (after warm-up).", "",
             "| seq | budget | policy | measured ms | predicted ms | error | measured cv | predicted cv |"
             + (" host issue us measured | predicted |" if has_issue else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if has_issue else "")]  # fmt: skip
    for _, r in d.iterrows():
        lines.append(f"| {r.seq} | {_budget(r)} | {r.policy} | {r.measured_ms:.1f} | {r.predicted_ms:.1f} | "
                     f"{r.error:+.1%} | {r.measured_cv:.3f} | {r.predicted_cv:.3f} |"
                     + (f" {r.measured_issue_us:.2f} | {r.predicted_issue_us:.2f} |" if has_issue else ""))  # fmt: skip
    nd = d[d.policy == "nondet"]
    lines += ["", "| seq | budget | " + " | ".join(f"nondet/{o} measured | predicted" for o in others) + " |",
              "|---|---|" + "---|---|" * len(others)]  # fmt: skip
    for _, r in nd.iterrows():
        cells = [f"{r[f'nondet_over_{o}_{k}']:.3f}" for o in others for k in ("measured", "predicted")]
        lines.append(f"| {r.seq} | {_budget(r)} | " + " | ".join(cells) + " |")
    for o in others:
        gap = (nd[f"nondet_over_{o}_predicted"] - nd[f"nondet_over_{o}_measured"]).abs() * 100
        lines.append(f"\nnondet/{o}: predicted within 3 points of measured in {(gap <= 3).sum()} of {len(nd)} cells "
                     f"(largest gap {gap.max():.1f} points).")  # fmt: skip
    err = d.error.abs()
    lines += ["", f"Cells within ±5%: {(err <= 0.05).sum()} of {len(d)}; mean |error| {err.mean():.1%}, "
              f"worst {d.error.iloc[err.argmax()]:+.1%} ({d.seq.iloc[err.argmax()]}:{_budget(d.iloc[err.argmax()])} "
              f"{d.policy.iloc[err.argmax()]})."]  # fmt: skip
    if at_run:
        what = " and ".join(w for w, on in (("host time", a.at_host_time), ("host link rate", a.at_link_rate)) if on)
        how = [x for x, on in (("every host cost of a simulated run scaled until its host thread spends as long "
                                "issuing and handling completions as the measured run's did", a.at_host_time),
                               ("its host link's copies as slow as the measured run's, bytes over time on the link",
                                a.at_link_rate)) if on]  # fmt: skip
        cols = [c for c, on in (("measured_host_ms", a.at_host_time), ("measured_link_gbps", a.at_link_rate)) if on]
        heads = {"measured_host_ms": "host ms measured", "measured_link_gbps": "link GB/s measured"}
        drawn = (" (runs that also offload, whose link rate one way is not defined: the host link factor drawn, "
                 "given the run's host factor)" if a.at_link_rate else " (the host link factor drawn, given the "
                 "run's host factor)")  # fmt: skip
        lines += ["", f"At each run's own {what} ({'; '.join(how)}){drawn}:", "",
                  "| seq | budget | policy | " + " | ".join(heads[c] for c in cols) + " | predicted ms at it | error |",
                  "|---|---|---|" + "---|" * len(cols) + "---|---|"]  # fmt: skip
        lines += [f"| {r.seq} | {_budget(r)} | {r.policy} | " + " | ".join(_num(r[c], ".2f") for c in cols)
                  + f" | {_num(r.predicted_at_run_ms, '.1f')} | {_num(r.error_at_run, '+.1%')} |"
                  for _, r in d.iterrows()]  # fmt: skip
        eh = d.error_at_run.abs().dropna()
        blank = f" ({len(d) - len(eh)} cells without these figures)" if len(eh) < len(d) else ""
        lines += ["", f"At the runs' own {what}: cells within ±5%: {(eh <= 0.05).sum()} of {len(eh)}; mean |error| "
                  f"{eh.mean():.1%}{blank}."]  # fmt: skip
    if overlays:
        lines += ["", "Overlays of a simulated run on the recorded traces (real against simulated, per resource):", ""]
        lines += [f"- {x}" for x in overlays]
    with atomic_write(f"{stem}.md") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _budget(r) -> str:
    """A result row's budget, with the bytes of inputs its plan kept resident (sized budgets)."""
    from turnip.cli import format_nbytes

    res = r.get("resident_nbytes") if r.budget != "none" else None
    return str(r.budget) if res is None or res != res else f"{r.budget}, {format_nbytes(int(res))} resident"


def _num(x, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)  # x != x: NaN


def _per_run(r, col: str) -> np.ndarray | None:
    """A grid row's per-run figures of ``col`` (a JSON list; null entries NaN), None when the row has none."""
    v = getattr(r, col, None)
    if not isinstance(v, str):
        return None
    return np.array([np.nan if x is None else x for x in json.loads(v)], dtype=np.float64)


def run_factors(mg, prof, tm, policy: str, order, seed: int, host_ms: float | None, link_gbps: float | None):
    """(host factor, link factor) at which a simulated run (``seed``) matches a measured run's host time and
    host link rate. Host: the factor that gives the simulated host thread as much issue and completion-handling
    time (``turnip.machine.costs.host_busy_ns``: linear in it); None when ``host_ms`` is None (the drawn one).
    Link: the factor at which the simulated run's ``turnip.calibrate.run_link_gbps`` is the measured one, from
    its rate at factor 1 and one secant step (a copy's latency does not scale with it); None (the drawn one,
    as for a plain prediction) when ``link_gbps`` is None or either rate is not a number (a run without copies
    from the host, or that offloads)."""
    from sim.engine import simulate
    from turnip.calibrate import run_link_gbps
    from turnip.machine.costs import host_factor_for

    host = None if host_ms is None else host_factor_for(tm, host_ms)
    if link_gbps is None or not link_gbps > 0:
        return host, None

    def busy_ns(f: float) -> float:  # the simulated run's bytes over time on the link, as time per byte
        return 1.0 / run_link_gbps(mg, simulate(mg, prof, policy, seed=seed, tm=tm, order=order, host=host, link=f))

    want, t1 = 1.0 / link_gbps, busy_ns(1.0)
    if not t1 > 0:
        return host, None
    f0 = want / t1
    t0 = busy_ns(f0) if f0 != 1.0 else t1
    f = 1.0 + (f0 - 1.0) * (want - t1) / (t0 - t1) if abs(t0 - t1) > 1e-12 * t1 else f0
    return host, float(f) if f > 0 else f0


def _at_run(mg, prof, tm, policy: str, order, meas: np.ndarray, host_ms: np.ndarray | None,
            link_gbps: np.ndarray | None, use_host: bool, use_link: bool) -> dict:  # fmt: skip
    """Each measured run predicted at its own conditions: one simulated run per measured one (seed = its index)
    at the host factor and host link factor of ``run_factors`` (``use_host``: its host time, else the drawn
    host factor; ``use_link``: its link rate where it has one, else the drawn link factor). NaN where a
    wanted figure is missing."""
    from sim.engine import simulate

    blank = {"measured_host_ms": np.nan, "measured_link_gbps": np.nan, "predicted_at_run_ms": np.nan,
             "error_at_run": np.nan}  # fmt: skip
    n = len(meas)
    missing = [x is None or len(x) != n for x, on in ((host_ms, use_host), (link_gbps, use_link)) if on]
    if any(missing):
        return blank
    pred = []
    for i in range(n):
        host, link = run_factors(mg, prof, tm, policy, order, i, host_ms[i] if use_host else None,
                                 link_gbps[i] if use_link else None)  # fmt: skip
        pred.append(simulate(mg, prof, policy, seed=i, tm=tm, order=order, host=host, link=link).makespan_ns / 1e6)
    pred = np.array(pred)
    has_link = use_link and np.isfinite(link_gbps).any()
    return {"measured_host_ms": float(np.mean(host_ms)) if use_host else np.nan,
            "measured_link_gbps": float(np.nanmean(link_gbps)) if has_link else np.nan,
            "predicted_at_run_ms": float(pred.mean()),
            "error_at_run": float(pred.mean() / meas.mean() - 1)}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run the grid on the GPU")
    m.add_argument("--seqs", nargs="+", type=int, default=list(SEQS), help="prompt lengths (tokens)")
    m.add_argument("--budgets", nargs="+", default=list(BUDGETS),
                   help="GPU memory budgets ('none': the whole model resident; else bytes, e.g. 6GiB)")
    m.add_argument("--policies", nargs="+", default=list(POLICIES), help="dispatch policies timed in every cell")
    m.add_argument("--model", default="llama-7b", help="model preset")
    m.add_argument("--gpus", type=int, default=1, help="GPUs the plans use")
    m.add_argument("--resident", default="auto",
                   help="inputs kept on the GPU under a sized budget: auto or bytes (as `turnip compile`)")
    m.add_argument("--warmup", type=int, default=1, help="warm-up rounds (at least; one run of every policy each)")
    m.add_argument("--heat", type=float, default=1.0,
                   help="seconds of warm-up rounds (at least; per policy with --sequential): the timed runs find the "
                        "GPU's clocks where runs back to back keep them (its power limit), as the simulator assumes")
    m.add_argument("--repeat", type=int, default=3, help="timed runs per cell and policy (at least 1)")
    m.add_argument("--sequential", action="store_true",
                   help="time each policy's runs in one block after its warm-up, not interleaved with the other "
                        "policies' (how grids before 2026-11-25 were measured)")
    m.add_argument("--out", required=True, help="CSV of the measured runs (rewritten after every cell)")
    m.add_argument("--traces", metavar="DIR", help="also record one run per cell and policy with start events as a "
                   "trace in DIR (the plan loaded again with them)")
    c = sub.add_parser("compare", help="simulate the measured cells' plans and compare")
    c.add_argument("measured", help="CSV written by `measure`")
    c.add_argument("--profile", required=True, help="machine profile: a shipped name (h100-calibrated) or a file")
    c.add_argument("--runs", type=int, default=10, help="simulated runs per cell and policy")
    c.add_argument("--out", required=True, help="writes OUT.csv (per cell) and OUT.md (tables and summary)")
    c.add_argument("--traces", metavar="DIR", help="overlay a simulated run on each trace `measure --traces` recorded "
                   "in DIR (DIR/overlay-<cell>/)")
    c.add_argument("--at-host-time", action="store_true",
                   help="also predict each measured run at its own host time (host_ms: the simulated run's host costs "
                        "scaled until it spends as long issuing and handling completions), apart from the host's speed")
    c.add_argument("--at-link-rate", action="store_true",
                   help="also predict each measured run at its own host link rate (link_gbps: the simulated run's "
                        "host-to-device copies slowed until they move their bytes as slowly); with --at-host-time, "
                        "at both")
    a = ap.parse_args(argv)
    if a.cmd == "measure" and a.repeat < 1:
        ap.error("--repeat must be at least 1")
    if a.cmd == "compare" and a.runs < 1:
        ap.error("--runs must be at least 1")
    return measure(a) if a.cmd == "measure" else compare(a)


if __name__ == "__main__":
    sys.exit(main())
