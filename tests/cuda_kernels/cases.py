"""Example instances of every op (tiny for the simulator, LLaMA-7B tiles for the GPU) and their inputs.

Shared by the kernel tests and ``benchmarks/kernel_speed.py``. ``make_inputs`` draws fresh random inputs
(never zeros); ``reference_f64`` evaluates the numpy reference in float64 (the references compute in
float32 by design; the checks compare kernels against float64). bf16 (``ml_dtypes.bfloat16``) is in
``NP_DTYPE`` when ml_dtypes is installed (``DTYPES`` lists the dtypes to test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from unittest import mock

import numpy as np

from turnip import reference
from turnip.reference import partial_len

NP_DTYPE = {"fp16": np.float16, "fp32": np.float32}
try:
    import ml_dtypes

    NP_DTYPE["bf16"] = ml_dtypes.bfloat16
except ImportError:  # bf16 cases are not generated
    pass
DTYPES = tuple(NP_DTYPE)


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    in_shapes: tuple
    out_shape: tuple
    params: dict = field(default_factory=dict)
    kinds: tuple = ()  # per input: normal | uniform | pos | ids:V | targets:V | step | partial

    @property
    def contraction(self) -> bool:
        return self.op == "einsum"


LLAMA3_ROPE = {"theta": 500000.0, "rope_factor": 8.0, "rope_low": 1.0, "rope_high": 4.0, "rope_orig": 8192}
ADAM = {"lr": 0.5, "b1": 0.9, "b2": 0.999, "eps": 1e-8}  # a large lr: the update shows in the error
FP32_ONLY = frozenset({"mix", "adam_m", "adam_v", "adam_p"})  # defined on float32: tested at fp32 only
_FP32_OUT = FP32_ONLY | {"xent"}


def vertex_dtype(case: Case, dtype: str) -> str:
    """The dtype ``prepare`` gets, the output's: float32 for ``FP32_ONLY`` ops and ``xent``, else ``dtype``."""
    return "fp32" if case.op in _FP32_OUT else dtype


def input_dtype(case: Case, dtype: str) -> str:
    """The dtype of the float inputs: the ``src`` param where the op has one (``cast``, ``xent``), else the
    vertex dtype."""
    return case.params.get("src", vertex_dtype(case, dtype))


