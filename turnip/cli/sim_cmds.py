"""``turnip simulate``, ``turnip ablate`` and ``turnip report``: what-if runs on a laptop."""

from __future__ import annotations

import argparse

from turnip.cli import DefaultsHelp, format_bound
from turnip.cli import args as ck

POLICY_HELP = (
    "nondet: launch anything ready whose resources are free (ties by compile order); "
    "nondet-cp: ties by critical path; det: each GPU issues everything in compile order (the paper's "
    "ablation); det-kernels: only kernels in fixed order; det-replay: the issue order of the fastest of "
    "--record-runs nondet runs (seeds seed, seed+1, ...), replayed fixed in every run (each GPU's kernels, "
    "copies per direction and transfers per link strictly in the recorded sequence)"
)


def register(sub) -> None:
    from turnip.compile import MODELS
    from turnip.decode import DEFAULT_BLOCK
    from turnip.sched import POLICIES

    s = sub.add_parser(
        "simulate",
        help="replay a plan in the discrete-event simulator",
        description="Simulate a compiled plan on a virtual GPU server (SimPy), driving the same scheduler "
        "core as real runs. PLAN is a plan file from `turnip compile -o`, or MODEL:SEQ:GPUS:BUDGET "
        "(e.g. llama-7b:4096:1:6GiB; MODEL may be a Hugging Face model directory) to compile on the fly "
        "as `turnip compile` does by default (budget-aware tiles, --resident auto). With --decode, "
        "MODEL:SEQ:GPUS:BUDGET is one decode step of --batch sequences over a KV cache of SEQ tokens, the plan "
        "`turnip generate` runs (docs/generate.md): per-step time, tokens/s and nondet against det.",
        formatter_class=DefaultsHelp,
    )
    s.add_argument("plan", metavar="PLAN", help="a plan file (`turnip compile -o`) or MODEL:SEQ:GPUS:BUDGET")
    s.add_argument("--policy", default="nondet", choices=POLICIES, help=POLICY_HELP)
    s.add_argument("--runs", type=ck.COUNT, default=20, help="replications (seeds seed..seed+runs-1)")
    s.add_argument("--record-runs", type=ck.COUNT, metavar="N",
                   help="det-replay: nondet runs (seeds seed..seed+N-1) whose fastest order is replayed "
                   "(default: --runs)")
    s.add_argument("--seed", type=ck.SEED, default=0, help="first seed (and the graph's seed of random:...)")
    s.add_argument("--profile", default="h100", help="machine profile: preset name or .toml/.json file")
    s.add_argument("--force", action="store_true", help="compile MODEL:SEQ:GPUS:BUDGET even when it is very large")
    s.add_argument("--mean-only", action="store_true", help="no timing variance: every duration at its mean")
    s.add_argument("--host-factor", type=ck.float_in(0.0, lo_open=True), metavar="F",
                   help="every host cost (issue, completion handling, polling) times F in every run: a host F times "
                        "slower than the profile's (default: each run's drawn from the profile's host_excess_sd)")
    ck.add_groups_flag(s)
    s.add_argument("--link-factor", type=ck.float_in(0.0, lo_open=True), metavar="F",
                   help="every copy between host and GPU moves its bytes F times slower (its latency stays) in every "
                        "run: a host link at 1/F of the profile's rate, as when the host's memory is busy (default: "
                        "each run's drawn from the profile's link_excess_sd; 1 where it is 0)")
    s.add_argument("--trace", metavar="OUT.json", help="write the first run as a Chrome/Perfetto trace")
    s.add_argument("--csv", metavar="OUT.csv",
                   help="write one row per run (makespan, lower bound, its host and host link factors)")
    s.add_argument("--vs", choices=[*POLICIES, "none"], metavar="POLICY",
                   help="also run POLICY with the same seeds and print the paired makespan ratio --policy/POLICY "
                   "(default: det with --decode, or nondet where --policy is det; none otherwise)")
    s.add_argument("--decode", action="store_true",
                   help="MODEL:SEQ:GPUS:BUDGET is one decode step: --batch sequences whose new token is the SEQ-th, "
                   "over a cache of SEQ slots rounded up to --block (a decode plan file is recognised by itself)")
    s.add_argument("--block", type=ck.COUNT, default=None,
                   help=f"--decode: cache slots per block, as `turnip generate --block` (default {DEFAULT_BLOCK})")
    ck.add_train_flags(s)  # for MODEL:SEQ:GPUS:BUDGET: a LoRA training step, SEQ tokens per sequence
    ck.add_split_flag(s)  # for MODEL:SEQ:GPUS:BUDGET
    s.set_defaults(func=cmd_simulate)
    ck.keep_defaults(s)

    a = sub.add_parser(
        "ablate",
        help="sweep models x seq lens x GPUs x budgets x policies x seeds; write CSVs, PNGs, a trace",
        description="Run an ablation sweep on all local cores. Without options: LLaMA-7B prefill at 1K, 4K "
        "and 16K tokens, 1 and 4 GPUs, a tight (1 GiB) and a roomy (16 GiB) budget per GPU with inputs kept "
        "resident as `turnip run --resident auto` does, nondet against det, det-kernels and det-replay (the "
        "issue order of each configuration's fastest nondet run, replayed fixed), 5 seeds (+ one noise-free run "
        "each), on the h100 profile. The report gives per configuration the paired makespan ratios nondet/det, "
        "nondet/det-kernels and nondet/det-replay (below 1: adapting at run time wins). Plans are compiled once "
        "and cached in OUT/plans. `--workloads prefill lora decode` adds one LoRA training step (--train-batch "
        "sequences of each length) and one decode step (--decode-batch sequences over a KV cache of each length) "
        "per configuration, reported next to that configuration's prefill. Options "
        "override the config file, which overrides the defaults. --scheduler runs the simulations on a Dask cluster "
        "instead of local processes.",
        formatter_class=DefaultsHelp,
    )
    a.add_argument("--config", metavar="FILE.toml", help="sweep config ([ablate] table with the keys below)")
    a.add_argument("--models", nargs="+", choices=MODELS, metavar="MODEL",
                   help=f"e.g. llama-7b llama-13b (default llama-7b); one of {', '.join(MODELS)}")
    a.add_argument("--seqs", nargs="+", type=ck.COUNT, help="sequence lengths (default 1024 4096 16384)")
    a.add_argument("--gpus", nargs="+", type=ck.GPUS, help="GPU counts, 1..8 (default 1 4)")
    a.add_argument("--budgets", nargs="+", metavar="NAME=SIZE", help="default tight=1GiB roomy=16GiB")
    a.add_argument("--policies", nargs="+", choices=POLICIES,
                   help="default nondet det det-kernels det-replay (det-replay adds nondet when absent)")
    a.add_argument("--workloads", nargs="+", choices=["prefill", "lora", "decode"],
                   help="what each plan computes: prefill; lora: one LoRA training step (rank 16 on q, k, v "
                   "and the FFN, checkpointing auto) of --train-batch sequences of each length; decode: one decode "
                   "step of --decode-batch sequences over a KV cache of each length (the plan `turnip generate` "
                   "runs); each reported next to the prefill of the same configuration (default prefill)")
    a.add_argument("--train-batch", type=ck.COUNT, metavar="N", help="sequences per LoRA training step (default 1)")
    a.add_argument("--decode-batch", type=ck.COUNT, metavar="N", help="sequences per decode step (default 1)")
    a.add_argument("--decode-block", type=ck.COUNT, metavar="T",
                   help=f"cache slots per block of a decode step (default {DEFAULT_BLOCK})")
    a.add_argument("--seeds", type=ck.COUNT, help="seeds per configuration and policy (default 5)")
    a.add_argument("--resident", metavar="auto|BYTES",
                   help="inputs kept on the GPU across runs: auto (a quarter of the budget when the plan still "
                   "compiles and moves no more host-link bytes per run than none, as `turnip run`) or a size per GPU; "
                   "0 streams every input (default auto)")
    a.add_argument("--split", choices=["tensor", "layers", "data", "auto"],
                   help="how each multi-GPU configuration is split across GPUs: by tensor blocks, by layers, by "
                   "sequences (data: training workloads), or auto: the plan the simulator predicts fastest on "
                   "--profile (default auto; runs.csv's split column says which)")
    a.add_argument("--no-mean-only", action="store_true", help="skip the noise-free runs")
    a.add_argument("--profile", help="machine profile (default h100)")
    a.add_argument("--jobs", type=ck.COUNT, default=None, help="processes (default: all cores)")
    a.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run the simulations on a Dask cluster instead of local processes: its scheduler's address "
        "(tcp://HOST:8786; workers need turnip installed), or local:N to start N worker processes here "
        "(needs pip install 'turnip[cluster]'); same rows either way (docs/sweeps.md)",
    )
    a.add_argument("--out", default="reports", help="output directory")
    a.add_argument("--force", action="store_true", help="compile configurations even when they are very large")
    a.set_defaults(func=cmd_ablate)

    r = sub.add_parser(
        "report",
        help="rebuild summary.csv and figures from a report directory, or overlay a simulated and a real trace",
        description="Read DIR/runs.csv (and DIR/traces/) and write DIR/summary.csv and DIR/figures/*.png; "
        "print the nondet-over-det speedup table. With --overlay SIM_TRACE REAL_TRACE (the --trace files of "
        "`turnip simulate` and `turnip run` on the same plan) instead: write OUT/overlay.png (real and simulated "
        "spans per GPU engine, link and host thread on one time axis) and OUT/overlay.csv (busy time, end time "
        "and their errors per resource, the makespan error, time per op); print the per-resource table.",
    )
    r.add_argument("dir", metavar="DIR", nargs="?", help="report directory written by `turnip ablate --out DIR`")
    r.add_argument("--overlay", nargs=2, metavar=("SIM_TRACE", "REAL_TRACE"), help="overlay two traces of one plan")
    r.add_argument("--out", help="output directory of --overlay (default: the current directory)")
    r.set_defaults(func=cmd_report)


