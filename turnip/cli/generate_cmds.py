"""``turnip generate``: prompts in, text out, through a prefill plan and decode plans over a KV cache that may
be larger than the GPU budget (``turnip.generation``)."""

from __future__ import annotations

import os
import sys

from turnip.cli import DefaultsHelp, format_nbytes
from turnip.cli import args as ck


def register(sub) -> None:
    from turnip.compile import MODEL_HELP
    from turnip.decode import DEFAULT_BLOCK
    from turnip.runtime import BACKENDS
    from turnip.sched import POLICIES

    p = sub.add_parser(
        "generate",
        help="generate text: a prefill fills the KV cache, decode plans extend it token by token",
        description="Generate up to --max-new-tokens per prompt with a LLaMA-family model under --budget per GPU: "
        "the prompts' keys and values go into a KV cache of blocks that the memgraph keeps on the GPU while "
        "they fit and offloads when they do not; one decode plan per (batch, cache blocks), built once and "
        "cached in --plan-dir. Greedy by default; --temperature > 0 samples (with --top-k, --top-p, --seed). "
        "Stops at the model's end-of-sequence ids or a --stop string. With one prompt the text streams as it "
        "comes (token ids without a tokenizer); then prints time to first token, tokens/s, bytes moved per "
        "token and the decode step's lower bound. See docs/generate.md.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--model", default="llama-tiny", type=ck.model, metavar="MODEL", help=MODEL_HELP)
    p.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="prompt text (repeat for several), tokenized with the model directory's tokenizer.json",
    )
    p.add_argument(
        "--prompt-ids",
        metavar="FILE",
        help="prompt token ids: a .npy (1-D: one prompt, 2-D: one per row) or a .json list of id lists",
    )
    p.add_argument("--max-new-tokens", type=ck.COUNT, default=32, help="new tokens per prompt at most")
    p.add_argument(
        "--batch",
        type=ck.COUNT,
        default=None,
        help="sequences decoded together (default: the number of prompts; fewer prompts repeat)",
    )
    p.add_argument("--budget", default="6GiB", help="GPU memory budget per GPU")
    p.add_argument("--gpus", type=ck.GPUS, default=1, help="GPUs (1..8)")
    p.add_argument("--dtype", default="fp16", choices=ck.DTYPES, help="compute dtype")
    p.add_argument(
        "--backend",
        default="cpu",
        choices=BACKENDS,
        help="cpu: numpy on byte arenas with real threads (any machine); cuda: the GPU",
    )
    p.add_argument("--temperature", type=ck.float_in(0.0), default=0.0, help="0: greedy; else sample")
    p.add_argument("--top-k", type=ck.int_in(0), default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--top-p", type=ck.float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=ck.SEED, default=0, help="sampling seed (and random weights of a preset)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop a sequence at this text")
    p.add_argument("--block", type=ck.COUNT, default=DEFAULT_BLOCK, help="cache slots per block")
    p.add_argument(
        "--plan-dir",
        default=os.path.join("~", ".cache", "turnip", "plans"),
        help="where compiled plans are kept across runs ('' for none)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="a model directory without safetensors weights: seeded random weights",
    )
    p.add_argument("--trace", metavar="OUT.json",
                   help="write the last new token's decode step, with its device times, as a Chrome/Perfetto trace")
    p.add_argument("--policy", default="nondet", choices=POLICIES, help="dispatch policy")
    p.add_argument("--streams", type=ck.int_in(1, 64), default=5, help="stream slots per GPU (1..64)")
    p.add_argument(
        "--chaos",
        type=ck.float_in(0.0, 1.0),
        default=0.0,
        help="cpu backend: probability of random delays per vertex (tokens must not change)",
    )
    p.add_argument("--profile", default="auto",
                   help="machine profile of the reported lower bound (auto: the shipped profile of the GPU run on, "
                        "h100-calibrated or h200-calibrated; the h100 preset for the CPU backend)")  # fmt: skip
    p.set_defaults(func=cmd_generate)


def _prompts(a) -> list:
    """The prompts as given: strings (--prompt) or id lists (--prompt-ids); ``CliError`` for a bad file."""
    import json

    import numpy as np

    if a.prompt and a.prompt_ids:
        raise ck.CliError("pass --prompt or --prompt-ids, not both", ck.USAGE)
    if a.prompt_ids:
        f = ck.input_file(a.prompt_ids, "--prompt-ids", "a .npy of token ids or a .json list of id lists")
        try:
            if f.suffix == ".json":
                x = json.loads(f.read_text())
                rows = x if x and isinstance(x[0], list) else [x]
            else:
                arr = np.load(f, allow_pickle=False)
                rows = [arr] if arr.ndim == 1 else list(arr)
        except (OSError, ValueError, TypeError, IndexError, KeyError) as e:
            raise ck.CliError(f"--prompt-ids {a.prompt_ids}: cannot read token ids ({e}); pass a 1-D or 2-D .npy "
                              "of integers or a .json list of id lists", ck.USAGE) from None  # fmt: skip
        return [np.asarray(r) for r in rows]
    if a.prompt:
        return list(a.prompt)
    return [np.random.default_rng(a.seed).integers(0, 1 << 30, size=8)]  # reduced below the vocabulary


def cmd_generate(a) -> int:
    import time
    from pathlib import Path

    from turnip.generation import GenerateError, Sampling, generate, load_model

    if a.backend == "cuda":
        from turnip.cli.run_cmds import _cuda_preflight

        _cuda_preflight()
    from turnip.runtime.driver import machine_profile

    a.profile = machine_profile(a.profile, a.backend)
    ck.load_profile(a.profile)
    budget = ck.nbytes(a.budget, "--budget", minimum=1)
    if a.trace:
        ck.output_file(a.trace, "--trace")
    if a.chaos and a.backend != "cpu":
        raise ck.CliError("--chaos applies to --backend cpu", ck.USAGE)
    t0 = time.perf_counter()
    try:
        m = load_model(a.model, a.dtype, a.seed, a.random_weights)
        prompts = _prompts(a)
        if not (a.prompt or a.prompt_ids):
            prompts = [p % m.cfg.vocab for p in prompts]
        batch = a.batch or len(prompts)
        if len(prompts) > batch:
            raise GenerateError(f"--batch {batch} is smaller than the {len(prompts)} prompts given")
        prompts = [prompts[i % len(prompts)] for i in range(batch)]
        stream = batch == 1

        def on_token(b, tok, piece):
            if stream:
                print(piece if m.tokenizer is not None else f"{tok} ", end="", flush=True)

        plan_dir = Path(os.path.expanduser(a.plan_dir)) if a.plan_dir else None
        res = generate(m, prompts, a.max_new_tokens, budget, a.gpus, a.dtype, a.backend,
                       Sampling(a.temperature, a.top_k, a.top_p, a.seed), tuple(a.stop), a.block, plan_dir=plan_dir,
                       policy=a.policy, streams=a.streams, chaos=a.chaos, on_token=on_token,
                       profile=a.profile, trace=a.trace)  # fmt: skip
    except GenerateError as e:
        raise ck.CliError(str(e), ck.USAGE) from None
    if stream:
        print(flush=True)
    else:
        for b, (ids, text) in enumerate(zip(res.ids, res.text, strict=True)):
            print(f"[{b}] {text if text is not None else ' '.join(map(str, ids))}", flush=True)
    s = res.stats
    print(f"time to first token  {s['ttft_s'] * 1e3:.1f} ms (plans and prefill included)", file=sys.stderr)
    tps = f"{s['tokens_per_s']:.1f}" if s["tokens_per_s"] else "n/a"
    print(f"tokens/s             {tps} ({s['new_tokens']} new tokens, batch {len(res.ids)}, {s['steps']} steps in "
          f"{s['decode_s']:.2f} s)", file=sys.stderr)  # fmt: skip
    if s["first_plan_s"]:
        print(f"first decode plan    {s['first_plan_s']:.2f} s of that loading it (after the prefill's first token)",
              file=sys.stderr)  # fmt: skip
    if s["switch_s"]:
        kept = f"; {s['weights_kept']} took the plan before's host weights" if s.get("weights_kept") else ""
        print(f"cache buckets        {s['switch_s']:.2f} s of that loading the next bucket's plan (longer cache)"
              f"{kept}", file=sys.stderr)  # fmt: skip
    if s["link_nbytes_per_token"] is not None:  # (none when the prefill gave every token)
        print(f"bytes moved / token  {format_nbytes(s['link_nbytes_per_token'])} (host<->GPU, last decode plan)",
              file=sys.stderr)  # fmt: skip
    if s["bound_ms"] is not None:
        print(f"decode step bound    {s['bound_ms']:.3f} ms on {a.profile} (per step of batch {len(res.ids)})",
              file=sys.stderr)  # fmt: skip
    print(
        f"plans                {len(s['plans_built'])} built, {len(s['plans_loaded'])} loaded"
        f"{f' from {plan_dir}' if plan_dir else ''}; total {time.perf_counter() - t0:.2f} s",
        file=sys.stderr,
    )
    if a.trace:
        print(f"trace                {a.trace} (the last step; open in https://ui.perfetto.dev)", file=sys.stderr)
    return 0
