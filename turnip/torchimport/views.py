"""Lowering rules for views and data movement: reshape, permute, expand, slice, split, select, cat. A view of a
record is a new grouping of its dimensions (no vertex); a view or slice of a pending contraction is applied
to its weight on the host; only splits of computed dimensions, slices and concatenations make vertices."""

from __future__ import annotations

import math

from turnip.torchimport.rules import Context
from turnip.torchimport.values import TV, Inp, Lin, Unsupported, extents, in_torch_order, physical, regroup, single


def torch_shape(ctx: Context, v) -> tuple[int, ...]:
    if isinstance(v, TV):
        return extents(ctx.ir, v.groups)
    if isinstance(v, Inp):
        return v.shape
    if isinstance(v, Lin):
        base = (*extents(ctx.ir, v.x.groups[:-1]), *v.w.shape[:-1])
        return base if v.perm is None else tuple(base[i] for i in v.perm)
    return tuple(v.shape)


def reshape(ctx: Context, x, shape):
    ir = ctx.ir
    shape = _resolve(shape, math.prod(torch_shape(ctx, x)))
    if isinstance(x, Inp) and x.name not in ctx.placed:  # not placed yet: the caller's array is reshaped
        return Inp(x.name, shape, x.is_int)
    if isinstance(x, Lin):
        y = _lin_reshape(ctx, x, shape)
        if y is not None:
            return y
    v = ctx.force(x)
    g = regroup(ir, v.groups, shape)
    if g is not None:
        return TV(v.rec, g)
    v = in_torch_order(ir, v)  # a split of a computed dimension: one copy into the new shape, kept whole
    dims = [d for g in v.groups for d in g]
    out = [ir.dim(s) for s in shape if s > 1] or [ir.dim(1)]
    ir.keep_whole(*dims, *out)
    perm = [physical(ir, v).index(d) for d in dims] + [i for i, d in enumerate(physical(ir, v)) if d not in dims]
    r = ir.add("relayout", [v.rec], out, {"perm": perm, "shape": [ir.ext[d] for d in out]})
    it = iter(out)
    return TV(r, [(next(it),) if s > 1 else () for s in shape])


def _resolve(shape, numel: int) -> tuple[int, ...]:
    shape = [int(s) for s in shape]
    if -1 in shape:
        k = shape.index(-1)
        shape[k] = numel // max(1, math.prod(s for i, s in enumerate(shape) if i != k))
    return tuple(shape)


def _lin_reshape(ctx: Context, L: Lin, shape) -> Lin | None:
    """A reshape of a pending contraction that keeps its leading (input) part and reshapes its weight's
    output axes, or None."""
    if L.perm is not None:
        return None
    ir = ctx.ir
    lead = extents(ir, L.x.groups[:-1])
    out = tuple(L.w.shape[:-1])
    for k in range(len(shape) + 1):
        if math.prod(shape[:k]) == math.prod(lead) and math.prod(shape[k:]) == math.prod(out):
            g = regroup(ir, L.x.groups[:-1], shape[:k])
            if g is None:
                continue
            w = L.w.reshape(*shape[k:], L.w.shape[-1])
            b = None if L.b is None else L.b.reshape(shape[k:])
            _name(ctx, L.w, w)
            return Lin(TV(L.x.rec, [*g, L.x.groups[-1]]), w, b)
    return None


def _name(ctx: Context, old, new) -> None:
    if id(old) in ctx.names:
        ctx.names[id(new)] = ctx.names[id(old)]


def _axis(d: int, n: int) -> int:
    return d + n if d < 0 else d


def view(ctx, x, shape):
    return reshape(ctx, x, shape)


def flatten(ctx, x, start=0, end=-1):
    s = torch_shape(ctx, x)
    a, b = _axis(start, len(s)), _axis(end, len(s))
    return reshape(ctx, x, (*s[:a], math.prod(s[a : b + 1]), *s[b + 1 :]))


def unflatten(ctx, x, dim, sizes):
    s = torch_shape(ctx, x)
    a = _axis(dim, len(s))
    return reshape(ctx, x, (*s[:a], *_resolve(sizes, s[a]), *s[a + 1 :]))


def unsqueeze(ctx, x, dim):
    s = list(torch_shape(ctx, x))
    s.insert(_axis(dim, len(s) + 1), 1)
    return reshape(ctx, x, s)


def squeeze(ctx, x, dims=None):
    s = torch_shape(ctx, x)
    if dims is None:
        dims = [i for i, e in enumerate(s) if e == 1]
    dims = {_axis(d, len(s)) for d in ([dims] if isinstance(dims, int) else dims)}
    return reshape(ctx, x, [e for i, e in enumerate(s) if i not in dims or e != 1])


def permute(ctx, x, dims):
    n = len(torch_shape(ctx, x))
    dims = [_axis(d, n) for d in dims]
    if isinstance(x, Lin):
        base = x.perm or tuple(range(n))
        return Lin(x.x, x.w, x.b, tuple(base[d] for d in dims))
    v = ctx.force(x)
    return TV(v.rec, [v.groups[d] for d in dims])


def transpose(ctx, x, d0, d1):
    n = len(torch_shape(ctx, x))
    p = list(range(n))
    a, b = _axis(d0, n), _axis(d1, n)
    p[a], p[b] = p[b], p[a]
    return permute(ctx, x, p)