def _plan(spec: str, force: bool, seed: int = 0, train: argparse.Namespace | None = None):
    """The memgraph of PLAN and its trace metadata. ``train``: the parsed training flags (``--train lora``
    and the rest; ``ck.add_train_flags``), which apply when PLAN is MODEL:SEQ:GPUS:BUDGET, and ``--decode``
    and ``--block``; a decode step's metadata has ``workload`` decode (``_decode_meta``)."""
    from pathlib import Path

    from turnip.cli.compile_cmds import build_plan, compile_args, load_plan_arg, split_profile

    decode = getattr(train, "decode", False)
    if getattr(train, "block", None) is not None and not decode:
        raise ck.CliError("--block applies to --decode only; drop it, or add --decode", ck.USAGE)
    if decode and getattr(train, "train", "none") != "none":
        raise ck.CliError("--decode and --train lora are different plans; pass one of them", ck.USAGE)
    flags = {k: getattr(train, k) for k in ("train", "batch", "rank", "alpha", "targets", "lr", "checkpoint", "split")
             if train is not None and hasattr(train, k)}  # fmt: skip
    flags["profile"] = split_profile(train) if train is not None else None  # --profile picks the split
    if Path(spec).is_file():
        if flags.get("train", "none") != "none":
            raise ck.CliError(f"--train applies to MODEL:SEQ:GPUS:BUDGET; {spec} is a compiled plan (compile it "
                              "with `turnip compile --train lora` instead)", ck.USAGE)  # fmt: skip
        if train is not None:
            ck.unused_flags(train, plan_file=spec)
        if getattr(train, "block", None) is not None:
            raise ck.CliError(f"--block: {spec} is a compiled plan, which fixes it; drop it", ck.USAGE)
        mg, tg = load_plan_arg(spec)
        meta = {"plan": spec}
        if tg is not None and tg.meta.get("head") == "decode":
            return mg, meta | _decode_meta(tg, mg)
        if decode:
            raise ck.CliError(f"--decode: {spec} is not a decode step's plan; drop --decode, or pass "
                              "MODEL:SEQ:GPUS:BUDGET", ck.USAGE)  # fmt: skip
        return mg, meta
    model, seq_n, gpus_n, budget = _parse_spec(spec)
    if decode:
        return _decode_plan(model, seq_n, gpus_n, budget, train, force)
    a = argparse.Namespace(model=model, seq=seq_n, gpus=gpus_n, budget=budget, dtype="fp16", tile=[], resident="auto",
                           **flags)  # fmt: skip
    tiles, nbytes, est = compile_args(a, force, budget_flag=f"BUDGET in {spec!r}")
    tg, mg = build_plan(a, tiles, nbytes, est, seed=seed)
    meta = {"model": model, "seq": seq_n, "gpus": gpus_n, "budget": budget, "split": tg.meta.get("split", "tensor")}
    if ck.train_spec(a) is not None:
        meta |= {"workload": "lora", "batch": a.batch}
    return mg, meta


