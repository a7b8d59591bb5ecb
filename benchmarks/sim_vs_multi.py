"""The simulator against measured multi-GPU prefills: each row of a ``benchmarks/multi_gpu.py`` CSV compiled
again (the same model, prompt, batch, GPUs, budget, split and ``--resident auto``: compiling is deterministic)
and simulated ``--runs`` times per policy on ``--profile``; the error of the mean simulated makespan against
the measured median, and the simulated nondet/det ratio against the measured one.

    python benchmarks/sim_vs_multi.py benchmarks/results/multi_gpu/prefill_7b_h100x4.csv --profile h100-calibrated
    python benchmarks/sim_vs_multi.py CSV --links probe.json   # the host link totals of another measurement

``--links FILE.json``: host link totals (``turnip.linkprobe`` output, the profile's three
``host_*_total_bytes_per_s`` fields) in place of the profile's; ``--independent-links``: none (every GPU its
own link, as before the host was modelled); ``--p2p serial|pairs``: each GPU's NVLink ports as one queue, or
every pair of GPUs independent, whatever the profile says; ``--p2p-slowdown F``: its
``kernel_slowdown_with_p2p``; ``--at-host-time``: each row simulated at its own host time too (the CSV's
``host_ms_per_run``). Writes ``--out`` (CSV) when given.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path


class PlanChanged(ValueError):
    """A measured row's plan no longer compiles the same (the compiler changed since): not compared."""


