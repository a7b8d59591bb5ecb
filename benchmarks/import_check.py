"""The torch.export importer on a GPU: imported models against PyTorch eager, and the imported LLaMA against
the LLaMA builder's plan of the same shape, all measured in this process.

Per model of ``--models`` (an MLP stack, GPT-2, a ViT and a LLaMA from transformers; random weights,
seeded; the ``tiny`` sizes are ``tests/test_torch_import.py``'s, ``small`` ones of hidden 1024, 4 layers,
1024 tokens (four 224x224 images for the ViT) so that kernels dominate) and per budget of ``--budget``:
  1. ``from_torch`` (export, lower, plan under the budget on ``--gpus`` GPUs, in ``--dtype``); the plan is
     verified (``imp.verify() == []``, else the row fails);
  2. a warm-up run, then ``--repeat`` timed runs on ``--backend``: the plan's makespan
     (``stats["last_makespan_ns"]``) and the wall time of ``Imported.run`` (loading the plan, writing its
     inputs, running it, reading its outputs), medians; every output's relative error (norm ratio) against
     the module's own, run by PyTorch on the GPU in the same dtype (on the CPU in float32 where there is no
     GPU); it passes under 2e-5 (fp32), 1e-2 (fp16), 5e-2 (bf16);
  3. the same plan in a session (``Imported.session``: loaded and its constants written once, resident ones on
     the GPU under ``--resident``): a warm-up call, then ``--repeat`` calls, each writing only the inputs;
     the median makespan (``session_ms``) and call time (``session_wall_ms``: inputs written, run, outputs read);
     ``--trace-dir`` keeps each row's last call as a Chrome trace;
  4. PyTorch eager, same forward, same device and dtype, ``torch.no_grad()``: the median of ``--repeat``
     after a warm-up (``torch.cuda.synchronize`` around each), and turnip's makespans / torch's time
     (``turnip_over_torch``, ``session_over_torch``);
  5. LLaMA only: the model saved with ``save_pretrained`` and compiled by the LLaMA builder as the importer
     test does (``make_taskgraph(dir, head="all")``, ``build_with_resident``), run the same way (loaded,
     checkpoint streamed in, run, logits read, per run): its makespan, imported / builder (the goal: at most
     1.2x), and the relative error between the two plans' logits.
A table is printed and ``import_check.csv`` written to ``--out``, one row per model and budget; a model that
raises is a row with the error and the script goes on. Exit status 0 only if every row passed its check.

    PYTHONPATH=. python benchmarks/import_check.py                             # all four, small, fp16, 8GiB
    PYTHONPATH=. python benchmarks/import_check.py --budget 8GiB 64MiB --out benchmarks/results/import
    PYTHONPATH=. python benchmarks/import_check.py --backend cpu --size tiny --dtype fp32 --budget 256KiB \\
        --repeat 1 --out /tmp/ic                                                # the script itself, no GPU
"""

from __future__ import annotations

import argparse
import copy
import csv
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

MODELS = ("mlp", "gpt2", "vit", "llama")
TOL = {"fp32": 2e-5, "fp16": 1e-2, "bf16": 5e-2}
TORCH_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_IDS = dict(use_cache=False, bos_token_id=0, eos_token_id=0)
SIZES = {
    "mlp": {"tiny": dict(d_in=24, d=64, f=160, layers=2, d_out=10, rows=40),
            "small": dict(d_in=1024, d=1024, f=4096, layers=4, d_out=1024, rows=1024)},
    "gpt2": {"tiny": dict(cfg=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64, **_IDS), seq=24),
             "small": dict(cfg=dict(n_embd=1024, n_layer=4, n_head=16, vocab_size=32000, n_positions=1024, **_IDS),
                           seq=1024)},
    "vit": {"tiny": dict(cfg=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                  image_size=32, patch_size=8, num_labels=10), images=2),
            "small": dict(cfg=dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                                   intermediate_size=4096, image_size=224, patch_size=16, num_labels=1000), images=4)},
    "llama": {"tiny": dict(cfg=dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **_IDS), seq=32),
              "small": dict(cfg=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                     num_attention_heads=16, num_key_value_heads=8, pad_token_id=0, **_IDS), seq=1024)},
}  # fmt: skip
HF = {"gpt2": ("GPT2", "GPT2LMHeadModel"), "vit": ("ViT", "ViTForImageClassification"),
      "llama": ("Llama", "LlamaForCausalLM")}  # fmt: skip
