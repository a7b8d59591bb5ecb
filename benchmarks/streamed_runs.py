"""Streamed prefills traced per vertex: what the host link waits on, and each run at its own conditions.

A streamed plan (weights copied in as the run goes: the 6 GiB and 1 GiB cells of ``sim_vs_real.py``) keeps
one copy from the host on the link at a time; the next is issued once the host has seen the last one done,
handled its completion and issued what that readied. On the lent H100s a run's makespan then follows the
host CPU, and in the phases where the host slows down, the link as well.

    # on the GPU: every vertex's host and device times of --rounds rounds of each policy per cell
    PYTHONPATH=. python benchmarks/streamed_runs.py measure --out DIR
    # anywhere: the link's hand-overs and each run's conditions, real against simulated
    python benchmarks/streamed_runs.py analyze DIR --profile h100-calibrated --out benchmarks/results/streamed_h100

``measure`` writes ``DIR/runs.npz`` (per run: host start, issue, device start, end, done, stream, handling
time of every vertex) and ``DIR/runs.csv`` (per run: makespan, host time, host link rate, the host thread's
run-queue wait and the machine's steal time over the run, a CPU probe: ns per iteration of an empty Python
loop just before). ``analyze`` writes ``OUT_handover.csv`` (per cell and policy, the mean hand-over between
two copies from the host on the link, split into: notice, the device end of the one before to the host seeing
it; handle, the host handling that completion; other, the host's other work until it begins the next copy;
issue, the copy's issue call; start, the issue to the copy starting on the device; the median run against a
simulated run at the profile's median host and host link), ``OUT_handling.csv`` (median handling time by the
commands a completion handed back, ``turnip.calibrate.handed_back``) and ``OUT_runs.csv`` (each run
predicted at its own host time, its host link factor drawn given that host, and at its own host time and
host link rate: ``sim_vs_real.py compare --at-host-time --at-link-rate`` run by run; the factors of the
latter), with a summary in ``OUT.md``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_vs_real import _warm_up, _write_rows, plan, run_factors  # noqa: E402 - the grid's plans and runs

CELLS = ("1024:6GiB", "4096:1GiB", "8192:1GiB")
POLICIES = ("nondet", "det-kernels")
COLUMNS = ("host_start_ns", "issue_ns", "start_ns", "end_ns", "done_ns", "stream", "handle_ns")
PARTS = ("notice", "handle", "other", "issue", "start")


def _cell(c: str) -> tuple[int, str]:
    seq, budget = c.split(":")
    return int(seq), budget


def _probe() -> float:
    """ns per iteration of an empty Python loop: the host CPU's speed right now."""
    t = time.perf_counter_ns()
    for _ in range(20000):
        pass
    return (time.perf_counter_ns() - t) / 20000


def _steal_ticks() -> int:
    """The machine's steal time so far (clock ticks; 0 where /proc/stat is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if len(fields) > 8 else 0
    except OSError:
        return 0


def _runqueue_ns() -> int:
    """This thread's time spent runnable but not running, so far (0 where schedstat is missing)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1])
    except OSError:
        return 0


def measure(a) -> int:
    from types import SimpleNamespace

    from turnip.calibrate import run_link_gbps
    from turnip.fileio import atomic_write
    from turnip.runtime import execute, open_loaded

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arrays, rows = {}, []
    for c in a.cells:
        seq, budget = _cell(c)
        t0 = time.perf_counter()
        tg, mg = plan(seq, budget)
        with open_loaded("cuda", tg, mg, device_start=True) as be:
            _warm_up(SimpleNamespace(warmup=2, heat=1.0), mg, be, a.policies, {})  # 2 rounds and 1 s at least
            for r in range(a.rounds):
                for pol in a.policies:
                    probe, steal, rq = _probe(), _steal_ticks(), _runqueue_ns()
                    x = execute(mg, be, pol, 5, seed=r)
                    steal, rq = _steal_ticks() - steal, _runqueue_ns() - rq
                    key = f"{seq}_{budget}_{pol}_{r}"
                    arrays[key] = np.stack([getattr(x, k) for k in COLUMNS]).astype(np.int64)
                    rows.append({"key": key, "seq": seq, "budget": budget, "policy": pol, "round": r,
                                 "makespan_ms": x.makespan_ns / 1e6, "host_ms": float(x.host_cost_ns().sum()) / 1e6,
                                 "link_gbps": run_link_gbps(mg, x), "probe_ns": probe, "steal_ticks": steal,
                                 "runqueue_us": rq / 1e3})  # fmt: skip
        print(f"{c}: {a.rounds} rounds of {', '.join(a.policies)} in {time.perf_counter() - t0:.1f} s", flush=True)
        with atomic_write(out / "runs.npz", "wb") as f:  # after every cell: a run cut short keeps what it has
            np.savez_compressed(f, **arrays)
        _write_rows(rows, str(out / "runs.csv"))
    return 0


