"""``turnip compile`` and ``turnip verify``."""

from __future__ import annotations

import json
import time

from turnip.cli import DefaultsHelp
from turnip.cli import args as ck
from turnip.cli import format_nbytes as _sz


def register(sub) -> None:
    from turnip.cli.torch_cmds import TORCH_HELP
    from turnip.compile import MODEL_HELP
    from turnip.models import HEADS

    p = sub.add_parser(
        "compile",
        help="compile a model into a memgraph plan under a GPU memory budget",
        description="Tile and place a model's computation, then run BuildMemgraph: every tensor gets a fixed "
        "GPU address inside the budget, with offload/reload vertices and memory dependencies added. "
        "Prints vertex and edge counts, offload/reload traffic, peak memory and build time.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--model", default="llama-7b", type=ck.model, metavar="MODEL",
                   help=f"computation to compile: {MODEL_HELP}")
    p.add_argument("--logits", default="auto", choices=["auto", *HEADS],
                   help="LLaMA output: none (final hidden states), last (the last position's logits, tiled over the "
                   "vocabulary), all (every position's); auto = last for a Hugging Face model, none for presets")
    p.add_argument("--seq", type=ck.COUNT, default=4096, help="prompt length in tokens (LLaMA prefill)")
    p.add_argument("--gpus", type=ck.GPUS, default=1, help="number of GPUs (1..8)")
    p.add_argument("--seed", type=ck.SEED, default=0, help="seed of the graph of --model random")
    p.add_argument("--budget", default="6GiB", help="GPU memory budget per GPU, e.g. 6GiB, 512MiB")
    p.add_argument("--dtype", default="fp16", choices=ck.DTYPES, help="compute dtype")
    p.add_argument("--policy", default="furthest", choices=["furthest", "lru", "largest"], help="eviction policy")
    p.add_argument("--lookahead", type=ck.COUNT, default=None, help="cap on vertices allocated ahead of execution")
    p.add_argument("--lookahead-bytes", default=None, help="cap on bytes reserved ahead of execution")
    p.add_argument(
        "--tile",
        action="append",
        default=[],
        metavar="DIM=SIZE",
        help="tile size override (llama-* models), e.g. t=512 (tokens), h=8 (heads), f=2752 (FFN columns), "
        "kv=4096 (key range in tokens, a multiple of t); repeatable",
    )
    p.add_argument(
        "--resident",
        default="auto",
        help="bytes per GPU of inputs/weights kept on the GPU for good (steady state: loaded once, "
        "never evicted); 'auto' = a quarter of the budget when it fits, unless the plan then spills activations "
        "and moves more host-link bytes per run than with none; 0 = stream every input",
    )
    p.add_argument(
        "--workspace",
        default="auto",
        help="bytes per stream slot kept free at the top of each GPU's arena for kernels' scratch (cuDNN "
        "attention); 'auto' = 1/256 of the budget, between 256 B and 1 MiB",
    )
    p.add_argument("--layers", type=ck.COUNT, default=None, help="compile only the first N layers")
    ck.add_split_flag(p)
    p.add_argument("--verify", action="store_true", help="run the verifier on the result")
    p.add_argument("-o", "--output", help="write the plan here (.tplan)")
    p.add_argument("--force", action="store_true",
                   help="compile even when the estimate is above the limits (2M vertices, 120 s, host memory)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    ck.add_train_flags(p)
    p.add_argument("--torch", metavar="FILE.py:factory", help=TORCH_HELP)
    p.set_defaults(func=cmd_compile)

    v = sub.add_parser(
        "verify",
        help="check a plan file for cycles, lost dependencies and races",
        description="Independent verification of a saved plan: acyclic, every taskgraph dependency "
        "kept or replaced by offload->reload, no race under any valid order, writes in bounds. A plan that fails "
        "the checks every backend makes before loading it (array types, ranges, shapes, bounds) is reported by "
        "the first of them as a [load] violation, without verifying further.",
    )
    v.add_argument("plan", help="plan file written by `turnip compile -o`")
    v.add_argument("--json", action="store_true", help="print the violations as JSON")
    v.set_defaults(func=cmd_verify)


def summary(tg, mg) -> dict:
    from turnip.memgraph.plan import KIND_NAMES

    s = mg.stats
    counts = {k: mg.count(i) for i, k in enumerate(KIND_NAMES)}
    return {
        "model": tg.meta.get("model") if tg is not None else None,
        "taskgraph_vertices": tg.n if tg is not None else None,
        "memgraph_vertices": mg.n,
        "vertices_by_kind": counts,
        "edges": {"data": s["n_data_edges"], "memory": s["n_memory_edges"]},
        "offloads": {"count": s["n_offload"], "nbytes": s["offload_nbytes"]},
        "reloads": {"count": s["n_reload"], "nbytes": s["reload_nbytes"]},
        "clean_evictions": {"count": s.get("n_clean_evict", 0), "nbytes": s.get("clean_evict_nbytes", 0)},
        "relayed": {"count": s.get("n_relayed", 0), "nbytes": s.get("relayed_nbytes", 0),
                    "slots_per_gpu": s.get("relay_slots", 0) * max(0, mg.n_gpus - 1),
                    "slot_nbytes": s.get("relay_slot_nbytes", 0)},  # fmt: skip
        "budget_nbytes_per_gpu": [int(b) for b in mg.budget_nbytes],
        "peak_nbytes_per_gpu": [int(p) for p in s["peak_nbytes_per_gpu"]],
        "host_peak_nbytes": s["host_peak_nbytes"],
        "host_input_nbytes": s["host_input_nbytes"],
        "resident_input_nbytes": s["resident_input_nbytes"],
        "build_s": round(s["build_s"], 3),
        "vertices_per_s": round(tg.n / s["build_s"]) if tg is not None and s["build_s"] > 0 else None,
    } | split_summary(tg)


def split_summary(tg) -> dict:
    """The split of a plan and, where it was chosen, every split's predicted makespan."""
    meta = tg.meta if tg is not None else {}
    keys = ("split", "split_choice", "split_predicted_ms", "split_profile", "split_failed")
    return {k: meta[k] for k in keys if k in meta}


def split_line(d: dict) -> str:
    """'layers (predicted 48.1 ms; tensor 79.0 ms, on h100-calibrated)' from a ``split_summary``."""
    s, pred = d.get("split_choice", d.get("split", "tensor")), d.get("split_predicted_ms")
    if not pred:
        return s
    from turnip.models import TILE_CHOICE_MARGIN

    margin = f" (not kept: less than {TILE_CHOICE_MARGIN:.0%} faster)"
    others = "; ".join(f"{k} {v:.1f} ms{margin if v < pred[s] else ''}" for k, v in pred.items() if k != s)
    failed = "; ".join(f"{k} does not fit the budget" for k in d.get("split_failed", {}))
    rest = "; ".join(x for x in (others, failed) if x)
    return f"{s} (predicted {pred[s]:.1f} ms{'; ' + rest if rest else ''}, on {d['split_profile']})"


def print_summary(d: dict) -> None:
    k = d["vertices_by_kind"]
    print(f"{d['model']}: {d['taskgraph_vertices']} taskgraph vertices -> {d['memgraph_vertices']} memgraph vertices")
    print("  vertices  " + ", ".join(f"{n} {name}" for name, n in k.items()))
    print(f"  edges     {d['edges']['data']} data, {d['edges']['memory']} memory")
    print(
        f"  offload   {d['offloads']['count']} ({_sz(d['offloads']['nbytes'])}), reload {d['reloads']['count']} "
        f"({_sz(d['reloads']['nbytes'])}), clean evictions {d['clean_evictions']['count']} "
        f"({_sz(d['clean_evictions']['nbytes'])}, no copy)"
    )
    r = d.get("relayed", {})
    if r.get("count"):
        print(f"  relayed   {r['count']} loads ({_sz(r['nbytes'])}) through other GPUs' host links, "
              f"{r['slots_per_gpu']} slots of {_sz(r['slot_nbytes'])} per GPU (TURNIP_RELAY_LOADS)")  # fmt: skip
    print(
        "  peak/GPU  "
        + ", ".join(
            f"{_sz(p)} of {_sz(b)}" for p, b in zip(d["peak_nbytes_per_gpu"], d["budget_nbytes_per_gpu"], strict=True)
        )
    )
    print(
        f"  host      {_sz(d['host_peak_nbytes'])} offload area, {_sz(d['host_input_nbytes'])} inputs; "
        f"{_sz(d['resident_input_nbytes'])} of inputs resident on the GPUs (loaded once)"
    )
    if "split" in d:
        print(f"  split     {split_line(d)}")
    print(f"  build     {d['build_s']} s ({d['vertices_per_s']} vertices/s)")


def compile_args(a, force: bool = False, extra_nbytes=None, budget_flag: str = "--budget"):
    """Check a compile's arguments (--model, --seq, --gpus, --dtype, --tile, --layers, --budget, --resident,
    --workspace) and its size, before any work. ``extra_nbytes(estimate)``: host memory the command needs
    besides the compile. Returns (tiles, budget, estimate)."""
    ck.unused_flags(a)
    tiles = ck.parse_tiles(a.tile, a.model)
    layers = getattr(a, "layers", None)
    if layers is not None:
        from turnip.models import llama_config

        cfg = llama_config(a.model)
        if cfg is None:
            raise ck.CliError(f"--layers applies to LLaMA models only, not {a.model}; drop --layers", ck.USAGE)
        n = cfg.n_layers
        if layers > n:
            raise ck.CliError(f"--layers {layers}: {a.model} has {n} layers; use 1..{n}", ck.USAGE)
    budget = ck.nbytes(a.budget, budget_flag, minimum=1)
    ck.nbytes(a.resident, "--resident", auto=True)
    ck.nbytes(getattr(a, "workspace", "auto"), "--workspace", auto=True)
    split = getattr(a, "split", "tensor")  # auto: the tensor split's estimate (the larger plan)
    est = ck.guard(a.model, a.seq, a.gpus, a.dtype, tiles, layers, budget, force, extra_nbytes,
                   head=getattr(a, "logits", None), train=ck.train_spec(a), batch=getattr(a, "batch", 1),
                   split="tensor" if split == "auto" else split)  # fmt: skip
    return tiles, budget, est


def split_profile(a) -> str | None:
    """The profile that picks the split of ``--split auto``: the command's ``--profile`` where one was given,
    else None (``turnip.compile.SPLIT_PROFILE``)."""
    prof = getattr(a, "profile", None)
    return prof if prof is not None and prof != getattr(a, "compile_defaults", {}).get("profile") else None


def build_plan(a, tiles, budget, est, config=None, seed: int = 0, label: str = "compile", announce: bool = True):
    """Lower (a heartbeat against the estimate) and build (a progress bar) the plan of checked arguments;
    with ``--split auto`` on several GPUs, the plans of both splits, keeping the one predicted faster
    (``announce``: the choice is printed on stderr)."""
    import sys

    from turnip.compile import build_split, build_with_resident, candidate, make_taskgraph, split_candidates
    from turnip.memgraph.build import BudgetError
    from turnip.progress import Heartbeat, Progress

    splits = split_candidates(a.model, a.gpus, getattr(a, "split", "tensor"), getattr(a, "layers", None),
                              ck.train_spec(a) is not None, a.seq, a.dtype, budget, tiles,
                              getattr(a, "batch", 1))  # fmt: skip
    which = lambda s: f" ({s} split)" if len(splits) > 1 else ""  # noqa: E731

    def lower(name: str):
        s, t = candidate(name, tiles)
        with Heartbeat(f"{label}: lowering ~{est.vertices:,} vertices{which(name)}", est.lower_s):
            return make_taskgraph(a.model, a.seq, a.gpus, a.dtype, t, seed=seed,
                                  n_layers=getattr(a, "layers", None), budget_nbytes=budget,
                                  head=getattr(a, "logits", None), train=ck.train_spec(a),
                                  batch=getattr(a, "batch", 1), split=s)  # fmt: skip

    def build(tg):
        with Progress(tg.n, f"{label}: build{which(tg.meta.get('split', 'tensor'))}") as bar:
            return build_with_resident(tg, budget, config, a.resident, progress=bar.update,
                                       workspace=getattr(a, "workspace", "auto"))  # fmt: skip

    try:
        tg, mg = build_split(splits, lower, build, split_profile(a))
    except BudgetError as e:
        hint = _tile_hint(e, est.tiles)
        if hint:
            raise BudgetError(f"{str(e).removesuffix('.')} ({hint}).") from e
        raise
    if announce and len(splits) > 1:
        print(f"{label}: split {split_line(split_summary(tg))}", file=sys.stderr)
    return tg, mg


def _tile_hint(e, tiles: dict) -> str:
    """``--tile`` values that shrink the tensor a ``BudgetError`` names: each tile dimension whose size is one
    of that tensor's dimensions (the vocabulary's only for logits and embedding tensors), halved."""
    shape, name = getattr(e, "shape", None) or (), getattr(e, "tensor", "")
    vocab = any(w in name for w in ("logit", "embed", "head"))  # else a size equal to v is another axis
    flags = [f"--tile {k}={v // 2}" for k, v in (tiles or {}).items()
             if isinstance(v, int) and v > 1 and v in shape and (k != "v" or vocab)]  # fmt: skip
    return "for example " + " or ".join(flags) if flags else ""


def verify_with_progress(mg, tg, label: str = "verify"):
    from turnip.memgraph.verify import verify
    from turnip.progress import Heartbeat

    with Heartbeat(f"{label} {mg.n:,} vertices", mg.n / VERIFY_VERTICES_PER_S):
        return verify(mg, tg)


VERIFY_VERTICES_PER_S = 25_000  # measured on 2 cores (LLaMA-7B, 69K vertices)


def cmd_compile(a) -> int:
    from turnip.memgraph.build import BuildConfig
    from turnip.memgraph.io import save_plan

    t0 = time.perf_counter()
    ck.output_file(a.output, "-o")
    lb = ck.nbytes(a.lookahead_bytes, "--lookahead-bytes", minimum=1) if a.lookahead_bytes else None
    if a.torch:  # a PyTorch module through torch.export (turnip.cli.torch_cmds)
        from turnip.cli.torch_cmds import compile_torch

        tg, mg = compile_torch(a, BuildConfig(a.policy, a.lookahead, lb))
    else:
        tiles, budget, est = compile_args(a, a.force)
        tg, mg = build_plan(a, tiles, budget, est, BuildConfig(a.policy, a.lookahead, lb), seed=a.seed,
                            announce=False)  # fmt: skip
    d = summary(tg, mg)
    d["total_s"] = round(time.perf_counter() - t0, 3)
    if a.verify:
        vs = verify_with_progress(mg, tg)
        d["violations"] = [str(v) for v in vs]
    if a.output:
        save_plan(a.output, mg, tg)
        d["plan"] = a.output
    if a.json:
        print(json.dumps(d, indent=1))
    else:
        print_summary(d)
        if a.verify:
            print(f"  verify    {'ok' if not d['violations'] else str(len(d['violations'])) + ' violations'}")
            for v in d["violations"][:20]:
                print("   ", v)
        if a.output:
            print(f"  wrote     {a.output}")
    if d.get("violations"):
        raise ck.CliError(f"the plan has {len(d['violations'])} violations (listed above); this is a compiler "
                          "bug: please report it with the command line", ck.FAILED)  # fmt: skip
    return 0


def load_plan_arg(path: str, what: str = "plan"):
    """A plan file named on the command line: (memgraph, taskgraph or None), past the load checks; usage
    errors if it is not one (``PlanFormatError``) or fails them (``PlanError``; ``turnip.cli.as_cli_error``)."""
    mg, tg, problems, _ = read_plan(path, what, verify=False)
    if problems:
        raise problems[0]
    return mg, tg


def read_plan(path: str, what: str = "plan", verify: bool = True):
    """Read a plan file and report its problems, for ``turnip verify`` and ``turnip run``: (memgraph,
    taskgraph or None, problems, verify_s). ``problems`` is empty for a plan safe to run, else the first
    failed load check (a ``PlanError``, ``turnip.runtime.plancheck``: the verifier is not run on such a plan),
    else the verifier's violations (``verify``; ``verify_s`` is its time). A file that is not a plan raises
    ``PlanFormatError`` naming it."""
    from turnip.memgraph.io import load_plan
    from turnip.runtime.errors import PlanError
    from turnip.runtime.plancheck import check_plan

    ck.input_file(path, what, "pass a plan written by `turnip compile -o`")
    mg, tg = load_plan(path)  # PlanFormatError: a usage error naming the problem (turnip.cli.as_cli_error)
    try:
        check_plan(mg, tg)
    except PlanError as e:
        return mg, tg, [e], 0.0
    if not verify:
        return mg, tg, [], 0.0
    t0 = time.perf_counter()
    vs = verify_with_progress(mg, tg)
    return mg, tg, vs, time.perf_counter() - t0


def cmd_verify(a) -> int:
    mg, tg, vs, dt = read_plan(a.plan)
    vs = [f"[load] {v}" if isinstance(v, Exception) else str(v) for v in vs]
    if a.json:
        print(json.dumps({"plan": a.plan, "vertices": mg.n, "violations": vs, "verify_s": dt}))
    else:
        print(f"{a.plan}: {mg.n} vertices, {'ok' if not vs else f'{len(vs)} violations'} ({dt:.2f} s)")
        for v in vs[:50]:
            print("  ", v)
    if vs:
        raise ck.CliError(f"{a.plan} has {len(vs)} violations (listed above); the plan is not safe to run", ck.FAILED)
    return 0