def _parse_spec(spec: str) -> tuple[str, int, int, str]:
    """MODEL:SEQ:GPUS:BUDGET as (model, seq, gpus, budget text); usage errors say what is wrong."""
    from turnip.compile import MODELS

    parts = spec.rsplit(":", 3)  # MODEL may be a path
    if len(parts) != 4 and (spec.endswith(".tplan") or "/" in spec):
        raise ck.CliError(f"{spec}: no such plan file; write one with `turnip compile -o {spec}`, or pass "
                          "MODEL:SEQ:GPUS:BUDGET (e.g. llama-7b:4096:1:6GiB)", ck.USAGE)  # fmt: skip
    if len(parts) != 4:
        raise ck.CliError(f"{spec!r} is neither a plan file nor MODEL:SEQ:GPUS:BUDGET; pass a file written by "
                          "`turnip compile -o` or e.g. llama-7b:4096:1:6GiB", ck.USAGE)  # fmt: skip
    model, seq, gpus, budget = parts
    if model not in MODELS:
        try:
            ck.model(model)
        except argparse.ArgumentTypeError as e:
            raise ck.CliError(f"model in {spec!r}: {e}", ck.USAGE) from None
    try:
        seq_n, gpus_n = ck.COUNT(seq), ck.GPUS(gpus)
    except argparse.ArgumentTypeError as e:
        which = "SEQ" if not seq.isdigit() or int(seq) < 1 else "GPUS"
        raise ck.CliError(f"{which} in {spec!r}: {e}; e.g. llama-7b:4096:1:6GiB", ck.USAGE) from None
    return model, seq_n, gpus_n, budget


