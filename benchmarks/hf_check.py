"""Hugging Face checkpoints on a GPU: turnip's next token and logits against transformers' model.

For each model (``--models``): a random LLaMA-family model is made with ``transformers`` (seeded; norms
near 1) and saved with ``save_pretrained`` as a sharded safetensors checkpoint (config.json, index,
shards) in the dtype of the recipe; the reference is ``LlamaForCausalLM.from_pretrained`` of that
directory on the GPU in fp16 (the prefill's last-position logits, ``logits_to_keep=1``), and in fp32 for
context. turnip compiles the directory's config (``--model DIR``), reads the checkpoint tensor by tensor
(``turnip.checkpoint``) and runs on the CUDA backend under ``--budget`` on 1 GPU and, with ``--gpus 2``,
on two (two physical GPUs when there are two, else two logical GPUs sharing one device: ``devices=[0,
0]``, a correctness check of the 2-GPU plan, not a timing). Per prompt: top-1 token equal?, logits
relative error vs HF fp16 and vs HF fp32, the gap between HF's top two logits. Then the CLI end to end
(``turnip run --model DIR --prompt-ids ...`` in a subprocess): its printed next token, and its peak
resident memory against the pinned input region and the largest shard (``--rss``).

Recipes: ``llama3-small`` (GQA 8/2 heads, vocabulary 128,256, rope theta 500,000 with LLaMA-3 scaling,
tied embeddings, bf16 on disk, 100 KB-ish shards), ``llama2-7b`` (LLaMA-2-7B shapes, fp16 on disk),
``llama3-8b`` (LLaMA-3-8B shapes, bf16 on disk); the other families at 4 layers of width 1024:
``mistral-swa`` (a window of 1024, prompts of twice the window), ``qwen2-small`` (q, k, v biases),
``qwen3-small`` (q/k norms), ``phi3-small`` (fused projections, a window of 1023), ``gemma-small`` and
``gemma2-small`` (GeGLU, (1 + w) norms, embedding scale; Gemma 2 with its soft caps and every other layer
sliding over 512 tokens, against transformers' eager attention, which its caps need).

    PYTHONPATH=. python benchmarks/hf_check.py --models llama3-small llama2-7b --gpus 1 2 --rss
    PYTHONPATH=. python benchmarks/hf_check.py --models mistral-swa qwen2-small qwen3-small phi3-small \
        gemma-small gemma2-small --gpus 1 2 --budget 256MiB --tag hf_families
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

GiB = 1 << 30

RECIPES = {
    "llama3-small": dict(
        cfg=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 max_position_embeddings=131072,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}),
        dtype="bfloat16", shard="20MB", seqs=[7, 300, 3000]),
    "llama2-7b": dict(
        cfg=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=32000, rms_norm_eps=1e-5, max_position_embeddings=4096),
        dtype="float16", shard="2GB", seqs=[1024, 1024, 1024]),
    "llama3-8b": dict(
        cfg=dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5, max_position_embeddings=131072,
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}),
        dtype="bfloat16", shard="5GB", seqs=[4096]),
    "mistral-swa": dict(arch="Mistral", cfg=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, sliding_window=1024),
        dtype="float16", shard="2GB", seqs=[2048]),
    "qwen2-small": dict(arch="Qwen2", cfg=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
        dtype="bfloat16", shard="2GB", seqs=[7, 1000]),
    "qwen3-small": dict(arch="Qwen3", cfg=dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
        dtype="bfloat16", shard="2GB", seqs=[1000]),
    "phi3-small": dict(arch="Phi3", cfg=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=32064, sliding_window=1023),
        dtype="bfloat16", shard="2GB", seqs=[2048]),
    "gemma-small": dict(arch="Gemma", cfg=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000),
        dtype="bfloat16", shard="2GB", seqs=[1000]),
    "gemma2-small": dict(arch="Gemma2", attn="eager", cfg=dict(hidden_size=1024, intermediate_size=4096,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
        sliding_window=512, query_pre_attn_scalar=256), dtype="bfloat16", shard="2GB", seqs=[1024]),
}  # fmt: skip


def random_model(r: dict, seed: int, dtype):
    """A random transformers model of recipe ``r`` (its ``arch``, LLaMA by default) on the GPU in ``dtype``:
    weights and biases 0.02 * N(0, 1), norm weights 1 + 0.1 * N(0, 1) (Gemma's, which scale by 1 + w:
    0.1 * N(0, 1)), seeded."""
    import torch
    import transformers
    from llama_prefill import random_llama

    arch = r.get("arch", "Llama")
    cfg = getattr(transformers, arch + "Config")(**r["cfg"])
    if arch == "Llama":
        return random_llama(cfg, seed, dtype)
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):
        model = getattr(transformers, arch + "ForCausalLM")(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if arch.startswith("Gemma") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return model


def make_checkpoint(name: str, root: Path, seed: int) -> Path:
    """Write a random model of recipe ``name`` with transformers' own ``save_pretrained`` (sharded)."""
    import torch

    r = RECIPES[name]
    d = root / name
    if (d / "config.json").exists():
        return d
    model = random_model(r, seed, getattr(torch, r["dtype"]))
    t = time.perf_counter()
    model.save_pretrained(d, max_shard_size=r["shard"])
    print(f"{name}: saved {sum(f.stat().st_size for f in d.glob('*.safetensors')) / GiB:.2f} GiB in "
          f"{len(list(d.glob('*.safetensors')))} shard(s), {time.perf_counter() - t:.1f} s", flush=True)  # fmt: skip
    del model
    torch.cuda.empty_cache()
    return d


