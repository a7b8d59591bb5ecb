"""The paper's experiment at its scale: LLaMA-65B on one server of several GPUs with too little memory on
each, turnip against Hugging Face Accelerate, every row in one session.

Rows (defaults: the paper's setting on 4 GPUs):
  turnip prefill   each ``--prompts`` (SEQ or SEQxBATCH) under each ``--budgets`` (per GPU), nondet and det
                   (``benchmarks/multi_gpu.py``'s rows: random fp16 weights, the split ``--splits``)
  turnip LoRA      ``--lora`` (BATCHxSEQ:BUDGET; rank 16 on q, k, v and the FFN), `turnip train` in a subprocess
  Accelerate       ``dispatch_model`` over the GPUs with ``max_memory`` = each budget per GPU and the rest of the
                   weights in CPU memory (Accelerate's offload: each layer's weights copied in when it runs), and
                   with no limit (every layer on some GPU, balanced over them: its pipeline), same shapes, random
                   fp16 weights, loaded once per budget and timed on every prompt; medians of ``--repeat`` after
                   ``--warmup``; a row that does not fit says so
  PEFT             ``--peft`` (BATCHxSEQ): a LoRA step (the same adapters, Adam, gradient checkpointing) of PyTorch +
                   PEFT on Accelerate's pipeline with no limit, median seconds per step after the first
  DeepSpeed        ``--deepspeed``: ZeRO-Inference (``benchmarks/zero_inference.py`` under torchrun: parameters
                   partitioned over the GPUs and offloaded to pinned CPU memory, each GPU its own prompt)
Results: ``<out>/paper_scale<tag>.csv`` and a table with each turnip row's speed-up over Accelerate at the
same budget.

    PYTHONPATH=. python benchmarks/paper_scale.py --gpus 4 --out res/           # everything (~30 min on 4 H100s)
    PYTHONPATH=. python benchmarks/paper_scale.py --no-turnip --prompts 4096 --budgets 30GiB   # one baseline
    PYTHONPATH=. python benchmarks/paper_scale.py --no-turnip --no-accelerate --lora --peft 8x1024 --deepspeed
    python benchmarks/paper_scale.py --model llama-tiny --gpus 0 --no-turnip --prompts 64      # CPU smoke run

Accelerate needs torch, transformers and accelerate (the GPU image has them); PEFT needs peft; DeepSpeed needs
deepspeed (see ``zero_inference.py``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
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
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        model = LlamaForCausalLM(cfg)
    if budget_nbytes is None and gpus:
        # no limit: the weights balanced over the GPUs (Accelerate's own split; filling each GPU in turn up to
        # 64 GiB left a 4K prompt of LLaMA-65B out of memory on GPU 0)
        max_memory = get_balanced_memory(model, max_memory={g: 64 * GiB for g in range(gpus)}, dtype=torch.float16,
                                         no_split_module_classes=["LlamaDecoderLayer"])  # fmt: skip
    else:
        max_memory = {g: budget_nbytes for g in range(gpus)}
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


class AccelerateModel:
    """Accelerate's dispatched model at one budget per GPU (``none``: no limit), loaded once (random weights) and
    timed on each prompt: ``row(seq, batch)``; ``close`` frees it. A load that fails leaves ``error`` set and
    every row saying so."""

    def __init__(self, a, cfg, budget: str):
        import torch

        from turnip.compile import parse_nbytes

        self.a, self.cfg, self.budget, self.model, self.error, self.info = a, cfg, budget, None, None, {}
        t0 = time.perf_counter()
        try:
            self.model, on_cpu, units = random_offloaded_llama(cfg, a.gpus, None if budget == "none" else
                                                               parse_nbytes(budget), a.seed)  # fmt: skip
        except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
            self.error = f"{type(e).__name__}: {str(e)[:200]}"
            return
        # one load serves every prompt at this budget
        self.info = {"load_s": round(time.perf_counter() - t0, 1), "modules_on_cpu": on_cpu, "modules": units}

    def row(self, seq: int, batch: int) -> dict:
        """Median prefill time (ms) of a prompt of ``seq`` tokens x ``batch``: hidden states of every token, as
        turnip's rows compute them (a prompt that runs out of GPU memory says so; the model stays)."""
        import torch

        a = self.a
        row = {"system": "accelerate", "seq": seq, "batch": batch, "budget": self.budget, "gpus": a.gpus} | self.info
        if self.error:
            return row | {"error": self.error}
        dev = "cuda:0" if a.gpus else "cpu"
        gen = torch.Generator().manual_seed(a.seed)
        ids = torch.randint(0, self.cfg.vocab_size, (batch, seq), generator=gen).to(dev)
        sync = torch.cuda.synchronize if a.gpus else (lambda: None)
        ts = []
        try:
            with torch.no_grad():
                for i in range(a.warmup + a.repeat):
                    sync()
                    t = time.perf_counter()
                    self.model.model(input_ids=ids, use_cache=False)
                    sync()
                    if i >= a.warmup:
                        ts.append((time.perf_counter() - t) * 1e3)
        except torch.cuda.OutOfMemoryError as e:
            return row | {"error": f"out of GPU memory: {str(e)[:160]}"}
        finally:
            if a.gpus:
                torch.cuda.empty_cache()
        return row | {"ms_median": statistics.median(ts), "ms_min": min(ts)}

    def close(self) -> None:
        import torch

        self.model = None
        if self.a.gpus:
            torch.cuda.empty_cache()


