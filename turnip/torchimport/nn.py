"""Lowering rules for contractions, norms, reductions, softmax, embeddings, patch convolutions and fused
attention."""

from __future__ import annotations

import math

from turnip.torchimport.rules import Context, _is_tensor, ew
from turnip.torchimport.values import TV, Inp, Lin, Unsupported, in_torch_order, physical, single, to_numpy
from turnip.torchimport.views import _axis, torch_shape


def _tensorish(x) -> bool:
    return isinstance(x, TV | Lin | Inp)


def linear(ctx: Context, x, w, b=None):
    if _is_tensor(w) and (b is None or _is_tensor(b)):
        return Lin(ctx.force(x), w, b)
    y = matmul(ctx, x, transpose_last(ctx, w))
    return y if b is None else ew(ctx, "add", y, b)


def transpose_last(ctx, w):
    if _is_tensor(w):
        return w.transpose(-1, -2)
    from turnip.torchimport.views import transpose

    return transpose(ctx, w, -1, -2)


def addmm(ctx, b, x, w, beta=1, alpha=1):
    if beta != 1 or alpha != 1:
        raise Unsupported("addmm with alpha or beta")
    if _is_tensor(w) and _is_tensor(b):
        return Lin(ctx.force(x), w.t(), b)
    return ew(ctx, "add", matmul(ctx, x, w), b)


def mm(ctx, a, b):
    if _is_tensor(b) and b.dim() == 2:
        return Lin(ctx.force(a), b.t(), None)
    return matmul(ctx, a, b)


def matmul(ctx: Context, a, b):
    """``a @ b`` with torch's batch broadcasting: one einsum vertex."""
    if _is_tensor(b) and b.dim() == 2 and _tensorish(a):
        return Lin(ctx.force(a), b.t(), None)
    ir = ctx.ir
    A, B = ctx.force(a), ctx.force(b)
    if len(A.groups) < 2 or len(B.groups) < 2:
        raise Unsupported("a matrix product of a vector")
    for attempt in range(2):
        try:
            return _matmul(ir, A, B)
        except _Layout:
            if attempt:
                raise Unsupported("operands whose axes are split differently") from None
            A, B = in_torch_order(ir, A), in_torch_order(ir, B)
    raise AssertionError


class _Layout(Exception):
    pass


def _matmul(ir, A: TV, B: TV) -> TV:
    da, db = physical(ir, A), physical(ir, B)
    idx: dict[int, int] = {d: i for i, d in enumerate(da)}
    nxt = len(da)
    rank = max(len(A.groups), len(B.groups))
    ga = [()] * (rank - len(A.groups)) + list(A.groups)
    gb = [()] * (rank - len(B.groups)) + list(B.groups)
    pairs = [(ga[i], gb[i]) for i in range(rank - 2)] + [(ga[-1], gb[-2])]
    shared: dict[int, int] = {}  # B dim -> A dim
    for x, y in pairs:
        ex, ey = [ir.ext[d] for d in x if ir.ext[d] > 1], [ir.ext[d] for d in y if ir.ext[d] > 1]
        if ex and ey and ex != ey:
            raise _Layout
        if ex and ey:
            for p, q in zip([d for d in x if ir.ext[d] > 1], [d for d in y if ir.ext[d] > 1], strict=True):
                if p not in da or q not in db:
                    raise Unsupported("a matrix product over a broadcast axis")
                shared[q] = p
                ir.join(p, q)
    contracted = {d for d in ga[-1] if d in da}
    ib = []
    for d in db:
        if d in shared:
            ib.append(idx[shared[d]])
        else:
            ib.append(nxt)
            idx[d], nxt = nxt, nxt + 1
    keep = [d for d in da if d not in contracted] + [d for d in db if d not in shared]
    out = [ir.like(d) for d in keep]
    m = dict(zip(keep, out, strict=True))
    r = ir.add("einsum", [A.rec, B.rec], out, {"idx": [[idx[d] for d in da], ib], "out": [idx[d] for d in keep]})
    batch = [x if math.prod(ir.ext[d] for d in x) > 1 else y for x, y in zip(ga[:-2], gb[:-2], strict=True)]
    groups = [*batch, ga[-2], gb[-1]]
    return TV(r, [tuple(m.get(d, d) for d in g) for g in groups])


