"""Numpy references for every kernel op a taskgraph uses: the specification the GPU kernels must match.

Every op takes a list of input arrays (already shaped, row-major, contiguous) and a params dict, and
returns the output array. ``sum_into`` is the one in-place op: it adds its second input into its first
(the accumulator) and returns the accumulator. Half-precision inputs are computed in float32 and cast
back, the way the GPU kernels accumulate.

bf16 arrays use ``ml_dtypes.bfloat16`` (numpy has no bfloat16); like fp16 they compute in float32.

Layouts (t = tokens of a tile, h = heads of a tile, dh = head dim):
  q, attention output: (t, h, dh), or (t, hk, r, dh) with grouped-query attention (any middle axes are
  flattened into query heads, in order); k, v: (t, hk, dh). Query head i reads key/value head
  i // (h / hk) (Hugging Face's ``repeat_kv`` order); hk == h is plain multi-head attention.
  attention partial (``sdpa`` with ``partial``): one flat array of the tile dtype holding the
  normalised partial output O (tq, h, dh) followed by its natural log-sum-exp L (h, tq) as float32 bytes
  (``partial_len`` elements of the tile dtype in all; h counts query heads); ``attn_combine`` merges
  partials over disjoint key ranges: L = logsumexp_j L_j, O = sum_j exp(L_j - L) O_j.
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


def visible_keys(tq: int, tk: int, p) -> np.ndarray:
    """Number of keys each query row of ``sdpa`` sees: keys ``j < tk`` with ``k_off + j <= q_off + i``
    when causal."""
    n = np.full(tq, tk, dtype=np.int64)
    if p.get("causal", True):
        n = np.clip(p["q_off"] - p["k_off"] + 1 + np.arange(tq), 0, tk)
    return n


def partial_len(tq: int, h: int, dh: int, dtype) -> int:
    """Elements (of ``dtype``) of an ``sdpa`` partial: O (tq, h, dh) then L (h, tq) as float32 bytes."""
    return tq * h * dh + -(-h * tq * 4 // np.dtype(dtype).itemsize)


def split_partial(x: np.ndarray, tq: int, h: int, dh: int) -> tuple[np.ndarray, np.ndarray]:
    """Views (O (tq, h, dh), L (h, tq) float32) of a flat partial buffer."""
    n = tq * h * dh
    return x[:n].reshape(tq, h, dh), x[n:].view(np.float32)[: h * tq].reshape(h, tq)


def sdpa(xs, p):
    """Fused causal attention of one query block against keys ``k[:tk]`` (``tk`` param, default all):
    S = scale * q k^T, masked where ``k_off + j > q_off + i`` (if causal), softmax over keys, times v.
    Output (tq, h, dh); with ``partial`` the flat partial (O, log-sum-exp) instead (see module doc).
    Rows that see no key give O = 0 and L = -inf. Computed in float32."""
    q, k, v = (_f32(x) for x in xs)
    q = q.reshape(q.shape[0], -1, q.shape[-1])
    tk = int(p.get("tk", k.shape[0]))
    group = q.shape[1] // k.shape[1]
    if group * k.shape[1] != q.shape[1]:
        raise ValueError(f"sdpa: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads")
    k, v = (np.repeat(x[:tk], group, axis=1) for x in (k, v))
    qh, kh, vh = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q, k, v))  # (h, t, dh)
    h, tq, dh = qh.shape
    s = np.matmul(qh, kh.transpose(0, 2, 1)) * np.asarray(p["scale"], dtype=qh.dtype)  # (h, tq, tk)
    vis = visible_keys(tq, tk, p)
    s = np.where(np.arange(tk)[None, None, :] < vis[None, :, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(axis=-1)  # (h, tq)
    with np.errstate(invalid="ignore", divide="ignore"):
        o = (np.matmul(e, vh) / np.where(den > 0, den, 1.0)[:, :, None]).transpose(1, 0, 2)
        lse = np.where(den > 0, np.log(den) + m[..., 0], -np.inf).astype(np.float32)
    if not p.get("partial", False):
        return _out(o.reshape(xs[0].shape), xs[0])
    out = np.empty(partial_len(tq, h, dh, xs[0].dtype), dtype=xs[0].dtype)
    po, pl = split_partial(out, tq, h, dh)
    po[...] = o
    pl[...] = lse
    return out


def attn_combine(xs, p):
    """Merge ``sdpa`` partials over disjoint key ranges into the output (tq, h, dh) (params tq, h, dh; h
    counts query heads; ``r`` > 1: grouped-query output (tq, h / r, r, dh))."""
    tq, h, dh = p["tq"], p["h"], p["dh"]
    parts = [split_partial(x, tq, h, dh) for x in xs]
    lse = np.stack([pl for _, pl in parts])  # (n, h, tq)
    m = lse.max(axis=0)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lse - m)  # (n, h, tq)
    tot = w.sum(axis=0)
    o = sum(wj.T[:, :, None] * _f32(po) for wj, (po, _) in zip(w, parts, strict=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        o = o / np.where(tot > 0, tot, 1.0).T[:, :, None]
    r = int(p.get("r", 1))
    return _out(o if r == 1 else o.reshape(tq, h // r, r, dh), xs[0])


def concat(xs, p):
    """Concatenation along the first axis (key blocks into one key range)."""
    return np.concatenate(xs, axis=0)


def add_n(xs, p):
    acc = _f32(xs[0]).copy()
    for x in xs[1:]:
        acc += _f32(x)
    return _out(acc, xs[0])


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


def rope_inv_freq(dh: int, p) -> np.ndarray:
    """Rotary frequencies (dh / 2, float64): theta^(-2i/dh), with LLaMA-3 scaling when ``rope_factor`` is
    given (params ``rope_factor``, ``rope_low``, ``rope_high``, ``rope_orig``: Hugging Face's ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``): wavelengths longer
    than rope_orig / rope_low are divided by rope_factor, shorter than rope_orig / rope_high kept, and
    those between blended by smooth = (rope_orig / wavelength - rope_low) / (rope_high - rope_low)."""
    inv = 1.0 / (float(p.get("theta", 10000.0)) ** (np.arange(dh // 2, dtype=np.float64) * 2.0 / dh))
    factor = p.get("rope_factor")
    if not factor:
        return inv
    low, high, orig = float(p["rope_low"]), float(p["rope_high"]), float(p["rope_orig"])
    wavelen = 2.0 * np.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1.0 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen > orig / low, inv / factor, np.where(wavelen < orig / high, inv, blended))


def rotary(xs, p):
    """Rotary embedding, rotate-half convention: x (t, h, dh) or (t, ..., dh) (middle axes are heads),
    positions pos_off + [0, t), frequencies ``rope_inv_freq``."""
    x = _f32(xs[0])
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    t, _, dh = x.shape
    half = dh // 2
    inv = rope_inv_freq(dh, p)
    ang = (p["pos_off"] + np.arange(t, dtype=np.float64))[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return _out(y.reshape(xs[0].shape), xs[0])


def embed(xs, p):
    """out[i, :] = table[ids[i], :]."""
    ids, table = xs
    return table[ids.astype(np.int64)]


def rows(xs, p):
    """out = x[start:stop] along the first axis (the last token's row of a tile, for the LM head)."""
    return np.ascontiguousarray(xs[0][int(p["start"]) : int(p["stop"])])


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
        einsum, add_n, mul, scale, silu,
        silu_mul, rmsnorm, rotary, embed, rows, sum_into, mix, sdpa, attn_combine, concat,
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
