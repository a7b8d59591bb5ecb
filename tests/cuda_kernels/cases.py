"""Example instances of every op (tiny for the simulator, LLaMA-7B tiles for the GPU) and their inputs.

Shared by the kernel tests and ``benchmarks/kernel_speed.py``. ``make_inputs`` draws fresh random inputs
(never zeros); ``reference_f64`` evaluates the numpy reference in float64 (the references compute in
float32 by design; the checks compare kernels against float64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from unittest import mock

import numpy as np

from turnip import reference

NP_DTYPE = {"fp16": np.float16, "fp32": np.float32}


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    in_shapes: tuple
    out_shape: tuple
    params: dict = field(default_factory=dict)
    kinds: tuple = ()  # per input: normal | uniform | pos | scores | ids:V | rowmax:0

    @property
    def contraction(self) -> bool:
        return self.op in ("einsum", "attn_scores")


def llama_cases(t: int, hidden: int = 4096, ffn: int = 11008, heads: int = 32, dh: int = 128,
                vocab: int = 32000) -> list[Case]:
    """One instance per op at a token tile of ``t`` (LLaMA-7B widths by default)."""
    h, d, f = heads, hidden, ffn
    sc = 1.0 / math.sqrt(dh)
    attn = dict(scale=sc, causal=True, q_off=0, k_off=0)
    return [
        Case("gemm_up", "einsum", ((t, d), (d, f)), (t, f), {"subscripts": "td,df->tf"}),
        Case("gemm_down", "einsum", ((t, f), (f, d)), (t, d), {"subscripts": "tf,fd->td"}),
        Case("gemm_qkv", "einsum", ((t, d), (d, d)), (t, d), {"subscripts": "td,df->tf"}),
        Case("attn_pv", "einsum", ((h, t, t), (t, h, dh)), (t, h, dh), {"subscripts": "hqk,khd->qhd"},
             ("uniform", "normal")),
        Case("attn_scores", "attn_scores", ((t, h, dh), (t, h, dh)), (h, t, t), attn),
        Case("rowmax", "rowmax", ((h, t, t),), (h, t), {}, ("scores",)),
        Case("exp_sub", "exp_sub", ((h, t, t), (h, t)), (h, t, t), {}, ("scores", "rowmax:0")),
        Case("rowsum", "rowsum", ((h, t, t),), (h, t), {}, ("uniform",)),
        Case("max_n", "max_n", ((h, t), (h, t), (h, t)), (h, t)),
        Case("add_n", "add_n", ((t, h, dh), (t, h, dh)), (t, h, dh)),
        Case("div_rows", "div_rows", ((t, h, dh), (h, t)), (t, h, dh), {}, ("normal", "pos")),
        Case("mul", "mul", ((t, f), (t, f)), (t, f)),
        Case("scale", "scale", ((t, d),), (t, d), {"alpha": 0.125}),
        Case("silu", "silu", ((t, f),), (t, f)),
        Case("silu_mul", "silu_mul", ((t, f), (t, f)), (t, f)),
        Case("rmsnorm", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-5}),
        Case("rotary", "rotary", ((t, h, dh),), (t, h, dh), {"pos_off": t, "theta": 10000.0}),
        Case("embed", "embed", ((t,), (vocab, d)), (t, d), {}, (f"ids:{vocab}", "normal")),
        Case("sum_into", "sum_into", ((t, d), (t, d)), (t, d)),
        Case("mix", "mix", ((t * d,), (t * d // 2,), (1000,)), (t * d,), {"n_out": t * d}),
    ]


def tiny_cases() -> list[Case]:
    """Simulator-sized instances (a few hundred threads each), covering odd extents and offsets."""
    t, h, dh, d, f = 5, 2, 8, 12, 20
    attn = dict(scale=0.35, causal=True, q_off=6, k_off=4)
    return [
        Case("gemm_nn", "einsum", ((t, d), (d, f)), (t, f), {"subscripts": "td,df->tf"}),
        Case("gemm_scaled_nt", "einsum", ((t, d), (f, d)), (t, f), {"subscripts": "td,fd->tf", "scale": 0.5}),
        Case("gemm_tn", "einsum", ((d, t), (d, f)), (t, f), {"subscripts": "dt,df->tf"}),
        Case("attn_pv", "einsum", ((h, t, 7), (7, h, dh)), (t, h, dh), {"subscripts": "hqk,khd->qhd"},
             ("uniform", "normal")),
        Case("gemm_split_m", "einsum", ((2, 3, 4), (3, 5)), (2, 4, 5), {"subscripts": "ikj,kl->ijl"}),
        Case("attn_scores", "attn_scores", ((t, h, dh), (7, h, dh)), (h, t, 7), attn),
        Case("attn_scores_nocausal", "attn_scores", ((t, h, dh), (3, h, dh)), (h, t, 3),
             dict(scale=0.2, causal=False, q_off=0, k_off=0)),
        Case("rowmax", "rowmax", ((h, t, 9),), (h, t), {}, ("scores",)),
        Case("rowmax_2d", "rowmax", ((t, 9),), (t,)),
        Case("exp_sub", "exp_sub", ((h, t, 9), (h, t)), (h, t, 9), {}, ("scores", "rowmax:0")),
        Case("rowsum", "rowsum", ((h, t, 9),), (h, t), {}, ("uniform",)),
        Case("max_n", "max_n", ((h, t), (h, t), (h, t)), (h, t)),
        Case("add_n", "add_n", ((t, h, dh), (t, h, dh)), (t, h, dh)),
        Case("div_rows", "div_rows", ((t, h, dh), (h, t)), (t, h, dh), {}, ("normal", "pos")),
        Case("mul", "mul", ((t, f), (t, f)), (t, f)),
        Case("mul_bcast", "mul", ((t, f), (f,)), (t, f)),
        Case("scale", "scale", ((t, d),), (t, d), {"alpha": -0.75}),
        Case("silu", "silu", ((t, f),), (t, f)),
        Case("silu_mul", "silu_mul", ((t, f), (t, f)), (t, f)),
        Case("rmsnorm", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-5}),
        Case("rotary", "rotary", ((t, h, dh),), (t, h, dh), {"pos_off": 1000, "theta": 10000.0}),
        Case("embed", "embed", ((t,), (11, d)), (t, d), {}, ("ids:11", "normal")),
        Case("sum_into", "sum_into", ((t, d), (t, d)), (t, d)),
        Case("mix", "mix", ((30,), (7,), (0,), (2, 3)), (40,), {"n_out": 40}),
    ]


def make_inputs(case: Case, dtype: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Fresh random inputs in ``dtype`` (ids int32). Score inputs are causally masked with -inf,
    including one fully masked row; ``rowmax:k`` is the reference row max of input k."""
    dt = NP_DTYPE[dtype] if case.op != "mix" else np.float32
    kinds = case.kinds or ("normal",) * len(case.in_shapes)
    xs: list[np.ndarray] = []
    for kind, shape in zip(kinds, case.in_shapes, strict=True):
        if kind.startswith("ids:"):
            xs.append(rng.integers(0, int(kind[4:]), size=shape, dtype=np.int32))
        elif kind.startswith("rowmax:"):
            xs.append(reference.rowmax([xs[int(kind[7:])]], {}))
        elif kind == "scores":
            s = rng.standard_normal(shape, dtype=np.float32) * 3
            i = np.arange(shape[-2])[:, None] if len(shape) > 1 else 0
            s = np.where(np.arange(shape[-1])[None, :] > i, -np.inf, s)
            s[..., 0, :] = -np.inf
            xs.append(s.astype(dt))
        elif kind == "uniform":
            xs.append(rng.random(shape, dtype=np.float32).astype(dt))
        elif kind == "pos":
            xs.append((0.5 + rng.random(shape, dtype=np.float32)).astype(dt))
        else:
            xs.append(rng.standard_normal(shape, dtype=np.float32).astype(dt))
    return xs


def reference_f64(case: Case, xs: list[np.ndarray]) -> np.ndarray:
    """The reference evaluated in float64 on the same (already rounded) inputs."""
    up = [x.astype(np.float64) if x.dtype.kind == "f" else x for x in xs]
    with mock.patch.object(reference, "_f32", lambda x: x.astype(np.float64, copy=False)):
        return np.asarray(reference.run_reference(case.op, up, case.params), dtype=np.float64)


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| over finite reference entries; inf if infinities differ or out has NaN."""
    out = np.asarray(out, dtype=np.float64)
    if out.shape != ref.shape or np.isnan(out).any():
        return math.inf
    fin = np.isfinite(ref)
    if not np.array_equal(out[~fin], ref[~fin]):
        return math.inf
    num = np.linalg.norm(out[fin] - ref[fin])
    den = np.linalg.norm(ref[fin])
    return float(num / den) if den > 0 else float(num)


TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2}