COLUMNS = ["model", "size", "dtype", "budget", "vertices", "offloads", "verify_errors", "max_rel_err", "passed",
           "turnip_ms", "turnip_wall_ms", "torch_ms", "turnip_over_torch", "resident_nbytes", "session_open_s",
           "session_ms", "session_wall_ms", "session_phases_ms", "session_over_torch", "builder_vertices", "builder_ms",
           "builder_wall_ms", "imported_over_builder", "builder_rel_err", "reference", "error"]  # fmt: skip


def make(name: str, size: str, seed: int):
    """The module (CPU, float32, eval) and its example inputs, seeded."""
    import torch

    s = SIZES[name][size]
    torch.manual_seed(seed)
    if name == "mlp":
        from torch import nn

        class Block(nn.Module):  # the test's residual MLP block with a square projection
            def __init__(self, d, f):
                super().__init__()
                self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(f, d)
                self.mix = nn.Linear(d, d, bias=False)

            def forward(self, x):
                h = self.down(nn.functional.gelu(self.up(self.norm(x))))
                return x + h + self.mix(torch.relu(x)) * 0.5

        blocks = [Block(s["d"], s["f"]) for _ in range(s["layers"])]
        m = nn.Sequential(nn.Linear(s["d_in"], s["d"]), *blocks, nn.Linear(s["d"], s["d_out"]))
        return m.eval(), (torch.randn(s["rows"], s["d_in"]),)
    import transformers

    arch, cls = HF[name]
    cfg = getattr(transformers, arch + "Config")(**s["cfg"])
    cfg._attn_implementation = "sdpa"
    m = getattr(transformers, cls)(cfg).eval()
    if name == "vit":
        return m, (torch.randn(s["images"], 3, cfg.image_size, cfg.image_size),)
    return m, (torch.randint(0, cfg.vocab_size, (1, s["seq"])),)


def torch_reference(m, inputs, dtype: str, repeat: int) -> tuple[list[np.ndarray], float, str]:
    """The module's outputs (float32 numpy) and its eager time in ms (median of ``repeat`` after a warm-up),
    run on a copy on the GPU in ``dtype``, or on the CPU in float32 without one."""
    import torch

    cuda = torch.cuda.is_available()
    dev, tdt = ("cuda", getattr(torch, TORCH_DTYPE[dtype])) if cuda else ("cpu", torch.float32)
    ref = copy.deepcopy(m).to(dev, tdt)
    xs = tuple(x.to(dev, tdt) if x.is_floating_point() else x.to(dev) for x in inputs)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ts = []
    with torch.no_grad():
        for _ in range(1 + repeat):
            sync()
            t0 = time.perf_counter()
            out = ref(*xs)
            sync()
            ts.append(time.perf_counter() - t0)
    outs = [out] if isinstance(out, torch.Tensor) else out.values() if hasattr(out, "values") else out
    want = [o.float().cpu().numpy() for o in outs]
    del ref, out, outs
    if cuda:
        torch.cuda.empty_cache()
    return want, float(np.median(ts[1:])) * 1e3, f"torch {dev} {str(tdt).removeprefix('torch.')}"


def rel(got, want) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - want) / np.linalg.norm(want))


