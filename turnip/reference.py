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
  attention gradients (``sdpa_bwd``): (t, hk, (r + 2) dh) with, per token and key-value head, the r query
  heads' dq (r dh values), then dk (dh), then dv (dh); ``cols`` takes each part out.

Training ops (``turnip.autodiff``, ``turnip.train``): backward rules (``rmsnorm_bwd``, ``silu_mul_dg``,
``sdpa_bwd``, ``rotary`` with ``inverse``), the next-token cross-entropy (``xent``, ``xent_bwd``) and the
Adam update (``adam_m``, ``adam_v``, ``adam_p``). Ops whose inputs have another dtype than their output
name it in the ``src`` param (``cast``, ``xent``); targets are int32, negative = ignored.
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
    """out = scale * einsum(subscripts, a, b) (+ addend, a third input of the output's shape); fp32
    accumulation."""
    a, b = xs[:2]
    r = np.einsum(p["subscripts"], _f32(a), _f32(b), optimize=True) * np.float32(p.get("scale", 1.0))
    if len(xs) == 3:
        r = r + _f32(xs[2])
    return _out(r, a)


def visible_keys(tq: int, tk: int, p) -> np.ndarray:
    """One past the last key each query row of ``sdpa`` sees: keys ``j < tk`` with ``k_off + j <= q_off + i``
    when causal."""
    n = np.full(tq, tk, dtype=np.int64)
    if p.get("causal", True):
        n = np.clip(p["q_off"] - p["k_off"] + 1 + np.arange(tq), 0, tk)
    return n


def first_keys(tq: int, tk: int, p) -> np.ndarray:
    """The first key each query row of ``sdpa`` sees: 0, or under a sliding ``window`` (causal only) the
    first ``j`` with ``q_off + i - (k_off + j) < window``."""
    w = int(p.get("window", 0))
    if not w:
        return np.zeros(tq, dtype=np.int64)
    return np.clip(p["q_off"] - p["k_off"] - w + 1 + np.arange(tq), 0, tk)


def key_pairs(tq: int, tk: int, p) -> int:
    """(query, key) pairs ``sdpa`` computes: the keys each row sees, summed over rows."""
    return int(np.maximum(visible_keys(tq, tk, p) - first_keys(tq, tk, p), 0).sum())


def partial_len(tq: int, h: int, dh: int, dtype) -> int:
    """Elements (of ``dtype``) of an ``sdpa`` partial: O (tq, h, dh) then L (h, tq) as float32 bytes."""
    return tq * h * dh + -(-h * tq * 4 // np.dtype(dtype).itemsize)


def split_partial(x: np.ndarray, tq: int, h: int, dh: int) -> tuple[np.ndarray, np.ndarray]:
    """Views (O (tq, h, dh), L (h, tq) float32) of a flat partial buffer."""
    n = tq * h * dh
    return x[:n].reshape(tq, h, dh), x[n:].view(np.float32)[: h * tq].reshape(h, tq)


def packed_sequences(rows: int, p) -> int:
    """Sequences packed in a token tile of ``rows`` rows: ``rows / seq`` with a ``seq`` param below ``rows``
    (``ValueError`` where they are not whole), else 1."""
    s = int(p.get("seq", 0))
    if not s or s >= rows:
        return 1
    if rows % s:
        raise ValueError(f"{rows} rows are not whole sequences of {s}")
    return rows // s


def packed(f):
    """``f`` over whole sequences packed in a token tile (``packed_sequences``): each ``seq`` rows of every
    operand and of the output form one sequence, computed apart (rows of other sequences neither seen nor
    changed; attention's keys: its own sequence's, ``tk`` = ``seq``)."""

    def each(xs, p):
        n = xs[0].shape[0]
        if packed_sequences(n, p) == 1:
            return f(xs, p)
        s = int(p["seq"])
        one = {k: v for k, v in p.items() if k != "seq"} | ({"tk": s} if "tk" in p else {})
        return np.concatenate([f([x[i : i + s] for x in xs], one) for i in range(0, n, s)])

    each.__name__, each.__doc__ = f.__name__, f.__doc__
    return each


@packed
def sdpa(xs, p):
    """Fused causal attention of one query block against keys ``k[:tk]`` (``tk`` param, default all):
    S = scale * q k^T, capped to ``softcap`` tanh(S / ``softcap``) when that param is > 0, masked where
    ``k_off + j > q_off + i`` (if causal) and, with a sliding ``window`` > 0 (causal only), where
    ``q_off + i - (k_off + j) >= window``; softmax over keys, times v. Output (tq, h, dh); with
    ``partial`` the flat partial (O, log-sum-exp) instead (see module doc). Rows that see no key give
    O = 0 and L = -inf. Computed in float32."""
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
    cap = float(p.get("softcap", 0.0))
    if cap > 0:
        s = np.tanh(s / np.asarray(cap, dtype=s.dtype)) * np.asarray(cap, dtype=s.dtype)
    j = np.arange(tk)[None, None, :]
    vis, lo = visible_keys(tq, tk, p), first_keys(tq, tk, p)
    s = np.where((j < vis[None, :, None]) & (j >= lo[None, :, None]), s, -np.inf)
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


GELU_C = 0.7978845608028654  # sqrt(2 / pi), of the tanh approximation of GELU


def gelu_tanh_mul(xs, p):
    """out = gelu(gate) * up with GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    (the GeGLU product; PyTorch's ``gelu(approximate="tanh")``)."""
    g = _f32(xs[0])
    c = np.asarray(GELU_C, dtype=g.dtype)
    return _out(0.5 * g * (1.0 + np.tanh(c * (g + 0.044715 * g * g * g))) * _f32(xs[1]), xs[0])


def softcap(xs, p):
    """out = cap tanh(x / cap) (Gemma 2's soft-capped logits; param ``cap`` > 0)."""
    x = _f32(xs[0])
    cap = np.asarray(float(p["cap"]), dtype=x.dtype)
    return _out(np.tanh(x / cap) * cap, xs[0])


def rmsnorm(xs, p):
    """y = x / sqrt(mean(x^2) + eps) * (w + offset) over the last axis (``offset`` param, default 0;
    Gemma's norms take 1)."""
    x, w = _f32(xs[0]), _f32(xs[1])
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(p.get("eps", 1e-5)))
    off = float(p.get("offset", 0.0))
    return _out(x * r * (w + np.asarray(off, dtype=w.dtype) if off else w), xs[0])


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


