"""Builders of the training ops of the specification (``turnip.reference``): the backward of RMSNorm, the
next-token cross-entropy and its gradient, ``cols`` (a part of ``sdpa_bwd``'s packed output), ``cast`` and
the helpers of the Adam update (``adam_m``/``adam_v``/``adam_p`` are elementwise, in ``kernels``'s table).
Each returns ``(path, run, flops, bind)`` as every builder of ``cuda_kernels.kernels`` does.
"""

from __future__ import annotations

import math

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels._build import DTYPES, _arr, _ew, _kern, _need, _noop, _noop_bind
from cuda_kernels._numba import Compiled, scalar_type


def _rmsnorm_bwd(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 3 and len(out_shape) >= 1 and in_shapes[0] == in_shapes[2] == out_shape
          and in_shapes[1] == out_shape[-1:], "rmsnorm_bwd takes x (..., d), w (d,) and dy (..., d)")
    d, blk, bf = out_shape[-1], cg.row_block(), dtype == "bf16"
    rows = int(np.prod(out_shape[:-1], dtype=np.int64))
    if rows == 0 or d == 0:
        return "kernel", _noop, 0, _noop_bind
    types = [_arr(dtype, 2), _arr(dtype, 2), _arr(dtype, 1), _arr(dtype, 2), scalar_type("f4")]
    k = Compiled(cg.jit(cg.rmsnorm_bwd_source(blk, bf)), types, (rows,), (blk,))
    eps = np.float32(params.get("eps", 1e-5))

    def args_of(out, ins):  # rows of the last axis: (rows, d) views
        return (out.reshape(rows, d), ins[0].reshape(rows, d), ins[1], ins[2].reshape(rows, d), eps)

    run, bind = _kern(k, args_of, bf)
    return "kernel", run, 0, bind


def _xent(in_shapes, out_shape, dtype, params, opts, backward: bool = False):
    """``xent`` (backward False: logits in dtype params["src"] -> (t,) float32) and ``xent_bwd`` (logits
    in the vertex dtype -> (t, V) in it); targets int32."""
    _need(len(in_shapes) == 2 and len(in_shapes[0]) == 2 and in_shapes[1] == in_shapes[0][:1]
          and out_shape == (in_shapes[0] if backward else in_shapes[0][:1]),
          "xent takes logits (t, V) and targets (t,) -> (t,) (xent_bwd: -> (t, V))")
    src = dtype if backward else params.get("src", dtype)
    _need(src in DTYPES and (backward or dtype == "fp32"), f"logits dtype {src!r} -> {dtype!r} not supported")
    (t, v), blk, bf = in_shapes[0], cg.row_block(), src == "bf16"
    if t == 0:
        return "kernel", _noop, 0, _noop_bind
    _need(v > 0, "xent over an empty vocabulary")
    types = [_arr(dtype, 1 + backward), _arr(src, 2), _arr("int32", 1), *[scalar_type("f4")] * backward]
    k = Compiled(cg.jit(cg.softmax_row_source(blk, backward, bf)), types, (t,), (blk,))
    sc = (np.float32(params.get("scale", 1.0)),) if backward else ()
    run, bind = _kern(k, lambda out, ins: (out, ins[0], ins[1], *sc), bf)
    return "kernel", run, 0, bind


def _cols(in_shapes, out_shape, dtype, params, opts):
    a, b, tail = int(params["start"]), int(params["stop"]), tuple(int(e) for e in params["tail"])
    _need(len(in_shapes) == 1 and len(in_shapes[0]) >= 1 and 0 <= a < b <= in_shapes[0][-1]
          and int(np.prod(tail, dtype=np.int64)) == b - a and out_shape == (*in_shapes[0][:-1], *tail),
          "cols takes x (..., n) and 0 <= start < stop <= n -> (..., *tail) with prod(tail) = stop - start")
    lead = in_shapes[0][:-1]  # viewed as (lead0, rest, n) -> (lead0, rest, stop - start); a copy of bits
    lead = lead if len(lead) <= 1 else (lead[0], int(np.prod(lead[1:], dtype=np.int64)))
    vin, vout, nd = (*lead, in_shapes[0][-1]), (*lead, b - a), len(lead) + 1
    idx = ", ".join([*cg.out_names(nd)[:-1], "c + s0"])
    src = cg.elementwise_source(1, nd, [], f"x0[{idx}]", 1)
    types = [_arr(dtype, nd), _arr(dtype, nd), scalar_type("i8")]
    run, bind = _ew(src, vout, types, (np.int64(a),), dtype == "bf16",
                    lambda out, ins: (out.reshape(vout), [ins[0].reshape(vin)]))
    return "kernel", run, 0, bind


def _cast(in_shapes, out_shape, dtype, params, opts):
    src = params.get("src", dtype)
    _need(len(in_shapes) == 1 and in_shapes[0] == out_shape and src in DTYPES and params.get("dtype", dtype) == dtype,
          f"cast takes x in dtype src -> the same shape in the vertex dtype (src {src!r}, dtype "
          f"{params.get('dtype')!r}, vertex {dtype!r})")
    n = (int(np.prod(out_shape, dtype=np.int64)),)  # flat views
    code = cg.elementwise_source(1, 1, [cg.load(0, "c", src == "bf16")], "v0 * s0", 1, bf16=dtype == "bf16")
    types = [_arr(dtype, 1), _arr(src, 1), scalar_type("f4")]
    run, bind = _ew(code, n, types, (np.float32(params.get("alpha", 1.0)),), True,
                    lambda out, ins: (out.reshape(n), [ins[0].reshape(n)]))
    return "kernel", run, 0, bind


def _log(b: float) -> float:
    return math.log(b) if b > 0 else -math.inf


def _adam_scalars(p: dict) -> tuple:
    """lr, log b1, log b2, eps: the kernel's bias corrections 1 - b^step = -expm1(step log b) lose no digits
    to b rounded to float32."""
    return (p["lr"], _log(float(p["b1"])), _log(float(p["b2"])), p["eps"])
