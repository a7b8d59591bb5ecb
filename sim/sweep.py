"""Ablation sweeps: models x seq lens x GPU counts x budgets x workloads x policies x seeds, on all local cores.

A workload (``WORKLOADS``) is what a plan computes: ``prefill`` (the default), ``lora``, one LoRA training
step of ``train_batch`` sequences of the configuration's length (``LORA``: rank 16 on q, k, v and the FFN,
activation checkpointing when it must), or ``decode``, one decode step of ``decode_batch`` sequences over a KV
cache of the configuration's length (rounded up to ``decode_block`` slots: the plan ``turnip generate`` runs,
``turnip.plancache.decode_plan``; tensor split, its own resident sets); each run's row names it (``workload``),
so the report compares prefill, training and decoding of one model, length, GPU count and budget side by side
and never mixes them.

Plans are compiled once each (in parallel; inputs kept resident as ``--resident`` says, ``auto`` by default as
for ``turnip run``) and cached as plan files under ``<out>/plans/`` (named with the compiler's source
fingerprint, so changed compiler code never reuses an old plan); then every (configuration, policy, seed) run
is one task. ``det-replay`` runs come last: each configuration replays the issue order of its fastest noisy
``nondet`` run (the lowest makespan, ties to the lowest seed; added to the sweep when absent). Results:
``runs.csv`` (one row per run), one trace per policy for the trace configuration, then
``analysis.report.write_report``; every file is written whole (``turnip.fileio.atomic_write``) and the tables
only once every run has finished, so a sweep that fails leaves only finished plan files behind.

The tasks run on a pool: local processes by default (``Processes``: its workers read and write the plan files
themselves), or one passed in, such as ``sim.cluster.ClusterSweep`` (a Dask cluster). A pool is a context
manager with ``where`` (words for messages), ``compile(out, plans)``, an iterator of (configuration, seconds,
error) as each plan is compiled into ``out/plans`` (or found there), and ``run(out, tasks)``, an iterator of
(index in ``tasks``, ``run_row``'s result) in any order. A run is the same function of its task whichever pool
runs it, so the rows are the same apart from ``TIMING_COLUMNS``.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from turnip.machine.profile import load_profile

GiB = 1 << 30
WORKLOADS = ("prefill", "lora", "decode")
LORA = {"rank": 16, "targets": "q,k,v,ffn", "checkpoint": "auto"}  # the sweep's training step
TIMING_COLUMNS = ("sim_wall_s",)  # runs.csv's columns that time this machine, not the simulated one


class SweepError(RuntimeError):
    """The sweep cannot produce any result (no configuration compiled)."""


@dataclass(frozen=True)
class SweepConfig:
    models: tuple[str, ...] = ("llama-7b",)
    seqs: tuple[int, ...] = (1024, 4096, 16384)
    gpus: tuple[int, ...] = (1, 4)
    budgets: dict = field(default_factory=lambda: {"tight": "1GiB", "roomy": "16GiB"})
    policies: tuple[str, ...] = ("nondet", "det", "det-kernels", "det-replay")
    seeds: int = 5
    mean_only: bool = True  # also one noise-free run per policy and configuration
    profile: str = "h100"
    resident: str = "auto"  # inputs kept on the GPU across runs: "auto" (as `turnip run --resident auto`) or bytes
    trace: dict = field(default_factory=lambda: {"model": "llama-7b", "seq": 4096, "gpus": 1, "budget": "tight"})
    workloads: tuple[str, ...] = ("prefill",)  # WORKLOADS
    train_batch: int = 1  # sequences per LoRA training step (workload lora)
    decode_batch: int = 1  # sequences per decode step (workload decode)
    decode_block: int = 256  # cache slots per block (workload decode; turnip.decode.DEFAULT_BLOCK)
    split: str = "auto"  # across GPUs: tensor, layers, or auto (the plan predicted faster on ``profile``)

    @staticmethod
    def from_toml(path: str | Path, **overrides) -> SweepConfig:
        data = tomllib.loads(Path(path).read_text())
        data = data.get("ablate", data)
        known = {f.name for f in fields(SweepConfig)}
        if set(data) - known:
            raise ValueError(f"{path}: unknown keys {sorted(set(data) - known)}; known: {sorted(known)}")
        data |= {k: v for k, v in overrides.items() if v is not None}
        return SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def plans(self) -> list[dict]:
        """One dict per configuration; a training step's also has ``batch``, a decode step's ``batch`` and
        ``block`` (and the tensor split: a decode plan has no other)."""
        return [
            {"model": m, "seq": s, "gpus": g, "budget": b, "budget_nbytes": _nbytes(v), "workload": w,
             "resident": str(self.resident), "split": self.split, "split_profile": self.profile}
            | ({"batch": self.train_batch} if w == "lora" else {})
            | ({"batch": self.decode_batch, "block": self.decode_block, "split": "tensor"} if w == "decode" else {})
            for m in self.models
            for s in self.seqs
            for g in self.gpus
            for b, v in self.budgets.items()
            for w in self.workloads
        ]  # fmt: skip

    def is_traced(self, p: dict) -> bool:
        """Whether configuration ``p`` is the one traced (``trace``; its workload defaults to the first)."""
        want = {"workload": self.workloads[0]} | self.trace
        return all(p.get(k) == v for k, v in want.items())


def _nbytes(v) -> int:
    from turnip.compile import parse_nbytes

    return int(v) if isinstance(v, int) else parse_nbytes(v)


def _workload_rank(w: str) -> int:
    return WORKLOADS.index(w) if w in WORKLOADS else len(WORKLOADS)


def train_spec(p: dict):
    """The ``TrainSpec`` of a configuration (None for a prefill or a decode step)."""
    w = p.get("workload", "prefill")
    if w in ("prefill", "decode"):
        return None
    if w != "lora":
        raise ValueError(f"unknown workload {w!r}; use one of {', '.join(WORKLOADS)}")
    from turnip.train import LoraConfig, TrainSpec, parse_targets

    return TrainSpec(int(p["batch"]), LoraConfig(LORA["rank"], targets=parse_targets(LORA["targets"])),
                     LORA["checkpoint"])  # fmt: skip


def plan_path(out: Path, p: dict) -> Path:
    from turnip.compile import compiler_fingerprint

    res = "" if str(p.get("resident", "0")) == "0" else f"_r{p['resident']}"
    work = "" if p.get("workload", "prefill") == "prefill" else f"_{p['workload']}-b{p['batch']}"
    if p.get("workload") == "decode":  # its resident sets are the generator's, whatever ``resident`` says
        res, work = "", f"{work}-t{p['block']}"
    split = p.get("split", "tensor")
    split = (
        ""
        if split == "tensor" or p["gpus"] < 2
        else f"_{split}" + (f"-{Path(str(p.get('split_profile'))).stem}" if split == "auto" else "")
    )
    fp = _decode_fingerprint() if p.get("workload") == "decode" else compiler_fingerprint()
    name = f"{p['model']}_{p['seq']}_{p['gpus']}g_{p['budget_nbytes']}{res}{work}{split}_{fp}.tplan"
    return out / "plans" / name


@functools.cache
def _decode_fingerprint() -> str:
    """The fingerprint of decode plans (``turnip.plancache.plan_fingerprint``: the compiler's and the decode
    modules' source), once per process."""
    from turnip.plancache import plan_fingerprint

    return plan_fingerprint()


def compile_plan(args, split_profile=None) -> tuple[dict, float, str | None]:
    """(out, configuration) -> (configuration, seconds, error): its plan compiled into ``out/plans`` unless
    there already; a configuration that does not compile (a budget too small) gives the error's text.
    ``split_profile``: the configuration's ``split_profile`` loaded already (a ``MachineProfile``)."""
    out, p = args
    path = plan_path(out, p)
    if path.exists():
        return p, 0.0, None
    from turnip.compile import compile_model
    from turnip.memgraph.io import save_plan

    t0 = time.perf_counter()
    if p.get("workload") == "decode":
        return _compile_decode(path, p, t0)
    try:
        tg, mg = compile_model(p["model"], p["seq"], p["gpus"], p["budget_nbytes"], resident=p.get("resident", "0"),
                               train=train_spec(p), split=p.get("split", "tensor"),
                               profile=split_profile or p.get("split_profile"))  # fmt: skip
        mg.stats["split"] = tg.meta.get("split", "tensor")  # what auto chose: the runs' rows say it
    except Exception as e:  # a budget too small for the plan: reported, the sweep goes on
        return p, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    save_plan(path, mg)
    return p, time.perf_counter() - t0, None


def _compile_decode(path: Path, p: dict, t0: float) -> tuple[dict, float, str | None]:
    """``compile_plan`` of a decode step (``turnip.plancache.decode_plan``); ``mg.stats`` gets the split, the
    step's batch and its cache's bytes and slots, which the runs' rows report."""
    from turnip.decode import cache_nbytes
    from turnip.memgraph.io import save_plan
    from turnip.models import llama_config
    from turnip.plancache import decode_plan

    try:
        cfg = llama_config(p["model"])
        if cfg is None:
            raise ValueError(f"decode steps need a LLaMA-family model, not {p['model']!r}")
        tg, mg = decode_plan(cfg, p["seq"], p["batch"], p["gpus"], p["budget_nbytes"], block=p["block"])
    except Exception as e:  # as compile_plan: reported, the sweep goes on
        return p, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    d = tg.meta["decode"]
    mg.stats |= {"split": "tensor", "cache_nbytes": cache_nbytes(tg), "cache_slots": d["n_blocks"] * d["block"]}
    save_plan(path, mg)
    return p, time.perf_counter() - t0, None


def tokens_per_run(p: dict) -> int:
    """Tokens one run of configuration ``p`` processes: a prefill's ``seq``, a training step's ``batch`` x
    ``seq``, a decode step's ``batch`` (one new token per sequence)."""
    w = p.get("workload", "prefill")
    return int(p.get("batch", 1)) * (1 if w == "decode" else int(p["seq"]))


_PLANS: dict = {}


def _load(path: Path):
    if path not in _PLANS:
        from sim.timing import TimingModel
        from turnip.memgraph.io import load_plan

        mg = load_plan(path)[0]
        _PLANS.clear()  # keep one plan per worker in memory
        _PLANS[path] = (mg, None)
        _PLANS[path] = (mg, TimingModel(mg, _PROFILE))
    return _PLANS[path]


_PROFILE = None


def _init(profile_name: str) -> None:
    global _PROFILE
    _PROFILE = load_profile(profile_name)


def run_row(mg, tm, prof, task) -> tuple[dict, dict | None, object]:
    """One simulated run: its ``runs.csv`` row, its trace when asked, and its issue order when asked (the
    nondet runs that ``det-replay`` picks from). ``task``: (configuration, policy, seed, mean_only, want_trace,
    want_order, replay), ``replay``: (seed, order) of the run det-replay replays."""
    from analysis.metrics import run_metrics
    from sim.engine import simulate

    p, policy, seed, mean_only, want_trace, want_order, replay = task
    r = simulate(mg, prof, policy, seed, mean_only, tm, None if replay is None else replay[1])
    tr = r.trace(mg, p)
    row = {k: p[k] for k in ("model", "seq", "gpus", "budget", "budget_nbytes", "workload")}
    row["split"] = mg.stats.get("split", "tensor")
    row |= {"batch": int(p.get("batch", 1)), "cache_nbytes": int(mg.stats.get("cache_nbytes", 0)),
            "cache_slots": int(mg.stats.get("cache_slots", 0))}  # fmt: skip
    row |= {"policy": policy, "seed": seed, "mean_only": mean_only, "lower_bound_ns": r.lower_bound_ns}
    row |= run_metrics(tr.spans, mg.n_gpus)
    row["tokens_per_s"] = tokens_per_run(p) * 1e9 / row["makespan_ns"] if row["makespan_ns"] else 0.0
    row |= {f"bound_{k}": v for k, v in r.bound.items() if k != "lower_bound_ns"}
    row |= {"n_vertices": mg.n, "sim_wall_s": r.wall_s, "resident_nbytes": int(mg.out_nbytes[mg.preloaded()].sum()),
            "replayed_seed": -1 if replay is None else replay[0]}  # fmt: skip
    return row, (tr if want_trace else None), (r.order if want_order else None)


def _run(args) -> tuple[dict, dict | None, object]:
    """A pool worker's run: (out, task) with the plan read from ``out/plans``."""
    out, task = args
    mg, tm = _load(plan_path(out, task[0]))
    return run_row(mg, tm, _PROFILE, task)


class Processes:
    """The sweep's tasks on a pool of local processes, whose workers read and write ``out/plans`` themselves."""

    def __init__(self, jobs: int, profile: str):
        self.jobs, self.profile = jobs, profile
        self.where = f"{jobs} processes"

    def __enter__(self) -> Processes:
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        self.pool = ctx.Pool(self.jobs, initializer=_init, initargs=(self.profile,))
        return self

    def __exit__(self, *exc) -> None:
        self.pool.terminate()

    def compile(self, out: Path, plans: list[dict]):
        """(configuration, seconds, error) of each plan as it is compiled (or found in ``out/plans``)."""
        return self.pool.imap_unordered(compile_plan, [(out, p) for p in plans])

    def run(self, out: Path, tasks: list[tuple]):
        """(index in ``tasks``, ``run_row``'s result) of each run, in order."""
        return enumerate(self.pool.imap(_run, [(out, t) for t in tasks], chunksize=1))


def _write_csv(df, path: Path) -> None:
    """A table written atomically (temporary file renamed into place)."""
    from turnip.fileio import atomic_write

    with atomic_write(path, newline="") as f:
        df.to_csv(f, index=False)


def _write_text(path: Path, text: str) -> None:
    from turnip.fileio import atomic_write

    with atomic_write(path) as f:
        f.write(text)


def run_sweep(
    cfg: SweepConfig,
    out: str | Path = "reports",
    jobs: int | None = None,
    quiet: bool = False,
    pool=None,
):
    """Run the whole sweep; write ``runs.csv``, traces and the report into ``out``. Returns the summary.
    ``jobs``: local processes (default: all cores); ``pool``: where the tasks run instead (opened and closed
    here), e.g. ``sim.cluster.ClusterSweep(address, cfg.profile)``."""
    import pandas as pd

    from analysis.report import write_report
    from turnip.progress import Progress

    t_start = time.perf_counter()
    out = Path(out)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    (out / "traces").mkdir(exist_ok=True)
    plans = cfg.plans()
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    policies = list(cfg.policies)
    if "det-replay" in policies and "nondet" not in policies:
        policies.insert(0, "nondet")
        say("ablate: det-replay replays the fastest nondet run's order; adding nondet runs")
    ex = Processes(jobs or os.cpu_count() or 1, cfg.profile) if pool is None else pool
    with ex:
        say(f"ablate: {len(plans)} plans x {len(policies)} policies x {cfg.seeds} seeds on {ex.where}")
        ok = []
        with Progress(len(plans), "ablate: compile plans") as bar:
            for i, (p, _, err) in enumerate(ex.compile(out, plans), 1):
                if err:
                    what = "" if p["workload"] == "prefill" else f" {p['workload']} batch {p['batch']}"
                    say(f"  skipped {p['model']} {p['seq']} {p['gpus']} GPUs {p['budget']}{what}: {err}")
                else:
                    ok.append(p)
                bar.update(i)
        if not ok:
            raise SweepError(f"none of the {len(plans)} configurations compiled (reasons above)")
        ok.sort(key=lambda p: -plan_path(out, p).stat().st_size)
        replay = "det-replay" in policies
        n_tasks = len(ok) * len(policies) * (cfg.seeds + cfg.mean_only)
        rows, traces, best = [], {}, {}
        first = [p for p in policies if p != "det-replay"]
        with Progress(n_tasks, "ablate: runs") as bar:
            # det-replay last: it replays the fastest noisy nondet run of its configuration (best[i])
            for phase in (first, ["det-replay"] if replay else []):
                tasks, plan_of = [], []
                for i, p in enumerate(ok):
                    is_tr = cfg.is_traced(p)
                    rep = best[i][1:] if phase == ["det-replay"] else None
                    for pol in phase:
                        rec = replay and pol == "nondet"
                        for s in range(cfg.seeds):
                            tasks.append((p, pol, s, False, is_tr and s == 0, rec, rep))
                        if cfg.mean_only:
                            tasks.append((p, pol, 0, True, False, False, rep))
                        plan_of += [i] * (cfg.seeds + cfg.mean_only)
                for k, (row, tr, order) in ex.run(out, tasks):  # in any order
                    rows.append(row)
                    if tr is not None:
                        traces[row["policy"]] = tr
                    i, key = plan_of[k], (row["makespan_ns"], row["seed"])
                    if order is not None and (i not in best or key < best[i][:2]):
                        best[i] = (*key, order)
                    bar.update(len(rows))
    traces = {pol: traces[pol] for pol in [*first, "det-replay"] if pol in traces}  # the phases' order, not finishing
    order = ["model", "seq", "gpus", "budget_nbytes", "budget", "workload", "policy", "mean_only", "seed"]
    runs = pd.DataFrame(rows).sort_values(order, key=lambda c: c.map(_workload_rank) if c.name == "workload" else c)
    _write_csv(runs, out / "runs.csv")
    for pol, tr in traces.items():
        spans, mem = tr.to_frames()
        _write_csv(spans, out / "traces" / f"{pol}.spans.csv")
        _write_csv(mem, out / "traces" / f"{pol}.memory.csv")
        if pol == "nondet" or len(traces) == 1:
            tr.write_chrome(out / "traces" / f"{pol}.trace.json")
    if traces:
        meta = next(iter(traces.values())).meta
        _write_text(out / "traces" / "meta.json", json.dumps({k: str(v) for k, v in meta.items()}, indent=1))
    _write_text(out / "config.json", json.dumps(asdict(cfg), indent=1))
    text = write_report(out, quiet=True)
    wall = time.perf_counter() - t_start
    sim_v = int(runs.n_vertices.sum())
    say(text)
    wrote = ", traces/" if traces else f" (no traces: the traced configuration {cfg.trace} did not run)"
    say(
        f"\n{len(runs)} runs, {sim_v:,} simulated vertices, {wall:.1f} s wall on {ex.where}; "
        f"wrote {out}/runs.csv, summary.csv, figures/*.png{wrote}"
    )
    return text