def peft_row(a, cfg, seq: int, batch: int) -> dict:
    """Median seconds per LoRA step (rank ``a.rank`` on q, k, v and the FFN, Adam, gradient checkpointing) of
    PyTorch + PEFT on Accelerate's pipeline over ``a.gpus`` GPUs with no limit: each GPU its run of layers."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    row = {"system": "peft", "workload": "lora", "seq": seq, "batch": batch, "budget": "none", "gpus": a.gpus}
    acc = AccelerateModel(a, cfg, "none")  # the pipeline without a limit, loaded as the prefill rows' is
    if acc.error:
        return row | {"error": acc.error}
    model, acc.model = acc.model, None
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    pm = get_peft_model(model, PeftLora(r=a.rank, lora_alpha=2 * a.rank, lora_dropout=0.0, bias="none",
                                        target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                                        "down_proj"]))  # fmt: skip
    pm.train()
    opt = torch.optim.Adam([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    row |= acc.info
    dev = "cuda:0" if a.gpus else "cpu"
    gen = torch.Generator().manual_seed(a.seed)
    sync = torch.cuda.synchronize if a.gpus else (lambda: None)
    ts, losses = [], []
    try:
        for i in range(1 + a.steps):
            ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen).to(dev)
            sync()
            t = time.perf_counter()
            loss = pm(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            losses.append(round(float(loss.detach()), 4))
            if i >= 1:  # the first step warms up
                ts.append(time.perf_counter() - t)
            print(f"peft step {i}: {time.perf_counter() - t:.2f} s, loss {losses[-1]}", flush=True)
    except torch.cuda.OutOfMemoryError as e:
        return row | {"error": f"out of GPU memory: {str(e)[:160]}"}
    finally:
        del pm, model, opt
        if a.gpus:
            torch.cuda.empty_cache()
    return row | {"ms_median": statistics.median(ts) * 1e3, "ms_min": min(ts) * 1e3,
                  "losses": " ".join(map(str, losses))}


def deepspeed_rows(a, prompts: list[str], out: Path) -> list[dict]:
    """``zero_inference.py`` under torchrun over ``a.gpus`` GPUs, one process each: its rows (or one saying
    why there are none)."""
    csv_path = out / f"zero_inference{a.tag}.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={max(a.gpus, 1)}",
           str(Path(__file__).with_name("zero_inference.py")), "--model", a.model, "--prompts", *prompts,
           "--warmup", str(a.warmup), "--repeat", str(a.repeat), "--seed", str(a.seed),
           "--out", str(csv_path)]  # fmt: skip
    if not a.gpus:
        cmd += ["--dtype", "bf16", "--no-pin"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    rows = list(csv.DictReader(open(csv_path))) if csv_path.exists() else []
    if p.returncode or not rows:
        err = [ln for ln in (p.stderr + p.stdout).splitlines() if "Error" in ln or "error" in ln][-3:]
        rows.append({"system": "deepspeed-zero-inference", "rc": p.returncode,
                     "seconds": round(time.perf_counter() - t0), "error": " | ".join(err)[-400:] or "no rows"})
    return rows


def print_tables(rows: list[dict]) -> None:
    """Markdown tables: each turnip prefill row against Accelerate at its budget and DeepSpeed ZeRO-Inference
    at its prompt (which takes no budget), each turnip LoRA row against PEFT at its batch."""

    def ms(r):
        v = r.get("ms_median")
        return float(v) if v not in (None, "") else None

    key = lambda r: (int(r["seq"]), int(r["batch"]))  # noqa: E731
    acc = {(*key(r), r["budget"]): ms(r) for r in rows if r.get("system") == "accelerate" and "seq" in r}
    ds = {key(r): ms(r) for r in rows if r.get("system") == "deepspeed-zero-inference" and "seq" in r}
    peft = {key(r): ms(r) for r in rows if r.get("system") == "peft"}
    x = lambda base, t: f"{base / t:.2f}x" if base else "-"  # noqa: E731
    r1 = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print("\n| prompt | batch | budget per GPU | policy | turnip ms | Accelerate ms | speed-up | ZeRO-Inference ms "
          "| speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("system") != "turnip" or r.get("workload") != "prefill" or not ms(r):
            continue
        t, a, d = ms(r), acc.get((*key(r), r["budget"])), ds.get(key(r))
        print(f"| {r['seq']} | {r['batch']} | {r['budget']} | {r['policy']} | {t:.1f} | {r1(a)} | {x(a, t)} | "
              f"{r1(d)} | {x(d, t)} |")
    lora = [r for r in rows if r.get("system") == "turnip" and r.get("workload") == "lora" and ms(r)]
    if lora:
        print("\n| LoRA batch | turnip ms per step | PEFT ms per step | speed-up |")
        print("|---|---|---|---|")
        for r in lora:
            p = peft.get((int(r["seq"]), int(r["batch"])))
            print(f"| {r['batch']} x {r['seq']} | {ms(r):.1f} | {r1(p)} | {x(p, ms(r))} |")


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
    ap.add_argument("--peft", nargs="*", default=[], help="PEFT LoRA rows on Accelerate's pipeline, BATCHxSEQ")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (PEFT rows)")
    ap.add_argument("--deepspeed", action="store_true", help="DeepSpeed ZeRO-Inference rows for --prompts")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="LoRA steps (the first not timed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="auto",
                    help="profile of the bounds (auto: the shipped one of the GPU, h100-calibrated without one)")
    ap.add_argument("--timeout", type=float, default=900, help="per LoRA subprocess")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    from turnip.runtime.driver import machine_profile

    a.profile = machine_profile(a.profile, "cuda" if a.gpus else "cpu", fallback="h100-calibrated")
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
    longest = max(seq * batch for seq, batch in map(shape, a.prompts))
    for budget in a.budgets:
        acc = None  # Accelerate's model at this budget, loaded at the first prompt, kept for the others
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
                write_csv(path, rows)  # kept should the baseline's row outlast the time given
            if not a.no_accelerate:
                acc = acc or AccelerateModel(a, hf_config(s, longest), budget)
                rows.append(acc.row(seq, batch))
            if rows:
                write_csv(path, rows)
                print(rows[-1], flush=True)
        if acc is not None:
            acc.close()
    if not a.no_accelerate and not a.no_limit_baseline:
        acc = AccelerateModel(a, hf_config(s, longest), "none")
        for p in a.prompts:
            seq, batch = shape(p)
            rows.append(acc.row(seq, batch))
            write_csv(path, rows)
            print(rows[-1], flush=True)
        acc.close()
    for spec in a.peft:
        batch, seq = map(int, spec.split("x"))
        rows.append(peft_row(a, hf_config(s, seq), seq, batch))
        write_csv(path, rows)
        print(rows[-1], flush=True)
    if a.deepspeed:
        rows += deepspeed_rows(a, a.prompts, out)
        write_csv(path, rows)
        print(rows[-1], flush=True)
    if not a.no_turnip:
        for spec in a.lora:
            for split in a.splits:
                rows.append(lora_row(mg_args, spec, a.gpus, split) | {"system": "turnip"})
                write_csv(path, rows)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