def embedding(ctx: Context, w, ids, padding_idx=-1, scale_grad=False, sparse=False):
    if not _is_tensor(w):
        raise Unsupported("an embedding table that is computed")
    ir = ctx.ir
    if isinstance(ids, Inp):  # gathered on the host, as the builder does
        return _host_gather(ctx, w, ids)
    iv = ctx.force(ids)
    if len(physical(ir, iv)) != 1:
        raise Unsupported("token ids of more than one sequence")
    table = ctx.const(w, ctx.names.get(id(w), "table"))
    v, d = physical(ir, table)
    i = physical(ir, iv)[0]
    out = [ir.like(i), ir.like(d)]
    ir.keep_whole(v, d)
    r = ir.add("embed", [iv.rec, table.rec], out)
    return TV(r, [tuple(out[0] if e == i else e for e in g) for g in iv.groups] + [(out[1],)])


def _host_gather(ctx: Context, w, ids: Inp) -> TV:
    """The embedded prompt as an input filled on the host from the table's rows (``Context.gathers``): the table
    never goes to the GPU for it, whatever the vocabulary."""
    ir = ctx.ir
    groups = [(ir.dim(s),) if s > 1 else () for s in ids.shape] + [(ir.dim(w.shape[1]),)]
    name = f"{ids.name}.embedded"
    r = ir.add("input", [], [d for g in groups for d in g], name=name)
    ctx.gathers[name] = (ids.name, to_numpy(w, ir.dtype))
    return TV(r, groups)


