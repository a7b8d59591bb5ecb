"""Launchers for every op of the specification (``turnip.reference``): ``prepare`` once, then launch many times.

``prepare(op, in_shapes, out_shape, dtype, params)`` validates shapes, generates and compiles the kernel
for the operand ranks and dtype (JIT warm-up happens here), computes the launch geometry and returns a
``Launcher``. ``launcher(stream, out, ins)`` then only packs arguments and enqueues work on the numba
stream: no allocation, no view creation, no compilation. ``out`` and ``ins`` are C-contiguous device
arrays already shaped as declared; for ``sum_into`` ``ins[0]`` is the accumulator and is ``out``.

Einsums that are GEMMs go to cuBLAS (through CuPy's bindings, on the caller's stream) when CuPy is
importable and ``gemm`` is 'auto' or 'cublas'; otherwise to a generated numba tiled kernel.
Importing this module needs numpy only; numba is imported by ``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels import gemm as gm
from cuda_kernels._numba import Compiled, array_type, scalar_type

DTYPES = {"fp16": np.float16, "fp32": np.float32}
GEMM_MODES = ("auto", "cublas", "numba")


class KernelPrepareError(ValueError):
    """An op cannot be prepared for the given shapes/params; the message names op, shapes and reason."""


class Launcher:
    """A prepared op. ``path`` is 'cublas', 'numba-gemm' or 'kernel'; ``flops`` counts GEMM work."""

    __slots__ = ("op", "in_shapes", "out_shape", "dtype", "params", "path", "flops", "_run")

    def __init__(self, op, in_shapes, out_shape, dtype, params, path, run, flops=0):
        self.op, self.in_shapes, self.out_shape = op, in_shapes, out_shape
        self.dtype, self.params, self.path, self._run, self.flops = dtype, params, path, run, flops

    def __call__(self, stream, out, ins: Sequence) -> None:
        self._run(stream, out, ins)

    def __repr__(self) -> str:
        return f"Launcher({self.op}, {self.in_shapes} -> {self.out_shape}, {self.dtype}, {self.path})"


def prepare(op: str, in_shapes: Sequence[tuple], out_shape: tuple, dtype: str, params: dict | None = None,
            gemm: str = "auto") -> Launcher:
    """Build (and compile) the launcher of one op instance. Raises ``KernelPrepareError``."""
    params = dict(params or {})
    in_shapes = [tuple(int(e) for e in s) for s in in_shapes]
    out_shape = tuple(int(e) for e in out_shape)
    if op not in _BUILDERS:
        raise KernelPrepareError(f"unknown op {op!r}; known: {sorted(_BUILDERS)}")
    if dtype not in DTYPES:
        raise KernelPrepareError(f"{op}: dtype {dtype!r} not in {sorted(DTYPES)}")
    if gemm not in GEMM_MODES:
        raise KernelPrepareError(f"{op}: gemm={gemm!r} not in {GEMM_MODES}")
    try:
        path, run, flops = _BUILDERS[op](in_shapes, out_shape, dtype, params, gemm)
    except (ValueError, KeyError, IndexError) as e:
        raise KernelPrepareError(f"{op} {in_shapes} -> {out_shape} {dtype} {params}: {e}") from e
    return Launcher(op, in_shapes, out_shape, dtype, params, path, run, flops)


# ---------------------------------------------------------------- helpers


def _arr(dtype, shape_or_ndim):
    nd = shape_or_ndim if isinstance(shape_or_ndim, int) else len(shape_or_ndim)
    return array_type(DTYPES.get(dtype, dtype), nd)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _ew(src: str, out_shape, argtypes, scalars=()) -> Callable:
    grid, block = cg.elementwise_geometry(out_shape, per_thread=cg.unroll())
    k = Compiled(cg.jit(src), argtypes, grid, block)
    sc = tuple(scalars)
    if any(e == 0 for e in out_shape):
        return _noop
    return lambda stream, out, ins: k.launch(stream, (out, *ins, *sc))


def _noop(stream, out, ins) -> None:
    return None


def _simple(n_in: int, expr: str, n_scalars: int = 0, pre: tuple = ()):
    """Elementwise op on same-shaped (or broadcastable) inputs."""

    def build(in_shapes, out_shape, dtype, params, gemm):
        _need(len(in_shapes) == n_in if n_in else len(in_shapes) >= 1, f"expects {n_in or '>=1'} inputs")
        nd = len(out_shape)
        loads = [cg.load(k, cg.broadcast_index(s, out_shape)) for k, s in enumerate(in_shapes)]
        ex = expr(len(in_shapes)) if callable(expr) else expr
        src = cg.elementwise_source(len(in_shapes), nd, loads, ex, n_scalars, pre)
        scal = [np.float32(params["alpha"])] if n_scalars else []
        types = [_arr(dtype, nd), *(_arr(dtype, s) for s in in_shapes), *[scalar_type("f4")] * n_scalars]
        return "kernel", _ew(src, out_shape, types, scal), 0

    return build


def _max_expr(n: int) -> str:
    e = "v0"
    for k in range(1, n):
        e = f"max({e}, v{k})"
    return e


# ---------------------------------------------------------------- contractions


def _gemm_run(plan: gm.EinsumPlan, in_shapes, out_shape, dtype, alpha: float, gemm: str):
    if gemm != "numba" and gm.cupy_usable():
        layout = gm.cublas_layout(plan)
        if layout is not None:
            g = gm.CublasGemm(layout, dtype, alpha)
            return "cublas", lambda stream, out, ins: g(stream, out, ins[0], ins[1])
        if gemm == "cublas":
            raise ValueError(f"einsum {plan.subscripts!r} is not a single strided cuBLAS GEMM")
    elif gemm == "cublas":
        raise ValueError("gemm='cublas' but CuPy/cuBLAS is not usable here")
    grid, block = gm.numba_gemm_geometry(plan)
    sizes = tuple(plan.size[c] for c in gm.gemm_letters(plan))
    types = [_arr(dtype, in_shapes[0]), _arr(dtype, in_shapes[1]), _arr(dtype, out_shape),
             scalar_type("f4"), *[scalar_type("i8")] * len(sizes)]
    k = Compiled(cg.jit(gm.numba_gemm_source(plan)), types, grid, block)
    a32 = np.float32(alpha)
    return "numba-gemm", lambda stream, out, ins: k.launch(stream, (ins[0], ins[1], out, a32, *sizes))


def _einsum(in_shapes, out_shape, dtype, params, gemm):
    _need(len(in_shapes) == 2, "einsum takes two inputs")
    plan = gm.plan_einsum(params["subscripts"], in_shapes[0], in_shapes[1], out_shape)
    path, run = _gemm_run(plan, in_shapes, out_shape, dtype, float(params.get("scale", 1.0)), gemm)
    return path, run, plan.flops()


def _attn_scores(in_shapes, out_shape, dtype, params, gemm):
    _need(len(in_shapes) == 2 and len(in_shapes[0]) == 3, "attn_scores takes q (tq, h, dh), k (tk, h, dh)")
    (tq, h, _), (tk, _, _) = in_shapes
    _need(out_shape == (h, tq, tk), f"output must be (h, tq, tk) = {(h, tq, tk)}")
    plan = gm.plan_einsum("ihd,jhd->hij", in_shapes[0], in_shapes[1], out_shape)
    path, mm = _gemm_run(plan, in_shapes, out_shape, dtype, float(params["scale"]), gemm)
    q_off, k_off = int(params.get("q_off", 0)), int(params.get("k_off", 0))
    c0 = max(0, q_off - k_off + 1)  # columns below c0 are unmasked in every row
    if not params.get("causal", True) or c0 >= tk:
        return path, mm, plan.flops()
    grid, block = cg.elementwise_geometry(out_shape, tk - c0)
    mask = Compiled(cg.jit(cg.CAUSAL_MASK_SOURCE), [_arr(dtype, 3), *[scalar_type("i8")] * 2], grid, block)
    margs = (q_off, k_off)

    def run(stream, out, ins):
        mm(stream, out, ins)
        mask.launch(stream, (out, *margs))

    return path, run, plan.flops()


# ---------------------------------------------------------------- rows, softmax pieces, norms


def _row_reduce(kind):
    def build(in_shapes, out_shape, dtype, params, gemm):
        _need(len(in_shapes) == 1 and out_shape == in_shapes[0][:-1], "output must drop the last axis")
        nd, blk = len(in_shapes[0]), cg.row_block()
        rows = int(np.prod(out_shape, dtype=np.int64))
        types = [_arr(dtype, nd - 1), _arr(dtype, nd)]
        k = Compiled(cg.jit(cg.row_source(kind, nd, blk)), types, (rows,), (blk,))
        return "kernel", lambda stream, out, ins: k.launch(stream, (out, ins[0])), 0

    return build


def _rmsnorm(in_shapes, out_shape, dtype, params, gemm):
    _need(len(in_shapes) == 2 and in_shapes[1] == in_shapes[0][-1:] and out_shape == in_shapes[0],
          "rmsnorm takes x (..., d) and w (d,)")
    nd, blk = len(out_shape), cg.row_block()
    rows = int(np.prod(out_shape[:-1], dtype=np.int64))
    types = [_arr(dtype, nd), _arr(dtype, nd), _arr(dtype, 1), scalar_type("f4")]
    k = Compiled(cg.jit(cg.row_source("rmsnorm", nd, blk)), types, (rows,), (blk,))
    eps = np.float32(params.get("eps", 1e-5))
    return "kernel", lambda stream, out, ins: k.launch(stream, (out, ins[0], ins[1], eps)), 0


def _exp_sub(in_shapes, out_shape, dtype, params, gemm):
    s, m = in_shapes
    _need(len(s) >= 2 and m == s[:-1] and out_shape == s, "exp_sub takes S (..., tk) and m (...)")
    names = cg.out_names(len(s))
    loads = [cg.load(0, ", ".join(names)), cg.load(1, ", ".join(names[:-1]))]
    src = cg.elementwise_source(2, len(s), loads, "math.exp(v0 - mm)",
                                pre=("mm = v1 if (v1 > NEG_INF and v1 < POS_INF) else ZERO",))
    return "kernel", _ew(src, out_shape, [_arr(dtype, s), _arr(dtype, s), _arr(dtype, m)]), 0


def _div_rows(in_shapes, out_shape, dtype, params, gemm):
    o, l = in_shapes
    _need(len(o) == 3 and l == (o[1], o[0]) and out_shape == o, "div_rows takes o (t, h, dh) and l (h, t)")
    src = cg.elementwise_source(2, 3, [cg.load(0, "a, b, c"), cg.load(1, "b, a")], "v0 / v1")
    return "kernel", _ew(src, out_shape, [_arr(dtype, 3), _arr(dtype, 3), _arr(dtype, 2)]), 0


def _rotary(in_shapes, out_shape, dtype, params, gemm):
    _need(len(in_shapes) == 1 and len(out_shape) == 3 and in_shapes[0] == out_shape and out_shape[2] % 2 == 0,
          "rotary takes x (t, h, dh) with even dh")
    t, h, dh = out_shape
    (gx,), block = cg.elementwise_geometry((dh // 2,))
    grid = (gx, t, -(-h // cg.ROTARY_HEADS_PER_THREAD))
    _need(t <= 65535, f"rotary tile of {t} tokens exceeds the grid limit 65535")
    types = [_arr(dtype, 3), _arr(dtype, 3), scalar_type("i8"), scalar_type("f8")]
    k = Compiled(cg.jit(cg.rotary_source()), types, grid, block)
    sc = (int(params["pos_off"]), float(params.get("theta", 10000.0)))
    return "kernel", lambda stream, out, ins: k.launch(stream, (out, ins[0], *sc)), 0


def _embed(in_shapes, out_shape, dtype, params, gemm):
    (t,), (_, d) = in_shapes
    _need(out_shape == (t, d), "embed takes ids (t,) and table (V, d) -> (t, d)")
    src = cg.elementwise_source(2, 2, [], "x1[x0[b], c]")
    by_itemsize = {}
    for ids in ("int32", "int64"):
        types = [_arr(dtype, 2), _arr(ids, 1), _arr(dtype, 2)]
        by_itemsize[np.dtype(ids).itemsize] = _ew(src, out_shape, types)
    r4, r8 = by_itemsize[4], by_itemsize[8]
    return "kernel", lambda stream, out, ins: (r4 if ins[0].dtype.itemsize == 4 else r8)(stream, out, ins), 0


def _sum_into(in_shapes, out_shape, dtype, params, gemm):
    _need(len(in_shapes) == 2 and in_shapes[0] == out_shape, "sum_into takes (acc, x) with acc shaped as out")
    return _simple(2, "v0 + v1")(in_shapes, out_shape, dtype, params, gemm)


def _mix(in_shapes, out_shape, dtype, params, gemm):
    n = int(params["n_out"])
    _need(out_shape == (n,), f"mix output must be ({n},)")
    loads, terms = [], ["ONE"]
    for k, s in enumerate(in_shapes):
        if int(np.prod(s, dtype=np.int64)) == 0:
            loads.append("ZERO")
            continue
        loads.append(cg.load(k, cg.flat_index(f"c % x{k}.size", len(s), f"x{k}")))
        terms.append(f"np.float32({k + 1}.0) * v{k}")
    src = cg.elementwise_source(len(in_shapes), 1, loads, f"HALF * math.tanh({' + '.join(terms)})")
    types = [_arr("fp32", 1), *(_arr(dtype, s) for s in in_shapes)]
    return "kernel", _ew(src, out_shape, types), 0


_BUILDERS: dict[str, Callable] = {
    "einsum": _einsum,
    "attn_scores": _attn_scores,
    "rowmax": _row_reduce("max"),
    "rowsum": _row_reduce("sum"),
    "max_n": _simple(0, _max_expr),
    "add_n": _simple(0, lambda n: " + ".join(f"v{k}" for k in range(n))),
    "exp_sub": _exp_sub,
    "div_rows": _div_rows,
    "mul": _simple(2, "v0 * v1"),
    "scale": _simple(1, "v0 * s0", n_scalars=1),
    "silu": _simple(1, "v0 / (ONE + math.exp(-v0))"),
    "silu_mul": _simple(2, "v0 / (ONE + math.exp(-v0)) * v1"),
    "rmsnorm": _rmsnorm,
    "rotary": _rotary,
    "embed": _embed,
    "sum_into": _sum_into,
    "mix": _mix,
}
OPS = frozenset(_BUILDERS)  # every op of the specification (``turnip.reference``); a test checks they agree