def decode_guard(model: str, seq: int, gpus: int, budget_nbytes: int, block: int, force: bool, where: str):
    """The LLaMA config of a decode step of ``model`` over a cache of ``seq`` tokens: usage errors for a model
    that has none or that decode plans do not run (``where`` names the argument), and a refusal (exit 1) of a
    plan too large to compile in reasonable time, unless ``force`` (as ``ck.guard`` for prefills)."""
    from turnip.compile import BUILD_VERTICES_PER_S, LOWER_VERTICES_PER_S, MAX_COMPILE_S, MAX_VERTICES
    from turnip.decode import check_decodable, context_blocks, decode_vertices
    from turnip.models import llama_config

    cfg = llama_config(model)
    if cfg is None:
        raise ck.CliError(f"{where}: decode steps need a LLaMA-family model, not {model}", ck.USAGE)
    try:
        check_decodable(cfg)
        n = decode_vertices(cfg, context_blocks(seq, block), gpus, "fp16", budget_nbytes)
    except ValueError as e:
        raise ck.CliError(f"{where}: {e}", ck.USAGE) from None
    compile_s = n / LOWER_VERTICES_PER_S + 4 * n / BUILD_VERTICES_PER_S  # up to four resident sets built
    if (n > MAX_VERTICES or compile_s > MAX_COMPILE_S) and not force:
        raise ck.CliError(f"{where}: a decode step of {model} over {seq} tokens would have {n:,} taskgraph vertices "
                          f"(about {compile_s:,.0f} s to compile); use a shorter context or a larger --block, or "
                          "pass --force", ck.FAILED)  # fmt: skip
    return cfg


def _decode_plan(model: str, seq: int, gpus: int, budget: str, a, force: bool):
    """``--decode``: the decode step's memgraph and metadata (``turnip.plancache.decode_plan``)."""
    from turnip.decode import DEFAULT_BLOCK
    from turnip.memgraph.build import BudgetError
    from turnip.plancache import decode_plan

    split = getattr(a, "split", None) or "auto"
    if split == "data":
        raise ck.CliError("--split data: a decode step is split by tensor blocks or by layers", ck.USAGE)
    where = f"{model}:{seq}:{gpus}:{budget}"
    nbytes = ck.nbytes(budget, f"BUDGET in {where!r}", minimum=1)
    block = a.block or DEFAULT_BLOCK
    cfg = decode_guard(model, seq, gpus, nbytes, block, force, where)
    try:
        tg, mg = decode_plan(cfg, seq, a.batch, gpus, nbytes, block=block, split=None if split == "auto" else split)
    except BudgetError as e:
        raise ck.CliError(f"{e}; raise BUDGET in {where!r}", ck.FAILED) from None
    meta = {"model": model, "seq": seq, "gpus": gpus, "budget": budget, "split": tg.meta["split"]}
    return mg, meta | _decode_meta(tg, mg)


def _decode_meta(tg, mg) -> dict:
    """A decode step's metadata: workload, batch, block, its cache's slots, bytes and whether it streams."""
    from turnip.decode import cache_nbytes, state_inputs
    from turnip.memgraph.plan import KIND_INPUT

    d = tg.meta["decode"]
    streamed = mg.tensor[(mg.kind == KIND_INPUT) & ~mg.preloaded()]
    return {"workload": "decode", "batch": int(tg.meta["batch"]), "block": int(d["block"]),
            "cache_slots": int(d["n_blocks"] * d["block"]), "cache_nbytes": cache_nbytes(tg),
            "cache_streamed": bool(set(state_inputs(tg)) & set(streamed.tolist()))}  # fmt: skip