def conv2d(ctx: Context, x, w, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
    """A patch embedding: a convolution whose stride is its kernel (no padding), on an input not used
    before, becomes one contraction over a row-major split of the input."""
    ir = ctx.ir
    if not (isinstance(x, Inp) and _is_tensor(w) and w.dim() == 4 and len(x.shape) == 4):
        raise Unsupported("a convolution that is not a patch embedding of a model input")
    o, c, p, q = w.shape
    if list(stride) != [p, q] or any(padding) or list(dilation) != [1, 1] or groups != 1 or x.shape[2] % p or \
            x.shape[3] % q:  # fmt: skip
        raise Unsupported("a convolution that is not a patch embedding (stride = kernel, no padding)")
    n, _, h, wd = x.shape
    if min(c, h // p, p, wd // q, q) < 2:
        raise Unsupported("a patch embedding with a dimension of 1")
    xv = ctx.place(x, [(n,), (c,), (h // p, p), (wd // q, q)])  # (images,) channels, rows, row, columns, column
    bg, (dc,), (gy, dp), (gx, dq) = xv.groups
    wv = ctx.const(w, ctx.names.get(id(w), "conv"))
    od, cd, pd, qd = physical(ir, wv)
    for a, b_ in ((cd, dc), (pd, dp), (qd, dq)):
        ir.join(a, b_)
    xd = physical(ir, xv)
    keep = [*bg, gy, gx]
    out = [ir.like(d) for d in keep] + [ir.like(od)]
    idx = {d: i for i, d in enumerate(xd)}
    m = len(xd)
    r = ir.add("einsum", [xv.rec, wv.rec], out, {"idx": [list(range(m)), [m, idx[dc], idx[dp], idx[dq]]],
                                                 "out": [idx[d] for d in keep] + [m]})  # fmt: skip
    nb = len(bg)
    tv = TV(r, [tuple(out[:nb]), (out[-1],), (out[nb],), (out[nb + 1],)])
    return tv if b is None else ew(ctx, "add", tv, b.reshape(-1, 1, 1))


def _one_axis(ctx, x, dims) -> tuple[TV, int]:
    """``x`` with the one torch axis of ``dims`` as one dimension of its record, and that axis."""
    dims = [dims] if isinstance(dims, int) else list(dims)
    n = len(torch_shape(ctx, x))
    if len(dims) != 1:
        raise Unsupported("a reduction over several axes")
    a = _axis(dims[0], n)
    return single(ctx.ir, ctx.force(x), a), a


def _along(ctx, op: str, v: TV, a: int, inputs=(), drop: bool = False, keepdim: bool = False, **params) -> TV:
    ir = ctx.ir
    dims = physical(ir, v)
    d = v.groups[a][0]
    ir.keep_whole(d)
    kept = [e for e in dims if not (drop and e == d)]
    out = [ir.like(e) for e in kept] or [ir.dim(1)]
    m = dict(zip(kept, out, strict=True))
    r = ir.add(op, [v.rec, *inputs], out, {"axis": dims.index(d), **params})
    groups = [tuple(m.get(e, e) for e in g) for g in v.groups]
    if drop:
        groups = [g if i != a else () for i, g in enumerate(groups) if i != a or keepdim]
    return TV(r, groups)


def _reduction(fn):
    def rule(ctx, x, dims=None, keepdim=False, dtype=None):
        if dims is None:
            raise Unsupported("a reduction over every axis")
        v, a = _one_axis(ctx, x, dims)
        return _along(ctx, "reduce", v, a, drop=True, keepdim=keepdim, fn=fn)

    return rule


def softmax(ctx, x, dim, *rest, **kw):
    v, a = _one_axis(ctx, x, dim)
    return _along(ctx, "softmax", v, a)


def layer_norm(ctx: Context, x, shape, w=None, b=None, eps=1e-5, *rest):
    import torch

    if len(shape) != 1 or (w is not None and not _is_tensor(w)) or (b is not None and not _is_tensor(b)):
        raise Unsupported("a layer norm over several axes or with computed weights")
    v, a = _one_axis(ctx, x, -1)
    n = shape[0]
    ws = [ctx.force(t if t is not None else torch.full((n,), float(f))) for t, f in ((w, 1.0), (b, 0.0))]
    for wv in ws:
        ctx.ir.join(physical(ctx.ir, wv)[0], v.groups[a][0])
    return _along(ctx, "layernorm", v, a, [wv.rec for wv in ws], eps=float(eps))


def _causal(mask, t: int, s: int) -> bool | None:
    """True for a causal mask, False for one that masks nothing, None for any other."""
    import torch

    m = mask.reshape(-1, *mask.shape[-2:])
    tril = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    keep = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    if m.dtype != torch.bool and bool((m[keep] != 0).any()):
        return None
    if bool(keep.all()):
        return False
    return True if bool((keep == tril).all()) else None


def sdpa(ctx: Context, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Fused attention: q, k, v as (tokens, heads, head dim) records; a constant causal mask is the causal op."""
    ir = ctx.ir
    Q, K, V = (ctx.force(x) for x in (q, k, v))
    lead = [i for i in range(len(Q.groups) - 3)
            if any(math.prod(ir.ext[d] for d in x.groups[i]) > 1 for x in (Q, K, V))]  # fmt: skip
    if len(lead) > 1:
        raise Unsupported("attention over more than one batch axis")
    if lead:  # one attention per sequence of the batch, stacked
        outs = [sdpa(ctx, *(_take(ctx, x, lead[0], b) for x in (Q, K, V)), attn_mask=_take_mask(attn_mask, b),
                     is_causal=is_causal, scale=scale) for b in range(torch_shape(ctx, Q)[lead[0]])]  # fmt: skip
        return _stack(ctx, outs, lead[0])
    t, s, e = (math.prod(ir.ext[d] for d in x.groups[i]) for x, i in ((Q, -2), (K, -2), (Q, -1)))
    causal = bool(is_causal)
    if attn_mask is not None:
        c = _causal(attn_mask, t, s) if _is_tensor(attn_mask) else None
        if c is None:
            raise Unsupported("an attention mask that is neither causal nor empty")
        causal = causal or c
    if causal and t != s:
        raise Unsupported("causal attention with fewer queries than keys")
    qr, kr, vr = (_heads_tokens(ctx, x) for x in (Q, K, V))
    (tq, hq, eq), (tk, hk, ek), (tv, hv, ev) = (physical(ir, x) for x in (qr, kr, vr))
    ir.join(tk, tv)
    ir.join(hk, hv)
    ir.join(ek, ev)
    ir.join(eq, ek)
    if t == s:
        ir.join(tq, tk)
    if ir.ext[hq] == ir.ext[hk]:
        ir.join(hq, hk)
    else:
        ir.keep_whole(hq, hk)
    ir.keep_whole(eq)
    out = [ir.like(tq), ir.like(hq), ir.like(eq)]
    p = {"scale": float(scale) if scale else 1.0 / math.sqrt(e)} | ({} if causal else {"causal": False})
    r = ir.add("attention", [qr.rec, kr.rec, vr.rec], out, p)
    return TV(r, [()] * (len(Q.groups) - 3) + [(out[1],), (out[0],), (out[2],)])


def _take(ctx: Context, x: TV, axis: int, i: int) -> TV:
    """Index ``i`` of torch ``axis`` of ``x``, the axis removed (a ``slice`` vertex, or none for a broadcast)."""
    ir = ctx.ir
    x = single(ir, x, axis)
    d = x.groups[axis][0]
    groups = x.groups[:axis] + x.groups[axis + 1 :]
    dims = physical(ir, x)
    if d not in dims:
        return TV(x.rec, groups)
    ir.keep_whole(d)
    out = [ir.like(e) for e in dims if e != d]
    m = dict(zip([e for e in dims if e != d], out, strict=True))
    r = ir.add("slice", [x.rec], out, {"axis": dims.index(d), "start": i, "stop": i + 1, "drop": True})
    return TV(r, [tuple(m.get(e, e) for e in g) for g in groups])


def _take_mask(mask, b: int):
    if mask is None or not _is_tensor(mask) or mask.dim() < 4 or mask.shape[0] == 1:
        return mask
    return mask[b : b + 1]


def _stack(ctx: Context, outs: list[TV], axis: int) -> TV:
    """Records of one layout stacked along a new torch ``axis`` (a new leading dimension in memory)."""
    ir = ctx.ir
    dims0 = physical(ir, outs[0])
    nd = ir.dim(len(outs))
    out = [ir.like(e) for e in dims0]
    for o in outs[1:]:
        for a, b in zip(out, physical(ir, o), strict=True):
            ir.join(a, b)
    ir.keep_whole(nd)
    r = ir.add("cat", [o.rec for o in outs], [nd, *out], {"axis": 0, "stack": True})
    m = dict(zip(dims0, out, strict=True))
    groups = [tuple(m.get(e, e) for e in g) for g in outs[0].groups]
    return TV(r, groups[:axis] + [(nd,)] + groups[axis:])


def _heads_tokens(ctx: Context, x: TV) -> TV:
    """(…, heads, tokens, head dim) as a record laid out (tokens, heads, head dim); heads repeated by an
    expand (grouped-query attention) are dropped: the attention op repeats key heads itself."""
    ir = ctx.ir
    dims = physical(ir, x)
    h = tuple(d for d in x.groups[-3] if d in dims)
    y = TV(x.rec, [h, *x.groups[-2:]])
    want = [g[0] if len(g) == 1 and g[0] in dims else None for g in (y.groups[1], y.groups[0], y.groups[2])]
    if None not in want and dims == want:
        return y
    y = in_torch_order(ir, y, keep=(0, 1, 2))
    hh, tt, ee = (g[0] for g in y.groups)
    d2 = physical(ir, y)
    out = [ir.like(tt), ir.like(hh), ir.like(ee)]
    r = ir.add("relayout", [y.rec], out, {"perm": [d2.index(tt), d2.index(hh), d2.index(ee)],
                                           "shape": [-1, -2, -3]})  # fmt: skip
    return TV(r, [(out[1],), (out[0],), (out[2],)])
