"""Numpy references for every kernel op a taskgraph uses: the specification the GPU kernels must match.

Every op takes a list of input arrays (already shaped, row-major, contiguous) and a params dict, and
returns the output array. ``sum_into`` is the one in-place op: it adds its second input into its first
(the accumulator) and returns the accumulator. Half-precision inputs are computed in float32 and cast
back, the way the GPU kernels accumulate.

Layouts (t = tokens of a tile, h = heads of a tile, dh = head dim):
  q, k, v, attention output: (t, h, dh)     scores / exp tiles: (h, tq, tk)     row stats: (h, tq)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Params = dict
Ref = Callable[[Sequence[np.ndarray], Params], np.ndarray]


def _f32(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32, copy=False)


def _out(x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return x.astype(like.dtype, copy=False)


def einsum(xs, p):
    """out = scale * einsum(subscripts, a, b); fp32 accumulation."""
    a, b = xs
    r = np.einsum(p["subscripts"], _f32(a), _f32(b), optimize=True)
    return _out(r * np.float32(p.get("scale", 1.0)), a)


def attn_scores(xs, p):
    """S[h, i, j] = scale * q[i, h, :] . k[j, h, :], -inf where (q_off + i) < (k_off + j) if causal."""
    q, k = xs
    s = np.einsum("ihd,jhd->hij", _f32(q), _f32(k)) * np.float32(p["scale"])
    if p.get("causal", True):
        qi = p["q_off"] + np.arange(q.shape[0])[:, None]
        kj = p["k_off"] + np.arange(k.shape[0])[None, :]
        s = np.where(qi >= kj, s, -np.inf)
    return _out(s, q)


def rowmax(xs, p):
    return xs[0].max(axis=-1)


def max_n(xs, p):
    return _out(np.maximum.reduce([_f32(x) for x in xs]), xs[0])


def exp_sub(xs, p):
    """E = exp(S - m[..., None]); rows that are all -inf give 0."""
    s, m = _f32(xs[0]), _f32(xs[1])
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        return _out(np.exp(s - m[..., None]), xs[0])


def rowsum(xs, p):
    return _out(_f32(xs[0]).sum(axis=-1), xs[0])


def add_n(xs, p):
    acc = _f32(xs[0]).copy()
    for x in xs[1:]:
        acc += _f32(x)
    return _out(acc, xs[0])


def div_rows(xs, p):
    """out[i, h, :] = o[i, h, :] / l[h, i]."""
    o, l = _f32(xs[0]), _f32(xs[1])
    return _out(o / l.T[:, :, None], xs[0])


def mul(xs, p):
    return _out(_f32(xs[0]) * _f32(xs[1]), xs[0])


def scale(xs, p):
    return _out(_f32(xs[0]) * np.float32(p["alpha"]), xs[0])


def _silu(x):
    return x / (1.0 + np.exp(-x))


def silu(xs, p):
    return _out(_silu(_f32(xs[0])), xs[0])


def silu_mul(xs, p):
    """out = silu(gate) * up (the SwiGLU product)."""
    return _out(_silu(_f32(xs[0])) * _f32(xs[1]), xs[0])


def rmsnorm(xs, p):
    """y = x / sqrt(mean(x^2) + eps) * w over the last axis."""
    x, w = _f32(xs[0]), _f32(xs[1])
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(p.get("eps", 1e-5)))
    return _out(x * r * w, xs[0])


def rotary(xs, p):
    """Rotary embedding, rotate-half convention: x (t, h, dh), positions pos_off + [0, t)."""
    x = _f32(xs[0])
    t, _, dh = x.shape
    half = dh // 2
    inv = 1.0 / (p.get("theta", 10000.0) ** (np.arange(half, dtype=np.float64) * 2.0 / dh))
    ang = (p["pos_off"] + np.arange(t, dtype=np.float64))[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return _out(np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1), xs[0])


def embed(xs, p):
    """out[i, :] = table[ids[i], :]."""
    ids, table = xs
    return table[ids.astype(np.int64)]


def sum_into(xs, p):
    """acc += x, in place on xs[0]; returns acc."""
    acc, x = xs
    acc[...] = _out(_f32(acc) + _f32(x), acc)
    return acc


def mix(xs, p):
    """Test op for random DAGs: out[i] = 1 + sum_k (k + 1) * in_k[i mod len(in_k)], on float32 vectors."""
    n = p["n_out"]
    out = np.ones(n, dtype=np.float32)
    idx = np.arange(n)
    for k, x in enumerate(xs):
        x = x.reshape(-1)
        out += np.float32(k + 1) * x[idx % x.size] if x.size else 0
    return np.float32(0.5) * np.tanh(out)


REFERENCE: dict[str, Ref] = {
    f.__name__: f
    for f in (
        einsum, attn_scores, rowmax, max_n, exp_sub, rowsum, add_n, div_rows, mul, scale, silu,
        silu_mul, rmsnorm, rotary, embed, sum_into, mix,
    )
}
IN_PLACE = frozenset({"sum_into"})


def run_reference(op: str, xs: Sequence[np.ndarray], params: Params) -> np.ndarray:
    """Evaluate one op; ``KeyError`` names the unknown op."""
    try:
        f = REFERENCE[op]
    except KeyError:
        raise KeyError(f"no reference for op {op!r}; known: {sorted(REFERENCE)}") from None
    return f(xs, params)