def _runs(mg, prof, tm, policy: str, a, progress: str):
    """``a.runs`` simulated runs of ``policy`` (seeds ``a.seed``...): their rows, the first run's result, and
    for det-replay the words saying whose order it replays."""
    from sim.engine import fastest_run, simulate
    from turnip.progress import Progress

    order, replayed = None, ""
    if policy == "det-replay":
        n_rec = a.record_runs or a.runs
        with Progress(n_rec, "simulate: record nondet orders") as bar:
            best = fastest_run(mg, prof, range(a.seed, a.seed + n_rec), a.mean_only, tm, progress=bar.update,
                               host=a.host_factor, link=a.link_factor, groups=ck.GROUPS[a.launch_groups])  # fmt: skip
        order = best.order
        replayed = (f"replaying the issue order of nondet seed {best.seed} ({best.makespan_ns / 1e6:.3f} ms, the "
                    f"fastest of {n_rec} nondet runs)")  # fmt: skip
    rows, first = [], None
    with Progress(a.runs, progress) as bar:
        for i in range(a.runs):
            r = simulate(mg, prof, policy, a.seed + i, a.mean_only, tm, order, host=a.host_factor,
                         link=a.link_factor, groups=ck.GROUPS[a.launch_groups])  # fmt: skip
            first = first or r  # its bound is the one printed
            rows.append({"policy": policy, "seed": r.seed, "makespan_ns": r.makespan_ns,
                         "lower_bound_ns": r.lower_bound_ns, "wall_s": r.wall_s, "host_factor": r.host_factor,
                         "link_factor": r.link_factor})  # fmt: skip
            bar.update(i + 1)
    return rows, first, replayed


def cmd_simulate(a) -> int:
    import numpy as np

    from sim.timing import TimingModel

    ck.output_file(a.trace, "--trace")
    ck.output_file(a.csv, "--csv")
    if a.record_runs is not None and "det-replay" not in (a.policy, a.vs):
        raise ck.CliError("--record-runs applies to --policy det-replay (or --vs det-replay) only; drop it", ck.USAGE)
    prof = ck.load_profile(a.profile)
    mg, meta = _plan(a.plan, a.force, a.seed, a)
    decode = meta.get("workload") == "decode"
    vs = a.vs if a.vs is not None else ("none" if not decode else "nondet" if a.policy == "det" else "det")
    vs = None if vs in ("none", a.policy) else vs
    tm = TimingModel(mg, prof)
    rows, first, replayed = _runs(mg, prof, tm, a.policy, a, "simulate")
    if a.trace:
        first.trace(mg, meta).write_chrome(a.trace)
    other = _runs(mg, prof, tm, vs, a, f"simulate {vs}") if vs else ([], None, "")
    ms = np.array([x["makespan_ns"] for x in rows]) / 1e6
    eff = np.mean([x["lower_bound_ns"] / x["makespan_ns"] for x in rows])  # each run against its own bound
    wall = sum(x["wall_s"] for x in rows + other[0])
    rate = f"{mg.n * len(rows + other[0]) / wall:,.0f}" if wall > 0 else "-"
    lora = meta.get("workload") == "lora"
    step = f", one LoRA training step of {meta['batch']} x {meta['seq']} tokens" if lora else ""
    if decode:
        seqs = f"{meta['batch']} sequence{'s' * (meta['batch'] > 1)}"
        where = "streamed from the host" if meta["cache_streamed"] else "kept on the GPUs"
        step = (f", one decode step of {seqs} over a cache of {meta['cache_slots']} slots ({meta['block']} per "
                f"block, {meta['cache_nbytes'] / 2**20:.1f} MiB, {where})")  # fmt: skip
    host = f", host costs x {a.host_factor:g}" if a.host_factor is not None else ""
    host += f", host link copies x {a.link_factor:g}" if a.link_factor is not None else ""
    print(f"{mg.n} vertices{step}, {mg.n_gpus} GPU(s), policy {a.policy}, profile {prof.name}{host}, {a.runs} run(s)")
    for words in (replayed, other[2]):
        if words:
            print(words)
    print(f"makespan  mean {ms.mean():.3f} ms  sd {ms.std():.3f}  min {ms.min():.3f}  max {ms.max():.3f}")
    drawn = a.runs > 1 and not a.mean_only and (
        (a.host_factor is None and prof.host_excess_sd > 0) or (a.link_factor is None and prof.link_excess_sd > 0))
    which = " (run 1's: each run's host and host link factors are drawn)" if drawn else ""
    parts = format_bound(first.bound, 1)
    print(f"lower bound {first.lower_bound_ns / 1e6:.3f} ms{which} ({parts})")
    print(f"efficiency {eff:.3f}; simulated {rate} vertices/s")
    if decode:
        print(f"per step {ms.mean():.3f} ms: {meta['batch'] * 1e3 / ms.mean():,.1f} tokens/s ({seqs} x 1 token)")
    if vs:
        ms_vs = np.array([x["makespan_ns"] for x in other[0]]) / 1e6
        ratio = ms / ms_vs  # the same seeds: paired
        per = f": {meta['batch'] * 1e3 / ms_vs.mean():,.1f} tokens/s" if decode else ""
        print(f"{a.policy}/{vs} {ratio.mean():.3f} (paired over {len(ratio)} seeds: {ratio.min():.3f}.."
              f"{ratio.max():.3f}; below 1: {a.policy} faster); {vs} mean {ms_vs.mean():.3f} ms{per}")  # fmt: skip
    if a.trace:
        print(f"trace: {a.trace} (open in https://ui.perfetto.dev)")
    if a.csv:
        import pandas as pd

        from turnip.fileio import atomic_write

        df = pd.DataFrame(rows + other[0]).assign(mean_only=a.mean_only, **meta)
        if decode:
            df["tokens_per_s"] = meta["batch"] * 1e9 / df.makespan_ns
        with atomic_write(a.csv, newline="") as f:
            df.to_csv(f, index=False)
    return 0


