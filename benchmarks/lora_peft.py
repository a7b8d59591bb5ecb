"""turnip's LoRA training step against PyTorch + PEFT on a GPU, one process, the same random weights: the
first step's loss and adapter gradients compared (``--check``), time per step of turnip under each
``--rows B:S:BUDGET`` and policy, and of PyTorch + PEFT with gradient checkpointing and no memory limit
(``--peft``). Results to ``--out`` (.csv and .md).

    PYTHONPATH=. python benchmarks/lora_peft.py --size 7b --rows 1:1024:16GiB 8:1024:16GiB --peft --check \\
        --out benchmarks/results/lora_7b_h100

Needs torch, transformers and peft. ``peft_model`` / ``peft_step`` are also tests/test_train.py's reference.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_prefill import hf_config, random_llama  # noqa: E402  (a transformers config of turnip's; weights)

from turnip.models import LlamaConfig  # noqa: E402
from turnip.train import HF_MODULE, AdapterState, LoraConfig  # noqa: E402

TORCH_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def peft_model(cfg: LlamaConfig, weights: dict, lora: LoraConfig, dtype: str, device: str, n_layers=None,
               checkpointing: bool = False):  # fmt: skip
    """A ``LlamaForCausalLM`` holding ``weights`` (turnip logical names; ``tok_embed`` needed) wrapped by PEFT
    with ``lora``'s targets."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    from turnip.runtime.weights import hf_name, hf_shape

    tdt = getattr(torch, TORCH_DTYPE[dtype])
    hc = hf_config(cfg, 8192, n_layers)
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


def _sd_inputs(tg, sd, skip):
    """turnip's logical inputs (frozen weights) from a Hugging Face state dict, one tensor at a time."""
    from turnip.runtime.weights import hf_name, logical_inputs

    for name, (shape, _blocks) in logical_inputs(tg).items():
        if name not in skip:
            yield name, sd[hf_name(name)].reshape(shape).contiguous().cpu().numpy()


