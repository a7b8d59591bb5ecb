"""The paper's experiment at its scale: LLaMA-65B on one server of several GPUs with too little memory on
each, turnip against Hugging Face Accelerate, every row in one session.

Rows (defaults: the paper's setting on 4 GPUs):
  turnip prefill   each ``--prompts`` (SEQ or SEQxBATCH) under each ``--budgets`` (per GPU), nondet and det
                   (``benchmarks/multi_gpu.py``'s rows: random fp16 weights, the split ``--splits``)
  turnip LoRA      ``--lora`` (BATCHxSEQ:BUDGET; rank 16 on q, k, v and the FFN), `turnip train` in a subprocess
  Accelerate       ``dispatch_model`` over the GPUs with ``max_memory`` = each budget per GPU and the rest of the
                   weights in CPU memory (Accelerate's offload: each layer's weights copied in when it runs), and
                   with no limit (every layer on some GPU: its pipeline), same shapes, random fp16 weights;
                   medians of ``--repeat`` after ``--warmup``; a row that does not fit says so
Results: ``<out>/paper_scale<tag>.csv`` and a table with each turnip row's speed-up over Accelerate at the
same budget.

    PYTHONPATH=. python benchmarks/paper_scale.py --gpus 4 --out res/           # everything (~30 min on 4 H100s)
    PYTHONPATH=. python benchmarks/paper_scale.py --no-turnip --prompts 4096 --budgets 30GiB   # one baseline
    python benchmarks/paper_scale.py --model llama-tiny --gpus 0 --no-turnip --prompts 64      # CPU smoke run

Accelerate needs torch, transformers and accelerate (the GPU image has them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

GiB = 1 << 30


def shape(spec: str) -> tuple[int, int]:
    """'4096' -> (4096, 1); '1024x8' -> (1024, 8)."""
    seq, _, batch = spec.partition("x")
    return int(seq), int(batch or 1)


def random_offloaded_llama(cfg, gpus: int, budget_nbytes: int | None, seed: int):
    """A ``LlamaForCausalLM`` of transformers config ``cfg`` dispatched by Accelerate over ``gpus`` GPUs with
    ``budget_nbytes`` each (None: no limit) and the rest in CPU memory; weights 0.02 * N(0, 1) (slices of one
    pool of such values), norms 1 + 0.1 * N(0, 1), each put on the device it lives on (never the whole model on
    one)."""
    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(cfg)
    # no limit: all but 15 GiB of each GPU (at 72 GiB, a 4K prompt of LLaMA-65B ran out of memory on GPU 0)
    max_memory = {g: (budget_nbytes if budget_nbytes is not None else 64 * GiB) for g in range(gpus)}
    max_memory["cpu"] = 1 << 50
    device_map = infer_auto_device_map(model, max_memory=max_memory, dtype=torch.float16,
                                       no_split_module_classes=["LlamaDecoderLayer"])  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def placed(name: str):
        """The device of the deepest module of ``name`` in the map (the main device for one it leaves out, such
        as the rotary embedding, which holds no parameter)."""
        parts = name.split(".")
        for i in range(len(parts), -1, -1):
            key = ".".join(parts[:i])
            if key in device_map:
                return device_map[key]
        return 0 if gpus else "cpu"

    # one pool of random values, each weight a slice of it at a random offset: drawing 130 GB of normals one
    # value at a time would take minutes; weights in CPU memory are copies (their own memory, as loaded ones)
    params = list(model.named_parameters())
    pool = (0.02 * torch.randn(max(p.numel() for _, p in params) + 65536, generator=gen)).to(torch.float16)
    offsets = torch.randint(0, 65536, (len(params),), generator=gen).tolist()
    for (name, p), off in zip(params, offsets, strict=True):
        dev = placed(name)
        dev = "cpu" if dev == "disk" else dev
        if name.endswith("norm.weight"):
            x = (1 + 0.1 * torch.randn(p.shape, generator=gen)).to(torch.float16)
        else:
            x = pool[off : off + p.numel()].view(p.shape)
            x = x.clone() if dev == "cpu" else x
        set_module_tensor_to_device(model, name, dev, value=x)
    for name, b in list(model.named_buffers()):  # rotary inverse frequencies: on their module's device
        dev = placed(name)
        set_module_tensor_to_device(model, name, "cpu" if dev == "disk" else dev, value=b)
    on_cpu = sum(1 for d in device_map.values() if d == "cpu")
    model = dispatch_model(model, device_map=device_map, main_device=0 if gpus else "cpu")
    return model.eval(), on_cpu, len(device_map)


def accelerate_row(a, cfg, seq: int, batch: int, budget: str) -> dict:
    """Median prefill time (ms) of Accelerate at ``budget`` per GPU (``none``: no limit), hidden states of every
    token as turnip's rows compute them."""
    import torch

    from turnip.compile import parse_nbytes

    row = {"system": "accelerate", "seq": seq, "batch": batch, "budget": budget, "gpus": a.gpus}
    t0 = time.perf_counter()
    try:
        model, on_cpu, units = random_offloaded_llama(cfg, a.gpus, None if budget == "none" else parse_nbytes(budget),
                                                      a.seed)  # fmt: skip
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
        return row | {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    row |= {"load_s": round(time.perf_counter() - t0, 1), "modules_on_cpu": on_cpu, "modules": units}
    dev = "cuda:0" if a.gpus else "cpu"
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(a.seed)).to(dev)
    sync = torch.cuda.synchronize if a.gpus else (lambda: None)
    ts = []
    try:
        with torch.no_grad():
            for i in range(a.warmup + a.repeat):
                sync()
                t = time.perf_counter()
                model.model(input_ids=ids, use_cache=False)
                sync()
                if i >= a.warmup:
                    ts.append((time.perf_counter() - t) * 1e3)
    except torch.cuda.OutOfMemoryError as e:
        return row | {"error": f"out of GPU memory: {str(e)[:160]}"}
    finally:
        del model
        if a.gpus:
            torch.cuda.empty_cache()
    return row | {"ms_median": statistics.median(ts), "ms_min": min(ts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-65b")
    ap.add_argument("--gpus", type=int, default=4, help="GPUs (0: Accelerate on the CPU alone, a smoke run)")
    ap.add_argument("--budgets", nargs="+", default=["16GiB", "30GiB"], help="per GPU")
    ap.add_argument("--prompts", nargs="+", default=["1024", "4096", "16384", "1024x8", "4096x8", "32768"])
    ap.add_argument("--lora", nargs="*", default=["8x1024:24GiB"], help="turnip LoRA rows, BATCHxSEQ:BUDGET")
    ap.add_argument("--splits", nargs="+", default=["auto"])
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--no-turnip", action="store_true", help="the Accelerate rows only")
    ap.add_argument("--no-accelerate", action="store_true", help="turnip's rows only")
    ap.add_argument("--no-limit-baseline", action="store_true", help="skip Accelerate's no-limit pipeline rows")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="LoRA steps (the first not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="h100-calibrated")
    ap.add_argument("--timeout", type=float, default=900, help="per LoRA subprocess")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    from llama_prefill import hf_config  # sibling scripts
    from multi_gpu import lora_row, prefill_row, write_csv

    from turnip.models import llama_config

    s = llama_config(a.model)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"paper_scale{a.tag}.csv"
    rows: list[dict] = []
    mg_args = SimpleNamespace(model=a.model, layers=None, policies=a.policies, warmup=a.warmup, repeat=a.repeat,
                              seed=a.seed, profile=a.profile, graph_events=False, steps=a.steps, timeout=a.timeout)
    for budget in a.budgets:
        for p in a.prompts:
            seq, batch = shape(p)
            if not a.no_turnip:
                for split in a.splits:
                    try:
                        rows += [r | {"system": "turnip"} for r in prefill_row(mg_args, seq, budget, a.gpus, split,
                                                                                batch)]  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - one configuration failing does not end the session
                        rows.append({"system": "turnip", "seq": seq, "batch": batch, "budget": budget,
                                     "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            if not a.no_accelerate:
                cfg = hf_config(s, seq * batch)
                rows.append(accelerate_row(a, cfg, seq, batch, budget))
            write_csv(path, rows)
            print(rows[-1], flush=True)
    if not a.no_accelerate and not a.no_limit_baseline:
        for p in a.prompts:
            seq, batch = shape(p)
            rows.append(accelerate_row(a, hf_config(s, seq * batch), seq, batch, "none"))
            write_csv(path, rows)
            print(rows[-1], flush=True)
    if not a.no_turnip:
        for spec in a.lora:
            for split in a.splits:
                rows.append(lora_row(mg_args, spec, a.gpus, split) | {"system": "turnip"})
                write_csv(path, rows)
    acc = {(r["seq"], r["batch"], r["budget"]): r.get("ms_median") for r in rows if r.get("system") == "accelerate"}
    print("\n| prompt | batch | budget per GPU | policy | turnip ms | Accelerate ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("system") != "turnip" or r.get("workload") != "prefill" or not r.get("ms_median"):
            continue
        base = acc.get((r["seq"], r["batch"], r["budget"]))
        up = f"{base / r['ms_median']:.2f}x" if base else "-"
        print(f"| {r['seq']} | {r['batch']} | {r['budget']} | {r['policy']} | {r['ms_median']:.1f} | "
              f"{base if base is None else round(base, 1)} | {up} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