def hf_logits(d: Path, prompts: list[np.ndarray], dtype, attn: str = "sdpa") -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=attn).cuda().eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.from_numpy(ids[None]).cuda()
            out.append(m(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu().numpy())
    del m
    torch.cuda.empty_cache()
    return out


def turnip_logits(d: Path, prompts: list[np.ndarray], budget: str, gpus: int, devices, dtype: str = "fp16"
                  ) -> tuple[list, dict]:  # fmt: skip
    """Compile the directory's model for the prompts' length, load the checkpoint once, run each prompt
    (rewriting only the embedded prompt ``x0`` between them)."""
    from turnip.checkpoint import Checkpoint
    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes
    from turnip.memgraph.interp import assemble
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import write_streaming

    seq = int(prompts[0].size)
    b = parse_nbytes(budget)
    t0 = time.perf_counter()
    tg = make_taskgraph(str(d), seq, gpus, dtype, budget_nbytes=b, head="last")
    mg = build_with_resident(tg, b, None, "auto")
    info = {"compile_s": time.perf_counter() - t0, "vertices": mg.n, "tiles": json.dumps(tg.meta["tiles"])}
    ck = Checkpoint(d)
    be = open_backend("cuda", mg, 5, devices=devices)
    outs = []
    try:
        t0 = time.perf_counter()
        write_streaming(be, tg, ck.iter_inputs(tg, ids=prompts[0]))
        info["load_s"] = time.perf_counter() - t0
        times = []
        for i, ids in enumerate(prompts):
            if i:
                write_streaming(be, tg, ((n, x) for n, x in ck.iter_inputs(tg, ids=ids, only=("x0",))))
            execute(mg, be, "nondet", 5, seed=0)  # warm-up
            res = execute(mg, be, "nondet", 5, seed=1)
            times.append(res.makespan_ns / 1e6)
            outs.append(assemble(tg, be.read_outputs(), "logits")[-1].astype(np.float32))
        info["ttft_ms"] = json.dumps([round(t, 2) for t in times])
    finally:
        be.close()
    return outs, info


def rel(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def cli_rss(d: Path, ids: np.ndarray, budget: str, tmp: Path) -> dict:
    """``turnip run --model DIR --prompt-ids`` in a child process: its next token and peak RSS."""
    p = tmp / "prompt.npy"
    np.save(p, ids)
    cmd = [sys.executable, "-c", "import sys; from turnip.cli import main; sys.exit(main())", "run", "--model", str(d),
           "--backend", "cuda", "--budget", budget, "--resident", "auto", "--prompt-ids", str(p), "--repeat", "1",
           "--warmup", "0"]  # fmt: skip
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": os.getcwd()})
    wall = time.perf_counter() - t
    out = r.stdout + r.stderr
    lines = out.splitlines()
    tok = next((int(line.split()[2]) for line in lines if line.startswith("next token")), None)
    mem = next((line for line in lines if line.startswith("host memory peak")), "")
    load = next((line for line in lines if " load " in line and "plan" in line), "")
    shards = [f.stat().st_size for f in d.glob("*.safetensors")]
    res = {"rc": r.returncode, "next_token": tok, "wall_s": round(wall, 1), "host_memory": mem[len("host memory peak"):]
           .strip(), "load_line": load.strip(), "checkpoint_gib": sum(shards) / GiB,
           "largest_shard_gib": max(shards) / GiB}  # fmt: skip
    if r.returncode:
        res["tail"] = out[-2000:]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama3-small"], choices=list(RECIPES))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1])
    ap.add_argument("--budget", default="6GiB")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"],
                    help="turnip's compute dtype, and the dtype of the reference the errors are taken against")
    ap.add_argument("--prompts", type=int, default=3, help="random prompts per length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="an fp32 reference for the large recipes too")
    ap.add_argument("--rss", action="store_true", help="also run the CLI in a child process (next token, peak RSS)")
    ap.add_argument("--dir", default="/tmp/hf_models", help="where the checkpoints are written")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="hf_check")
    a = ap.parse_args(argv)

    import torch

    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    n_dev = torch.cuda.device_count()
    rng = np.random.default_rng(a.seed)
    for name in a.models:
        d = make_checkpoint(name, root, a.seed)
        vocab = RECIPES[name]["cfg"]["vocab_size"]
        by_len: dict[int, list] = {}
        for s in RECIPES[name]["seqs"]:
            by_len.setdefault(s, []).extend(rng.integers(0, vocab, size=s).astype(np.int64) for _ in range(a.prompts))
        refs: dict = {}  # prompt length -> HF's logits of its prompts, in the compute dtype
        for s, prompts in by_len.items():
            prompts = prompts[: a.prompts]
            attn = RECIPES[name].get("attn", "sdpa")
            ref16 = refs[s] = hf_logits(d, prompts, torch.bfloat16 if a.dtype == "bf16" else torch.float16, attn)
            small = RECIPES[name]["cfg"]["hidden_size"] <= 1024
            ref32 = hf_logits(d, prompts, torch.float32, attn) if small or a.fp32 else None
            for g in a.gpus:
                devices = list(range(g)) if n_dev >= g else [0] * g
                outs, info = turnip_logits(d, prompts, a.budget, g, devices, a.dtype)
                for i, (o, r16) in enumerate(zip(outs, ref16, strict=True)):
                    top2 = np.sort(r16)[-2:]
                    row = {"model": name, "dtype": a.dtype, "seq": s, "prompt": i, "gpus": g, "devices": str(devices),
                           "budget": a.budget, "top1_turnip": int(o.argmax()), "top1_hf": int(r16.argmax()),
                           "top1_equal": bool(o.argmax() == r16.argmax()), "hf_top2_gap": float(top2[1] - top2[0]),
                           "err_vs_hf_fp16": rel(o, r16)} | info  # fmt: skip
                    if ref32 is not None:
                        row["err_vs_hf_fp32"] = rel(o, ref32[i])
                        row["hf_fp16_err_vs_fp32"] = rel(r16, ref32[i])
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        if a.rss:
            ids = by_len[max(by_len)][0]
            r = cli_rss(d, ids, a.budget, root) | {"model": name, "seq": int(ids.size), "kind": "cli"}
            attn = RECIPES[name].get("attn", "sdpa")
            cli16 = refs[max(by_len)][0] if a.dtype == "fp16" else None  # the CLI runs fp16
            ref = cli16 if cli16 is not None else hf_logits(d, [ids], torch.float16, attn)[0]
            r["top1_hf"] = int(ref.argmax())
            print(json.dumps(r), flush=True)
            rows.append(r)
    write(Path(a.out), a, rows)
    return 0


def write(out: Path, a, rows: list[dict]) -> None:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / f"{a.tag}.csv", index=False)
    cmd = "PYTHONPATH=. python " + " ".join(sys.argv)
    lines = [f"# Hugging Face checkpoints: turnip vs LlamaForCausalLM ({platform.node()})", "", f"Command: `{cmd}`", "",
             f"Compute dtype {a.dtype}; 'HF fp16' columns: HF in that dtype.", "",
             "| model | seq | GPUs (devices) | prompt | top-1 equal | HF top-2 gap | err vs HF fp16 | err vs HF fp32 "
             "| HF fp16 err vs fp32 | TTFT ms | load s |", "|---" * 11 + "|"]  # fmt: skip
    for r in rows:
        if r.get("kind") == "cli":
            continue

        def f(k, r=r):
            return f"{r[k]:.2e}" if isinstance(r.get(k), float) else "-"

        lines.append(f"| {r['model']} | {r['seq']} | {r['gpus']} ({r['devices']}) | {r['prompt']} | {r['top1_equal']} "
                     f"| {r['hf_top2_gap']:.3f} | {f('err_vs_hf_fp16')} | {f('err_vs_hf_fp32')} "
                     f"| {f('hf_fp16_err_vs_fp32')} | {json.loads(r['ttft_ms'])[r['prompt']]} "
                     f"| {r['load_s']:.1f} |")  # fmt: skip
    cli = [r for r in rows if r.get("kind") == "cli"]
    if cli:
        lines += ["", "`turnip run --model DIR --prompt-ids` in a child process:", "",
                  "| model | seq | exit | next token | HF top-1 | host memory peak (turnip run) | checkpoint GiB "
                  "| largest shard GiB | wall s |", "|---" * 9 + "|"]  # fmt: skip
        for r in cli:
            lines.append(f"| {r['model']} | {r['seq']} | {r['rc']} | {r['next_token']} | {r['top1_hf']} "
                         f"| {r['host_memory']} | {r['checkpoint_gib']:.2f} | {r['largest_shard_gib']:.2f} "
                         f"| {r['wall_s']} |")  # fmt: skip
    (out / f"{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
