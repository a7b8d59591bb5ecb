"""Generation: turnip (prefill + decode plans over a KV cache, ``turnip.generation``) vs Hugging Face
``generate`` (whole model on the device, and dispatched by Accelerate under the same budget), one set of
seeded random weights, one process.

For each ``--rows BATCH:PROMPT:NEW:BUDGET`` (BUDGET ``none``: 90% of the GPU's free memory): turnip's time
to first token (every decode plan built beforehand, in memory), tokens/s, ms per decode step (all steps,
and within a cache bucket: less the time spent loading the next bucket's plan), host<->GPU bytes per token
and the decode step's lower bound on ``--profile``; HF ``generate`` (greedy, ``min_new_tokens`` = NEW) without
a limit or, with ``--accelerate``, through ``dispatch_model`` with ``max_memory`` = BUDGET; the greedy
tokens compared (how many leading tokens agree per sequence; the issue's fp16 check is 32). Prompts: random
ids of PROMPT tokens. Times from this run only; results to ``--out`` as ``generate_<tag>.csv`` and ``.md``.
Progress (setup, plans built, warm-up done) goes to stderr with the seconds since the start.

    PYTHONPATH=. python benchmarks/generate.py --rows 1:512:128:6GiB 64:512:128:6GiB 1:512:128:none \\
        --accelerate --tag h100_a
    PYTHONPATH=. python benchmarks/generate.py --size tiny --device cpu --backend cpu --dtype fp32 \\
        --rows 2:9:8:64KiB --block 4 --tag smoke      # anywhere: the script's own check
    PYTHONPATH=. python benchmarks/generate.py --size 65b --gpus 4 --rows 16:512:16:30GiB --no-hf --tag 65b_x4
        # turnip alone on its own random weights, made when written (no HF model), on 4 GPUs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np


def turnip_row(st: dict, B: int, P: int, N: int, budget: str, keep) -> dict:
    """The CSV row of one timed turnip generation (its ``stats``)."""
    row = {"system": "turnip", "batch": B, "prompt": P, "new": N, "budget": budget, "ttft_ms": st["ttft_s"] * 1e3,
           "tokens_per_s": st["tokens_per_s"], "ms_per_step": st["decode_s"] / max(1, st["steps"] - 1) * 1e3,
           "switch_s": st["switch_s"], "first_plan_s": st["first_plan_s"], "prefill_s": st["prefill_s"],
           "prefill_phases": " ".join(f"{k}={v:.2f}" for k, v in st["prefill_phases_s"].items()),
           "switch_phases": " ".join(f"{k}={v:.2f}" for k, v in st["switch_phases_s"].items()),
           "step_phases_ms": " ".join(f"{k}={1e3 * v / max(st['decode_steps'], 1):.2f}"
                                      for k, v in st["step_phases_s"].items()),  # fmt: skip
           "open_s": " ".join(f"{x:.2f}" for x in st["open_s"]),
           "ms_per_step_in_bucket": (st["decode_s"] - st["switch_s"] - st["first_plan_s"]) / max(1, st["steps"] - 1)
           * 1e3,
           "bound_ms": st["bound_ms"], "link_nbytes_per_token": st["link_nbytes_per_token"],
           "plans": len(st["plans_built"]), "keep_weights": keep, "weights_kept": st["weights_kept"],
           "session_kept_nbytes": st.get("session_kept_nbytes", 0)}  # fmt: skip
    row["efficiency"] = row["bound_ms"] / row["ms_per_step"] if row["bound_ms"] else None
    return row


def turnip_model(s, sd, dtype: str):
    """A ``turnip.generation.Model`` over the HF state dict's tensors (reshaped to turnip's layouts)."""
    from turnip.generation import Model, _reference_tg, weight_names
    from turnip.runtime.weights import NP_OF, hf_name, logical_inputs

    shapes = {k: v[0] for k, v in logical_inputs(_reference_tg(s, dtype)).items()}
    dt = NP_OF[dtype]
    w = {k: sd[hf_name(k)].float().cpu().numpy().reshape(shapes[k]).astype(dt) for k in weight_names(s, dtype)}
    table = sd["model.embed_tokens.weight"].float().cpu().numpy().astype(dt)
    return Model(s, w, lambda ids: table[np.asarray(ids)], None, (), dtype)


def hf_generate(model, prompts: list, new: int, device: str):
    """(seconds, new ids per prompt) of greedy HF ``generate`` on the batch (left-padded as HF wants)."""
    import torch

    P = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = torch.tensor(p)
        mask[b, P - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    sync()
    return time.perf_counter() - t, [r[P:].tolist() for r in out]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="7b", help="a preset of turnip.models.LLAMA")
    p.add_argument("--rows", nargs="+", required=True, metavar="BATCH:PROMPT:NEW:BUDGET")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where HF runs")
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="turnip's backend")
    p.add_argument("--block", type=int, default=256, help="cache slots per block")
    p.add_argument("--gpus", type=int, default=1, help="GPUs turnip's plans use (budgets are per GPU)")
    p.add_argument("--accelerate", action="store_true", help="also HF generate dispatched under each budget")
    p.add_argument("--no-hf", action="store_true",
                   help="turnip only, on its own seeded random weights (made when written: no HF model in memory)")
    p.add_argument("--profile", default="h100")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan-dir", default="", help="keep compiled plans here")
    p.add_argument("--keep", nargs="+", default=[], choices=["0", "1"],
                   help="time each row once per value of TURNIP_KEEP_WEIGHTS (a plan's host weights passed to "
                        "the next plan's backend), in this order")  # fmt: skip
    p.add_argument("--keep-cache", nargs="+", default=[], choices=["0", "1"],
                   help="and once per value of TURNIP_KEEP_CACHE (cache blocks kept in that region too)")  # fmt: skip
    p.add_argument("--vary", action="append", default=[], metavar="VAR=V1,V2",
                   help="and once per value of environment variable VAR (repeatable; a column each), e.g. "
                        "TURNIP_PREFILL_DECODE_TILES=0,1")  # fmt: skip
    p.add_argument("--session", action="store_true",
                   help="the warm-up and timed runs of a row as calls of one generation Session (each call's first "
                        "plan takes over the host weights the call before left)")  # fmt: skip
    p.add_argument("--trace", action="store_true",
                   help="write each timed generation's last decode step as a Chrome trace into --out (device "
                        "times; trace_<tag>_b<batch>_<n>.json)")  # fmt: skip
    p.add_argument("--tag", default=platform.node())
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args(argv)

    import torch

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from benchmarks.llama_prefill import hf_config, random_llama
    from turnip.compile import parse_nbytes
    from turnip.generation import Session, generate
    from turnip.models import LLAMA
    from turnip.plancache import PlanCache
    from turnip.runtime.layout import common_prefix

    t_start = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f} s] {what}", file=sys.stderr, flush=True)

    s = LLAMA[a.size]
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    rows = [r.split(":") for r in a.rows]
    max_seq = max(int(r[1]) + int(r[2]) for r in rows)
    model = None
    if a.no_hf:  # turnip's own seeded random weights, made when written (a 65B's 130 GB never held twice)
        from turnip.generation import load_model

        m = load_model(f"llama-{a.size}", a.dtype, a.seed, random_weights=True)
    elif a.device == "cuda":
        model = random_llama(hf_config(s, max_seq), a.seed, tdt).eval()
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(a.seed)
        model = LlamaForCausalLM(hf_config(s, max_seq)).to(tdt).eval()
        with torch.no_grad():
            for name, w in model.named_parameters():
                w.copy_(1 + 0.1 * torch.randn_like(w) if name.endswith("norm.weight") else 0.02 * torch.randn_like(w))
    if model is not None:
        m = turnip_model(s, {k: v for k, v in model.state_dict().items()}, a.dtype)
    progress("weights ready")
    results = []
    for batch, prompt, new, budget in rows:
        B, P, N = int(batch), int(prompt), int(new)
        rng = np.random.default_rng([a.seed, B, P])
        prompts = [rng.integers(0, s.vocab, P).tolist() for _ in range(B)]
        if budget == "none":  # what the device has free (the CPU backend: 1 GiB)
            b = int(torch.cuda.mem_get_info()[0] * 0.9) if a.backend == "cuda" else 1 << 30
        else:
            b = parse_nbytes(budget)
        plans = PlanCache(s, b, a.gpus, a.dtype, a.block, a.plan_dir or None)
        for n in range((P + N - 2) // a.block + 1):  # every plan built before the timed run
            plans.get("decode", B, n + 1)
        progress(f"batch {B}: decode plans built")
        kw = {"dtype": a.dtype, "backend": a.backend, "block": a.block, "plans": plans, "eos": (), "gpus": a.gpus}
        if a.session:  # the row's calls share the host region one call leaves (its plans are ``plans``)
            kw["session"] = Session(m, b, a.gpus, a.dtype, a.block)
        generate(m, prompts, 2, b, profile=None, **kw)  # warm-up: kernels compiled, the prefill plan built
        progress(f"batch {B}: warm-up done")
        axes = [("TURNIP_KEEP_WEIGHTS", a.keep or [None]), ("TURNIP_KEEP_CACHE", a.keep_cache or [None])]
        axes += [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in a.vary]
        for vals in itertools.product(*(vs for _, vs in axes)):
            env = {var: val for (var, _), val in zip(axes, vals, strict=True) if val is not None}
            os.environ.update(env)
            for key in [k for k in plans.plans if k[0].startswith("prefill")]:  # built again under this
                # variant's switches
                del plans.plans[key]
            tr = os.path.join(a.out, f"trace_{a.tag}_b{B}_{len(results)}.json") if a.trace else None
            r = generate(m, prompts, N, b, profile=a.profile, trace=tr, **kw)
            more = {k: v for k, v in env.items() if k not in ("TURNIP_KEEP_WEIGHTS", "TURNIP_KEEP_CACHE")}
            row = turnip_row(r.stats, B, P, N, budget, vals[0]) | {"keep_cache": vals[1], "gpus": a.gpus} | more
            progress(f"batch {B}: timed ({', '.join(f'{k}={v}' for k, v in env.items()) or 'defaults'})")
            print(json.dumps(row), flush=True)
            results.append(row)
        if a.session:
            kw["session"].close()
        if a.no_hf:
            continue
        hf = []
        if budget == "none" or not a.accelerate:
            secs, ids = hf_generate(model, prompts, N, a.device)
            hf.append(("hf", secs, ids))
        if a.accelerate and budget != "none":
            from accelerate import dispatch_model, infer_auto_device_map
            from accelerate.hooks import remove_hook_from_submodules

            dm = infer_auto_device_map(model.cpu(), max_memory={0: b, "cpu": "400GiB"},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=tdt)  # fmt: skip
            acc = dispatch_model(model, dm)
            secs, ids = hf_generate(acc, prompts, N, a.device)
            hf.append(("accelerate", secs, ids))
            remove_hook_from_submodules(model)
            model = model.to(a.device)
        for name, secs, ids in hf:
            agreed = [common_prefix(x, y) for x, y in zip(r.ids, ids, strict=True)]  # leading tokens shared
            hrow = {"system": name, "batch": B, "prompt": P, "new": N, "budget": budget,
                    "tokens_per_s": B * N / secs, "ms_per_step": secs / N * 1e3,
                    "turnip_speedup": row["tokens_per_s"] / (B * (N - 1) / secs) if row["tokens_per_s"] else None,
                    "tokens_agreeing_min": min(agreed), "tokens_agreeing_median": float(np.median(agreed))}  # fmt: skip
            print(json.dumps(hrow), flush=True)
            results.append(hrow)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import csv

    keys = sorted({k for r in results for k in r})
    with open(out / f"generate_{a.tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(results)
    lines = [f"# generate {a.tag}", "", f"`{' '.join(sys.argv)}`", "", "| " + " | ".join(keys) + " |",
             "|" + "---|" * len(keys)]  # fmt: skip
    lines += ["| " + " | ".join(f"{r.get(k, ''):.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                for k in keys) + " |" for r in results]  # fmt: skip
    (out / f"generate_{a.tag}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