SWEEP_KEYS = {"models": "list of model names", "seqs": "list of sequence lengths", "gpus": "list of GPU counts",
              "budgets": "table NAME = SIZE", "policies": "list of policies", "seeds": "seeds per configuration",
              "mean_only": "true/false", "profile": "machine profile name or file",
              "resident": "auto or bytes of inputs kept resident per GPU",
              "trace": "table with model, seq, gpus, budget, workload",
              "workloads": "list of prefill, lora, decode", "train_batch": "sequences per LoRA training step",
              "decode_batch": "sequences per decode step",
              "decode_block": "cache slots per block of a decode step"}  # fmt: skip


def _read_config(path: str) -> dict:
    """Check a sweep config file's form (readable TOML, known keys) before SweepConfig reads it; returns its
    [ablate] table."""
    import tomllib

    ck.input_file(path, "--config", "pass a TOML file with an [ablate] table")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ck.CliError(f"--config {path} is not valid TOML ({e}); fix the file", ck.USAGE) from None
    data = data.get("ablate", data)
    if not isinstance(data, dict):
        raise ck.CliError(f"--config {path}: [ablate] is not a table; put the keys {', '.join(SWEEP_KEYS)} under "
                          "[ablate]", ck.USAGE)  # fmt: skip
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    tables = [k for k in unknown if isinstance(data[k], dict)]
    if tables and "ablate" not in tables:
        import difflib

        near = difflib.get_close_matches(tables[0], ["ablate"], n=1, cutoff=0.6)
        hint = "; did you mean [ablate]?" if near else ""
        raise ck.CliError(f"--config {path}: no [ablate] table (found [{tables[0]}]){hint}", ck.USAGE)
    if unknown:
        known = "; ".join(f"{k} ({what})" for k, what in SWEEP_KEYS.items())
        raise ck.CliError(f"--config {path}: unknown keys {unknown}; known keys: {known}", ck.USAGE)
    return data