@packed
def rotary(xs, p):
    """Rotary embedding, rotate-half convention: x (t, h, dh) or (t, ..., dh) (middle axes are heads),
    positions pos_off + [0, t), frequencies ``rope_inv_freq``; ``inverse``: rotate by minus the angle (the
    transpose: rotary's backward)."""
    x = _f32(xs[0])
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    t, _, dh = x.shape
    half = dh // 2
    inv = rope_inv_freq(dh, p)
    ang = (p["pos_off"] + np.arange(t, dtype=np.float64))[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    if p.get("inverse", False):
        sin = -sin
    x1, x2 = x[..., :half], x[..., half:]
    y = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return _out(y.reshape(xs[0].shape), xs[0])


def rmsnorm_bwd(xs, p):
    """dx of ``rmsnorm`` (x, w) given dy: with r = 1 / sqrt(mean(x^2) + eps) and g = dy * w over the last
    axis, dx = r g - x r^3 mean(x g)."""
    x, w, dy = _f32(xs[0]), _f32(xs[1]), _f32(xs[2])
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + np.float32(p.get("eps", 1e-5)))
    g = dy * w
    return _out(r * g - x * r**3 * (x * g).mean(axis=-1, keepdims=True), xs[0])


def silu_mul_dg(xs, p):
    """d gate of ``silu_mul`` (gate, up) given dy: dy * up * s (1 + gate (1 - s)), s = sigmoid(gate). (d up is
    ``silu_mul(gate, dy)``.)"""
    g, u, dy = (_f32(x) for x in xs)
    s = 1.0 / (1.0 + np.exp(-g))
    return _out(dy * u * s * (1.0 + g * (1.0 - s)), xs[0])


