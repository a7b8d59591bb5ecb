"""``turnip run``: execute a compiled plan for real, on GPUs (cuda) or on the CPU (cpu)."""

from __future__ import annotations

import time

from turnip.cli import DefaultsHelp, format_bound
from turnip.cli import args as ck
from turnip.cli import format_nbytes as _sz


def register(sub) -> None:
    from turnip.compile import MODEL_HELP
    from turnip.models import HEADS
    from turnip.runtime import BACKENDS
    from turnip.sched import POLICIES

    p = sub.add_parser(
        "run",
        help="execute a plan on GPUs (cuda) or on the CPU (cpu) with the real runtime",
        description="Compile a model (or load PLAN, a file from `turnip compile -o` with its taskgraph) and "
        "run it for real with the same scheduler core the simulator drives. --model may be a Hugging Face "
        "LLaMA-family directory (config.json and safetensors, sharded or not): its weights are read tensor by "
        "tensor and, with --prompt (needs the tokenizers package and the directory's tokenizer.json) or "
        "--prompt-ids, it prints the next token and the top-5 logits (a directory without safetensors files is "
        "refused unless --random-weights). Presets run random weights (--seed) or "
        "--weights (a .safetensors file with turnip or Hugging Face LLaMA names; see docs/runtime.md). Prints "
        "time to first token (the prefill makespan), load time, bytes moved, GPU busy fraction, host cost per "
        "vertex and the plan's lower bound next to the measured time.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("plan", nargs="?", metavar="PLAN", help="plan file (default: compile --model ...); it is "
                   "checked and verified (`turnip verify`) before it is loaded")  # fmt: skip
    p.add_argument("--no-verify", action="store_true",
                   help="PLAN: skip the verifier (races, lost dependencies), for plans you made yourself; the "
                   "cheap checks that keep the runtime in its memory are always made")  # fmt: skip
    p.add_argument("--model", default="llama-tiny", type=ck.model, metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--seq", type=ck.COUNT, default=64, help="prompt length in tokens (random ids; a --prompt sets it)")
    p.add_argument("--prompt", metavar="TEXT", help="prompt text, tokenized with the model directory's tokenizer.json")
    p.add_argument("--prompt-ids", metavar="FILE.npy", help="prompt token ids: a 1-D integer .npy file")
    p.add_argument("--logits", default="auto", choices=["auto", *HEADS],
                   help="LLaMA output: none (final hidden states), last (next-token logits), all (every "
                   "position's); auto = last for a Hugging Face model, none for presets")
    p.add_argument("--all-logits", action="store_true", help="same as --logits all")
    p.add_argument("--gpus", type=ck.GPUS, default=1, help="GPUs (1..8)")
    p.add_argument("--budget", default="6GiB", help="GPU memory budget per GPU")
    p.add_argument("--dtype", default="fp16", choices=ck.DTYPES,
                   help="compute dtype (weights on disk in another dtype are converted as they load)")
    p.add_argument("--resident", default="auto",
                   help="bytes of inputs kept on the GPU across runs (loaded once with the plan), 0 to stream every "
                        "input, or auto (as `turnip compile`; default)")
    p.add_argument("--tile", action="append", default=[], metavar="DIM=SIZE",
                   help="tile size override (llama-*): t, h, f or kv, as in `turnip compile`")
    p.add_argument("--backend", default="cpu", choices=BACKENDS,
                   help="cpu: numpy on byte arenas with real threads (any machine); cuda: the GPU")
    p.add_argument("--policy", default="nondet", choices=POLICIES,
                   help="dispatch policy (see `turnip simulate --help`); det-replay: the warm-up runs and then "
                   "--record-runs untimed runs go nondet and record their issue orders, and every timed run "
                   "replays the fastest one's order fixed (each GPU's kernels, copies per direction and "
                   "transfers per link strictly in the recorded sequence)")
    p.add_argument("--record-runs", type=ck.COUNT, default=None, metavar="N",
                   help="det-replay: untimed nondet runs, after the warm-up, whose fastest order is replayed "
                   "(default 3)")
    p.add_argument("--streams", type=ck.int_in(1, 64), default=5, help="stream slots per GPU (1..64)")
    p.add_argument("--unordered-sums", action="store_true",
                   help="partial sums added in the order they finish: not bitwise reproducible across runs on 3+ GPUs")
    p.add_argument("--numba-kernels", action="store_true",
                   help="cuda: numba memory-bound kernels instead of the CUDA C++ ones (16-byte accesses, warp "
                   "reductions; those need CuPy)")
    p.add_argument("--graph-events", action="store_true",
                   help="cuda: record each vertex's end event inside its graph (one driver call per launch)")
    p.add_argument("--numba-launch", action="store_true",
                   help="cuda: launch through numba launchers instead of bound driver calls (slower)")
    p.add_argument("--repeat", type=ck.COUNT, default=3, help="timed runs")
    p.add_argument("--warmup", type=ck.int_in(0), default=1,
                   help="untimed runs first (kernel modules, cuBLAS handles)")
    p.add_argument("--seed", type=ck.SEED, default=0, help="weights / inputs seed (and chaos seeds)")
    p.add_argument("--weights", metavar="FILE.safetensors", help="read weights from this file")
    add_random_weights_flag(p)
    ck.add_runtime_flags(p, stall_s=60.0)
    p.add_argument("--check", action="store_true", help="compare outputs with the taskgraph evaluated in numpy")
    p.add_argument("--profile", default="auto",
                   help="machine profile for the lower bound (auto: the shipped profile of the GPU run on, "
                        "h100-calibrated or h200-calibrated; the h100 preset for the CPU backend)")  # fmt: skip
    p.add_argument("--trace", metavar="OUT.json", help="write the last timed run as a Chrome/Perfetto trace")
    p.add_argument("--csv", metavar="OUT.csv", help="write one row per timed run (the simulator's columns)")
    p.add_argument("--force", action="store_true", help="compile --model even when it is very large")
    ck.add_train_flags(p)
    ck.add_split_flag(p)
    p.set_defaults(func=cmd_run)
    ck.keep_defaults(p)


def _plan(a):
    import sys

    if a.plan:
        from turnip.cli.compile_cmds import read_plan

        mg, tg, problems, verify_s = read_plan(a.plan, verify=not a.no_verify)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ck.CliError(f"{a.plan} is not safe to run: {problems[0]}{more}; `turnip verify {a.plan}` lists "
                              "its problems: compile the plan again", ck.USAGE)  # fmt: skip
        if tg is None:
            raise ck.CliError(f"{a.plan} holds no taskgraph, which a run needs; compile it again with "
                              "`turnip compile -o`", ck.USAGE)  # fmt: skip
        if verify_s >= 1.0:
            print(f"verified {a.plan} in {verify_s:.1f} s (--no-verify skips it)", file=sys.stderr)
        return tg, mg, {"plan": a.plan, "model": tg.meta.get("model", "?")}
    from turnip.cli.compile_cmds import build_plan, compile_args

    # the run holds the inputs in host memory once (streamed into the input region), twice with --check
    tiles, budget, est = compile_args(a, a.force, extra_nbytes=lambda e: (2 if a.check else 1) * e.input_nbytes)
    tg, mg = build_plan(a, tiles, budget, est, seed=a.seed, label="plan")
    return tg, mg, {"model": a.model, "seq": a.seq, "gpus": a.gpus, "budget": a.budget, "budget_nbytes": budget}


def add_random_weights_flag(p) -> None:
    p.add_argument("--random-weights", action="store_true",
                   help="run on seeded random weights when the model directory has no safetensors files "
                   "(timing only)")  # fmt: skip


def _checkpoint(a):
    """The weights to read: ``--weights`` (a .safetensors file), else ``--model`` when it is a directory
    holding weights; None for random weights (presets, plan files, or ``--random-weights`` for a directory
    without weights: a Hugging Face model without weights is refused otherwise). Headers are read and checked
    now, before compiling."""
    import sys
    from pathlib import Path

    from turnip.checkpoint import Checkpoint, has_weights
    from turnip.compile import MODELS

    if a.weights:
        ck.input_file(a.weights, "--weights", WEIGHTS_HINT)
        try:
            return Checkpoint(a.weights)
        except (ValueError, OSError) as e:  # CheckpointError: one line naming the file or tensor
            raise ck.CliError(f"--weights {a.weights} is not a .safetensors file turnip can read ({e}); "
                              f"{WEIGHTS_HINT}", ck.USAGE) from None  # fmt: skip
    if a.plan or a.model in MODELS:
        return None
    d = Path(a.model) if Path(a.model).is_dir() else Path(a.model).parent  # a directory or its config.json
    random = getattr(a, "random_weights", False)
    if has_weights(d):
        if random:
            raise ck.CliError(f"--random-weights: {d} has safetensors weights, which --model reads; drop "
                              "--random-weights (or pass --model a copy of config.json alone)", ck.USAGE)  # fmt: skip
        try:
            return Checkpoint(d)
        except (ValueError, OSError) as e:
            raise ck.CliError(f"--model {a.model}: {e}", ck.USAGE) from None
    if not random:
        raise ck.CliError(f"--model {a.model}: no safetensors weights found in directory {d}; "
                          "add model.safetensors (or its shards and model.safetensors.index.json), pass "
                          "--weights FILE.safetensors, or --random-weights to run on seeded random weights "
                          "(timing only)", ck.USAGE)  # fmt: skip
    print(f"note: {d} has no safetensors weights; running on seeded random weights (--seed {a.seed}), so "
          "outputs mean nothing", file=sys.stderr)  # fmt: skip
    return None


WEIGHTS_HINT = "pass a .safetensors file with this model's tensors (turnip or Hugging Face LLaMA names)"


def _prompt_ids(a):
    """Token ids of --prompt / --prompt-ids (None: random ids of --seq tokens)."""
    import numpy as np

    if a.prompt_ids:
        return ck.token_ids_file(a.prompt_ids, "--prompt-ids", "a non-empty 1-D array of integer token ids",
                                 lambda ids: ids.ndim == 1 and ids.size > 0)  # fmt: skip
    if a.prompt is not None:
        tok = _tokenizer(a, required=True)
        ids = np.array(tok.encode(a.prompt).ids, dtype=np.int64)
        if ids.size == 0:
            raise ck.CliError("--prompt gives no tokens; pass some text", ck.USAGE)
        return ids
    return None


def _check_prompt_vocab(a, ids, tg=None) -> None:
    """The prompt's ids must be rows of the model's vocabulary (``CliError`` naming the first that is not):
    checked against ``--model``'s config before compiling, or against a plan file's taskgraph (``tg``)."""
    from functools import partial

    from turnip.models import llama_config
    from turnip.runtime.weights import check_ids, vocab_size

    if ids is None:
        return
    vocab = vocab_size(tg) if tg is not None else None
    if vocab is None:  # a prefill without an LM head has no (V, d) input: the config says
        try:
            cfg = llama_config(a.model if tg is None else str(tg.meta.get("model", "")))
        except (ValueError, OSError):
            cfg = None
        vocab = cfg.vocab if cfg is not None else None
    if vocab is None:
        return
    what = f"--prompt-ids {a.prompt_ids}" if a.prompt_ids else "--prompt (tokenized)"
    check_ids(ids, vocab, f"{what} (vocabulary of {vocab})", partial(ck.CliError, code=ck.USAGE))


def _tokenizer(a, required: bool = False):
    """The model directory's tokenizer (the ``tokenizers`` package), or None when there is none."""
    from pathlib import Path

    d = Path(a.model) if Path(a.model).is_dir() else Path(a.model).parent
    f = d / "tokenizer.json"
    if not f.is_file():
        if required:
            raise ck.CliError(f"--prompt needs {f}; this model has no tokenizer.json, pass --prompt-ids", ck.USAGE)
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if required:
            raise ck.CliError("--prompt needs the tokenizers package (pip install tokenizers); or pass token ids "
                              "with --prompt-ids", ck.USAGE) from None  # fmt: skip
        return None
    return Tokenizer.from_file(str(f))


def _inputs(a, tg, ids=None, ckpt=None):
    """The run's inputs as a stream of (logical name, array), one tensor at a time (random weights of
    ``--seed``, or ``ckpt``'s read tensor by tensor), or for a non-LLaMA graph {input tensor: array}.
    ``ids``: the prompt (the embedded prompt ``x0`` is gathered from the embedding table)."""
    import numpy as np

    from turnip.runtime.weights import RandomInputs, iter_random_inputs, logical_inputs, vocab_size

    if "x0" not in logical_inputs(tg):  # not a LLaMA: the test inputs of the reference interpreter
        from turnip.memgraph.interp import random_inputs

        return random_inputs(tg, np.random.default_rng(a.seed))
    if not tg.meta.get("train"):
        if ckpt is not None:
            return ckpt.inputs(tg, ids=ids, seed=a.seed)  # write_streaming reads it on threads
        return RandomInputs(tg, a.seed, ids=ids)  # write_streaming fills it from threads
    # a training step: fresh adapters (PEFT's initialisation) and the ids' next tokens; the rest as for a prefill
    from turnip.train import AdapterState, next_token_targets

    b, lg = tg.meta["batch"], logical_inputs(tg)
    rng = np.random.default_rng([a.seed, 7])
    rows = ids if ids is not None else rng.integers(0, vocab_size(tg), b * tg.meta["seq"])
    fixed = AdapterState.init(tg, a.seed).inputs() | {"targets": next_token_targets(rows.reshape(b, -1))}
    if ckpt is not None:
        import itertools

        return itertools.chain(ckpt.iter_inputs(tg, ids=ids, seed=a.seed, only=set(lg) - set(fixed)), fixed.items())
    return ((k, fixed.get(k, x)) for k, x in iter_random_inputs(tg, a.seed, ids=ids))


def _write_inputs(a, tg, be, source) -> dict | None:
    """Write the inputs into the loaded backend; returns {input tensor: array} when ``--check`` needs them
    (that keeps a second copy), else None (the weights pass through host memory once)."""
    from turnip.runtime.weights import tile_inputs, write_streaming

    if isinstance(source, dict):
        be.write_inputs(source)
        return source
    if not a.check:
        write_streaming(be, tg, source)
        if hasattr(source, "summary"):  # a checkpoint: bytes read, time and rate
            print(source.summary())
        return None
    values = tile_inputs(tg, dict(source))
    be.write_inputs(values)
    return values


def _cuda_preflight(what: str = "--backend cuda", instead: str = "or use --backend cpu") -> None:
    """The cuda backend needs the NVIDIA driver: fail before compiling when it cannot be loaded."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise ck.CliError(f"{what} needs an NVIDIA GPU and driver, but libcuda.so.1 cannot be loaded ({e}); "
                          f"run on a GPU machine, {instead}", ck.FAILED) from None  # fmt: skip


def _check_args(a) -> None:
    """Everything that can be checked before compiling and loading."""
    if a.backend == "cuda":
        _cuda_preflight()
    ck.output_file(a.trace, "--trace")
    ck.output_file(a.csv, "--csv")
    from turnip.runtime.driver import machine_profile

    a.profile = machine_profile(a.profile, a.backend)
    ck.load_profile(a.profile)
    if a.weights:
        from turnip.models import llama_config

        if a.plan is None and llama_config(a.model) is None:
            raise ck.CliError(f"--weights applies to LLaMA models only, not {a.model}; drop --weights", ck.USAGE)
    if a.prompt is not None and a.prompt_ids:
        raise ck.CliError("pass --prompt or --prompt-ids, not both", ck.USAGE)
    if (a.prompt is not None or a.prompt_ids) and a.train != "none":
        raise ck.CliError("--prompt/--prompt-ids are for prefills; a training step on your tokens is `turnip train "
                          "--data FILE`", ck.USAGE)  # fmt: skip
    if (a.prompt is not None or a.prompt_ids) and a.batch > 1:
        raise ck.CliError("a prompt is one sequence: drop --batch (batched prefills run random prompts)", ck.USAGE)
    if a.record_runs is not None and a.policy != "det-replay":
        raise ck.CliError("--record-runs applies to --policy det-replay only; drop it", ck.USAGE)
    if a.plan and a.tile:
        raise ck.CliError("--tile applies when compiling --model, not to a plan file (its tiles are fixed); drop "
                          "--tile or compile the plan again with them", ck.USAGE)  # fmt: skip
    if a.plan:
        ck.unused_flags(a, plan_file=a.plan)
    elif a.no_verify:
        raise ck.CliError("--no-verify applies to a plan file (a plan compiled here is not verified); drop it",
                          ck.USAGE)  # fmt: skip


def cmd_run(a) -> int:
    import sys

    from turnip.compile import MODELS
    from turnip.fileio import atomic_write
    from turnip.progress import Progress
    from turnip.runtime import execute, open_backend

    _check_args(a)
    if a.all_logits:
        a.logits = "all"
    ids = _prompt_ids(a)
    if ids is not None:
        a.seq = int(ids.size)
    if a.plan is None:
        _check_prompt_vocab(a, ids)
    ckpt = _checkpoint(a)
    t0 = time.perf_counter()
    tg, mg, meta = _plan(a)
    if ids is not None and tg.meta.get("seq", ids.size) != ids.size:
        raise ck.CliError(f"the prompt has {ids.size} tokens but {a.plan} was compiled for {tg.meta['seq']}; "
                          "compile it for this length or run --model directly", ck.USAGE)  # fmt: skip
    if a.plan is not None:
        _check_prompt_vocab(a, ids, tg)
        if ckpt is None and str(tg.meta.get("model", "")) not in MODELS:
            print(f"note: {a.plan} holds no weights; running on seeded random weights (--seed {a.seed}); pass "
                  "--weights FILE.safetensors for the model's own", file=sys.stderr)  # fmt: skip
    source = _inputs(a, tg, ids, ckpt)
    t_plan = time.perf_counter() - t0
    bound = _bound(mg, a.profile)
    opts = {"chaos": a.chaos} if a.backend == "cpu" else {"fast": not a.numba_kernels, "bound": not a.numba_launch,
                                                           "graph_events": a.graph_events}
    opts["groups"] = ck.GROUPS[a.launch_groups]
    rows, res = [], None
    t1 = time.perf_counter()
    with open_backend(a.backend, mg, a.streams, **opts) as be:
        t2 = time.perf_counter()
        try:
            values = _write_inputs(a, tg, be, source)
        except (ValueError, KeyError, OSError) as e:
            if ckpt is None:
                raise
            if a.weights:
                raise ck.CliError(f"--weights {a.weights} cannot be used: {e}; {WEIGHTS_HINT}", ck.USAGE) from None
            raise ck.CliError(f"--model {a.model}: {e}", ck.FAILED) from None
        t_load, gb_in = time.perf_counter() - t1, int(tg.nbytes[tg.kind == 0].sum()) / 1e9
        print(f"{mg.n} vertices on {mg.n_gpus} GPU(s), backend {a.backend}, policy {a.policy}; "
              f"plan {t_plan:.1f} s, load {t_load:.1f} s (inputs {gb_in:.3g} GB at "
              f"{gb_in / max(time.perf_counter() - t2, 1e-9):.3g} GB/s)")  # fmt: skip
        n_rec = (a.record_runs or 3) if a.policy == "det-replay" else 0
        untimed, recorded, order = a.warmup + n_rec, [], None
        with Progress(untimed + a.repeat, "run") as bar:
            for i in range(untimed + a.repeat):
                timed = i >= untimed
                policy = a.policy if timed or not n_rec else "nondet"
                res = execute(mg, be, policy, a.streams, seed=a.seed + i, stall_s=a.stall_s,
                              record_order=not timed and i >= a.warmup, order=order if timed else None,
                              ordered_sums=not a.unordered_sums)  # fmt: skip
                if res.order:
                    recorded.append(res)
                if n_rec and i == untimed - 1:
                    order = min(recorded, key=lambda r: r.makespan_ns).order
                if timed:
                    rows.append(res.row(mg, meta, bound))
                bar.update(i + 1)
        outs = be.read_outputs()
    _report(rows, bound, res, int(mg.stats.get("resident_input_nbytes", 0)), bool(tg.meta.get("train")),
            profile=a.profile, on_cpu=a.backend == "cpu", sustained_ns=_sustained(mg, a.profile))  # fmt: skip
    if a.backend != "cpu" and rows:
        print(host_speed_line(mg, a.profile, res, a.plan))
    if recorded:
        ms = sorted(r.makespan_ns / 1e6 for r in recorded)
        print(f"det-replay           replayed the issue order of the fastest of {len(ms)} nondet runs ({ms[0]:.3f} "
              f"ms; their median {ms[len(ms) // 2]:.3f} ms)")  # fmt: skip
    if "logits" in tg.meta.get("output_blocks", {}):
        _report_logits(a, tg, outs)
    _report_host_memory(mg)
    ok = True
    if a.check:
        from turnip.memgraph.interp import evaluate_taskgraph

        with Progress(tg.n, "check: numpy reference") as bar:
            ref = evaluate_taskgraph(tg, values, progress=bar.update)
        ok = _check_outputs(tg, outs, ref, 2e-2 if a.dtype == "fp16" else 1e-4)
    if a.trace and res is not None:
        res.trace(mg, meta).write_chrome(a.trace)
        print(f"trace     {a.trace} (open in https://ui.perfetto.dev)")
    if a.csv:
        import pandas as pd

        with atomic_write(a.csv, newline="") as f:
            pd.DataFrame(rows).to_csv(f, index=False)
        print(f"csv       {a.csv}")
    if not ok:
        raise ck.CliError("--check failed: the outputs differ from the numpy evaluation of the taskgraph beyond the "
                          "tolerance; rerun with --debug and report it with the command line", ck.FAILED)  # fmt: skip
    return 0


def _report_logits(a, tg, outs) -> None:
    """The next token (the last position's argmax) and the top-5 logits, with text when a tokenizer is there."""
    import numpy as np

    from turnip.memgraph.interp import assemble

    logits = assemble(tg, outs, "logits").astype(np.float32)
    last = logits[-1]
    top = np.argsort(-last, kind="stable")[:5]
    tok = _tokenizer(a) if a.plan is None else None

    def text(i: int) -> str:
        return f" {tok.decode([int(i)])!r}" if tok is not None else ""

    print(f"next token           {int(top[0])}{text(top[0])}")
    print("top-5 logits         " + ", ".join(f"{int(i)}{text(i)} {last[i]:.3f}" for i in top))


def _report_host_memory(mg) -> None:
    """Peak resident host memory of this process next to the plan's host regions (inputs, offloads)."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return
    from turnip.runtime.layout import plan_layout

    inputs, offloads = plan_layout(mg).host_nbytes
    print(f"host memory peak     {_sz(peak)} (pinned inputs {_sz(inputs)}, offload region {_sz(offloads)})")


def _check_outputs(tg, outs, ref, tol: float) -> bool:
    """``--check``: every output within ``tol`` of the numpy evaluation (relative error of the whole tile),
    except the parameters an Adam step wrote (``adam_p``), which move each element by about lr x the sign of
    its gradient: where a gradient is near 0, the order of partial sums can flip that sign, so at most 1% of
    their elements may land up to 2 lr from the reference (as in the training tests). Prints the figures."""
    import numpy as np

    errs = {t: _rel(outs[t], ref[t]) for t in outs if tg.op[t] != "adam_p"}
    worst_t = max(errs, key=errs.get, default=None)
    err = errs[worst_t] if errs else 0.0
    ok = err <= tol
    where = f", in {tg.name[worst_t]}" if errs and not ok else ""
    print(f"check     max relative error vs numpy taskgraph evaluation: {err:.2e}{where} ({'ok' if ok else 'FAILED'})")
    adam = [t for t in outs if tg.op[t] == "adam_p"]
    if adam:
        far = total = 0
        worst = 0.0  # the largest difference, in units of the step's lr
        for t in adam:
            x, y, lr = np.asarray(outs[t], np.float64), np.asarray(ref[t], np.float64), float(tg.params[t]["lr"])
            d = np.abs(x - y)
            far += int((d > tol * (np.abs(y) + lr)).sum())
            total += d.size
            worst = max(worst, float(d.max(initial=0.0)) / lr)
        good = far <= 0.01 * total and worst <= 2 * (1 + tol)
        print(f"check     Adam-updated parameters: {far} of {total} elements off the numpy evaluation (at most 1%), "
              f"by up to {worst:.2f} lr (at most 2: a near-zero gradient's sign) ({'ok' if good else 'FAILED'})")
        ok = ok and good
    return ok


def _rel(x, y) -> float:
    import numpy as np

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def host_speed_line(mg, profile: str, res, plan: str | None = None) -> str:
    """How fast this run's host was against ``profile``'s: the factor at which the simulator's host thread is
    as busy as this run's (issuing and handling completions, ``turnip.machine.costs.host_factor_for``), and the
    ``turnip simulate`` command that replays the plan at it. Host-bound plans (many commands, several GPUs)
    are predicted only at their host's speed, which differs between machines of one kind by up to 2x."""
    from turnip.machine.costs import VertexCosts, host_factor_for
    from turnip.machine.profile import load_profile

    host_ms = float(res.host_cost_ns().sum()) / 1e6
    f = host_factor_for(VertexCosts(mg, load_profile(profile)), host_ms)
    sim = f"turnip simulate {plan} --profile {profile} --host-factor {f:.2f}" if plan else f"--host-factor {f:.2f}"
    return (f"host speed           {host_ms:.1f} ms of host time a run: {f:.2f}x the {profile} profile's host costs "
            f"(simulated at it: {sim})")


def _bound(mg, profile: str) -> dict:
    from turnip.runtime.driver import lower_bound

    return lower_bound(mg, profile)


def _sustained(mg, profile: str) -> int:
    from turnip.machine.bound import plan_sustained_ns

    return plan_sustained_ns(mg, profile)


def _report(rows: list[dict], bound: dict, res, resident_nbytes: int = 0, training: bool = False,
            profile: str = "h100", on_cpu: bool = False, sustained_ns: int | None = None) -> None:  # fmt: skip
    """Print the run summary; trace byte counts exclude resident inputs (moved when the plan loaded).
    ``sustained_ns``: the busiest GPU's kernels at its power limit's clock (``turnip.machine.bound``), shown
    beside the bound on a GPU."""
    import numpy as np

    if not rows:
        return
    ms = np.array([r["makespan_ns"] for r in rows]) / 1e6
    r = rows[-1]
    inputs = r["input_nbytes"]
    moved = inputs + r["reload_nbytes"] + r["offload_nbytes"] + r["transfer_nbytes"]
    lb = bound["lower_bound_ns"] / 1e6
    what = "training step" if training else "time to first token"
    print(f"{what:<20} median {np.median(ms):.3f} ms  min {ms.min():.3f}  max {ms.max():.3f} ({len(ms)} runs)")
    print(f"bytes moved          {_sz(moved)} (inputs {_sz(inputs)}, resident {_sz(resident_nbytes)} loaded "
          f"with the plan, reloads "
          f"{_sz(r['reload_nbytes'])}, offloads {_sz(r['offload_nbytes'])}, GPU->GPU "
          f"{_sz(r['transfer_nbytes'])})")  # fmt: skip
    print(f"GPU busy fraction    {np.median([x['gpu_busy_frac'] for x in rows]):.3f}")
    hc = res.command_host_cost_ns() / 1e3  # issued as commands of their own: no resident input, no group member
    print(f"host cost / command  median {np.median(hc):.1f} us, p90 {np.percentile(hc, 90):.1f} us "
          "(issue + completion handling)")  # fmt: skip
    parts = format_bound(bound)
    if not on_cpu:
        print(f"lower bound          {lb:.3f} ms on the {profile} profile ({parts}); "
              f"efficiency {lb / np.median(ms):.3f}")
        if sustained_ns:
            s = sustained_ns / 1e6
            print(f"kernels sustained    {s:.3f} ms: the busiest GPU's kernels at the clock its power limit sustains "
                  f"(an estimate, not a bound); the run at {s / np.median(ms):.3f} of it")  # fmt: skip
        if ms.min() < lb:
            print(f"warning: a run took {ms.min():.3f} ms, less than its lower bound: the bound or the profile is "
                  "wrong there; please report it with this output")  # fmt: skip
    else:  # the bound describes a GPU machine, not this CPU run: no efficiency
        print(f"lower bound          {lb:.3f} ms on the {profile} profile ({parts}), for reference: this run is on "
              "the CPU backend")  # fmt: skip