def t(ctx, x):
    return transpose(ctx, x, 0, 1) if len(torch_shape(ctx, x)) == 2 else x


def expand(ctx, x, sizes, implicit=False):
    v = ctx.force(x)
    ir = ctx.ir
    groups = [()] * (len(sizes) - len(v.groups)) + list(v.groups)
    out = []
    for g, s in zip(groups, sizes, strict=True):
        e = math.prod(ir.ext[d] for d in g)
        out.append((ir.dim(s),) if s not in (-1, e) and e == 1 else g)
    return TV(v.rec, out)


def tslice(ctx, x, dim=0, start=None, end=None, step=1):
    s = torch_shape(ctx, x)
    a = _axis(dim, len(s))
    n = s[a]
    lo = 0 if start is None else max(0, min(n, start + n if start < 0 else start))
    hi = n if end is None else max(0, min(n, end + n if end < 0 else end))
    if step != 1:
        raise Unsupported(f"a slice with step {step}")
    if lo == 0 and hi == n:
        return x
    if hi <= lo:
        raise Unsupported("an empty slice")
    if isinstance(x, Lin) and x.perm is None and a >= len(x.x.groups) - 1:
        k = a - (len(x.x.groups) - 1)
        w = x.w.narrow(k, lo, hi - lo)
        _name(ctx, x.w, w)
        return Lin(x.x, w, None if x.b is None else x.b.narrow(k, lo, hi - lo))
    ir = ctx.ir
    v = single(ir, ctx.force(x), a)
    d = v.groups[a][0]
    dims = physical(ir, v)
    if d not in dims:  # a broadcast axis: a smaller broadcast
        return TV(v.rec, [*v.groups[:a], (ir.dim(hi - lo),), *v.groups[a + 1 :]])
    nd = ir.dim(hi - lo)
    out = [nd if e == d else ir.like(e) for e in dims]
    ir.keep_whole(d, nd)
    r = ir.add("slice", [v.rec], out, {"axis": dims.index(d), "start": lo, "stop": hi})
    m = dict(zip(dims, out, strict=True))
    return TV(r, [tuple(m.get(e, e) for e in g) for g in v.groups])


def select(ctx, x, dim, index):
    s = torch_shape(ctx, x)
    a = _axis(dim, len(s))
    i = index + s[a] if index < 0 else index
    y = tslice(ctx, x, a, i, i + 1)
    if isinstance(y, Lin):
        return squeeze(ctx, y, [a])
    v = ctx.force(y)
    return TV(v.rec, [g for j, g in enumerate(v.groups) if j != a])


def split(ctx, x, size, dim=0):
    n = torch_shape(ctx, x)[_axis(dim, len(torch_shape(ctx, x)))]
    sizes = [size] * (n // size) + ([n % size] if n % size else []) if isinstance(size, int) else list(size)
    return split_with_sizes(ctx, x, sizes, dim)


def split_with_sizes(ctx, x, sizes, dim=0):
    out, lo = [], 0
    for s in sizes:
        out.append(tslice(ctx, x, dim, lo, lo + s))
        lo += s
    return out


def chunk(ctx, x, chunks, dim=0):
    n = torch_shape(ctx, x)[_axis(dim, len(torch_shape(ctx, x)))]
    return split(ctx, x, -(-n // chunks), dim)


def cat(ctx, tensors, dim=0):
    ir = ctx.ir
    n = len(torch_shape(ctx, tensors[0]))
    a = _axis(dim, n)
    vs = [ctx.force(x) for x in tensors]
    if len({_layout(ir, v, a) for v in vs}) != 1 or _layout(ir, vs[0], a) is None:
        vs = [in_torch_order(ir, v, keep=(a,)) for v in vs]
    pos = [physical(ir, v).index(v.groups[a][0]) for v in vs]
    if len(set(pos)) != 1 or len({len(physical(ir, v)) for v in vs}) != 1:
        raise Unsupported("concatenation of operands of different layouts")
    nd = ir.dim(sum(ir.ext[v.groups[a][0]] for v in vs))
    out = []
    for i, d in enumerate(physical(ir, vs[0])):
        if i == pos[0]:
            out.append(nd)
            continue
        e = ir.like(d)
        for v in vs[1:]:
            ir.join(e, physical(ir, v)[i])
        out.append(e)
    ir.keep_whole(nd, *(v.groups[a][0] for v in vs))
    r = ir.add("cat", [v.rec for v in vs], out, {"axis": pos[0]})
    m = dict(zip(physical(ir, vs[0]), out, strict=True))
    return TV(r, [tuple(m.get(e, e) for e in g) for g in vs[0].groups])


def _layout(ir, v: TV, a: int):
    """Memory position per torch axis (those larger than 1, and ``a``) where each is one dimension and the
    record has no other, else None."""
    dims = physical(ir, v)
    pos = []
    for i, g in enumerate(v.groups):
        if i == a or math.prod(ir.ext[d] for d in g) > 1:
            if len(g) != 1 or g[0] not in dims:
                return None
            pos.append(dims.index(g[0]))
    return tuple(pos) if len(pos) == len(dims) else None


def identity(ctx, x, *args, **kwargs):
    return x


def getitem(ctx, seq, i):
    return seq[i]