def turnip_rows(a, cfg, sd, B: int, S: int, budget_name: str, check_pm=None) -> list[dict]:
    """Compile one training step, load it on the CUDA backend with the model's weights (``sd``; random
    when None), run ``a.warmup + a.repeat`` steps per policy; with ``check_pm`` (a PEFT model holding the same
    weights) compare the first step's loss and gradients with PEFT's."""
    import torch

    from turnip.compile import build_with_resident, parse_nbytes
    from turnip.runtime import open_backend
    from turnip.runtime.driver import lower_bound
    from turnip.runtime.weights import iter_random_inputs, write_random_inputs, write_streaming
    from turnip.train import Stepper, lora_step, next_token_targets

    lora = LoraConfig(rank=a.rank, alpha=2.0 * a.rank, lr=a.lr)
    budget = parse_nbytes(budget_name)
    t0 = time.perf_counter()
    tg = lora_step(cfg, S, B, 1, a.dtype, None, a.layers, budget, lora, a.checkpoint)
    mg = build_with_resident(tg, budget, None, a.resident)
    t_compile = time.perf_counter() - t0
    bound = lower_bound(mg, a.profile)
    state = AdapterState.init(tg, seed=1, b_std=0.02 if check_pm is not None else 0.0)
    per_step = set(state.inputs()) | {"x0", "targets"}
    rng = np.random.default_rng(7)
    rows = []
    emb = sd["model.embed_tokens.weight"] if sd is not None else None
    with open_backend(a.backend, mg, 5) as be:
        t0 = time.perf_counter()
        if sd is not None:
            write_streaming(be, tg, _sd_inputs(tg, sd, per_step))
        else:
            write_random_inputs(be, tg, 0, skip=per_step)
        stepper = Stepper(tg, mg, be, state)
        t_load = time.perf_counter() - t0
        x0_rand = None if sd is not None else next(x for k, x in iter_random_inputs(tg, 0) if k == "x0")
        for policy in a.policies:
            walls, spans = [], []
            for i in range(a.warmup + a.repeat):
                w0 = time.perf_counter()
                ids = rng.integers(0, cfg.vocab, size=(B, S))
                x0 = x0_rand if emb is None else emb[torch.from_numpy(ids.reshape(-1)).to(emb.device)].cpu().numpy()
                check = check_pm is not None and i == 0 and policy == a.policies[0]
                if check:
                    before = AdapterState({k: x.copy() for k, x in stepper.fetch().params.items()}, {}, {})
                loss, res, grads = stepper.step(x0, next_token_targets(ids), policy, 5, seed=i, stall_s=300,
                                                grads=check)  # fmt: skip
                wall = time.perf_counter() - w0
                if check:
                    rows += _check_rows(a, check_pm, ids, before, lora, loss, grads, B, S)
                if i >= a.warmup:
                    walls.append(wall)
                    spans.append(res.makespan_ns / 1e9)
            row = {"kind": "turnip", "batch": B, "seq": S, "budget": budget_name, "policy": policy,
                   "step_s": float(np.median(walls)), "makespan_s": float(np.median(spans)),
                   "lower_bound_s": bound["lower_bound_ns"] / 1e9, "vertices": mg.n,
                   "offloads": int(mg.stats["n_offload"]), "checkpoint": tg.meta["train"]["checkpoint"],
                   "resident_gib": int(mg.stats["resident_input_nbytes"]) / 2**30,
                   "compile_s": t_compile, "load_s": t_load, "loss_last": loss,
                   "times_s": json.dumps([round(x, 3) for x in walls])}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _check_rows(a, pms, ids, before, lora, loss, grads, B, S) -> list[dict]:
    """The first step's loss and gradients against PEFT in the same dtype and (when given) in float32."""
    rows = []
    for tag, pm in pms.items():
        set_adapters(pm, before)
        ref = peft_step(pm, ids, before, lora)
        errs = {k: rel(grads[k], g) for k, g in ref["grads"].items()}
        worst = max(errs, key=errs.get)
        print(f"check B={B} S={S} turnip {a.dtype} vs PEFT {tag}: loss {loss:.5f} vs {ref['loss']:.5f}; adapter "
              f"gradients: worst rel err {errs[worst]:.2e} ({worst}), median {np.median(list(errs.values())):.2e} "
              f"over {len(errs)}", flush=True)  # fmt: skip
        rows.append({"kind": "check", "batch": B, "seq": S, "subject": f"turnip {a.dtype}", "reference": f"PEFT {tag}",
                     "loss": loss, "peft_loss": ref["loss"], "grad_rel_err_max": errs[worst],
                     "grad_rel_err_median": float(np.median(list(errs.values()))), "worst": worst,
                     "ref_grads": {k: g for k, g in ref["grads"].items()}})  # fmt: skip
    if len(rows) == 2:  # PEFT in the model's dtype against PEFT in float32: the precision of the dtype itself
        g16, g32 = rows[0].pop("ref_grads"), rows[1]["ref_grads"]
        errs = {k: rel(g16[k], g32[k]) for k in g32}
        worst = max(errs, key=errs.get)
        print(f"check PEFT {a.dtype} vs PEFT fp32: gradients worst rel err {errs[worst]:.2e} ({worst}), median "
              f"{np.median(list(errs.values())):.2e}", flush=True)  # fmt: skip
        rows.append({"kind": "check", "batch": B, "seq": S, "subject": f"PEFT {a.dtype}", "reference": "PEFT fp32",
                     "loss": rows[0]["peft_loss"], "peft_loss": rows[1]["peft_loss"], "grad_rel_err_max": errs[worst],
                     "grad_rel_err_median": float(np.median(list(errs.values()))), "worst": worst})  # fmt: skip
    for r in rows:
        r.pop("ref_grads", None)
    return rows


