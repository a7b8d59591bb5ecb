"""LLaMA prefill on a GPU: turnip vs PyTorch eager vs Hugging Face Accelerate offload, same weights, one process.

One set of random fp16 weights (seeded) in a ``LlamaForCausalLM`` on the GPU, then per prompt length:
  1. PyTorch eager prefill, whole model on the GPU, no limit: time and peak memory (an out-of-memory is
     reported, not fatal); its final hidden states (after the last RMSNorm) of every token;
  2. optionally (``--fp32-max-seq``) an fp32 copy of the model as the numerical reference: eager fp16's
     and turnip's relative errors against it over every token's hidden state;
  3. turnip on the CUDA backend for each ``--rows SEQ:BUDGET`` (``none`` = every weight resident, loaded
     once; a size = that GPU arena with budget-aware tiles and ``--resident auto``), each policy of
     ``--policies``: time, the plan's lower bound, host cost per vertex, relative error vs eager;
  4. Accelerate ``dispatch_model`` with ``max_memory`` = BUDGET for each ``--accelerate SEQ:BUDGET``.
Times are medians of ``--repeat`` runs after ``--warmup``; ratios come from times measured in this run.
Results go to ``--out`` as ``prefill_<tag>.csv`` and ``.md``.

    PYTHONPATH=. python benchmarks/llama_prefill.py --rows 4096:none 4096:6GiB 16384:6GiB \\
        --accelerate 4096:6GiB 16384:6GiB --fp32-max-seq 4096 --tag h100_a
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

GiB = 1 << 30


def model_config(a):
    """turnip's config of the model: ``--config`` (a Hugging Face config.json) or the preset ``--size``."""
    from turnip.models import LLAMA, load_config

    return load_config(a.config) if a.config else LLAMA[a.size]


def hf_config(s, max_seq: int, n_layers: int | None = None):
    """A transformers ``LlamaConfig`` of turnip's config ``s``."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": s.rope_theta}
    if s.rope_scaling:
        f, lo, hi, orig = s.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": s.rope_theta, "factor": f, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": int(orig)}  # fmt: skip
    return LlamaConfig(hidden_size=s.d_model, intermediate_size=s.d_ffn, num_hidden_layers=n_layers or s.n_layers,
                       num_attention_heads=s.n_heads, num_key_value_heads=s.kv_heads, head_dim=s.dh,
                       vocab_size=s.vocab, rms_norm_eps=s.eps, max_position_embeddings=max(max_seq, 2048, *(
                           [int(s.rope_scaling[3]) + 1] if s.rope_scaling else [])),
                       tie_word_embeddings=s.tie_embeddings, rope_parameters=rope, rope_scaling=rope,
                       rope_theta=s.rope_theta, attn_implementation="sdpa")  # fmt: skip


def build_hf(s, seed: int, max_seq: int, n_layers: int | None = None):
    """A ``LlamaForCausalLM`` of turnip config ``s`` on the GPU, fp16, seeded random weights (norms near 1)."""
    import torch

    return random_llama(hf_config(s, max_seq, n_layers), seed, torch.float16).eval()


def random_llama(cfg, seed: int, dtype):
    """A ``LlamaForCausalLM`` of transformers config ``cfg`` on the GPU in ``dtype``: weights 0.02 * N(0, 1),
    norm weights 1 + 0.1 * N(0, 1), seeded."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return model


