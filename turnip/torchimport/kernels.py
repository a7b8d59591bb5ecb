"""Kernel ops of imported graphs: their output shapes, work and numpy references.

An exported program's elementwise arithmetic, reductions, norms, softmax and data movement become these ops;
contractions, fused attention and embedding lookups use the ops every model uses (``turnip.ops``). Every op
here reads numpy arrays and writes one new array; axes are positions in the vertex's block, so the ops never
depend on dimension letters:

  ew        ``fn`` (``EW_FNS``) of one or two inputs, each input's axis ``i`` placed at output axis
            ``axes[k][i]`` (missing axes broadcast); ``alpha`` / ``beta``: scalar operands
  reduce    sum, mean or max over ``axis`` (dropped)
  layernorm (x - mean) / sqrt(var + eps) * w + b over ``axis`` (the last); softmax over ``axis``
  relayout  ``x.transpose(perm).reshape(shape)``; a negative entry ``-1 - k`` of ``shape`` is the transposed
            block's extent on axis ``k`` (a dimension kept as it is, which may be tiled)
  slice     ``x[..., start:stop, ...]`` on ``axis`` (``drop``: ``x[..., start, ...]``, the axis removed); cat:
            inputs concatenated along ``axis`` (``stack``: stacked along a new axis there)

The tables ``SPECS`` and ``REFS`` are merged into ``turnip.ops.OPS`` and ``turnip.reference.REFERENCE``.
"""

from __future__ import annotations

import math

import numpy as np

_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _erf(x):
    """erf to 1.2e-7 (Numerical Recipes' erfc), vectorised."""
    z = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))  # fmt: skip
    r = 1.0 - t * np.exp(poly)
    return np.where(x >= 0, r, -r).astype(np.float32)


EW_FNS = {
    "add": lambda a, b, p: a + b,
    "sub": lambda a, b, p: a - b,
    "mul": lambda a, b, p: a * b,
    "div": lambda a, b, p: a / b,
    "copy": lambda a, b, p: a,
    "affine": lambda a, b, p: a * np.float32(p.get("alpha", 1.0)) + np.float32(p.get("beta", 0.0)),
    "rsub": lambda a, b, p: np.float32(p["beta"]) - a,
    "rdiv": lambda a, b, p: np.float32(p["beta"]) / a,
    "pow": lambda a, b, p: a ** np.float32(p["alpha"]),
    "neg": lambda a, b, p: -a,
    "exp": lambda a, b, p: np.exp(a),
    "tanh": lambda a, b, p: np.tanh(a),
    "sqrt": lambda a, b, p: np.sqrt(a),
    "rsqrt": lambda a, b, p: 1.0 / np.sqrt(a),
    "relu": lambda a, b, p: np.maximum(a, 0),
    "sigmoid": lambda a, b, p: 1.0 / (1.0 + np.exp(-a)),
    "silu": lambda a, b, p: a / (1.0 + np.exp(-a)),
    "gelu": lambda a, b, p: 0.5 * a * (1.0 + _erf(a / np.float32(math.sqrt(2.0)))),
    "gelu_tanh": lambda a, b, p: 0.5 * a * (1.0 + np.tanh(np.float32(_SQRT_2_PI) * (a + 0.044715 * a * a * a))),
}
BINARY = frozenset({"add", "sub", "mul", "div"})


def _f32(x):
    return x.astype(np.float32, copy=False)


def _placed(x, axes, n_out):
    """``x`` with its axes moved to output positions ``axes`` (-1: a size-1 axis dropped) and size-1 axes
    where it has none."""
    x = _f32(x).reshape([s for s, a in zip(x.shape, axes, strict=True) if a >= 0])
    axes = [a for a in axes if a >= 0]
    y = np.transpose(x, np.argsort(axes))
    shape = [1] * n_out
    for i, a in enumerate(sorted(axes)):
        shape[a] = y.shape[i]
    return y.reshape(shape)


def ew(xs, p):
    n = int(p["n"])
    a = _placed(xs[0], p["axes"][0], n)
    b = _placed(xs[1], p["axes"][1], n) if len(xs) > 1 else None
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        r = EW_FNS[p["fn"]](a, b, p)
    shape = _ew_shape([x.shape for x in xs], p)
    return np.ascontiguousarray(np.broadcast_to(r, shape)).astype(xs[0].dtype, copy=False)


def reduce(xs, p):
    x = _f32(xs[0])
    f = {"sum": np.sum, "mean": np.mean, "max": np.max}[p["fn"]]
    return np.ascontiguousarray(f(x, axis=int(p["axis"]))).astype(xs[0].dtype)