def run_imported(row: dict, m, inputs, want, budget: str, a) -> list[np.ndarray]:
    """Compile, verify, run (warm-up + ``--repeat``) and compare; fills ``row``; the outputs."""
    from turnip.torchimport.api import from_torch

    imp = from_torch(m, inputs, budget=budget, gpus=a.gpus, dtype=a.dtype, name=row["model"], resident=a.resident)
    errs = imp.verify()
    row.update(vertices=imp.mg.n, offloads=int(imp.mg.stats["n_offload"]), verify_errors=len(errs))
    if errs:
        raise RuntimeError(f"the imported plan fails verification: {len(errs)} error(s), first: {errs[0]}")
    ms, wall = [], []
    for i in range(1 + a.repeat):
        got = imp.run(*inputs, backend=a.backend, policy=a.policy, seed=i)
        ms.append(imp.stats["last_makespan_ns"] / 1e6)
        wall.append(imp.stats["last_run_s"] * 1e3)
    shapes = [(g.shape, w.shape) for g, w in zip(got, want, strict=True) if g.shape != w.shape]
    if shapes:
        raise RuntimeError(f"output shapes differ from torch's: {shapes}")
    row.update(turnip_ms=float(np.median(ms[1:])), turnip_wall_ms=float(np.median(wall[1:])),
               max_rel_err=max(rel(g, w) for g, w in zip(got, want, strict=True)))  # fmt: skip
    row["passed"] = row["max_rel_err"] < TOL[a.dtype]
    row["turnip_over_torch"] = row["turnip_ms"] / row["torch_ms"]
    with imp.session(a.backend, a.policy) as s:  # loaded once: calls write only their inputs
        ms, wall, phases = [], [], []
        for i in range(1 + a.repeat):
            again = s(*inputs, seed=i)
            ms.append(s.stats["last_makespan_ns"] / 1e6)
            wall.append(s.stats["last_call_s"] * 1e3)
            phases.append(s.stats["last_phases_s"])
        if a.trace_dir:
            Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
            meta = {"model": row["model"], "budget": budget, "dtype": a.dtype, "start_events": False}
            s.last.trace(imp.mg, meta).write_chrome(Path(a.trace_dir) / f"{row['model']}_{budget}.json")
    row.update(session_open_s=s.stats["open_s"], session_ms=float(np.median(ms[1:])),
               session_wall_ms=float(np.median(wall[1:])))  # fmt: skip
    row["session_phases_ms"] = " ".join(f"{k}={np.median([p[k] for p in phases[1:]]) * 1e3:.2f}" for k in phases[0])
    row["resident_nbytes"] = int(imp.mg.out_nbytes[imp.mg.preloaded()].sum())
    row["session_over_torch"] = row["session_ms"] / row["torch_ms"]
    err = max(rel(g, w) for g, w in zip(again, want, strict=True))
    row["max_rel_err"] = max(row["max_rel_err"], err)
    row["passed"] = row["max_rel_err"] < TOL[a.dtype]
    return got


def run_builder(row: dict, d: Path, ids, logits: np.ndarray, budget: str, a) -> None:
    """The LLaMA builder's plan of the saved model ``d`` for the same prompt, budget and ``--resident``, run as
    ``Imported.run`` runs (load, write the checkpoint's inputs, run, read), timed the same way."""
    from turnip.checkpoint import Checkpoint
    from turnip.compile import build_with_resident, make_taskgraph, parse_nbytes
    from turnip.memgraph.interp import assemble
    from turnip.memgraph.verify import verify
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import write_streaming

    b = parse_nbytes(budget)
    tg = make_taskgraph(str(d), int(ids.shape[1]), a.gpus, a.dtype, budget_nbytes=b, head="all")
    mg = build_with_resident(tg, b, resident=a.resident)  # the imported plan's resident rule: like for like
    row["builder_vertices"] = mg.n
    if errs := verify(mg, tg):
        raise RuntimeError(f"the builder's plan fails verification: {len(errs)} error(s), first: {errs[0]}")
    ms, wall = [], []
    for i in range(1 + a.repeat):
        t0 = time.perf_counter()
        with open_backend(a.backend, mg, 3) as be:
            write_streaming(be, tg, Checkpoint(d).iter_inputs(tg, ids=ids[0].numpy()))
            res = execute(mg, be, a.policy, 3, seed=i)
            want = assemble(tg, be.read_outputs(), "logits")
        ms.append(res.makespan_ns / 1e6)
        wall.append((time.perf_counter() - t0) * 1e3)
    row.update(builder_ms=float(np.median(ms[1:])), builder_wall_ms=float(np.median(wall[1:])),
               builder_rel_err=rel(logits.reshape(want.shape), want))  # fmt: skip
    row["imported_over_builder"] = row["turnip_ms"] / row["builder_ms"]