def handover(mg, run) -> dict:
    """The mean hand-over between two copies from the host on the link, where the next one waited for the host
    to see the one before done: its parts (``PARTS``, ns) and their sum (``gap``), and how many there were."""
    from turnip.machine.costs import ENG_H2D, engine_class

    hs, iss, st, en, dn, hd = (np.asarray(getattr(run, k)) for k in COLUMNS if k != "stream")
    idx = np.flatnonzero((engine_class(mg) == ENG_H2D) & (iss > 0))
    idx = idx[np.argsort(st[idx], kind="stable")]
    p, n = idx[:-1], idx[1:]
    keep = (st[n] > en[p]) & (hs[n] >= dn[p])  # the link idle, the next copy begun after the host saw this one
    p, n = p[keep], n[keep]
    parts = {"notice": dn[p] - en[p], "handle": hd[p], "other": hs[n] - dn[p] - hd[p], "issue": iss[n] - hs[n],
             "start": st[n] - iss[n]}  # fmt: skip
    out = {k: float(v.mean()) if len(v) else float("nan") for k, v in parts.items()}
    return out | {"gap": float((st[n] - en[p]).mean()) if len(n) else float("nan"), "n": int(len(n))}


def analyze(a) -> int:
    from types import SimpleNamespace

    import pandas as pd

    from sim.engine import simulate
    from sim.timing import TimingModel
    from turnip.calibrate import handed_back, run_link_gbps
    from turnip.fileio import atomic_write
    from turnip.machine.profile import load_profile
    from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL

    d = Path(a.dir)
    runs = pd.read_csv(d / "runs.csv")
    z = np.load(d / "runs.npz")
    prof = load_profile(a.profile)
    hand, handling, per_run = [], [], []
    for (seq, budget), cell in runs.groupby(["seq", "budget"], sort=False):
        _tg, mg = plan(int(seq), str(budget))
        tm = TimingModel(mg, prof)
        real = {r.key: SimpleNamespace(**dict(zip(COLUMNS, z[r.key], strict=True))) for r in cell.itertuples()}
        kind = np.where(mg.kind == KIND_KERNEL, "kernel", np.where(mg.kind == KIND_INPUT, "input", "other"))
        for pol, rs in cell.groupby("policy", sort=False):
            med = rs.sort_values("makespan_ms", kind="stable").iloc[len(rs) // 2]
            sim = simulate(mg, prof, pol, seed=0, tm=tm, host=1.0, link=1.0)  # at the profile's median host, link
            for src, run, ms in (("real", real[med.key], med.makespan_ms), ("sim", sim, sim.makespan_ns / 1e6)):
                hand.append({"seq": seq, "budget": budget, "policy": pol, "run": src, "makespan_ms": ms}
                            | {k: v / 1e3 if k != "n" else v for k, v in handover(mg, run).items()})  # fmt: skip
        for r in cell.itertuples():  # each run at its own host time, then at its host time and link rate
            x = real[r.key]
            nb = handed_back(x)
            sent = (x.issue_ns > 0) & (x.handle_ns > 0)
            for k in np.unique(kind[sent]):
                for c in np.unique(nb[sent & (kind == k)]):
                    m = sent & (kind == k) & (nb == c)
                    handling.append({"seq": seq, "budget": budget, "policy": r.policy, "key": r.key, "kind": k,
                                     "commands": int(c), "handle_us": float(np.median(x.handle_ns[m])) / 1e3,
                                     "n": int(m.sum())})  # fmt: skip
            g = run_link_gbps(mg, x)
            f, link = run_factors(mg, prof, tm, r.policy, None, r.round, r.host_ms, g)
            at_host = simulate(mg, prof, r.policy, seed=r.round, tm=tm, host=f)
            at_run = simulate(mg, prof, r.policy, seed=r.round, tm=tm, host=f, link=link)
            per_run.append({"key": r.key, "seq": seq, "budget": budget, "policy": r.policy,
                            "makespan_ms": r.makespan_ms, "host_ms": r.host_ms, "link_gbps": g,
                            "probe_ns": r.probe_ns, "steal_ticks": r.steal_ticks, "runqueue_us": r.runqueue_us,
                            "host_factor": at_run.host_factor, "link_factor": at_run.link_factor,
                            "error_at_host": at_host.makespan_ns / 1e6 / r.makespan_ms - 1,
                            "error_at_host_and_link": at_run.makespan_ns / 1e6 / r.makespan_ms - 1})  # fmt: skip
    hand, per_run = pd.DataFrame(hand), pd.DataFrame(per_run)
    handling = pd.DataFrame(handling).groupby(["kind", "commands"]).agg(
        handle_us=("handle_us", "median"), runs=("key", "nunique"), n=("n", "sum")).reset_index()  # fmt: skip
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, t in (("handover", hand), ("handling", handling), ("runs", per_run)):
        with atomic_write(f"{out}_{name}.csv", newline="") as fh:
            t.to_csv(fh, index=False)
    lines = [f"# Streamed runs traced per vertex: {d.name} on profile {Path(a.profile).name}", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             "Hand-overs between two copies from the host (mean us; the median run of each cell and policy against "
             "a simulated run at the profile's median host and host link):", "",
             "| seq | budget | policy | run | makespan ms | hand-overs | gap | " + " | ".join(PARTS) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(PARTS)]  # fmt: skip
    for r in hand.itertuples():
        lines.append(f"| {r.seq} | {r.budget} | {r.policy} | {r.run} | {r.makespan_ms:.1f} | {r.n} | {r.gap:.1f} | "
                     + " | ".join(f"{getattr(r, k):.1f}" for k in PARTS) + " |")  # fmt: skip
    lines += ["", "Handling time by the commands a completion handed back (median us over runs):", "",
              "| completion of | commands | handle us | runs | completions |", "|---|---|---|---|---|"]
    lines += [f"| {r.kind} | {r.commands} | {r.handle_us:.2f} | {r.runs} | {r.n} |" for r in handling.itertuples()
              if r.n >= 20]  # fmt: skip
    e1, e2 = per_run.error_at_host.abs(), per_run.error_at_host_and_link.abs()
    lines += ["", f"Each of {len(per_run)} runs at its own host time: {(e1 <= 0.05).sum()} within ±5% (mean |error| "
              f"{e1.mean():.1%}, worst {e1.max():.1%}); at its own host time and host link rate: {(e2 <= 0.05).sum()} "
              f"(mean {e2.mean():.1%}, worst {e2.max():.1%})."]  # fmt: skip
    if per_run.steal_ticks.notna().any():  # recordings made before these were taken have none
        lines[-1] += (f" Steal time over the runs: {per_run.steal_ticks.sum():.0f} ticks; the host thread's run-queue "
                      f"wait: at most {per_run.runqueue_us.max():.0f} us in a run.")  # fmt: skip
    text = "\n".join(lines) + "\n"
    with atomic_write(f"{out}.md") as fh:
        fh.write(text)
    print(text)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="trace streamed runs on the GPU")
    m.add_argument("--cells", nargs="+", default=list(CELLS), help="SEQ:BUDGET cells of sim_vs_real's grid")
    m.add_argument("--policies", nargs="+", default=list(POLICIES))
    m.add_argument("--rounds", type=int, default=14, help="rounds of one run per policy (at least 1)")
    m.add_argument("--out", required=True, help="directory for runs.npz and runs.csv")
    c = sub.add_parser("analyze", help="hand-overs and per-run conditions, real against simulated")
    c.add_argument("dir", help="a directory `measure` wrote")
    c.add_argument("--profile", required=True)
    c.add_argument("--out", required=True, help="prefix of the CSVs and the .md summary")
    a = ap.parse_args(argv)
    if a.cmd == "measure" and a.rounds < 1:
        ap.error("--rounds must be at least 1")
    return measure(a) if a.cmd == "measure" else analyze(a)


if __name__ == "__main__":
    sys.exit(main())