def layernorm(xs, p):
    x, w, b = (_f32(v) for v in xs)
    ax = int(p["axis"])
    at = [1] * x.ndim
    at[ax] = x.shape[ax]
    w, b = w.reshape(at), b.reshape(at)
    mu = x.mean(axis=ax, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=ax, keepdims=True)
    return ((x - mu) / np.sqrt(var + np.float32(p["eps"])) * w + b).astype(xs[0].dtype)


def softmax(xs, p):
    x = _f32(xs[0])
    ax = int(p["axis"])
    e = np.exp(x - x.max(axis=ax, keepdims=True))
    return (e / e.sum(axis=ax, keepdims=True)).astype(xs[0].dtype)


def relayout(xs, p):
    y = np.transpose(xs[0], p["perm"])
    return np.ascontiguousarray(y.reshape(_relayout_target(y.shape, p["shape"])))


def tslice(xs, p):
    ax = int(p["axis"])
    idx = [slice(None)] * xs[0].ndim
    idx[ax] = int(p["start"]) if p.get("drop") else slice(int(p["start"]), int(p["stop"]))
    return np.ascontiguousarray(xs[0][tuple(idx)])


def cat(xs, p):
    return (np.stack if p.get("stack") else np.concatenate)(xs, axis=int(p["axis"]))


def _relayout_target(tshape, shape):
    return tuple(tshape[-1 - s] if s < 0 else s for s in shape)


def _ew_shape(ins, p):
    ext = [1] * int(p["n"])
    for shape, axes in zip(ins, p["axes"], strict=True):
        if len(shape) != len(axes):
            raise ValueError(f"input of shape {shape} placed at axes {axes}")
        for s, a in zip(shape, axes, strict=True):
            if a < 0:
                continue
            if ext[a] not in (1, s):
                raise ValueError(f"axis {a} is {ext[a]} and {s}")
            ext[a] = max(ext[a], s)
    return tuple(ext)


def _reduce_shape(ins, p):
    s = list(ins[0])
    del s[int(p["axis"])]
    return tuple(s)


def _norm_shape(ins, p):
    x = ins[0]
    ax = int(p["axis"])
    if any(tuple(s) not in ((x[ax],), tuple(x)) for s in ins[1:]):
        raise ValueError(f"weights {ins[1:]} of a norm over axis {ax} of {x}")
    return tuple(x)


def _relayout_shape(ins, p):
    x = ins[0]
    if sorted(p["perm"]) != list(range(len(x))):
        raise ValueError(f"perm {p['perm']} of a block of shape {x}")
    t = tuple(x[i] for i in p["perm"])
    out = _relayout_target(t, p["shape"])
    if math.prod(out) != math.prod(x):
        raise ValueError(f"relayout of {x} to {out}")
    return out


def _slice_shape(ins, p):
    s, ax = list(ins[0]), int(p["axis"])
    a, b = int(p["start"]), int(p["stop"])
    if not 0 <= a < b <= s[ax]:
        raise ValueError(f"slice [{a}, {b}) of axis {ax} of {tuple(s)}")
    if p.get("drop") and b - a != 1:
        raise ValueError(f"slice [{a}, {b}) of axis {ax} drops the axis, so it takes one index")
    s[ax] = b - a
    return tuple(s[:ax] + s[ax + 1 :]) if p.get("drop") else tuple(s)


def _cat_shape(ins, p):
    ax = int(p["axis"])
    if p.get("stack"):
        if len({tuple(x) for x in ins}) != 1:
            raise ValueError(f"stack of {ins}")
        return (*ins[0][:ax], len(ins), *ins[0][ax:])
    rest = [tuple(s[:ax]) + tuple(s[ax + 1 :]) for s in ins]
    if len(set(rest)) != 1:
        raise ValueError(f"cat along axis {ax} of {ins}")
    s = list(ins[0])
    s[ax] = sum(x[ax] for x in ins)
    return tuple(s)


def _n(shape) -> int:
    return math.prod(shape)


# (name, arity, output shape, flops); the shapes raise ValueError naming what is wrong
SPECS = (
    ("ew", None, _ew_shape, lambda ins, out, p: 4.0 * _n(out)),
    ("reduce", 1, _reduce_shape, lambda ins, out, p: float(_n(ins[0]))),
    ("layernorm", 3, _norm_shape, lambda ins, out, p: 8.0 * _n(out)),
    ("softmax", 1, lambda ins, p: tuple(ins[0]), lambda ins, out, p: 5.0 * _n(out)),
    ("relayout", 1, _relayout_shape, lambda ins, out, p: 0.0),
    ("slice", 1, _slice_shape, lambda ins, out, p: 0.0),
    ("cat", None, _cat_shape, lambda ins, out, p: 0.0),
)
REFS = {"ew": ew, "reduce": reduce, "layernorm": layernorm, "softmax": softmax, "relayout": relayout,
        "slice": tslice, "cat": cat}  # fmt: skip