def check_model(name: str, a) -> list[dict]:
    """One row per budget of model ``name``; an exception is its row's ``error``."""
    rows = [dict(model=name, size=a.size, dtype=a.dtype, budget=b, passed=False) for b in a.budget]
    with tempfile.TemporaryDirectory(prefix="import_check_") as tmp:
        try:
            m, inputs = make(name, a.size, a.seed)
            if name == "llama":
                m.save_pretrained(tmp, safe_serialization=True)
            want, torch_ms, ref = torch_reference(m, inputs, a.dtype, a.repeat)
        except Exception as e:
            traceback.print_exc()
            return [r | {"error": f"{type(e).__name__}: {e}"} for r in rows]
        for row in rows:
            row.update(torch_ms=torch_ms, reference=ref)
            try:
                got = run_imported(row, m, inputs, want, row["budget"], a)
                if name == "llama":
                    run_builder(row, Path(tmp), inputs[0], got[0], row["budget"], a)
            except Exception as e:
                traceback.print_exc()
                row.update(passed=False, error=f"{type(e).__name__}: {e}")
            print(f"{name} {row['budget']}: done", flush=True)
    return rows


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def table(rows: list[dict]) -> str:
    cols = ["model", "size", "dtype", "budget", "vertices", "verify_errors", "max_rel_err", "passed", "turnip_ms",
            "session_ms", "session_wall_ms", "torch_ms", "session_over_torch", "builder_ms",
            "imported_over_builder"]  # fmt: skip
    cells = [cols] + [[fmt(r.get(c)) for c in cols] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(x.rjust(n) for x, n in zip(c, w, strict=True)) for c in cells]
    lines += [f"{r['model']} {r['budget']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="models to check, in order")
    ap.add_argument("--size", default="small", choices=["small", "tiny"],
                    help="small: hidden 1024, 4 layers, 1024 tokens (a GPU's); tiny: the CPU tests'")  # fmt: skip
    ap.add_argument("--dtype", default="fp16", choices=list(TOL), help="turnip's compute dtype, and torch's on a GPU")
    ap.add_argument("--budget", nargs="+", default=["8GiB"],
                    help="budgets per GPU, a row each: 8GiB holds any model, 64MiB is tight")  # fmt: skip
    ap.add_argument("--gpus", type=int, default=1, help="GPUs the imported and builder plans use")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="where turnip runs (cpu: no GPU)")
    ap.add_argument("--policy", default="nondet", help="the runtime's dispatch policy (turnip.runtime.execute)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs after one warm-up, turnip's and torch's")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    ap.add_argument("--resident", default="auto", help="from_torch's resident input bytes per GPU (auto, 0, 1GiB...)")
    ap.add_argument("--trace-dir", default="", help="write the last session call of each row as a Chrome trace here")
    ap.add_argument("--out", default="benchmarks/results", help="directory of import_check.csv")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    rows = [r for name in a.models for r in check_model(name, a)]
    print(table(rows))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "import_check.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows({c: r.get(c, "") for c in COLUMNS} for r in rows)
    print(f"wrote {out / 'import_check.csv'}")
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