def simulate_row(r: dict, prof, runs: int, cache: dict, at_host: bool = False) -> float:
    """Mean simulated makespan (ms) of the measured row ``r`` (compiled once per configuration); ``at_host``: every
    run at the row's own host time (its ``host_ms_per_run``: the host costs scaled until the simulated host
    thread issues and handles for as long, ``turnip.machine.costs.host_factor_for``)."""
    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.compile import candidate, compile_model

    budget = "60GiB" if r["budget"] == "none" else r["budget"]
    key = (r["model"], r["seq"], r.get("batch", "1") or "1", r["gpus"], budget, r["split"])
    if key not in cache:
        kw = {}
        if r["split"] not in ("", "default"):  # a split, or the tile choice's plan: 'tensor t=4096'
            kw["split"], kw["tiles"] = candidate(r["split"])
        if int(key[2]) > 1:
            kw["batch"] = int(key[2])
        mg = compile_model(r["model"], seq=int(r["seq"]), gpus=int(r["gpus"]), budget=budget, resident="auto", **kw)[1]
        cache[key] = (mg, TimingModel(mg, prof))
    mg, tm = cache[key]
    if int(r.get("vertices") or mg.n) != mg.n:
        raise PlanChanged(f"compiled today it has {mg.n} vertices, the measured plan had {r['vertices']}")
    host = None
    if at_host:
        from turnip.machine.costs import host_factor_for

        host = host_factor_for(tm, float(r["host_ms_per_run"]))
    runs_ns = (simulate(mg, prof, r["policy"], s, False, tm, host=host).makespan_ns for s in range(runs))
    return statistics.fmean(runs_ns) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="a benchmarks/multi_gpu.py CSV (prefill rows)")
    ap.add_argument("--profile", default="h100-calibrated")
    ap.add_argument("--links", help="host link totals JSON (turnip.linkprobe --json) in place of the profile's")
    ap.add_argument("--independent-links", action="store_true", help="no host caps: every GPU its own link")
    ap.add_argument("--p2p", choices=("profile", "serial", "pairs"), default="profile",
                    help="GPU<->GPU copies: as the profile says, each GPU's ports as one queue out and one in "
                         "(p2p_ports_serial), or every pair independent")  # fmt: skip
    ap.add_argument("--p2p-slowdown", type=float, default=None, metavar="F",
                    help="kernel_slowdown_with_p2p in place of the profile's (0: as with a host copy)")
    ap.add_argument("--p2p-memory-share", action="store_true",
                    help="that slowdown by kernel, scaled by its roofline's memory share (p2p_slowdown_memory_share)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--at-host-time", action="store_true",
                    help="also simulate each row at its own host time (host_ms_per_run): what the host's speed, "
                         "which a profile cannot know in advance, leaves of the error")  # fmt: skip
    ap.add_argument("--out", help="write the rows with their simulated times here (CSV)")
    a = ap.parse_args(argv)
    from turnip.machine.profile import load_profile

    prof = load_profile(a.profile)
    if a.links:
        # lists of totals; p2p_ports_serial a bool (--p2p); the relay rates (--relay) are no profile fields
        fields = {k: v for k, v in json.loads(Path(a.links).read_text()).items() if not k.startswith("relay_")}
        prof = prof.replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    if a.independent_links:
        prof = prof.replace(**{f"host_{k}_total_bytes_per_s": () for k in ("h2d", "d2h", "both")})
    if a.p2p != "profile":
        prof = prof.replace(p2p_ports_serial=a.p2p == "serial")
    if a.p2p_slowdown is not None:
        prof = prof.replace(kernel_slowdown_with_p2p=a.p2p_slowdown)
    if a.p2p_memory_share:
        prof = prof.replace(p2p_slowdown_memory_share=True)
    rows = [r for r in csv.DictReader(open(a.csv)) if r["workload"] == "prefill" and r.get("ms_median")]
    cache: dict = {}
    skipped = []
    for r in list(rows):
        try:
            r["sim_ms"] = simulate_row(r, prof, a.runs, cache)
        except PlanChanged as e:
            rows.remove(r)
            skipped.append(r)
            print(f"not compared: {r['model']} {r['seq']} x {r.get('batch') or 1} at {r['budget']} on {r['gpus']} GPUs "
                  f"({r['split']}, {r['policy']}): {e}")  # fmt: skip
            continue
        r["error"] = r["sim_ms"] / float(r["ms_median"]) - 1
        if a.at_host_time:
            r["sim_ms_at_host"] = simulate_row(r, prof, a.runs, cache, at_host=True)
            r["error_at_host"] = r["sim_ms_at_host"] / float(r["ms_median"]) - 1
    by = {(r["seq"], r.get("batch") or "1", r["budget"], r["gpus"], r["split"], r["policy"]): r for r in rows}
    extra = " nondet / det error at own host time |" if a.at_host_time else ""
    print("| prompt | budget | GPUs | split | nondet measured / simulated | error | det error "
          "| nondet/det measured / sim |" + extra)
    print("|---|---|---|---|---|---|---|---|" + ("---|" if extra else ""))
    for (seq, batch, budget, gpus, split, policy), r in by.items():
        if policy != "nondet":
            continue
        d = by.get((seq, batch, budget, gpus, split, "det"))
        det = f"{d['error']:+.1%}" if d else "-"
        ratio = (f"{float(r['ms_median']) / float(d['ms_median']):.2f} / {r['sim_ms'] / d['sim_ms']:.2f}" if d
                 else "-")  # fmt: skip
        prompt = f"{int(seq) // 1024}K" + (f" x {batch}" if batch != "1" else "")
        at = (f" {r['error_at_host']:+.1%} / {d['error_at_host']:+.1%} |" if d else f" {r['error_at_host']:+.1%} / - |"
              ) if a.at_host_time else ""  # fmt: skip
        print(f"| {prompt} | {budget} | {gpus} | {split} | {float(r['ms_median']):.1f} / {r['sim_ms']:.1f} "
              f"| {r['error']:+.1%} | {det} | {ratio} |{at}")  # fmt: skip
    if not rows:
        print(f"no row compared ({len(skipped)} whose plans changed)")
        return 1
    within = sum(abs(r["error"]) <= 0.05 for r in rows)
    print(f"\n{within} of {len(rows)} cells within +-5%; mean |error| "
          f"{statistics.fmean(abs(r['error']) for r in rows):.1%} ({a.profile}"
          f"{', links ' + a.links if a.links else ''}{', independent links' if a.independent_links else ''}"
          f"{', p2p ' + a.p2p if a.p2p != 'profile' else ''}"
          f"{f', p2p slowdown {a.p2p_slowdown}' if a.p2p_slowdown is not None else ''}"
          f"{', by memory share' if a.p2p_memory_share else ''})"
          + (f"; {len(skipped)} not compared (their plans changed since)" if skipped else ""))
    if a.at_host_time:
        near = sum(abs(r["error_at_host"]) <= 0.05 for r in rows)
        worst = max(rows, key=lambda r: abs(r["error_at_host"]))
        print(f"at each row's own host time: {near} of {len(rows)} cells within +-5%; mean |error| "
              f"{statistics.fmean(abs(r['error_at_host']) for r in rows):.1%}; worst {worst['error_at_host']:+.1%} "
              f"({worst['seq']} {worst['budget']} {worst['gpus']} GPUs {worst['split']} {worst['policy']})")
    if a.out:
        from multi_gpu import write_csv  # a sibling script

        write_csv(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