def peft_time(a, pm, B: int, S: int, vocab: int) -> dict:
    """PyTorch + PEFT steps (forward, backward, Adam) with gradient checkpointing, whole model on the GPU."""
    import torch

    lora = LoraConfig(rank=a.rank, alpha=2.0 * a.rank, lr=a.lr)
    opt = adam(pm, lora)
    dev = next(pm.parameters()).device
    rng = np.random.default_rng(3)
    ts = []
    torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(a.warmup + a.repeat):
            x = torch.from_numpy(rng.integers(0, vocab, size=(B, S))).to(dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = pm(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= a.warmup:
                ts.append(time.perf_counter() - t)
    except torch.OutOfMemoryError as e:
        return {"kind": "peft", "batch": B, "seq": S, "step_s": float("nan"), "error": str(e)[:120]}
    row = {"kind": "peft", "batch": B, "seq": S, "step_s": float(np.median(ts)),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "times_s": json.dumps([round(x, 3) for x in ts])}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="7b", help="a preset of turnip.models.LLAMA")
    ap.add_argument("--layers", type=int, default=None, help="first N decoder layers only")
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--rows", nargs="+", default=["1:1024:16GiB"], metavar="B:S:BUDGET")
    ap.add_argument("--policies", nargs="+", default=["nondet", "det"])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--checkpoint", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--resident", default="auto")
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="compare the first step with PyTorch + PEFT")
    ap.add_argument("--check-fp32", action="store_true",
                    help="also against PEFT on a float32 copy of the model (and PEFT itself against it)")
    ap.add_argument("--peft", action="store_true", help="time PyTorch + PEFT with gradient checkpointing")
    ap.add_argument("--no-hf", action="store_true", help="random turnip weights, no PyTorch model (large models)")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="turnip's backend (cpu: smoke tests)")
    ap.add_argument("--out", type=Path, help="write OUT.csv and OUT.md")
    a = ap.parse_args(argv)
    from turnip.models import LLAMA

    cfg = LLAMA[a.size]
    rows: list[dict] = []
    pm = sd = None
    pms: dict = {}
    if not a.no_hf:
        import torch

        tdt = getattr(torch, TORCH_DTYPE[a.dtype])
        model = random_llama(hf_config(cfg, 8192, a.layers), 0, tdt)
        model.config.use_cache = False
        sd = {k: v for k, v in model.state_dict().items()}
        lora = LoraConfig(rank=a.rank, alpha=2.0 * a.rank, lr=a.lr)
        pc = __import__("peft").LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
                                           target_modules=sorted({HF_MODULE[m].split(".")[1] for m in lora.targets}))
        if a.peft:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        pm = __import__("peft").get_peft_model(model, pc)
        pms[a.dtype] = pm
        if a.check_fp32 and a.dtype != "fp32":
            from transformers import LlamaForCausalLM

            torch.set_default_dtype(torch.float32)
            with torch.device("cuda"):
                m32 = LlamaForCausalLM(hf_config(cfg, 8192, a.layers))
            m32.load_state_dict({k: v.float() for k, v in sd.items()})
            m32.config.use_cache = False
            pms["fp32"] = __import__("peft").get_peft_model(m32, pc)
    done_peft = set()
    for spec in a.rows:
        b, s_, budget = spec.split(":")
        B, S = int(b), int(s_)
        if a.peft and (B, S) not in done_peft:
            done_peft.add((B, S))
            rows.append(peft_time(a, pm, B, S, cfg.vocab))
        rows += turnip_rows(a, cfg, sd, B, S, budget, pms if a.check else None)
    if a.out:
        write_rows(a.out, rows, a)
    return 0


def write_rows(out: Path, rows: list[dict], a) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    peft = {(r["batch"], r["seq"]): r["step_s"] for r in rows if r["kind"] == "peft"}
    head = ("| batch x seq | budget | policy | turnip step (s) | makespan (s) | bound (s) | PEFT+ckpt (s) | "
            "turnip/PEFT |")
    lines = [f"# LoRA training step: turnip vs PyTorch + PEFT ({a.size}, {a.dtype}, rank {a.rank})", "",
             "command: `python benchmarks/lora_peft.py " + " ".join(sys.argv[1:]) + "`", "", head,
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["kind"] != "turnip":
            continue
        p = peft.get((r["batch"], r["seq"]), float("nan"))
        lines.append(f"| {r['batch']} x {r['seq']} | {r['budget']} | {r['policy']} | {r['step_s']:.3f} | "
                     f"{r['makespan_s']:.3f} | {r['lower_bound_s']:.3f} | {p:.3f} | {r['step_s'] / p:.2f} |")
    for r in rows:
        if r["kind"] == "check":
            lines.append(f"\ncheck {r['batch']} x {r['seq']}: {r['subject']} against {r['reference']}: loss "
                         f"{r['loss']:.5f} vs "
                         f"{r['peft_loss']:.5f}; gradient rel. err. max {r['grad_rel_err_max']:.2e} ({r['worst']}), "
                         f"median {r['grad_rel_err_median']:.2e}")  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
