"""Time every kernel at LLaMA-7B tile sizes on a GPU; print and write achieved rate vs ceilings.

For each op: median device time of single launches (CUDA events around each launch, the GPU kept busy
by a preceding GEMM so host launch cost does not show), host time per launch, achieved TFLOP/s
(contractions) or GB/s (bytes of inputs + output, each once), and the fraction of the ceilings measured
in the same run (fp16/fp32 cuBLAS GEMM 8192^3, device-to-device copy counted read + write) and of the
FACTS.md ceilings. Contractions are also timed through the numba GEMM (numba/cuBLAS time ratio), and
every op with a PyTorch equivalent is timed in PyTorch on the same stream and buffers. The cases include
grouped-query attention, LLaMA-3 rope scaling and row slices (LLaMA-3-8B head counts); ``--dtypes`` may
add bf16 (its GEMM ceiling is then measured too).

    PYTHONPATH=. python benchmarks/kernel_speed.py --tokens 2048 --fast --dtypes fp16,bf16 --out kernels.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time

import numpy as np

from cuda_kernels._numba import cuda, to_device
from cuda_kernels.kernels import prepare
from tests.cuda_kernels.cases import FP32_ONLY, NP_DTYPE, Case, for_dtype, llama_cases, make_inputs, vertex_dtype
from turnip import ops

FACTS = {"gemm_fp16_tflops": 740.0, "gemm_bf16_tflops": 740.0, "gemm_fp32_tflops": 52.0, "hbm_copy_gbps": 2900.0}
L2_BYTES = 200 << 20  # rotate input sets until one pass touches more than this


class Bench:
    def __init__(self, reps: int, warmup: int):
        self.c = cuda()
        self.stream = self.c.stream()
        self.reps, self.warmup = reps, warmup
        self._pad = None

    def set_pad(self, fn, dur_us: float):
        self._pad, self._pad_us = fn, max(dur_us, 1.0)

    def time(self, fn, n_sets: int = 1) -> tuple[float, float]:
        """(median device us per call, host us per call); fn(stream, set_index)."""
        s, c = self.stream, self.c
        for i in range(self.warmup):
            fn(s, i % n_sets)
        s.synchronize()
        host_t0 = time.perf_counter()
        for i in range(self.reps):
            fn(s, i % n_sets)
        s.synchronize()
        host_us = (time.perf_counter() - host_t0) / self.reps * 1e6
        if self._pad is not None:  # keep the GPU behind the host so events time only the kernel
            for _ in range(min(50, max(1, math.ceil(self.reps * (host_us + 10) / self._pad_us)))):
                self._pad(s)
        evs = [(c.event(), c.event()) for _ in range(self.reps)]
        for i, (e0, e1) in enumerate(evs):
            e0.record(s)
            fn(s, i % n_sets)
            e1.record(s)
        s.synchronize()
        dev = [e0.elapsed_time(e1) * 1e3 for e0, e1 in evs]
        return max(statistics.median(dev), 1e-3), host_us  # the simulator reports 0


def nbytes_moved(case: Case, dtype: str) -> int:
    isz = np.dtype(NP_DTYPE[dtype]).itemsize
    total = 0
    for kind, shp in zip(case.kinds or ("normal",) * len(case.in_shapes), case.in_shapes, strict=True):
        n = int(np.prod(shp))
        if case.op == "embed" and not kind.startswith("ids"):
            n = case.out_shape[0] * case.out_shape[1]  # rows gathered
        if case.op == "rows":
            n = int(np.prod(case.out_shape))  # the slice only
        total += n * (4 if kind.startswith("ids") or case.op == "mix" else isz)
    return total + int(np.prod(case.out_shape)) * (4 if case.op == "mix" else isz)


def torch_fn(case: Case, torch):
    """A PyTorch version of the op on (out, ins) torch tensors, or None."""
    F = torch.nn.functional
    p = case.params
    if case.op == "einsum":
        return lambda o, x: o.copy_(torch.einsum(p["subscripts"], x[0], x[1]))
    if case.op == "sdpa" and not p.get("partial"):
        tk = p.get("tk", case.in_shapes[1][0])
        causal = p["q_off"] - p["k_off"] < tk - 1
        gqa = len(case.in_shapes[0]) == 4 or case.in_shapes[0][1] != case.in_shapes[1][1]
        kw = {"enable_gqa": True} if gqa else {}

        def sdpa(o, x):
            q = x[0].reshape(x[0].shape[0], -1, x[0].shape[-1])
            q, k, v = (y.permute(1, 0, 2)[None] for y in (q, x[1][:tk], x[2][:tk]))
            mask = None
            if causal:  # bottom-right: the key range ends where the query block ends
                mask = torch.ones(q.shape[2], tk, dtype=torch.bool, device=o.device).tril_(tk - q.shape[2])
            r = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p["scale"], **kw)
            o.copy_(r[0].permute(1, 0, 2).reshape(o.shape))

        return sdpa
    ops = {
        "concat": lambda o, x: torch.cat(x, 0, out=o),
        "rows": lambda o, x: o.copy_(x[0][p["start"] : p["stop"]]),
        "add_n": lambda o, x: torch.add(x[0], x[1], out=o),
        "mul": lambda o, x: torch.mul(x[0], x[1], out=o),
        "scale": lambda o, x: torch.mul(x[0], p["alpha"], out=o),
        "silu": lambda o, x: o.copy_(F.silu(x[0])),
        "silu_mul": lambda o, x: torch.mul(F.silu(x[0]), x[1], out=o),
        "rmsnorm": lambda o, x: o.copy_(F.rms_norm(x[0], (x[0].shape[-1],), x[1], p["eps"])),
        "embed": lambda o, x: o.copy_(F.embedding(x[0], x[1])),
        "sum_into": lambda o, x: o.add_(x[1]),
    }
    return ops.get(case.op)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="token tile (LLaMA-7B 4K prefill: 2048)")
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--fast", action="store_true", help="the CUDA C++ memory-bound kernels where they cover an op")
    ap.add_argument("--smoke", action="store_true", help="tiny widths and ceilings (checks the script only)")
    ap.add_argument("--out", required=True, help="CSV path")
    a = ap.parse_args(argv)
    c = cuda()
    b = Bench(a.reps, a.warmup)
    rng = np.random.default_rng()
    try:
        import torch

        torch_stream = torch.cuda.ExternalStream(int(b.stream.handle)) if not a.no_torch else None
    except Exception as e:  # noqa: BLE001
        print(f"torch unavailable: {e!r}")
        torch = torch_stream = None

    # ceilings measured in this run
    ceil = {}
    n16, n32, ncopy = (64, 64, 1 << 12) if a.smoke else (8192, 4096, 1 << 30)
    big = prepare("einsum", [(n16, n16)] * 2, (n16, n16), "fp16", {"subscripts": "td,df->tf"})
    bx = [c.to_device(rng.standard_normal((n16, n16), dtype=np.float32).astype(np.float16)) for _ in range(2)]
    bo = c.device_array((n16, n16), np.float16)
    t_big, _ = b.time(lambda s, i: big(s, bo, bx))
    ceil["fp16"] = 2 * n16**3 / t_big / 1e6
    if not a.smoke:
        b.set_pad(lambda s: big(s, bo, bx), t_big)
    f32 = prepare("einsum", [(n32, n32)] * 2, (n32, n32), "fp32", {"subscripts": "td,df->tf"})
    fx = [c.to_device(rng.standard_normal((n32, n32), dtype=np.float32)) for _ in range(2)]
    fo = c.device_array((n32, n32), np.float32)
    ceil["fp32"] = 2 * n32**3 / b.time(lambda s, i: f32(s, fo, fx))[0] / 1e6
    if "bf16" in a.dtypes.split(","):
        bf = NP_DTYPE["bf16"]
        g16 = prepare("einsum", [(n16, n16)] * 2, (n16, n16), "bf16", {"subscripts": "td,df->tf"})
        gx = [to_device(rng.standard_normal((n16, n16), dtype=np.float32).astype(bf)) for _ in range(2)]
        go = c.device_array((n16, n16), bf)
        ceil["bf16"] = 2 * n16**3 / b.time(lambda s, i: g16(s, go, gx))[0] / 1e6
        print(f"bf16 GEMM ceiling this run: {ceil['bf16']:.0f} TFLOP/s")
    src, dst = c.device_array(ncopy, np.uint8), c.device_array(ncopy, np.uint8)
    ceil["copy"] = 2 * ncopy / b.time(lambda s, i: dst.copy_to_device(src, stream=s))[0] / 1e3
    print(f"ceilings this run: fp16 GEMM {ceil['fp16']:.0f} TFLOP/s, fp32 GEMM {ceil['fp32']:.1f} TFLOP/s, "
          f"D2D copy {ceil['copy']:.0f} GB/s (FACTS: 740 / 52 / 2900)")

    rows = []
    for dtype in a.dtypes.split(","):
        cases = llama_cases(a.tokens, 16, 24, 2, 8, 50) if a.smoke else llama_cases(a.tokens)
        for case in cases:
            if case.op in FP32_ONLY and dtype != "fp32":
                continue
            try:
                rows.append(bench_case(b, for_dtype(case, dtype), dtype, rng, ceil, torch, torch_stream, a.fast))
                print(fmt(rows[-1]), flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on to the next op
                print(f"{case.name} {dtype}: FAILED {e!r}", file=sys.stderr, flush=True)
    with open(a.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\nceilings: fp16 GEMM {ceil['fp16']:.0f} TFLOP/s, fp32 GEMM {ceil['fp32']:.1f}, "
          f"copy {ceil['copy']:.0f} GB/s; tokens {a.tokens}")
    print("\n".join(fmt(r) for r in rows))
    return 0


def bench_case(b: Bench, case: Case, dtype: str, rng, ceil, torch, torch_stream, fast: bool = False) -> dict:
    c = b.c
    nbytes = nbytes_moved(case, dtype)
    n_sets = 1 if case.contraction else max(1, min(4, math.ceil(L2_BYTES / nbytes)))
    sets = []
    for _ in range(n_sets):
        xs = make_inputs(case, dtype, rng)
        ins = [to_device(x) for x in xs]
        out = ins[0] if case.op == "sum_into" else c.device_array(case.out_shape, NP_DTYPE[vertex_dtype(case, dtype)])
        sets.append((out, ins))
    lau = prepare(case.op, case.in_shapes, case.out_shape, vertex_dtype(case, dtype), case.params, fast=fast)
    us, host_us = b.time(lambda s, i: lau(s, sets[i][0], sets[i][1]), n_sets)
    flops = lau.flops or ops.flops(case.op, case.in_shapes, case.out_shape, case.params)
    row = dict(case=case.name, op=case.op, dtype=dtype, path=lau.path,
               shapes=" ".join("x".join(map(str, s)) for s in case.in_shapes) + " -> "
               + "x".join(map(str, case.out_shape)),
               median_us=round(us, 2), host_us_per_launch=round(host_us, 1), gbytes=round(nbytes / 1e9, 4),
               gflop=round(flops / 1e9, 2))
    if case.contraction or case.op == "sdpa":
        rate, ref, facts = flops / us / 1e6, ceil[dtype], FACTS[f"gemm_{dtype}_tflops"]
        row.update(achieved=round(rate, 1), unit="TFLOP/s", numba_us="", numba_over_cublas="")
        if case.contraction:
            nb = prepare(case.op, case.in_shapes, case.out_shape, dtype, case.params, gemm="numba")
            nus, _ = b.time(lambda s, i: nb(s, sets[0][0], sets[0][1]))
            row.update(numba_us=round(nus, 1), numba_over_cublas=round(nus / us, 1))
    else:
        rate, ref, facts = nbytes / us / 1e3, ceil["copy"], FACTS["hbm_copy_gbps"]
        row.update(achieved=round(rate, 0), unit="GB/s", numba_us="", numba_over_cublas="")
    row.update(frac_ceiling_run=round(rate / ref, 3), frac_ceiling_facts=round(rate / facts, 3))
    tf = torch_fn(case, torch) if torch is not None and torch_stream is not None else None
    row.update(torch_us="", torch_over_ours="")
    if tf is not None:
        tsets = [(_torch(torch, o), [_torch(torch, x) for x in ins]) for o, ins in sets]
        if case.op == "embed":
            tsets = [(o, [x[0].long(), x[1]]) for o, x in tsets]

        def run_torch(s, i):
            with torch.cuda.stream(torch_stream):
                tf(tsets[i][0], tsets[i][1])

        tus, _ = b.time(run_torch, n_sets)
        row.update(torch_us=round(tus, 1), torch_over_ours=round(tus / us, 2))
    return row


def _torch(torch, x):
    """A torch view of a numba device array (bf16 through its int16 bits: no bfloat16 typestr)."""
    if x.dtype == NP_DTYPE.get("bf16"):
        return torch.as_tensor(x.view(np.int16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(x, device="cuda")


def fmt(r: dict) -> str:
    extra = f"  numba/cuBLAS {r['numba_over_cublas']}x" if r.get("numba_over_cublas") != "" else ""
    tor = f"  torch/ours {r['torch_over_ours']}" if r.get("torch_over_ours") != "" else ""
    return (f"{r['case']:<12} {r['dtype']} {r['path']:<10} {r['median_us']:>9.1f} us"
            f"  host {r['host_us_per_launch']:>5.1f} us"
            f"  {r['achieved']:>7} {r['unit']:<7} {r['frac_ceiling_run']:.2f} of run ceiling"
            f" ({r['frac_ceiling_facts']:.2f} of FACTS){extra}{tor}")


if __name__ == "__main__":
    sys.exit(main())
