"""DeepSpeed ZeRO-Inference prefill: a LLaMA-shaped model's parameters partitioned over the GPUs (ZeRO stage 3)
and kept in pinned CPU memory, each layer's gathered onto every GPU as it runs; each GPU runs its own prompt
(data parallel, as ZeRO-Inference serves), random fp16 weights. Launched once per process by torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/zero_inference.py \\
        --model llama-65b --prompts 4096 16384 --out zero.csv

Rank 0 writes one row per prompt: the median over ``--repeat`` runs (after ``--warmup``) of the slowest
GPU's forward (ms; every GPU holds ``batch`` sequences of ``seq`` tokens), prompts per second over all GPUs,
the set-up time (partitioning and offloading 130 GB for LLaMA-65B) and each GPU's peak memory.
``benchmarks/paper_scale.py --deepspeed`` runs it next to turnip's and Accelerate's rows.

Needs torch, transformers and deepspeed (the GPU image has no deepspeed: carry it as a wheel built from its
source release with ``DS_BUILD_OPS=0 pip wheel --no-deps deepspeed``, plus hjson and pydantic; no compiled op
is used: parameters offloaded to CPU memory, no optimizer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def ds_config(d_model: int, pin: bool = True, dtype: str = "fp16") -> dict:
    """ZeRO stage 3 with parameters offloaded to (pinned) CPU memory, ``dtype`` (fp16 or bf16), no optimizer:
    DeepSpeed's ZeRO-Inference set-up, bucket sizes as transformers' integration sizes them for a hidden size
    of ``d_model``."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        dtype: {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": pin},
            "overlap_comm": True,
            "reduce_bucket_size": d_model * d_model,
            "stage3_prefetch_bucket_size": int(0.9 * d_model * d_model),
            "stage3_param_persistence_threshold": 10 * d_model,
        },
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-65b", help="a turnip preset (llama-tiny for a smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    ap.add_argument("--prompts", nargs="+", default=["4096"], help="SEQ or SEQxBATCH per GPU")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16", help="bf16 for a CPU smoke run")
    ap.add_argument("--no-pin", action="store_true", help="offloaded parameters in pageable memory")
    ap.add_argument("--budget", default="", help="recorded in the rows only (ZeRO-Inference takes no limit)")
    ap.add_argument("--out", default="zero_inference.csv")
    a = ap.parse_args(argv)

    import deepspeed
    import torch
    from llama_prefill import hf_config
    from multi_gpu import write_csv
    from transformers import LlamaForCausalLM

    from turnip.models import llama_config

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    s = llama_config(a.model)
    shapes = [(int(p.partition("x")[0]), int(p.partition("x")[2] or 1)) for p in a.prompts]
    cfg = hf_config(s, max(seq for seq, _ in shapes), a.layers)
    conf = ds_config(s.d_model, pin=not a.no_pin, dtype=a.dtype)
    tdt = torch.float16 if a.dtype == "fp16" else torch.bfloat16
    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    # parameters made on each GPU, partitioned, each rank's part moved to CPU memory as its module is built
    with deepspeed.zero.Init(config_dict_or_path=conf, remote_device="cpu", pin_memory=not a.no_pin,
                             dtype=tdt):  # fmt: skip
        model = LlamaForCausalLM(cfg)
    model.config.use_cache = False
    engine = deepspeed.initialize(model=model, config=conf)[0]
    engine.module.eval()
    setup_s = time.perf_counter() - t0
    dev = torch.device("cuda") if gpu else torch.device("cpu")
    rows = []
    for seq, batch in shapes:
        gen = torch.Generator().manual_seed(a.seed + rank)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(dev)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        ts = []
        for i in range(a.warmup + a.repeat):
            if gpu:
                torch.cuda.synchronize()
            torch.distributed.barrier()
            t = time.perf_counter()
            with torch.no_grad():
                engine.module.model(input_ids=ids, use_cache=False)
            if gpu:
                torch.cuda.synchronize()
            el = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(el, op=torch.distributed.ReduceOp.MAX)  # the slowest GPU's
            if i >= a.warmup:
                ts.append(float(el) * 1e3)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0], device=dev)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        ms = statistics.median(ts)
        row = {"system": "deepspeed-zero-inference", "model": a.model, "seq": seq, "batch": batch,
               "budget": a.budget or "none", "gpus": world, "prompts_per_run": batch * world,
               "ms_median": round(ms, 1), "ms_min": round(min(ts), 1),
               "prompts_per_s": round(batch * world / ms * 1e3, 3),
               "setup_s": round(setup_s, 1), "peak_gib_per_gpu": round(float(peak), 2),
               "dtype": a.dtype, "pinned": not a.no_pin}  # fmt: skip
        rows.append(row)
        if rank == 0:
            print(row, flush=True)
            write_csv(a.out, rows)  # after every prompt: a run stopped at its limit keeps these
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
