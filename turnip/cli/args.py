"""Argument checks shared by the subcommands: argparse types for single values (their errors exit 2 through
argparse) and command-level checks that raise ``CliError`` (files, byte sizes, tiles against the model,
the size of what would be compiled)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from turnip.cli import FAILED, USAGE, CliError
from turnip.cli import format_nbytes as _sz

MAX_GPUS = 8


def int_in(lo: int, hi: int | None = None, what: str = "an integer"):
    """argparse type: an integer in ``lo..hi``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {rng}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    """argparse type: a finite float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (v > lo if lo_open else v >= lo) or (hi is not None and v > hi) or v != v or v == float("inf"):
            rng = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi is not None else "")
            raise argparse.ArgumentTypeError(f"must be a number {rng}, got {text!r}")
        return v

    parse.__name__ = "float"
    return parse


def model(text: str) -> str:
    """argparse type: a preset model name, or a Hugging Face LLaMA-family directory / config.json whose
    config turnip can run."""
    from turnip.compile import MODELS
    from turnip.models import load_config

    if text in MODELS:
        return text
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} is neither a preset nor an existing Hugging Face model directory "
                                         f"or config.json; pass one of {', '.join(MODELS)} or a directory with a "
                                         "config.json")  # fmt: skip
    try:
        load_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


model.__name__ = "model"
DTYPES = ["fp16", "bf16", "fp32"]
COUNT = int_in(1, what="a whole number >= 1")
SEED = int_in(0, what="a seed (an integer >= 0)")
GPUS = int_in(1, MAX_GPUS, what="a GPU count (1..8)")


def nbytes(text: str, flag: str, minimum: int = 0, auto: bool = False):
    """A byte size given to ``flag`` (``'auto'`` passes through when ``auto``); ``CliError`` if unreadable
    or below ``minimum``."""
    from turnip.compile import parse_nbytes

    if auto and str(text) == "auto":
        return "auto"
    try:
        n = parse_nbytes(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}", USAGE) from None
    if n < minimum:
        least = "positive" if minimum == 1 else f"at least {_sz(minimum)}"
        raise CliError(f"{flag} {text} is {_sz(n)}; it must be {least}, e.g. 6GiB or 512MiB", USAGE)
    return n


def parse_tiles(items: list[str], model: str) -> dict | None:
    """``--tile DIM=SIZE`` items -> {dim: size}; names checked against the model's tiles, sizes positive."""
    from turnip.models import LLAMA_TILES

    if not items:
        return None
    from turnip.models import llama_config

    names = ", ".join(f"{n} ({what})" for n, what in LLAMA_TILES.items())
    if llama_config(model) is None:
        raise CliError(f"--tile applies to llama-* models only; {model} has fixed tiles (drop --tile)", USAGE)
    tiles = {}
    for item in items:
        dim, eq, size = item.partition("=")
        if not eq or not dim or not size.strip().isdigit():
            raise CliError(f"--tile expects DIM=SIZE like t=512, got {item!r}; tiles: {names}", USAGE)
        if dim not in LLAMA_TILES:
            raise CliError(f"--tile {item}: unknown tile {dim!r}; use one of the LLaMA tiles: {names}", USAGE)
        if int(size) < 1:
            raise CliError(f"--tile {item}: a tile size must be a positive integer; e.g. --tile {dim}=512", USAGE)
        tiles[dim] = int(size)
    return tiles


def input_file(path: str, what: str, hint: str) -> Path:
    """``path`` must be a readable file: else ``CliError`` (usage) naming ``what`` and ``hint``."""
    p = Path(path)
    if not p.exists():
        raise CliError(f"{what} {path} does not exist; {hint}", USAGE)
    if not p.is_file():
        raise CliError(f"{what} {path} is not a file; {hint}", USAGE)
    if not os.access(p, os.R_OK):
        raise CliError(f"{what} {path} is not readable; check its permissions", USAGE)
    return p


def token_ids_file(path: str, flag: str, need: str, ok):
    """Integer token ids from the .npy file given to ``flag``, as int64; ``ok(ids)`` says whether their shape
    serves, ``need`` names what does (``CliError`` otherwise, and for a missing or unreadable file)."""
    import numpy as np

    input_file(path, flag, f"pass {need} as a .npy file")
    try:
        ids = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise CliError(f"{flag} {path}: not a .npy file ({e})", USAGE) from None
    if ids.dtype.kind not in "iu" or not ok(ids):
        raise CliError(f"{flag} {path}: need {need}, got {ids.dtype} {ids.shape}", USAGE)
    return ids.astype(np.int64)


def output_file(path: str | None, flag: str) -> None:
    """Fail now (usage) when ``path`` cannot be written, rather than after the work."""
    from turnip.fileio import output_file_problem

    if path is None:
        return
    why = output_file_problem(path)
    if why:
        todo = "name a file in it" if Path(path).is_dir() else "create the directory or choose another path"
        raise CliError(f"cannot write {flag} {path}: {why}; {todo}", USAGE)


