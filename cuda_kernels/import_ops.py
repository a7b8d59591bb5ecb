"""Builders of the ops of imported graphs (``turnip.torchimport.kernels``, whose numpy references are the
specification): ``ew``, ``softmax``, ``layernorm``, ``reduce``, ``slice``, ``cat`` and ``relayout``.

Elementwise and data-movement ops run one generated kernel over the output's flat index ``i`` (a
grid-stride loop); each operand's element is an index expression of ``i`` over the output's dimensions
merged where every operand is contiguous across them, so a same-shaped operand reads ``x[i]``. The extents,
strides and offsets of those expressions are int64 kernel arguments, so one compiled kernel serves every
geometry of the same structure. Data movement copies elements as they are (bf16 as its uint16 bits).
Norms, softmax and reductions run one block per (outer, inner) pair of the input viewed as (outer, n,
inner) around ``axis``, with shared-memory tree reductions (no warp shuffles, so the simulator runs them).
Each builder returns ``(path, run, flops, bind)`` as every builder of ``cuda_kernels.kernels`` does.
"""

from __future__ import annotations

import math
import os

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels._build import _arr, _kern, _need, _noop, _noop_bind
from cuda_kernels._numba import Compiled, scalar_type

_R2 = "np.float32(0.7071067811865476)"
_C_TANH = "np.float32(0.7978845608028654)"
EW_EXPRS = {  # float32 expressions of v0 (v1), alpha s0, beta s1
    "add": "v0 + v1", "sub": "v0 - v1", "mul": "v0 * v1", "div": "v0 / v1", "copy": "v0",
    "affine": "v0 * s0 + s1", "rsub": "s1 - v0", "rdiv": "s1 / v0", "pow": "math.pow(v0, s0)", "neg": "-v0",
    "exp": "math.exp(v0)", "tanh": "math.tanh(v0)", "sqrt": "math.sqrt(v0)", "rsqrt": "ONE / math.sqrt(v0)",
    "relu": "ZERO if v0 < ZERO else v0", "sigmoid": "ONE / (ONE + math.exp(-v0))",
    "silu": "v0 / (ONE + math.exp(-v0))", "gelu": f"HALF * v0 * (ONE + math.erf(v0 * {_R2}))",
    "gelu_tanh": f"HALF * v0 * (ONE + math.tanh({_C_TANH} * (v0 + np.float32(0.044715) * v0 * v0 * v0)))",
}  # fmt: skip
_BINARY = frozenset({"add", "sub", "mul", "div"})


class _Scalars:
    """The kernel's scalar arguments ``s0, s1, ..`` (float32 or int64), named as they are added."""

    def __init__(self):
        self.values, self.types = [], []

    def add(self, v, kind: str = "i8") -> str:
        self.values.append(np.int64(v) if kind == "i8" else np.float32(v))
        self.types.append(scalar_type(kind))
        return f"s{len(self.values) - 1}"


def _cstrides(shape) -> list[int]:
    st, acc = [], 1
    for e in reversed(shape):
        st.append(acc)
        acc *= int(e)
    return st[::-1]