def time_torch(fn, warmup: int, repeat: int) -> tuple[list[float], object]:
    import torch

    out, ts = None, []
    for i in range(warmup + repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        if i >= warmup:
            ts.append(time.perf_counter() - t)
    return ts, out


def rel(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


def worst_token(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x.astype(np.float64), y.astype(np.float64)
    return float((np.linalg.norm(x - y, axis=-1) / np.linalg.norm(y, axis=-1)).max())


def hidden(model, ids, logits: bool = False):
    """The final hidden states of every token, or (``logits``) the last position's logits, as HF computes
    them in a prefill (``logits_to_keep=1``)."""
    if logits:
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1:]
    return model.model(input_ids=ids, use_cache=False).last_hidden_state


def hf_inputs(tg, sd, ids):
    """turnip's logical inputs from a Hugging Face state dict (reshapes of the same tensors) and the prompt
    (``x0``: its rows of the embedding table), one tensor at a time."""
    from turnip.runtime.weights import hf_name, logical_inputs

    for name, (shape, _blocks) in logical_inputs(tg).items():
        if name == "x0":
            x = sd["model.embed_tokens.weight"][ids.reshape(-1)]
        else:
            x = sd[hf_name(name)]
        yield name, x.reshape(shape).contiguous().cpu().numpy()


def run_turnip(sd, ids, a, seq: int, budget_name: str):
    """Compile, load on the CUDA backend, copy the HF weights (our layouts are theirs, reshaped), run every
    policy."""
    from analysis.metrics import run_metrics
    from turnip.compile import build_with_resident, parse_nbytes
    from turnip.memgraph.interp import assemble
    from turnip.models import llama_prefill
    from turnip.runtime import execute, open_backend
    from turnip.runtime.driver import lower_bound
    from turnip.runtime.weights import write_streaming

    if budget_name == "none":
        n_weight = sum(int(v.numel()) * v.element_size() for v in sd.values())
        budget, resident = parse_nbytes(a.none_budget), str(n_weight + (1 << 28))
    else:
        budget, resident = parse_nbytes(budget_name), a.resident
    tiles = dict(t.split("=") for t in a.tile) if a.tile else None
    tiles = {k: int(v) for k, v in tiles.items()} if tiles else None
    t0 = time.perf_counter()
    tg = llama_prefill(model_config(a), seq, 1, "fp16", tiles, n_layers=a.layers, budget_nbytes=budget,
                       head="last" if a.logits else "none")
    mg = build_with_resident(tg, budget, None, resident)
    t_compile = time.perf_counter() - t0
    bound = lower_bound(mg, a.profile)
    t0 = time.perf_counter()
    be = open_backend("cuda", mg, 5, fast=not a.numba_kernels, bound=not a.numba_launch, graphs=not a.no_graphs,
                      graph_events=a.graph_events)
    t_views = time.perf_counter() - t0
    out = {"seq": seq, "budget": budget_name, "tiles": json.dumps(tg.meta.get("tiles", {})), "vertices": mg.n,
           "kernels": int((mg.kind == 1).sum()), "offloads": int(mg.stats["n_offload"]),
           "memory_edges": int(mg.stats.get("n_memory_edges", -1)),
           "resident_nbytes": int(mg.stats["resident_input_nbytes"]), "compile_s": t_compile,
           "load_views_s": t_views, "lower_bound_ms": bound["lower_bound_ns"] / 1e6,
           "bound": json.dumps({k: round(v / 1e6, 2) for k, v in bound.items()})}  # fmt: skip
    runs = {}
    try:
        t0 = time.perf_counter()
        write_streaming(be, tg, hf_inputs(tg, sd, ids))
        out["load_weights_s"] = time.perf_counter() - t0
        for pol in a.policies:
            rs = [execute(mg, be, pol, 5, seed=i) for i in range(a.warmup + a.repeat)][a.warmup:]
            runs[pol] = rs
        outs = be.read_outputs()
    finally:
        be.close()
    h = assemble(tg, outs, "logits" if a.logits else "out").astype(np.float32)
    resident = mg.preloaded()
    for pol, rs in runs.items():
        ms = [r.makespan_ns / 1e6 for r in rs]
        res = rs[-1]
        hc = (res.host_cost_ns() / 1e3)[~resident]
        m = run_metrics(res.trace(mg).spans, mg.n_gpus)
        out[f"{pol}_ms"] = float(np.median(ms))
        out[f"{pol}_times_ms"] = json.dumps([round(x, 2) for x in ms])
        out[f"{pol}_host_us_p50"] = float(np.median(hc))
        out[f"{pol}_host_us_p90"] = float(np.percentile(hc, 90))
        out[f"{pol}_gpu_busy"] = m["gpu_busy_frac"]
        out[f"{pol}_streamed_gib"] = (m["input_nbytes"] + m["reload_nbytes"]) / GiB
        if pol == a.policies[0] and a.trace_dir:
            res.trace(mg, {"seq": seq, "budget": budget_name}).write_chrome(
                Path(a.trace_dir) / f"prefill_{a.tag}_{seq}_{budget_name}.trace.json")
    return out, h


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="7b", help="a preset (turnip.models.LLAMA)")
    ap.add_argument("--config", help="a Hugging Face config.json instead of --size (e.g. a LLaMA-3-8B-shaped one)")
    ap.add_argument("--logits", action="store_true",
                    help="time and compare the last position's logits (LM head included), not hidden states")
    ap.add_argument("--layers", type=int, default=None, help="only the first N decoder layers (checks)")
    ap.add_argument("--rows", nargs="+", default=["4096:none", "4096:6GiB"], help="SEQ:BUDGET turnip rows")
    ap.add_argument("--accelerate", nargs="*", default=[], help="SEQ:BUDGET Accelerate rows")
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp32-max-seq", type=int, default=0, help="fp32 reference for prompts up to this length")
    ap.add_argument("--resident", default="auto", help="resident inputs under a sized budget: auto or bytes")
    ap.add_argument("--none-budget", default="40GiB", help="arena of the 'none' rows (all weights resident)")
    ap.add_argument("--tile", action="append", default=[], metavar="DIM=SIZE")
    ap.add_argument("--numba-kernels", action="store_true", help="numba memory-bound kernels, not CUDA C++")
    ap.add_argument("--no-graphs", action="store_true", help="launch bound kernels directly, not as graphs")
    ap.add_argument("--graph-events", action="store_true", help="end events recorded inside the graphs")
    ap.add_argument("--numba-launch", action="store_true")
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--trace-dir", default="")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)

    import torch

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.tag = a.tag or (model_config(a).name.removeprefix("hf:") if a.config else a.size)
    rows = [tuple(r.split(":")) for r in a.rows]
    acc_rows = [tuple(r.split(":")) for r in a.accelerate]
    seqs = sorted({int(s) for s, _ in rows + acc_rows})
    cfg = model_config(a)
    model = build_hf(cfg, a.seed, max(seqs), a.layers)
    sd = {k: v for k, v in model.state_dict().items()}
    n_weight = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{a.tag}: weights {n_weight / GiB:.2f} GiB", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(a.seed)
    ids = {s: torch.randint(0, model.config.vocab_size, (1, s), generator=gen).cuda() for s in seqs}
    results, eager_h = [], {}
    for s in seqs:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"system": "pytorch-eager", "seq": s, "budget": "none"}
        try:
            with torch.no_grad():
                ts, h = time_torch(lambda s=s: hidden(model, ids[s], a.logits), a.warmup, a.repeat)
            eager_h[s] = h[0].float().cpu().numpy()
            row |= {"ms": float(np.median(ts)) * 1e3, "times_ms": json.dumps([round(t * 1e3, 2) for t in ts]),
                    "peak_gib": torch.cuda.max_memory_allocated() / GiB}  # fmt: skip
            del h
        except torch.OutOfMemoryError:
            row |= {"ms": float("nan"), "peak_gib": torch.cuda.max_memory_allocated() / GiB, "note": "out of memory"}
        print(json.dumps(row), flush=True)
        results.append(row)
    fp32_h = {}
    if a.fp32_max_seq:
        m32 = build_hf(cfg, a.seed, max(seqs), a.layers).float()
        m32.load_state_dict({k: v.float() for k, v in sd.items()})
        with torch.no_grad():
            for s in seqs:
                if s <= a.fp32_max_seq:
                    fp32_h[s] = hidden(m32, ids[s], a.logits)[0].float().cpu().numpy()
                    r = next(r for r in results if r["system"] == "pytorch-eager" and r["seq"] == s)
                    if s in eager_h:
                        r["err_vs_fp32"] = rel(eager_h[s], fp32_h[s])
                        r["worst_token_err_vs_fp32"] = worst_token(eager_h[s], fp32_h[s])
        del m32
        gc.collect()
        torch.cuda.empty_cache()
    for s, b in rows:
        s = int(s)
        torch.cuda.empty_cache()
        r, h = run_turnip(sd, ids[s], a, s, b)
        r["system"] = "turnip"
        if s in eager_h:
            r["err_vs_eager"] = rel(h, eager_h[s])
            r["worst_token_err_vs_eager"] = worst_token(h, eager_h[s])
            r["last_token_err_vs_eager"] = rel(h[-1], eager_h[s][-1])
        if s in fp32_h:
            r["err_vs_fp32"] = rel(h, fp32_h[s])
            r["worst_token_err_vs_fp32"] = worst_token(h, fp32_h[s])
        r["ms"] = r[f"{a.policies[0]}_ms"]
        print(json.dumps({k: v for k, v in r.items() if not k.endswith("times_ms")}), flush=True)
        results.append(r)
    if acc_rows:
        from accelerate import dispatch_model, infer_auto_device_map

        del sd
        by_budget: dict = {}
        for s, b in acc_rows:
            by_budget.setdefault(b, []).append(int(s))
        for b, ss in by_budget.items():
            model = model.cpu()
            gc.collect()
            torch.cuda.empty_cache()
            dm = infer_auto_device_map(model, max_memory={0: b, "cpu": "200GiB"},
                                       no_split_module_classes=["LlamaDecoderLayer"], dtype=torch.float16)  # fmt: skip
            model = dispatch_model(model, dm)
            n_cpu = sum(1 for v in dm.values() if v == "cpu")
            for s in ss:
                with torch.no_grad():
                    ts, h = time_torch(lambda s=s, m=model: hidden(m, ids[s], a.logits), 1, max(1, a.repeat - 1))
                row = {"system": "accelerate", "seq": s, "budget": b, "ms": float(np.median(ts)) * 1e3,
                       "times_ms": json.dumps([round(t * 1e3, 2) for t in ts]), "cpu_modules": n_cpu}  # fmt: skip
                if s in eager_h:
                    row["err_vs_eager"] = rel(h[0].float().cpu().numpy(), eager_h[s])
                print(json.dumps(row), flush=True)
                results.append(row)
                del h
            from accelerate.hooks import remove_hook_from_submodules

            remove_hook_from_submodules(model)
    write(out, a, results)
    return 0