def _check_sweep(cfg, where: str, force: bool) -> None:
    """Every value of the final sweep config (from the file, options and defaults) valid, every plan of a
    size that compiles in reasonable time; usage errors name ``where`` the value came from."""
    from sim.sweep import WORKLOADS, train_spec
    from turnip.compile import MODELS, parse_nbytes
    from turnip.sched import POLICIES

    def bad(key, why):
        raise ck.CliError(f"{where}: {key} {why}", ck.USAGE)

    def int_list(key, v, lo, hi=None):
        if not isinstance(v, tuple | list) or not v:
            bad(key, f"is {v!r}; it must be a non-empty list")
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
                bad(key, f"has {x!r}; its values must be integers {f'in {lo}..{hi}' if hi else f'>= {lo}'}")

    if not isinstance(cfg.models, tuple | list) or not cfg.models or any(m not in MODELS for m in cfg.models):
        bad("models", f"is {cfg.models!r}; it must be a list of {', '.join(MODELS)}")
    int_list("seqs", cfg.seqs, 1)
    int_list("gpus", cfg.gpus, 1, ck.MAX_GPUS)
    if not isinstance(cfg.budgets, dict) or not cfg.budgets:
        bad("budgets", f"is {cfg.budgets!r}; it must be a table NAME = SIZE like tight = \"1GiB\"")
    for name, v in cfg.budgets.items():
        try:
            n = int(v) if isinstance(v, int) and not isinstance(v, bool) else parse_nbytes(str(v))
        except ValueError as e:
            raise ck.CliError(f"{where}: budget {name}: {e}", ck.USAGE) from None
        if n < 1:
            bad("budgets", f"{name} = {v!r} is not positive; use a size like 1GiB")
    if not isinstance(cfg.policies, tuple | list) or not cfg.policies or any(p not in POLICIES for p in cfg.policies):
        bad("policies", f"is {cfg.policies!r}; it must be a list of {', '.join(POLICIES)}")
    if isinstance(cfg.seeds, bool) or not isinstance(cfg.seeds, int) or cfg.seeds < 1:
        bad("seeds", f"is {cfg.seeds!r}; it must be an integer >= 1")
    if not isinstance(cfg.mean_only, bool):
        bad("mean_only", f"is {cfg.mean_only!r}; it must be true or false")
    if not isinstance(cfg.profile, str):
        bad("profile", f"is {cfg.profile!r}; it must be a profile name or file")
    if str(cfg.resident) != "auto":
        try:
            parse_nbytes(str(cfg.resident))
        except ValueError as e:
            bad("resident", f"is {cfg.resident!r}: {e}; or auto")
    if not isinstance(cfg.trace, dict) or set(cfg.trace) - {"model", "seq", "gpus", "budget", "workload"}:
        bad("trace", f"is {cfg.trace!r}; it must be a table with keys among model, seq, gpus, budget, workload")
    work = cfg.workloads
    if not isinstance(work, tuple | list) or not work or any(w not in WORKLOADS for w in work):
        bad("workloads", f"is {cfg.workloads!r}; it must be a list of {', '.join(WORKLOADS)}")
    for key in ("train_batch", "decode_batch", "decode_block"):
        v = getattr(cfg, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            bad(key, f"is {v!r}; it must be an integer >= 1")
    for p in cfg.plans():
        if p["workload"] == "decode":
            decode_guard(p["model"], p["seq"], p["gpus"], p["budget_nbytes"], p["block"], force,
                         f"{where}: decode of {p['model']} at {p['seq']} tokens")  # fmt: skip
            continue
        ck.guard(p["model"], p["seq"], p["gpus"], "fp16", None, None, p["budget_nbytes"], force, quiet=True,
                 train=train_spec(p))  # fmt: skip


def _check_scheduler(a) -> None:
    """--scheduler well formed, not given with --jobs, and dask.distributed installed (imported only here)."""
    from sim.cluster import ClusterError, distributed_module, parse_scheduler

    if a.jobs is not None:
        raise ck.CliError("--jobs sets local processes; with --scheduler the cluster's workers run the sweep "
                          "(local:N starts N of them): drop --jobs", ck.USAGE)  # fmt: skip
    try:
        parse_scheduler(a.scheduler)
    except ValueError as e:
        raise ck.CliError(f"--scheduler {e}", ck.USAGE) from None
    try:
        distributed_module()
    except ClusterError as e:
        raise ck.CliError(str(e), ck.FAILED) from None


def cmd_ablate(a) -> int:
    from sim.cluster import ClusterError, ClusterSweep
    from sim.sweep import SweepConfig, run_sweep

    if a.scheduler is not None:
        _check_scheduler(a)
    budgets = None
    if a.budgets:
        budgets = {}
        for b in a.budgets:
            name, eq, size = b.partition("=")
            if not eq or not name or not size:
                raise ck.CliError(f"--budgets got {b!r}; it takes NAME=SIZE items, e.g. tight=1GiB", ck.USAGE)
            if name in budgets:
                raise ck.CliError(f"--budgets names {name!r} twice ({name}={budgets[name]}, {b}); give each budget "
                                  "its own name", ck.USAGE)  # fmt: skip
            budgets[name] = size
    over = {"models": a.models, "seqs": a.seqs, "gpus": a.gpus, "budgets": budgets, "policies": a.policies,
            "seeds": a.seeds, "profile": a.profile, "mean_only": False if a.no_mean_only else None,
            "resident": a.resident, "workloads": a.workloads, "train_batch": a.train_batch,
            "decode_batch": a.decode_batch, "decode_block": a.decode_block, "split": a.split}  # fmt: skip
    ck.output_dir(a.out, "--out")
    given_trace = {}  # the config file's [ablate.trace], which must name a configuration of the grid
    if a.config:
        given_trace = _read_config(a.config).get("trace", {})
        cfg = SweepConfig.from_toml(a.config, **over)
    else:
        cfg = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in over.items() if v is not None})
    _check_sweep(cfg, f"--config {a.config}" if a.config else "ablate", a.force)
    ck.load_profile(cfg.profile)
    cfg = _trace_in_grid(cfg, given_trace)  # (_check_sweep made sure it is a table)
    from sim.sweep import SweepError

    try:
        pool = None if a.scheduler is None else ClusterSweep(a.scheduler, cfg.profile)
        run_sweep(cfg, a.out, a.jobs, pool=pool)
    except SweepError as e:
        raise ck.CliError(f"{e}; raise the budgets (--budgets NAME=SIZE) or shorten the sequences", ck.FAILED) from None
    except ClusterError as e:
        raise ck.CliError(f"{e}; no results written to {a.out}", ck.FAILED) from None
    return 0