@packed
def sdpa_bwd(xs, p):
    """Gradients of causal ``sdpa`` (full key range, as many keys as queries) from q, k, v, its output o and
    do: with P = softmax(scale q k^T masked), dv = P^T do, dP = do v^T, dS = P (dP - rowsum(do o)),
    dq = scale dS k, dk = scale dS^T q; a key-value head sums over its group. Output (t, hk, (r+2) dh),
    packed as the module doc says. Computed in float32."""
    q, k, v, o, do = (_f32(x) for x in xs)
    t, hk, dh = k.shape
    q, o, do = (x.reshape(t, -1, dh) for x in (q, o, do))
    r = q.shape[1] // hk
    kr, vr = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)
    qh, kh, vh, oh, doh = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q, kr, vr, o, do))  # (h, t, dh)
    sc = np.float32(p["scale"])
    s = np.matmul(qh, kh.transpose(0, 2, 1)) * sc
    vis = visible_keys(t, t, p)
    s = np.where(np.arange(t)[None, None, :] < vis[None, :, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    pr = e / np.where(den > 0, den, 1.0)
    dv = np.matmul(pr.transpose(0, 2, 1), doh)  # (h, t, dh)
    dp = np.matmul(doh, vh.transpose(0, 2, 1))
    ds = pr * (dp - (doh * oh).sum(axis=-1, keepdims=True))
    dq = np.matmul(ds, kh) * sc
    dk = np.matmul(ds.transpose(0, 2, 1), qh) * sc
    dk, dv = (x.reshape(hk, r, t, dh).sum(axis=1) for x in (dk, dv))  # (hk, t, dh)
    out = np.concatenate([dq.transpose(1, 0, 2).reshape(t, hk, r * dh), dk.transpose(1, 0, 2), dv.transpose(1, 0, 2)],
                         axis=-1)  # fmt: skip
    return _out(out, xs[0])


def cols(xs, p):
    """out = x[..., start:stop] with the last axis reshaped to ``tail`` (a part of ``sdpa_bwd``'s output)."""
    x = xs[0]
    return np.ascontiguousarray(x[..., int(p["start"]) : int(p["stop"])]).reshape(*x.shape[:-1], *p["tail"])


def _log_softmax(z):
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def xent(xs, p):
    """Cross-entropy of each row: logsumexp(logits) - logits[target], float32; 0 where target < 0."""
    z, tg = _f32(xs[0]), xs[1].astype(np.int64)
    ls = _log_softmax(z)
    ok = tg >= 0
    loss = -np.take_along_axis(ls, np.where(ok, tg, 0)[:, None], axis=1)[:, 0]
    return np.where(ok, loss, 0.0).astype(np.float32)


def xent_bwd(xs, p):
    """d logits of ``xent`` summed over rows, times ``scale``: (softmax(logits) - onehot(target)) * scale;
    rows whose target < 0 are 0."""
    z, tg = _f32(xs[0]), xs[1].astype(np.int64)
    g = np.exp(_log_softmax(z))
    ok = tg >= 0
    g[np.flatnonzero(ok), tg[ok]] -= 1.0
    g *= ok[:, None] * np.float32(p.get("scale", 1.0))
    return _out(g, xs[0])


_NP = {"fp16": np.float16, "fp32": np.float32}


def _np_dtype(name: str):
    if name == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return _NP[name]


def cast(xs, p):
    """out = alpha * x in the dtype ``dtype`` (param; the vertex's dtype), computed in float32."""
    return (_f32(xs[0]) * np.float32(p.get("alpha", 1.0))).astype(_np_dtype(p["dtype"]))


def adam_m(xs, p):
    """First moment: b1 m + (1 - b1) g (float32)."""
    m, g = _f32(xs[0]), _f32(xs[1])
    b1 = np.float32(p["b1"])
    return (b1 * m + (np.float32(1.0) - b1) * g).astype(np.float32)


def adam_v(xs, p):
    """Second moment: b2 v + (1 - b2) g^2 (float32)."""
    v, g = _f32(xs[0]), _f32(xs[1])
    b2 = np.float32(p["b2"])
    return (b2 * v + (np.float32(1.0) - b2) * g * g).astype(np.float32)


def adam_p(xs, p):
    """Adam's parameter update from the new moments m, v and the step number ``step`` (a 0-d float32 input,
    1 at the first step): p - lr / (1 - b1^step) * m / (sqrt(v) / sqrt(1 - b2^step) + eps), as
    ``torch.optim.Adam``."""
    w, m, v = (_f32(x) for x in xs[:3])
    step = np.float64(np.asarray(xs[3]).reshape(-1)[0])
    bc1 = 1.0 - float(p["b1"]) ** step
    bc2 = 1.0 - float(p["b2"]) ** step
    den = np.sqrt(v) / np.float32(np.sqrt(bc2)) + np.float32(p["eps"])
    return (w - np.float32(p["lr"] / bc1) * m / den).astype(np.float32)


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


def _import_refs() -> dict[str, Ref]:
    """The ops of graphs imported from PyTorch (``turnip.torchimport.kernels``)."""
    from turnip.torchimport.kernels import REFS

    return REFS


REFERENCE: dict[str, Ref] = {
    f.__name__: f
    for f in (
        einsum, add_n, mul, scale, silu,
        silu_mul, gelu_tanh_mul, softcap, rmsnorm, rotary, embed, rows, sum_into, mix, sdpa, attn_combine, concat,
        rmsnorm_bwd, silu_mul_dg, sdpa_bwd, cols, xent, xent_bwd, cast, adam_m, adam_v, adam_p,
    )
}
REFERENCE.update(_import_refs())
IN_PLACE = frozenset({"sum_into"})


def run_reference(op: str, xs: Sequence[np.ndarray], params: Params) -> np.ndarray:
    """Evaluate one op; ``KeyError`` names the unknown op."""
    try:
        f = REFERENCE[op]
    except KeyError:
        raise KeyError(f"no reference for op {op!r}; known: {sorted(REFERENCE)}") from None
    return f(xs, params)