def write(out: Path, a, results: list[dict]) -> None:
    import pandas as pd

    cmd = "PYTHONPATH=. python " + " ".join(sys.argv)
    pd.DataFrame(results).to_csv(out / f"prefill_{a.tag}.csv", index=False)
    eager = {r["seq"]: r["ms"] for r in results if r["system"] == "pytorch-eager"}
    acc = {(r["seq"], r["budget"]): r["ms"] for r in results if r["system"] == "accelerate"}
    pols = a.policies
    what = "last-position logits" if a.logits else "final hidden states"
    lines = [f"# {a.tag} prefill ({what}), fp16, random weights (seed {a.seed})", "", f"Command: `{cmd}`", "",
             f"Host: {platform.node()}; {a.repeat} timed runs after {a.warmup} warm-up; medians.", "",
             "| seq | budget | system | " + " | ".join(f"{p} ms" for p in pols) + " | vs eager | vs Accelerate "
             "| lower bound ms | bound/time | host µs/vertex p50 | err vs eager | err vs fp32 | vertices |",
             "|---" * (11 + len(pols)) + "|"]  # fmt: skip
    for r in results:
        s, b = r["seq"], r["budget"]
        ms = r["ms"]
        e, ac = eager.get(s), acc.get((s, b))
        times = [f"{r.get(f'{p}_ms', ms if r['system'] != 'turnip' and p == pols[0] else float('nan')):.1f}"
                 for p in pols]  # fmt: skip
        lb = r.get("lower_bound_ms")
        cells = [str(s), b, r["system"], *times, f"{ms / e:.2f}x" if e and e == e else "-",
                 f"{ms / ac:.2f}x" if ac and r["system"] == "turnip" else "-", f"{lb:.1f}" if lb else "-",
                 f"{lb / ms:.2f}" if lb else "-",
                 f"{r[f'{pols[0]}_host_us_p50']:.1f}" if f"{pols[0]}_host_us_p50" in r else "-",
                 f"{r['err_vs_eager']:.2e}" if "err_vs_eager" in r else "-",
                 f"{r['err_vs_fp32']:.2e}" if "err_vs_fp32" in r else "-", str(r.get("vertices", "-"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    (out / f"prefill_{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
