"""PyTorch + PEFT as the reference of a turnip LoRA training step: the same weights, adapters and tokens,
loss and adapter gradients compared (``compare``), and the time per step of both (``main``, on a GPU).

    python benchmarks/lora_peft.py --model llama-tiny --seq 32 --batch 2 --dtype fp32 --steps 20   # anywhere
    python benchmarks/lora_peft.py --model llama-7b --n-layers 32 --seq 1024 --batch 8 --budget 16GiB \\
        --time --out benchmarks/results/lora_h100                                                 # GPU

Needs torch, transformers and peft. ``peft_step`` is also used by tests/test_train.py.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnip.models import LlamaConfig  # noqa: E402
from turnip.train import HF_MODULE, AdapterState, LoraConfig  # noqa: E402

TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def hf_config(cfg: LlamaConfig, n_layers: int | None = None) -> dict:
    """A Hugging Face ``config.json`` dict for ``cfg`` (inverse of ``LlamaConfig.from_hf``)."""
    d = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=cfg.d_model,
             intermediate_size=cfg.d_ffn, num_hidden_layers=n_layers or cfg.n_layers,
             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.dh,
             vocab_size=cfg.vocab, rms_norm_eps=cfg.eps, rope_theta=cfg.rope_theta,
             tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", max_position_embeddings=1 << 17,
             attention_bias=False, mlp_bias=False)  # fmt: skip
    if cfg.rope_scaling:
        f, lo, hi, orig = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
                             "original_max_position_embeddings": int(orig)}  # fmt: skip
    return d


def peft_model(cfg: LlamaConfig, weights: dict, lora: LoraConfig, dtype: str, device: str, n_layers=None,
               checkpointing: bool = False):  # fmt: skip
    """A ``LlamaForCausalLM`` holding ``weights`` (turnip logical names; ``tok_embed`` needed) wrapped by PEFT
    with ``lora``'s targets."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import LlamaConfig as HfConfig
    from transformers import LlamaForCausalLM

    from turnip.runtime.weights import hf_name, hf_shape

    tdt = getattr(torch, TORCH_DTYPE[dtype])
    hc = HfConfig(**hf_config(cfg, n_layers))
    old = torch.get_default_dtype()
    torch.set_default_dtype(tdt)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hc)
    finally:
        torch.set_default_dtype(old)
    sd = {}
    for name, w in weights.items():
        try:
            key = hf_name(name)
        except KeyError:
            continue
        sd[key] = torch.from_numpy(np.ascontiguousarray(w).reshape(hf_shape(name, w.shape)).astype(np.float32))
    missing, _ = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"weights missing for {missing[:5]}")
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    pc = PeftLora(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                  target_modules=sorted({HF_MODULE[m].split(".")[1] for m in lora.targets}))  # fmt: skip
    return get_peft_model(model, pc)


def lora_modules(pm) -> dict:
    """turnip adapter name ('L0.q.lora_A') -> the PEFT ``nn.Linear`` holding it."""
    inv = {v: k for k, v in HF_MODULE.items()}
    out = {}
    for name, mod in pm.named_modules():
        for which in ("lora_A", "lora_B"):
            if name.endswith(f".{which}.default"):
                parts = name.split(".")
                i = parts.index("layers")
                out[f"L{parts[i + 1]}.{inv['.'.join(parts[i + 2 : i + 4])]}.{which}"] = mod
    return out


def set_adapters(pm, state: AdapterState) -> None:
    import torch

    mods = lora_modules(pm)
    with torch.no_grad():
        for k, x in state.params.items():
            w = mods[k].weight
            w.copy_(torch.from_numpy(x.reshape(w.shape)))


def peft_step(pm, ids: np.ndarray, state: AdapterState, lora: LoraConfig, optimizer=None) -> dict:
    """One step of PyTorch + PEFT from ``state``'s adapters: loss (mean over predicted tokens), every
    adapter's gradient and, with ``optimizer`` (Adam over the adapters), the new adapters, all in turnip's
    layouts (float32 numpy)."""
    import torch

    mods = lora_modules(pm)
    dev = next(pm.parameters()).device
    x = torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(dev)
    pm.zero_grad(set_to_none=True)
    loss = pm(input_ids=x, labels=x).loss
    loss.backward()
    shapes = {k: v.shape for k, v in state.params.items()}
    grads = {k: mods[k].weight.grad.float().cpu().numpy().reshape(shapes[k]) for k in shapes}
    out = {"loss": float(loss), "grads": grads}
    if optimizer is not None:
        optimizer.step()
        out["new"] = {k: mods[k].weight.detach().float().cpu().numpy().reshape(shapes[k]) for k in shapes}
    return out


def adam(pm, lora: LoraConfig):
    import torch

    params = [p for n, p in pm.named_parameters() if p.requires_grad]
    return torch.optim.Adam(params, lr=lora.lr, betas=(lora.b1, lora.b2), eps=lora.eps)


def rel(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def main(argv=None) -> int:
    from turnip.cli.train_cmds import add_train_args, run_training

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_train_args(ap)
    ap.add_argument("--time", action="store_true", help="also time PyTorch + PEFT steps (gradient checkpointing)")
    ap.add_argument("--out", type=Path, help="write OUT.csv and OUT.md")
    a = ap.parse_args(argv)
    return run_training(a, reference=True)


if __name__ == "__main__":
    raise SystemExit(main())


def write_rows(out: Path, rows: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _ = time  # (timing uses time.perf_counter in run_training)