def llama_cases(t: int, hidden: int = 4096, ffn: int = 11008, heads: int = 32, dh: int = 128,
                vocab: int = 32000) -> list[Case]:
    """One instance per op at a token tile of ``t`` (LLaMA-7B widths by default), plus grouped-query
    attention, rope scaling at positions up to 32768 + t and row slices (LLaMA-3-8B: 8 key/value heads)."""
    h, d, f = heads, hidden, ffn
    hk = max(1, h // 4)
    r = h // hk
    sc = 1.0 / math.sqrt(dh)
    n_part = partial_len(t, h, dh, np.float16)
    return [
        Case("gemm_up", "einsum", ((t, d), (d, f)), (t, f), {"subscripts": "td,df->tf"}),
        Case("gemm_down", "einsum", ((t, f), (f, d)), (t, d), {"subscripts": "tf,fd->td"}),
        Case("gemm_qkv", "einsum", ((t, d), (d, d)), (t, d), {"subscripts": "td,df->tf"}),
        Case("gemm_q_heads", "einsum", ((t, d), (d, h, dh)), (t, h, dh), {"subscripts": "td,dhe->the"}),
        Case("gemm_o_heads", "einsum", ((t, h, dh), (h, dh, d)), (t, d), {"subscripts": "the,hed->td"}),
        Case("gemm_o_heads_addend", "einsum", ((t, h, dh), (h, dh, d), (t, d)), (t, d), {"subscripts": "the,hed->td"}),
        Case("gemm_lora_b_addend", "einsum", ((t, 16), (h, dh, 16), (t, h, dh)), (t, h, dh),
             {"subscripts": "tk,hek->the", "scale": 2.0}),
        Case("sdpa_diag", "sdpa", ((t, h, dh), (t, h, dh), (t, h, dh)), (t, h, dh), _sdpa(sc, t, 0, t)),
        Case("sdpa_range", "sdpa", ((t, h, dh), (2 * t, h, dh), (2 * t, h, dh)), (t, h, dh), _sdpa(sc, t, t, 2 * t)),
        Case("sdpa_partial", "sdpa", ((t, h, dh), (t, h, dh), (t, h, dh)), (n_part,),
             _sdpa(sc, t, 0, t, partial=True)),
        Case("attn_combine", "attn_combine", ((n_part,), (n_part,)), (t, h, dh),
             {"tq": t, "h": h, "dh": dh, "itemsize": 2}, ("partial", "partial")),
        Case("sdpa_gqa", "sdpa", ((t, hk, r, dh), (t, hk, dh), (t, hk, dh)), (t, hk, r, dh), _sdpa(sc, t, 0, t)),
        Case("sdpa_gqa_range", "sdpa", ((t, hk, r, dh), (2 * t, hk, dh), (2 * t, hk, dh)), (t, hk, r, dh),
             _sdpa(sc, t, t, 2 * t)),
        Case("sdpa_gqa_partial", "sdpa", ((t, hk, r, dh), (t, hk, dh), (t, hk, dh)), (n_part,),
             _sdpa(sc, t, t, t, partial=True)),
        Case("attn_combine_gqa", "attn_combine", ((n_part,), (n_part,)), (t, hk, r, dh),
             {"tq": t, "h": h, "dh": dh, "itemsize": 2, "r": r}, ("partial", "partial")),
        *family_cases(t, h, hk, dh, d, f, vocab),
        Case("concat", "concat", ((t, h, dh), (t // 2, h, dh)), (t + t // 2, h, dh)),
        Case("rows_last", "rows", ((t, d),), (1, d), {"start": t - 1, "stop": t}),
        Case("rows", "rows", ((t, hk, dh),), (t // 2, hk, dh), {"start": t // 4, "stop": t // 4 + t // 2}),
        Case("add_n", "add_n", ((t, h, dh), (t, h, dh)), (t, h, dh)),
        Case("mul", "mul", ((t, f), (t, f)), (t, f)),
        Case("scale", "scale", ((t, d),), (t, d), {"alpha": 0.125}),
        Case("silu", "silu", ((t, f),), (t, f)),
        Case("silu_mul", "silu_mul", ((t, f), (t, f)), (t, f)),
        Case("rmsnorm", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-5}),
        Case("rotary", "rotary", ((t, h, dh),), (t, h, dh), {"pos_off": t, "theta": 10000.0}),
        Case("rotary_llama3_q", "rotary", ((t, hk, r, dh),), (t, hk, r, dh), {"pos_off": 32768} | LLAMA3_ROPE),
        Case("rotary_llama3_k", "rotary", ((t, hk, dh),), (t, hk, dh), {"pos_off": 32768} | LLAMA3_ROPE),
        Case("embed", "embed", ((t,), (vocab, d)), (t, d), {}, (f"ids:{vocab}", "normal")),
        Case("sum_into", "sum_into", ((t, d), (t, d)), (t, d)),
        Case("mix", "mix", ((t * d,), (t * d // 2,), (1000,)), (t * d,), {"n_out": t * d}),
        *training_cases(t, h, hk, dh, d, f, vocab, t // 4, 128256),
        *import_cases(t, h, dh, d, f),
    ]


def family_cases(t: int, h: int, hk: int, dh: int, d: int, f: int, vocab: int) -> list[Case]:
    """The ops and params of the families beyond LLaMA at tile ``t``: sliding-window attention (a window of
    t / 2 + 1 over a key range of 2t ending at the query block; a partial whose first rows see no key),
    soft-capped scores (Gemma 2), GeGLU, capped logits, (1 + w) RMSNorm, per-head q/k RMSNorm of a
    grouped-query tile (Qwen 3), a bias broadcast over tokens (Qwen 2)."""
    r = h // hk
    w = {"window": t // 2 + 1}
    n_part = partial_len(t, h, dh, np.float16)
    return [
        Case("sdpa_window", "sdpa", ((t, h, dh), (2 * t, h, dh), (2 * t, h, dh)), (t, h, dh),
             _sdpa(1.0 / math.sqrt(dh), t, t, 2 * t) | w),
        Case("sdpa_window_gqa_partial", "sdpa", ((t, hk, r, dh), (t, hk, dh), (t, hk, dh)), (n_part,),
             _sdpa(1.0 / math.sqrt(dh), t, t, t, partial=True) | w),
        Case("sdpa_softcap", "sdpa", ((t, h, dh), (t, h, dh), (t, h, dh)), (t, h, dh),
             _sdpa(1.0, t, 0, t) | {"softcap": 5.0}),
        Case("gelu_tanh_mul", "gelu_tanh_mul", ((t, f), (t, f)), (t, f)),
        Case("softcap", "softcap", ((t, vocab),), (t, vocab), {"cap": 1.5}),
        Case("rmsnorm_offset", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-6, "offset": 1.0}),
        Case("rmsnorm_heads_gqa", "rmsnorm", ((t, hk, r, dh), (dh,)), (t, hk, r, dh), {"eps": 1e-6}),
        Case("add_bias_gqa", "add_n", ((t, hk, r, dh), (hk, r, dh)), (t, hk, r, dh)),
    ]


def training_cases(t: int, h: int, hk: int, dh: int, d: int, f: int, vocab: int, t_big: int,
                   vocab_big: int) -> list[Case]:
    """The backward, loss, cast and Adam ops at tile ``t``: ``cols`` takes parts of an ``sdpa_bwd`` output
    (t, hk, (r + 2) dh); ``xent`` also at a vocabulary of ``vocab_big`` on ``t_big`` tokens; Adam on (d, d)."""
    r = h // hk
    pack = (t, hk, (r + 2) * dh)
    tg = f"targets:{vocab}"
    return [
        Case("rmsnorm_bwd", "rmsnorm_bwd", ((t, d), (d,), (t, d)), (t, d), {"eps": 1e-5}),
        Case("rmsnorm_bwd_heads", "rmsnorm_bwd", ((t_big, hk, dh), (dh,), (t_big, hk, dh)), (t_big, hk, dh),
             {"eps": 1e-6}),
        Case("silu_mul_dg", "silu_mul_dg", ((t, f),) * 3, (t, f)),
        Case("rotary_inverse", "rotary", ((t, h, dh),), (t, h, dh),
             {"pos_off": 3 * t, "theta": 10000.0, "inverse": True}),
        Case("rotary_inverse_llama3", "rotary", ((t, hk, r, dh),), (t, hk, r, dh),
             {"pos_off": 32768 - t // 2, "inverse": True} | LLAMA3_ROPE),
        Case("cols_dq", "cols", (pack,), (t, hk, r, dh), {"start": 0, "stop": r * dh, "tail": (r, dh)}),
        Case("cols_dv", "cols", (pack,), (t, hk, dh), {"start": (r + 1) * dh, "stop": (r + 2) * dh, "tail": (dh,)}),
        *sdpa_bwd_cases(t, h, hk, dh),
        *([] if t % 2 else packed_cases(t // 2, h, dh, hk=hk)),
        Case("cols_2d", "cols", ((t, f),), (t, f // 2), {"start": 3, "stop": 3 + f // 2, "tail": (f // 2,)}),
        Case("xent", "xent", ((t, vocab), (t,)), (t,), {"src": "fp16"}, ("normal", tg)),
        Case("xent_big_vocab", "xent", ((t_big, vocab_big), (t_big,)), (t_big,), {"src": "fp16"},
             ("normal", f"targets:{vocab_big}")),
        Case("xent_bwd", "xent_bwd", ((t, vocab), (t,)), (t, vocab), {"scale": 1.0 / t}, ("normal", tg)),
        Case("cast", "cast", ((t, d),), (t, d), {"alpha": 0.5, "dtype": "fp16", "src": "fp32"}),
        Case("adam_m", "adam_m", ((d, d),) * 2, (d, d), ADAM),
        Case("adam_v", "adam_v", ((d, d),) * 2, (d, d), ADAM, ("pos", "normal")),
        Case("adam_p", "adam_p", ((d, d),) * 3 + ((),), (d, d), ADAM, ("normal", "normal", "pos", "step")),
        Case("adam_p_4d", "adam_p", ((2, 3, dh, 4),) * 3 + ((),), (2, 3, dh, 4), ADAM,
             ("normal", "normal", "pos", "step")),  # a grouped-query LoRA B (hk, r, dh, rank): rank 4 runs flat
        Case("add_4d", "add_n", ((2, 3, dh, 4),) * 2, (2, 3, dh, 4)),
    ]


def _ew_case(name: str, fn: str, in_shapes: tuple, axes: list, out_shape: tuple, kinds: tuple = (), **p) -> Case:
    return Case(name, "ew", in_shapes, out_shape, {"fn": fn, "n": len(out_shape), "axes": axes} | p, kinds)


def import_cases(t: int, h: int, dh: int, d: int, f: int) -> list[Case]:
    """The ops of imported graphs (``turnip.torchimport.kernels``) at tile ``t``, as GPT-2 and a ViT use
    them: every ``ew`` function (broadcast, transposed and dropped-axis operands too), softmax over the
    last and a middle axis, layer norm, the reductions, slices of a fused qkv, cat, stack and relayouts."""
    x, one = (t, f), [[0, 1]]
    ews = [_ew_case(f"ew_{fn}", fn, (x,), one, x) for fn in ("copy", "neg", "exp", "tanh", "relu", "sigmoid",
                                                              "silu", "gelu", "gelu_tanh")]  # fmt: skip
    ews += [_ew_case(f"ew_{fn}", fn, (x,), one, x, ("pos",)) for fn in ("sqrt", "rsqrt")]
    return [
        *ews,
        _ew_case("ew_pow", "pow", (x,), one, x, alpha=3.0),
        _ew_case("ew_affine", "affine", (x,), one, x, alpha=0.5, beta=-2.0),
        _ew_case("ew_rsub", "rsub", (x,), one, x, beta=1.0),
        _ew_case("ew_rdiv", "rdiv", (x,), one, x, ("pos",), beta=2.0),
        _ew_case("ew_add_bias", "add", ((t, h, dh), (dh,)), [[0, 1, 2], [2]], (t, h, dh)),
        _ew_case("ew_sub", "sub", (x, x), [[0, 1], [0, 1]], x),
        _ew_case("ew_mul_transposed", "mul", ((t, h, dh), (dh, t)), [[0, 1, 2], [2, 0]], (t, h, dh)),
        _ew_case("ew_div_dropped_axis", "div", ((2, h, t, dh), (1, t)), [[0, 1, 2, 3], [-1, 2]], (2, h, t, dh),
                 ("normal", "pos")),
        _ew_case("ew_copy_placed", "copy", ((dh, t, h),), [[2, 0, 1]], (t, h, dh)),
        Case("softmax", "softmax", ((t, f),), (t, f), {"axis": 1}),
        Case("softmax_mid_axis", "softmax", ((h, t, 7),), (h, t, 7), {"axis": 1}),
        Case("layernorm", "layernorm", ((t, d), (d,), (d,)), (t, d), {"axis": 1, "eps": 1e-5}),
        Case("layernorm_mid_axis", "layernorm", ((2, d, 3), (d,), (d,)), (2, d, 3), {"axis": 1, "eps": 1e-6}),
        Case("reduce_sum", "reduce", ((t, h, dh),), (h, dh), {"fn": "sum", "axis": 0}),
        Case("reduce_mean", "reduce", ((t, d),), (t,), {"fn": "mean", "axis": 1}),
        Case("reduce_max", "reduce", ((t, h, dh),), (t, dh), {"fn": "max", "axis": 1}),
        Case("slice_qkv", "slice", ((t, 3, h, dh),), (t, 1, h, dh), {"axis": 1, "start": 1, "stop": 2}),
        Case("slice_drop", "slice", ((t, 3, h, dh),), (t, h, dh), {"axis": 1, "start": 2, "stop": 3, "drop": True}),
        Case("slice_rows", "slice", ((t, d),), (t - 1, d), {"axis": 0, "start": 1, "stop": t}),
        Case("cat_tokens", "cat", ((1, d), (t, d)), (t + 1, d), {"axis": 0}),
        Case("cat_mid_axis", "cat", ((t, 2, dh), (t, 1, dh), (t, 3, dh)), (t, 6, dh), {"axis": 1}),
        Case("cat_stack", "cat", ((t, h, dh),) * 3, (t, 3, h, dh), {"axis": 1, "stack": True}),
        Case("relayout_heads", "relayout", ((t, h, dh),), (h, t, dh), {"perm": [1, 0, 2], "shape": [h, t, dh]}),
        Case("relayout_merge", "relayout", ((t, h, dh),), (h, t * dh), {"perm": [1, 0, 2], "shape": [-1, t * dh]}),
    ]


def sdpa_bwd_cases(t: int, h: int, hk: int, dh: int, q_off: int = 0, k_off: int = 0) -> list[Case]:
    """``sdpa_bwd`` at tile ``t``: multi-head (h heads) and grouped-query (hk key/value heads), causal."""
    p = {"scale": 1.0 / math.sqrt(dh), "causal": True, "q_off": q_off, "k_off": k_off}
    r = h // hk
    return [
        Case("sdpa_bwd", "sdpa_bwd", ((t, h, dh),) * 5, (t, h, 3 * dh), p),
        Case("sdpa_bwd_gqa", "sdpa_bwd", ((t, hk, r, dh), (t, hk, dh), (t, hk, dh), (t, hk, r, dh), (t, hk, r, dh)),
             (t, hk, (r + 2) * dh), p),
    ]


def tiny_cases() -> list[Case]:
    """Simulator-sized instances (a few hundred threads each), covering odd extents and offsets."""
    t, h, dh, d, f = 5, 2, 8, 12, 20
    n_part = partial_len(t, h, dh, np.float16)
    n_part4 = partial_len(t, 4, dh, np.float16)  # grouped-query: 4 query heads on 2 key/value heads
    return [
        Case("gemm_nn", "einsum", ((t, d), (d, f)), (t, f), {"subscripts": "td,df->tf"}),
        Case("gemm_scaled_nt", "einsum", ((t, d), (f, d)), (t, f), {"subscripts": "td,fd->tf", "scale": 0.5}),
        Case("gemm_tn", "einsum", ((d, t), (d, f)), (t, f), {"subscripts": "dt,df->tf"}),
        Case("attn_pv", "einsum", ((h, t, 7), (7, h, dh)), (t, h, dh), {"subscripts": "hqk,khd->qhd"},
             ("uniform", "normal")),
        Case("gemm_split_m", "einsum", ((2, 3, 4), (3, 5)), (2, 4, 5), {"subscripts": "ikj,kl->ijl"}),
        Case("gemm_addend", "einsum", ((t, d), (f, d), (t, f)), (t, f), {"subscripts": "td,fd->tf", "scale": 0.5}),
        Case("gemm_addend_heads", "einsum", ((t, 3), (h, dh, 3), (t, h, dh)), (t, h, dh),
             {"subscripts": "tk,hek->the"}),
        Case("sdpa_diag", "sdpa", ((t, h, dh),) * 3, (t, h, dh), _sdpa(0.35, t, 3, t, k_off=3)),
        Case("sdpa_prefix", "sdpa", ((t, h, dh), (9, h, dh), (9, h, dh)), (t, h, dh), _sdpa(0.35, t, 2, 7)),
        Case("sdpa_before", "sdpa", ((t, h, dh), (4, h, dh), (4, h, dh)), (n_part,),
             _sdpa(0.35, t, 9, 4, k_off=2, partial=True)),
        Case("sdpa_empty_rows", "sdpa", ((t, h, dh), (4, h, dh), (4, h, dh)), (n_part,),
             _sdpa(0.35, t, 0, 4, k_off=2, partial=True)),
        Case("sdpa_nocausal", "sdpa", ((t, h, dh), (3, h, dh), (3, h, dh)), (t, h, dh),
             {"scale": 0.2, "causal": False, "q_off": 0, "k_off": 0, "tk": 3}),
        Case("sdpa_gqa", "sdpa", ((t, 2, 2, dh), (9, 2, dh), (9, 2, dh)), (t, 2, 2, dh), _sdpa(0.35, t, 2, 7)),
        Case("sdpa_mqa", "sdpa", ((t, 1, 3, dh), (4, 1, dh), (4, 1, dh)), (t, 1, 3, dh), _sdpa(0.35, t, 9, 4)),
        Case("sdpa_gqa_flat_q", "sdpa", ((t, 4, dh), (t, h, dh), (t, h, dh)), (t, 4, dh),
             _sdpa(0.35, t, 3, t, k_off=3)),
        Case("sdpa_gqa_partial", "sdpa", ((t, 2, 2, dh), (4, 2, dh), (4, 2, dh)), (n_part4,),
             _sdpa(0.35, t, 0, 4, k_off=2, partial=True)),
        Case("attn_combine", "attn_combine", ((n_part,),) * 3, (t, h, dh), {"tq": t, "h": h, "dh": dh, "itemsize": 2},
             ("partial", "partial", "partial")),
        Case("attn_combine_gqa", "attn_combine", ((n_part4,),) * 2, (t, 2, 2, dh),
             {"tq": t, "h": 4, "dh": dh, "itemsize": 2, "r": 2}, ("partial", "partial")),
        Case("concat", "concat", ((t, h, dh), (2, h, dh), (1, h, dh)), (t + 3, h, dh)),
        Case("rows", "rows", ((t, h, dh),), (2, h, dh), {"start": 1, "stop": 3}),
        Case("rows_last", "rows", ((t, d),), (1, d), {"start": t - 1, "stop": t}),
        Case("add_n", "add_n", ((t, h, dh), (t, h, dh)), (t, h, dh)),
        Case("mul", "mul", ((t, f), (t, f)), (t, f)),
        Case("mul_bcast", "mul", ((t, f), (f,)), (t, f)),
        Case("scale", "scale", ((t, d),), (t, d), {"alpha": -0.75}),
        Case("silu", "silu", ((t, f),), (t, f)),
        Case("silu_mul", "silu_mul", ((t, f), (t, f)), (t, f)),
        Case("rmsnorm", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-5}),
        Case("rotary", "rotary", ((t, h, dh),), (t, h, dh), {"pos_off": 1000, "theta": 10000.0}),
        Case("rotary_gqa", "rotary", ((t, 1, 3, dh),), (t, 1, 3, dh), {"pos_off": 7, "theta": 10000.0}),
        Case("rotary_llama3", "rotary", ((t, 2, 3, dh),), (t, 2, 3, dh), {"pos_off": 32763} | LLAMA3_ROPE),
        Case("embed", "embed", ((t,), (11, d)), (t, d), {}, ("ids:11", "normal")),
        Case("sum_into", "sum_into", ((t, d), (t, d)), (t, d)),
        Case("mix", "mix", ((30,), (7,), (0,), (2, 3)), (40,), {"n_out": 40}),
        Case("sdpa_window", "sdpa", ((t, h, dh), (9, h, dh), (9, h, dh)), (t, h, dh),
             _sdpa(0.35, t, 2, 7) | {"window": 3}),
        Case("sdpa_window_empty_rows", "sdpa", ((t, h, dh), (4, h, dh), (4, h, dh)), (n_part,),
             _sdpa(0.35, t, 9, 4, k_off=2, partial=True) | {"window": 6}),  # rows 2.. see none of keys 2..5
        Case("sdpa_window_gqa", "sdpa", ((t, 2, 2, dh), (9, 2, dh), (9, 2, dh)), (t, 2, 2, dh),
             _sdpa(0.35, t, 2, 7) | {"window": 2}),
        Case("sdpa_softcap", "sdpa", ((t, h, dh),) * 3, (t, h, dh), _sdpa(1.5, t, 3, t, k_off=3) | {"softcap": 2.0}),
        Case("sdpa_softcap_window_gqa_partial", "sdpa", ((t, 2, 2, dh), (4, 2, dh), (4, 2, dh)), (n_part4,),
             _sdpa(1.5, t, 3, 4, k_off=1, partial=True) | {"softcap": 2.0, "window": 3}),
        Case("gelu_tanh_mul", "gelu_tanh_mul", ((t, f), (t, f)), (t, f)),
        Case("softcap", "softcap", ((t, f),), (t, f), {"cap": 0.8}),
        Case("rmsnorm_offset", "rmsnorm", ((t, d), (d,)), (t, d), {"eps": 1e-6, "offset": 1.0}),
        Case("rmsnorm_heads", "rmsnorm", ((t, 2, 3, dh), (dh,)), (t, 2, 3, dh), {"eps": 1e-6}),
        Case("add_bias", "add_n", ((t, 2, 3, dh), (2, 3, dh)), (t, 2, 3, dh)),
        Case("mul_last_dim_4d", "mul", ((t, 2, 3, dh), (dh,)), (t, 2, 3, dh)),
        *training_cases(t, 4, h, dh, d, f, 37, 3, 150),
        *[Case(f"{c.name}_t13_off", c.op, c.in_shapes, c.out_shape, c.params, c.kinds)
          for c in sdpa_bwd_cases(13, 3, 1, 4, q_off=1, k_off=3)],  # odd extents; rows 0, 1 see no key
        *import_cases(t, h, dh, d, f),
        Case("sdpa_bwd_flat_gqa", "sdpa_bwd", ((7, 4, 8), (7, 2, 8), (7, 2, 8), (7, 4, 8), (7, 4, 8)), (7, 2, 32),
             {"scale": 0.3, "causal": False, "q_off": 0, "k_off": 0}),
        *packed_cases(3, h, dh),
    ]


def packed_cases(seq: int, h: int, dh: int, n: int = 2, hk: int | None = None) -> list[Case]:
    """Token tiles of ``n`` whole sequences of ``seq`` tokens (a ``seq`` param): attention, its backward and
    rotary each sequence apart; grouped-query on ``hk`` key/value heads (default h / 2)."""
    t, hk = n * seq, hk or max(1, h // 2)
    r = h // hk
    sc = 1.0 / math.sqrt(dh)
    pk = {"seq": seq}
    bwd = {"scale": sc, "causal": True, "q_off": 0, "k_off": 0} | pk
    gq = ((t, hk, r, dh), (t, hk, dh), (t, hk, dh))
    return [
        Case("sdpa_packed", "sdpa", ((t, h, dh),) * 3, (t, h, dh), _sdpa(sc, t, 0, t) | pk),
        Case("sdpa_packed_gqa_window", "sdpa", gq, gq[0], _sdpa(sc, t, 0, t) | pk | {"window": max(2, seq // 2)}),
        Case("sdpa_bwd_packed_gqa", "sdpa_bwd", (*gq, gq[0], gq[0]), (t, hk, (r + 2) * dh), bwd),
        Case("rotary_packed", "rotary", ((t, h, dh),), (t, h, dh), {"pos_off": 0, "theta": 10000.0} | pk),
    ]


def _sdpa(scale: float, tq: int, q_off: int, tk: int, k_off: int = 0, partial: bool = False) -> dict:
    p = {"scale": scale, "causal": True, "q_off": q_off, "k_off": k_off, "tk": tk, "partial": partial}
    return p | ({"itemsize": 2} if partial else {})


def for_dtype(case: Case, dtype: str) -> Case:
    """The case with attention partials sized for ``dtype`` (their length counts elements of the tile
    dtype; the cases are written for fp16), ``xent``'s logits in ``dtype`` and ``cast`` into ``dtype`` from
    another precision (fp32 from bf16, or fp16 without ml_dtypes; half precisions from fp32)."""
    if case.op == "xent":
        return Case(case.name, case.op, case.in_shapes, case.out_shape, case.params | {"src": dtype}, case.kinds)
    if case.op == "cast":
        src = "fp32" if dtype != "fp32" else "bf16" if "bf16" in NP_DTYPE else "fp16"
        p = case.params | {"dtype": dtype, "src": src}
        return Case(case.name, case.op, case.in_shapes, case.out_shape, p, case.kinds)
    if "itemsize" not in case.params:
        return case
    p = case.params
    tq, h, dh = (p["tq"], p["h"], p["dh"]) if case.op == "attn_combine" else q_dims(case.in_shapes[0])
    old, new = partial_len(tq, h, dh, np.float16), partial_len(tq, h, dh, NP_DTYPE[dtype])

    def fix(s):
        return (new,) if tuple(s) == (old,) else s

    return Case(case.name, case.op, tuple(fix(s) for s in case.in_shapes), fix(case.out_shape),
                p | {"itemsize": np.dtype(NP_DTYPE[dtype]).itemsize}, case.kinds)


def q_dims(q_shape: tuple) -> tuple[int, int, int]:
    """(tq, h, dh) of a query tile (tq, h, dh) or grouped (tq, hk, r, dh): h counts query heads."""
    return q_shape[0], math.prod(q_shape[1:-1]), q_shape[-1]


def is_float(dtype) -> bool:
    """float16/32/64 or bfloat16 (whose numpy kind is 'V')."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == NP_DTYPE.get("bf16", np.float16)


def make_inputs(case: Case, dtype: str, rng: np.random.Generator) -> list[np.ndarray]:
    """Fresh random inputs in ``input_dtype`` (ids and targets int32; targets with some -1 entries, the
    first always, the last never; ``step`` a 0-d float32 step number). ``partial`` inputs are attention partials (random
    outputs, log-sum-exps spread over a few units, one row with no visible key: -inf)."""
    dt = NP_DTYPE[input_dtype(case, dtype)]
    kinds = case.kinds or ("normal",) * len(case.in_shapes)
    xs: list[np.ndarray] = []
    for kind, shape in zip(kinds, case.in_shapes, strict=True):
        if kind.startswith("ids:"):
            xs.append(rng.integers(0, int(kind[4:]), size=shape, dtype=np.int32))
        elif kind.startswith("targets:"):
            x = rng.integers(0, int(kind[8:]), size=shape, dtype=np.int32)
            ignored = rng.random(shape) < 0.2
            ignored.flat[0], ignored.flat[-1] = True, False
            x[ignored] = -1
            xs.append(x)
        elif kind == "step":
            xs.append(np.asarray(rng.integers(1, 10), dtype=np.float32).reshape(shape))
        elif kind == "partial":
            p = case.params
            x = np.empty(reference.partial_len(p["tq"], p["h"], p["dh"], dt), dtype=dt)
            o, lse = reference.split_partial(x, p["tq"], p["h"], p["dh"])
            o[...] = rng.standard_normal(o.shape, dtype=np.float32)
            lse[...] = rng.standard_normal(lse.shape, dtype=np.float32) * 3
            if len(xs) == 0:
                lse[0, 0] = -np.inf
            xs.append(x)
        elif kind == "uniform":
            xs.append(rng.random(shape, dtype=np.float32).astype(dt))
        elif kind == "pos":
            xs.append((0.5 + rng.random(shape, dtype=np.float32)).astype(dt))
        else:
            xs.append(rng.standard_normal(shape, dtype=np.float32).astype(dt))
    return xs


def reference_f64(case: Case, xs: list[np.ndarray]) -> np.ndarray:
    """The reference evaluated in float64 on the same (already rounded) inputs."""
    up = [_repack_f64(case, x) if k == "partial" else x.astype(np.float64) if is_float(x.dtype) else x
          for k, x in zip(case.kinds or ("normal",) * len(xs), xs, strict=True)]
    with mock.patch.object(reference, "_f32", lambda x: x.astype(np.float64, copy=False)):
        return np.asarray(reference.run_reference(case.op, up, case.params), dtype=np.float64)


def decoded(case: Case, x: np.ndarray) -> np.ndarray:
    """An output as float64 values: an attention partial's output and log-sum-exp (whose packing depends
    on the buffer's dtype), anything else as it is."""
    if case.op != "sdpa" or not case.params.get("partial"):
        return x
    tq, h, dh = q_dims(case.in_shapes[0])
    o, lse = reference.split_partial(x, tq, h, dh)
    return np.concatenate([o.astype(np.float64).ravel(), lse.astype(np.float64).ravel()])


def _repack_f64(case: Case, x: np.ndarray) -> np.ndarray:
    """An attention partial re-packed as float64 (its log-sum-exp bytes keep their float32 meaning)."""
    tq, h, dh = case.params["tq"], case.params["h"], case.params["dh"]
    o, lse = reference.split_partial(x, tq, h, dh)
    y = np.empty(reference.partial_len(tq, h, dh, np.float64), dtype=np.float64)
    yo, yl = reference.split_partial(y, tq, h, dh)
    yo[...], yl[...] = o, lse
    return y


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


TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2}