def output_dir(path: str, flag: str) -> None:
    from turnip.fileio import output_dir_problem

    why = output_dir_problem(path)
    if why:
        raise CliError(f"cannot write into {flag} {path}: {why}; choose another directory", USAGE)


def load_profile(name: str):
    """A machine profile, or ``CliError`` (usage) listing the presets and profile files."""
    from turnip.machine.profile import load_profile as load

    try:
        return load(name)
    except FileNotFoundError as e:
        raise CliError(f"{e}", USAGE) from None
    except (ValueError, TypeError, OSError) as e:  # unknown fields, bad values, unreadable or invalid file
        raise CliError(f"bad machine profile {name}: {e}; see docs/profile.md for the format", USAGE) from None


def phys_mem() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _fmt_tiles(tiles: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in tiles.items()) or "fixed"


def add_runtime_flags(p, stall_s: float) -> None:
    """The flags of commands that run plans for real: CPU chaos and the stall watchdog."""
    p.add_argument("--chaos", type=float_in(0.0, 1.0), default=0.0,
                   help="cpu: probability of a random delay per vertex (0..1)")
    p.add_argument("--stall-s", type=float_in(0.0, lo_open=True), default=stall_s,
                   help="watchdog: stop when nothing completes this long")
    add_groups_flag(p)


GROUPS = {"auto": None, "on": True, "off": False}


def add_groups_flag(p) -> None:
    """``--launch-groups``: runs of kernels on one GPU dispatched as one unit (``turnip.sched.groups``)."""
    p.add_argument("--launch-groups", choices=list(GROUPS), default="auto",
                   help="dispatch runs of kernels on one GPU as one unit (one command, one captured graph, one "
                   "completion): auto = on for plans of several GPUs (TURNIP_LAUNCH_GROUPS=0|1 overrides auto); "
                   "a training step's groups are wide (TURNIP_WIDE_GROUPS=0|1 decides otherwise)")


TRAIN_DEFAULTS = {"rank": 16, "alpha": 32.0, "targets": "q,k,v,ffn", "lr": 1e-4, "checkpoint": "auto"}


def add_train_flags(p, always: bool = False) -> None:
    """The flags that make a plan one LoRA training step (``--train lora``; ``always``: the command only
    trains, so there is no --train)."""
    if not always:
        p.add_argument("--train", default="none", choices=["none", "lora"],
                       help="lora: compile one LoRA training step (forward, loss, backward, Adam on the adapters) "
                       "instead of a prefill; --seq is then the length of each of --batch sequences")  # fmt: skip
    p.add_argument("--batch", type=int_in(1, 4096), default=1,
                   help="sequences of --seq tokens: per training step, or prompts prefilled together (LLaMA)")
    p.add_argument("--rank", type=int_in(1, 4096), default=TRAIN_DEFAULTS["rank"], help="LoRA rank")
    p.add_argument("--alpha", type=float_in(0.0, lo_open=True), default=TRAIN_DEFAULTS["alpha"],
                   help="LoRA alpha (the adapters' output is scaled by alpha / rank)")
    p.add_argument("--targets", default=TRAIN_DEFAULTS["targets"],
                   help="adapted matrices: q, k, v, o, gate, up, down; ffn = gate,up,down; attn = q,k,v,o")
    p.add_argument("--lr", type=float_in(0.0, lo_open=True), default=TRAIN_DEFAULTS["lr"], help="Adam learning rate")
    p.add_argument("--checkpoint", default=TRAIN_DEFAULTS["checkpoint"], choices=["auto", "on", "off"],
                   help="activation checkpointing: recompute each layer's forward in its backward (on), keep "
                   "activations (off; the plan offloads them), auto: on when the kept activations would pass half "
                   "the budget")  # fmt: skip


def add_split_flag(p) -> None:
    """``--split``: how a LLaMA model is split across GPUs (``turnip.compile.build_split``)."""
    p.add_argument("--split", default="auto", choices=["tensor", "layers", "data", "auto"],
                   help="across GPUs: tensor (head, FFN and vocabulary blocks over all GPUs; every layer moves "
                   "activations between them), layers (contiguous decoder layers per GPU, a pipeline: weights "
                   "partitioned, only the hidden state crosses), data (training: each GPU its share of the "
                   "sequences, every GPU loading the frozen weights, the adapters' gradients summed on GPU 0), "
                   "auto: on several GPUs build each that applies and keep the one the simulator predicts fastest "
                   "(on --profile where given, else h100-calibrated)")  # fmt: skip


COMPILE_ONLY = ("model", "seq", "gpus", "budget", "dtype", "resident", "layers", "logits", "all_logits", "train",
                *TRAIN_DEFAULTS, "batch", "split")  # what a compiled plan fixes, in the order they are named


def keep_defaults(p) -> None:
    """Record parser ``p``'s defaults on its namespace (``compile_defaults``), for ``unused_flags``."""
    p.set_defaults(compile_defaults={x.dest: x.default for x in p._actions})