def _merge(sizes, strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Dimensions of extent 1 dropped and neighbours merged where every operand's stride allows."""
    keep = [a for a, e in enumerate(sizes) if e != 1]
    ms, mst = [], [[] for _ in strides]
    for a in keep:
        if ms and all(st[a] * sizes[a] == m[-1] for st, m in zip(strides, mst, strict=True)):
            ms[-1] *= sizes[a]
            for st, m in zip(strides, mst, strict=True):
                m[-1] = st[a]
        else:
            ms.append(int(sizes[a]))
            for st, m in zip(strides, mst, strict=True):
                m.append(st[a])
    return ms, mst


def _index(sizes, strides, sc: _Scalars, base: int = 0) -> str:
    """Index expression of flat element ``i`` of an iteration space ``sizes`` (row-major) in an operand
    with ``strides`` per dimension (0: broadcast), plus ``base``."""
    post = _cstrides(sizes)
    terms = []
    for j, (e, st) in enumerate(zip(sizes, strides, strict=True)):
        if st == 0:
            continue
        q = "i" if post[j] == 1 else f"(i // {sc.add(post[j])})"
        coord = q if j == 0 else f"({q} % {sc.add(e)})"
        terms.append(coord if st == 1 else f"{coord} * {sc.add(st)}")
    if base:
        terms.append(sc.add(base))
    return " + ".join(terms) or "0"


def _flat_source(n_in: int, n_sc: int, body: list[str]) -> str:
    """``kern(out, x0.., s0.., cnt)``: for each flat ``i < cnt`` the ``body`` lines (indented for the
    loop) set ``val``, stored at ``out[i]``."""
    args = ["out", *(f"x{k}" for k in range(n_in)), *(f"s{k}" for k in range(n_sc)), "cnt"]
    L = [f"def kern({', '.join(args)}):", cg._CONSTS.rstrip("\n"),
         "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
         "    step = cuda.gridDim.x * cuda.blockDim.x", "    while i < cnt:"]
    L += [f"        {b}" for b in body] + ["        out[i] = val", "        i += step"]
    return "\n".join(L) + "\n"


def _flat_kernel(src: str, n: int, dtype: str, in_dtypes: list, sc: _Scalars, bits: bool):
    """(run, bind) of ``_flat_source`` over ``n`` elements; arrays are passed flat."""
    if n == 0:
        return _noop, _noop_bind
    (gx,), block = cg.elementwise_geometry((n,))
    types = [_arr(dtype, 1), *(_arr(d, 1) for d in in_dtypes), *sc.types, scalar_type("i8")]
    k = Compiled(cg.jit(src), types, (gx,), block)
    args = (*sc.values, np.int64(n))
    return _kern(k, lambda out, ins: (out.reshape(out.size), *(x.reshape(x.size) for x in ins), *args), bits)


# ---------------------------------------------------------------- elementwise


def _ew_shape(in_shapes, axes, n: int) -> tuple:
    ext = [1] * n
    for shape, ax in zip(in_shapes, axes, strict=True):
        _need(len(shape) == len(ax), f"input of shape {shape} placed at axes {ax}")
        for s, a in zip(shape, ax, strict=True):
            if a < 0:
                _need(s == 1, f"input of shape {shape} drops axis of extent {s}")
                continue
            _need(0 <= a < n and ext[a] in (1, s), f"axis {a} is {ext[a]} and {s}")
            ext[a] = max(ext[a], s)
    return tuple(ext)


def _ew(in_shapes, out_shape, dtype, params, opts):
    fn, n = params["fn"], int(params["n"])
    axes = [list(map(int, a)) for a in params["axes"]]
    _need(fn in EW_EXPRS, f"ew function {fn!r} not in {sorted(EW_EXPRS)}")
    _need(len(in_shapes) == (2 if fn in _BINARY else 1) == len(axes), f"ew {fn} of {len(in_shapes)} inputs")
    _need(_ew_shape(in_shapes, axes, n) == out_shape, f"ew output {out_shape} of inputs {in_shapes} at {axes}")
    strides = []
    for shape, ax in zip(in_shapes, axes, strict=True):
        st = [0] * n
        for s, a, c in zip(shape, ax, _cstrides(shape), strict=True):
            if a >= 0 and s != 1:
                st[a] = c
        strides.append(st)
    sizes, strides = _merge(out_shape, strides)
    sc, bf = _Scalars(), dtype == "bf16"
    sc.add(params.get("alpha", 1.0), "f4")
    sc.add(params.get("beta", 0.0), "f4")
    body = [f"v{k} = {cg.ld(f'x{k}[{_index(sizes, st, sc)}]', bf)}" for k, st in enumerate(strides)]
    body.append(f"val = {cg.st(EW_EXPRS[fn], bf)}")
    src = _flat_source(len(in_shapes), len(sc.values), body)
    run, bind = _flat_kernel(src, math.prod(out_shape), dtype, [dtype] * len(in_shapes), sc, bf)
    return "kernel", run, 0, bind


# ---------------------------------------------------------------- row reductions


def _split(shape, ax: int) -> tuple[int, int, int]:
    return math.prod(shape[:ax]), int(shape[ax]), math.prod(shape[ax + 1 :])


def _tree(block: int, arr: str, op: str) -> list[str]:
    """Lines combining the shared ``arr`` into slot 0 (``op``: sum or max), a barrier before and after."""
    comb = f"{arr}[t] + {arr}[t + s]" if op == "sum" else f"{arr}[t] if {arr}[t] >= {arr}[t + s] else {arr}[t + s]"
    return ["    cuda.syncthreads()", f"    s = {block // 2}", "    while s > 0:", "        if t < s:",
            f"            {arr}[t] = {comb}", "        cuda.syncthreads()", "        s //= 2"]


def _pass(block: int, init: str, step: str, x: str) -> list[str]:
    """A thread's partial over its columns ``j`` of the row: ``acc = step`` with ``v`` the element."""
    return [f"    acc = {init}", "    j = t", "    while j < n:", f"        v = {x}", f"        acc = {step}",
            f"        j += {block}", "    sh[t] = acc"]


def row_source(kind: str, block: int, bf16: bool = False) -> str:
    """One block per row (a, c) of x viewed as (outer, n, inner), columns j a block apart. ``kind``:
    ``softmax`` ``kern(out, x)``; ``layernorm`` ``kern(out, x, w, b, eps)`` (w, b (n,)); ``sum``,
    ``mean``, ``max`` ``kern(out, x)`` with out (outer, inner)."""
    x = cg.ld("x[a, j, c]", bf16)
    args = "out, x, w, b, eps" if kind == "layernorm" else "out, x"
    L = [f"def kern({args}):", cg._CONSTS.rstrip("\n"), f"    sh = cuda.shared.array({block}, np.float32)",
         "    row = cuda.blockIdx.x", "    a = row // x.shape[2]", "    c = row % x.shape[2]",
         "    t = cuda.threadIdx.x", "    n = x.shape[1]"]
    if kind in ("sum", "mean", "max"):
        mx = kind == "max"
        L += _pass(block, "NEG_INF" if mx else "ZERO", "v if v > acc else acc" if mx else "acc + v", x)
        L += _tree(block, "sh", kind if mx else "sum")
        r = "sh[0]" if kind != "mean" else "sh[0] / np.float32(n)"
        L += ["    if t == 0:", f"        out[a, c] = {cg.st(r, bf16)}"]
        return "\n".join(L) + "\n"
    if kind == "softmax":
        L += _pass(block, "NEG_INF", "v if v > acc else acc", x) + _tree(block, "sh", "max")
        L += ["    m = sh[0]", "    cuda.syncthreads()", *_pass(block, "ZERO", "acc + math.exp(v - m)", x)]
        L += _tree(block, "sh", "sum")
        L += ["    r = ONE / sh[0]", "    j = t", "    while j < n:",
              f"        out[a, j, c] = {cg.st(f'math.exp({x} - m) * r', bf16)}", f"        j += {block}"]
        return "\n".join(L) + "\n"
    wi = "j"
    L += _pass(block, "ZERO", "acc + v", x) + _tree(block, "sh", "sum")
    L += ["    mu = sh[0] / np.float32(n)", "    cuda.syncthreads()",
          *_pass(block, "ZERO", "acc + (v - mu) * (v - mu)", x), *_tree(block, "sh", "sum"),
          "    r = ONE / math.sqrt(sh[0] / np.float32(n) + eps)", "    j = t", "    while j < n:",
          f"        y = ({x} - mu) * r * {cg.ld(f'w[{wi}]', bf16)} + {cg.ld(f'b[{wi}]', bf16)}",
          f"        out[a, j, c] = {cg.st('y', bf16)}", f"        j += {block}"]
    return "\n".join(L) + "\n"


def _rows(kind, x_shape, ax, out_view, dtype, n_w=0, scalars=()):
    o, n, inner = _split(x_shape, ax)
    _need(n > 0 or kind != "max", f"max over an empty axis {ax} of {x_shape}")
    if o * inner == 0 or (n == 0 and kind in ("softmax", "layernorm")):
        return "kernel", _noop, 0, _noop_bind
    blk, bf = cg.row_block(), dtype == "bf16"
    w_types = [_arr(dtype, 1)] * n_w
    types = [_arr(dtype, len(out_view)), _arr(dtype, 3), *w_types, *[scalar_type("f4")] * len(scalars)]
    k = Compiled(cg.jit(row_source(kind, blk, bf)), types, (o * inner,), (blk,))
    v3 = (o, n, inner)

    def args_of(out, ins):
        return (out.reshape(out_view), ins[0].reshape(v3), *ins[1 : 1 + n_w], *scalars)

    run, bind = _kern(k, args_of, bf)
    return "kernel", run, 0, bind


def _axis(shape, params) -> int:
    ax = int(params["axis"])
    _need(0 <= ax < len(shape), f"axis {ax} of a block of shape {shape}")
    return ax


def _softmax(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 1 and in_shapes[0] == out_shape, "softmax takes x and gives its shape")
    ax = _axis(out_shape, params)
    return _rows("softmax", out_shape, ax, _split(out_shape, ax), dtype)


def _layernorm(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 3 and in_shapes[0] == out_shape, "layernorm takes x, w and b and gives x's shape")
    ax = _axis(out_shape, params)
    _need(in_shapes[1] == in_shapes[2] == (out_shape[ax],), f"weights {in_shapes[1:]} of a norm over axis {ax} "
          f"of {out_shape} are not ({out_shape[ax]},)")
    return _rows("layernorm", out_shape, ax, _split(out_shape, ax), dtype, 2,
                 (np.float32(params.get("eps", 1e-5)),))


def _reduce(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 1 and len(in_shapes[0]) >= 1, "reduce takes one input of rank >= 1")
    ax = _axis(in_shapes[0], params)
    fn = params["fn"]
    _need(fn in ("sum", "mean", "max"), f"reduce {fn!r} not sum, mean or max")
    _need(out_shape == in_shapes[0][:ax] + in_shapes[0][ax + 1 :], f"reduce over axis {ax} gives {out_shape}")
    o, _, inner = _split(in_shapes[0], ax)
    return _rows(fn, in_shapes[0], ax, (o, inner), dtype)


# ---------------------------------------------------------------- data movement (bits copied as they are)


def _gather(sizes, strides, base, out_shape, dtype):
    sizes, (st,) = _merge(sizes, [strides])
    sc = _Scalars()
    idx = _index(sizes, st, sc, base)
    src = _flat_source(1, len(sc.values), [f"val = x0[{idx}]"])
    run, bind = _flat_kernel(src, math.prod(out_shape), dtype, [dtype], sc, dtype == "bf16")
    return "kernel", run, 0, bind


def _slice(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 1, "slice takes one input")
    x = in_shapes[0]
    ax = _axis(x, params)
    a, b, drop = int(params["start"]), int(params["stop"]), bool(params.get("drop"))
    _need(0 <= a < b <= x[ax] and (not drop or b - a == 1), f"slice [{a}, {b}) of axis {ax} of {x} (drop {drop})")
    want = x[:ax] + (() if drop else (b - a,)) + x[ax + 1 :]
    _need(out_shape == want, f"slice of {x} gives {want}, not {out_shape}")
    st = _cstrides(x)
    sizes = list(x[:ax]) + [b - a] + list(x[ax + 1 :])
    return _gather(sizes, st, a * st[ax], out_shape, dtype)


def _relayout(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 1, "relayout takes one input")
    x, perm = in_shapes[0], [int(p) for p in params["perm"]]
    _need(sorted(perm) == list(range(len(x))), f"perm {perm} of a block of shape {x}")
    t = tuple(x[i] for i in perm)
    tgt = tuple(t[-1 - s] if s < 0 else s for s in map(int, params["shape"]))
    _need(tgt == out_shape and math.prod(t) == math.prod(x), f"relayout of {x} by {perm} to {tgt}, not {out_shape}")
    st = _cstrides(x)
    return _gather(list(t), [st[i] for i in perm], 0, out_shape, dtype)


def _cat(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) >= 1, "cat takes inputs")
    ax, stack = int(params["axis"]), bool(params.get("stack"))
    if stack:
        _need(len(set(in_shapes)) == 1 and 0 <= ax <= len(in_shapes[0]), f"stack of {in_shapes} at axis {ax}")
        want, views = (*in_shapes[0][:ax], len(in_shapes), *in_shapes[0][ax:]), [1] * len(in_shapes)
        inner = math.prod(in_shapes[0][ax:])
    else:
        _need(0 <= ax < len(in_shapes[0]) and len({s[:ax] + s[ax + 1 :] for s in in_shapes}) == 1,
              f"cat along axis {ax} of {in_shapes}")
        want = (*in_shapes[0][:ax], sum(s[ax] for s in in_shapes), *in_shapes[0][ax + 1 :])
        views = [s[ax] for s in in_shapes]
        inner = math.prod(in_shapes[0][ax + 1 :])
    _need(out_shape == want, f"cat of {in_shapes} at axis {ax} gives {want}, not {out_shape}")
    total, offs = sum(views), np.cumsum([0, *views]).tolist()
    sc = _Scalars()
    inn, tot = sc.add(inner), sc.add(total * inner)
    body = [f"r = i % {tot}", f"o = i // {tot}", f"bb = r // {inn}", f"cc = r % {inn}"]
    live = [k for k in range(len(in_shapes)) if views[k]]
    for q, k in enumerate(live):
        line = f"val = x{k}[o * {sc.add(views[k] * inner)} + (bb - {sc.add(offs[k])}) * {inn} + cc]"
        if len(live) == 1:
            body.append(line)
            continue
        head = "else:" if q == len(live) - 1 else f"{'if' if q == 0 else 'elif'} bb < {sc.add(offs[k + 1])}:"
        body += [head, f"    {line}"]
    src = _flat_source(len(in_shapes), len(sc.values), body)
    run, bind = _flat_kernel(src, math.prod(out_shape), dtype, [dtype] * len(in_shapes), sc, dtype == "bf16")
    return "kernel", run, 0, bind


SWITCH = "TURNIP_IMPORT_KERNELS"  # "0": refuse these kernels on a real GPU (on by default since run on an H100)


def _gated(build):
    """``build``, unless ``TURNIP_IMPORT_KERNELS=0`` on a real GPU (a plan using them is then refused at load,
    naming the op). On by default: the imported MLP, GPT-2, ViT and LLaMA ran on an H100 within fp16 tolerance
    of PyTorch (``benchmarks/import_check.py``)."""

    def gated(in_shapes, out_shape, dtype, params, opts):
        from cuda_kernels._numba import simulating

        if not simulating() and os.environ.get(SWITCH) == "0":
            raise ValueError(f"the imported graphs' kernels are off ({SWITCH}=0); unset it to use them")
        return build(in_shapes, out_shape, dtype, params, opts)

    return gated


BUILDERS = {name: _gated(b) for name, b in {"ew": _ew, "softmax": _softmax, "layernorm": _layernorm,
                                             "reduce": _reduce, "slice": _slice, "relayout": _relayout,
                                             "cat": _cat}.items()}  # fmt: skip