def _trace_in_grid(cfg, given: dict):
    """The sweep with a traced configuration in its grid: what ``given`` (the config file's ``trace``) names
    must be there (else ``CliError``); keys it does not name take the grid's first value where the default
    (LLaMA-7B, 4K, 1 GPU, budget "tight") is not in the grid."""
    from sim.sweep import SweepConfig

    grid = {"model": cfg.models, "seq": cfg.seqs, "gpus": cfg.gpus, "budget": tuple(cfg.budgets),
            "workload": cfg.workloads}  # fmt: skip
    trace = dict(cfg.trace)
    for key, values in grid.items():
        if key in given and given[key] not in values:
            have = ", ".join(map(str, values))
            raise ck.CliError(f"--config: trace {key} = {given[key]!r} is not in the grid ({have}); name one of them",
                              ck.USAGE)  # fmt: skip
        if key in trace and trace[key] not in values:
            trace[key] = values[0]
    return SweepConfig(**{**cfg.__dict__, "trace": trace})


def cmd_report(a) -> int:
    from pathlib import Path

    from analysis.report import write_report

    if a.overlay or a.out is not None or a.dir is None:
        return _report_overlay(a)
    if not Path(a.dir).is_dir():
        raise ck.CliError(f"{a.dir}: no such directory; run `turnip ablate --out {a.dir}` first", ck.USAGE)
    if not (Path(a.dir) / "runs.csv").exists():
        raise ck.CliError(f"no runs.csv in {a.dir}; run `turnip ablate --out {a.dir}` first", ck.USAGE)
    ck.input_file(str(Path(a.dir) / "runs.csv"), "runs table", f"run `turnip ablate --out {a.dir}` again")
    ck.output_dir(a.dir, "DIR")
    _check_runs(Path(a.dir) / "runs.csv")
    write_report(a.dir)
    print(f"wrote {a.dir}/summary.csv and {a.dir}/figures/")
    return 0


def _report_overlay(a) -> int:
    from pathlib import Path

    from analysis.overlay import PlanMismatch, format_overlay, write_overlay
    from turnip.trace import TraceFormatError, read_chrome

    if not a.overlay or a.dir is not None:
        why = "--out applies to --overlay only" if a.overlay is None and a.dir is not None else "pass one of them"
        raise ck.CliError(f"report takes DIR or --overlay SIM_TRACE REAL_TRACE; {why}", ck.USAGE)
    out = "." if a.out is None else a.out
    ck.output_dir(out, "--out")
    traces = []
    for what, path in zip(("SIM_TRACE", "REAL_TRACE"), a.overlay, strict=True):
        ck.input_file(path, what, "pass the --trace file of `turnip simulate` or `turnip run`")
        try:
            traces.append(read_chrome(path))
        except TraceFormatError as e:
            raise ck.CliError(f"{what} {path} is not a turnip trace ({e}); pass the --trace file of `turnip "
                              "simulate` or `turnip run`", ck.USAGE) from None  # fmt: skip
    try:
        table = write_overlay(*traces, out)
    except PlanMismatch as e:
        raise ck.CliError(f"{a.overlay[0]} and {a.overlay[1]} are traces of different plans: {e}; overlay the "
                          "traces of `turnip simulate PLAN` and `turnip run PLAN` of one plan",
                          ck.USAGE) from None  # fmt: skip
    print(format_overlay(table))
    print(f"wrote {Path(out) / 'overlay.png'} and {Path(out) / 'overlay.csv'}")
    return 0


RUNS_COLUMNS = ("model", "seq", "gpus", "budget", "budget_nbytes", "policy", "seed", "mean_only", "makespan_ns",
                "lower_bound_ns", "input_nbytes", "offload_nbytes", "reload_nbytes")  # fmt: skip


def _check_runs(path) -> None:
    """runs.csv readable as the table `turnip ablate` writes (the columns the report uses), non-empty."""
    import pandas as pd

    try:
        runs = pd.read_csv(path)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError) as e:  # EmptyDataError is a ValueError
        raise ck.CliError(f"{path} is not a runs table ({type(e).__name__}: {e}); run `turnip ablate` again",
                          ck.USAGE) from None  # fmt: skip
    missing = [c for c in RUNS_COLUMNS if c not in runs.columns]
    if missing or runs.empty:
        why = f"lacks the columns {missing}" if missing else "has no rows"
        raise ck.CliError(f"{path} {why}; it must be the runs.csv of `turnip ablate`", ck.USAGE)