def unused_flags(a, plan_file: str | None = None) -> None:
    """``CliError`` (usage) for flags that would be ignored: where the command was given a compiled plan
    (``plan_file``), the flags that only shape a compile (``COMPILE_ONLY``, against the parser's defaults:
    ``keep_defaults``); else LoRA flags without ``--train lora``."""
    if plan_file is not None:
        was = a.compile_defaults
        given = [k for k in COMPILE_ONLY if hasattr(a, k) and getattr(a, k) != was.get(k)]
        if given:
            flags, them = ", ".join("--" + k.replace("_", "-") for k in given), "them" if len(given) > 1 else "it"
            raise CliError(f"{flags}: {plan_file} is a compiled plan, which fixes {them}; compile it again with "
                           f"{them} (`turnip compile ... -o`), or drop {them}", USAGE)  # fmt: skip
        return
    given = [k for k, v in TRAIN_DEFAULTS.items() if hasattr(a, k) and getattr(a, k) != v]
    if given and getattr(a, "train", "lora") == "none":
        flags, them = ", ".join(f"--{k}" for k in given), "them" if len(given) > 1 else "it"
        raise CliError(f"{flags}: only a LoRA training step has {them}; add --train lora, or drop {them}", USAGE)


def train_spec(a):
    """The ``TrainSpec`` of the training flags, or None for a prefill; ``CliError`` for bad targets."""
    if getattr(a, "train", "lora" if hasattr(a, "rank") else "none") == "none":
        return None
    from turnip.train import LoraConfig, TrainSpec, parse_targets

    try:
        targets = parse_targets(a.targets)
    except ValueError as e:
        raise CliError(f"--targets {a.targets}: {e}", USAGE) from None
    return TrainSpec(a.batch, LoraConfig(a.rank, a.alpha, targets, a.lr), a.checkpoint)


def guard(model: str, seq: int, gpus: int, dtype: str, tiles: dict | None, layers: int | None, budget: int,
          force: bool, extra_nbytes=None, quiet: bool = False, head: str | None = None, train=None,
          batch: int = 1, split: str = "tensor"):  # fmt: skip
    """Estimate what compiling would cost and refuse (exit 1) when it is too large, unless ``force``.
    Invalid model parameters are usage errors. Prints the estimate on stderr when the compile is long.
    ``extra_nbytes(estimate)``: host memory the command needs on top of the compile (a run's inputs)."""
    from turnip.compile import MAX_COMPILE_S, MAX_VERTICES, estimate

    try:
        est = estimate(model, seq, gpus, dtype, tiles, layers, budget, head=head, train=train, batch=batch,
                       split=split)  # fmt: skip
    except ValueError as e:
        raise CliError(f"{e}; see `turnip compile --help`", USAGE) from None
    need = est.host_nbytes + (extra_nbytes(est) if extra_nbytes else 0)
    mem = phys_mem()
    what = (f"{model} at {seq} tokens with tiles {_fmt_tiles(est.tiles)} would have {est.vertices:,} taskgraph "
            f"vertices (about {est.compile_s:,.0f} s to compile, {_sz(need)} of host memory)")  # fmt: skip
    over_mem = mem is not None and need > mem
    too_big = est.too_large() or over_mem
    if too_big and not force:
        why = []
        if est.vertices > MAX_VERTICES:
            why.append(f"more than {MAX_VERTICES:,} vertices")
        if est.compile_s > MAX_COMPILE_S:
            why.append(f"over {MAX_COMPILE_S:.0f} s")
        if over_mem:
            why.append(f"more than this machine's {_sz(mem)} of memory")
        if est.too_large() and train is None and batch == 1:
            fix = _suggest(model, seq, gpus, dtype, tiles, layers, budget, est)
        elif est.too_large():
            fix = "use a shorter --seq, a smaller --batch or fewer --layers"
        else:  # memory alone: mostly the weights, which tiles do not change
            fix = "use a machine with more memory, a smaller model or fewer --layers"
        raise CliError(f"{what}: {' and '.join(why)}; {fix}, or pass --force", FAILED)
    if (too_big or est.compile_s >= 10) and not quiet:
        print(f"note: {what}", file=sys.stderr)
    return est


def _suggest(model, seq, gpus, dtype, tiles, layers, budget, est) -> str:
    """A larger token tile that brings the vertex count under the limits, if there is one."""
    from turnip.compile import estimate

    t = int(est.tiles.get("t", seq))
    while t < seq:
        t = min(seq, 2 * t)
        trial = dict(tiles or {}) | {"t": t}
        if "kv" in trial:
            trial["kv"] = -(-trial["kv"] // t) * t
        e = estimate(model, seq, gpus, dtype, trial, layers, budget)
        if not e.too_large():
            kv = f" --tile kv={trial['kv']}" if tiles and "kv" in tiles else ""
            return f"raise the token tile (--tile t={t}{kv} gives {e.vertices:,} vertices)"
    return "use a shorter --seq or fewer --layers"
