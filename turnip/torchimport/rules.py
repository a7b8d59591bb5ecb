"""Lowering rules: one function per aten op (``RULES``), from importer values (``turnip.torchimport.values``)
to importer records. Views stay views; contractions with a constant weight stay pending (``Lin``) until a
consumer needs their data; elementwise ops follow torch broadcasting and become ``ew`` vertices."""

from __future__ import annotations

import math

from turnip.torchimport.ir import IR
from turnip.torchimport.values import TV, Inp, Lin, Unsupported, in_torch_order, physical, to_numpy


def _is_tensor(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "shape") and not isinstance(x, TV | Lin | Inp)


class Context:
    """The records being built plus what was already emitted for a value (each constant, user input and
    pending contraction becomes one record however often it is used)."""

    def __init__(self, ir: IR):
        self.ir = ir
        self.forced: dict[int, tuple] = {}
        self.names: dict[int, str] = {}  # id(constant tensor) -> parameter name
        self.placed: dict[str, int] = {}  # user input name -> record
        self.gathers: dict[str, tuple] = {}  # input filled on the host -> (user input name, embedding table)

    # -- values to records
    def force(self, v) -> TV:
        if isinstance(v, TV):
            return v
        hit = self.forced.get(id(v))
        if hit is not None:
            return hit[1]
        if isinstance(v, Inp):
            tv = self.place(v, [(s,) for s in v.shape])
        elif isinstance(v, Lin):
            tv = self._emit_lin(v)
        elif _is_tensor(v):
            tv = self.const(v)
        else:
            raise Unsupported(f"a {type(v).__name__} where a tensor is needed")
        self.forced[id(v)] = (v, tv)
        return tv

    def place(self, inp: Inp, split: list[tuple[int, ...]]) -> TV:
        """User input ``inp`` as a record: each torch axis of size > 1 split into the extents ``split[i]`` (a
        row-major reshape of the caller's array)."""
        if inp.name in self.placed:
            raise Unsupported(f"input {inp.name} split again after its first use")
        ir = self.ir
        dims, groups = [], []
        for parts in split:
            g = tuple(ir.dim(e) for e in parts if e > 1)
            dims += g
            groups.append(g)
        if not dims:
            dims = [ir.dim(1)]
        self.placed[inp.name] = ir.add("input", [], dims, name=inp.name, dtype="int32" if inp.is_int else ir.dtype)
        return TV(self.placed[inp.name], groups)

    def const(self, t, name: str = "") -> TV:
        ir = self.ir
        groups = [((ir.dim(s),) if s > 1 else ()) for s in t.shape]
        dims = [d for g in groups for d in g] or [ir.dim(1)]
        val = to_numpy(t, "fp32").reshape([ir.ext[d] for d in dims])  # exact here; the compute dtype at emission
        base = name or self.names.get(id(t), "const")
        r = ir.add("input", [], dims, name=f"{base}.{len(ir.recs)}", dtype="int32" if val.dtype.kind == "i" else None,
                   value=val)  # fmt: skip
        return TV(r, groups)

    def copy(self, v: TV) -> TV:
        dims = physical(self.ir, v)
        out = [self.ir.like(d) for d in dims]
        r = self.ir.add("ew", [v.rec], out, {"fn": "copy", "n": len(out), "axes": [list(range(len(out)))]})
        return TV(r, _mapped(v.groups, dict(zip(dims, out, strict=True))))

    def _emit_lin(self, L: Lin) -> TV:
        ir, x = self.ir, L.x
        xd = physical(ir, x)
        k = [d for d in x.groups[-1] if ir.ext[d] > 1]
        if any(d not in xd for d in k):
            raise Unsupported("a contraction over a broadcast axis")
        out_shape = tuple(L.w.shape[:-1])
        w = L.w.reshape(*out_shape, *[ir.ext[d] for d in k])
        wv = self.const(w, self.names.get(id(L.w), "w"))
        wd = physical(ir, wv)
        n_out = len([s for s in out_shape if s > 1])
        for a, b in zip(wd[n_out:], k, strict=True):
            ir.join(a, b)
        idx_x = list(range(len(xd)))
        pos = {d: i for i, d in enumerate(xd)}
        idx_w = [len(xd) + i for i in range(n_out)] + [pos[d] for d in k]
        keep = [d for d in xd if d not in k]
        out = [ir.like(d) for d in keep] + [ir.like(d) for d in wd[:n_out]]
        idx_o = [pos[d] for d in keep] + idx_w[:n_out]
        r = ir.add("einsum", [x.rec, wv.rec], out, {"idx": [idx_x, idx_w], "out": idx_o})
        m = dict(zip(keep, out[: len(keep)], strict=True))
        w_groups = iter((d,) for d in out[len(keep) :])
        groups = _mapped(x.groups[:-1], m) + [next(w_groups) if s > 1 else () for s in out_shape]
        tv = TV(r, groups)
        if L.b is not None:
            tv = ew(self, "add", tv, L.b)
        if L.perm is not None:
            tv = TV(tv.rec, [tv.groups[i] for i in L.perm])
        return tv


def _mapped(groups, m: dict) -> list[tuple[int, ...]]:
    return [tuple(m.get(d, d) for d in g) for g in groups]


def _scalar(x):
    if isinstance(x, bool | int | float):
        return float(x)
    if _is_tensor(x) and x.numel() == 1:
        return float(x.item())
    return None


# -- elementwise


def ew(ctx: Context, fn: str, a, b=None, **scalars) -> TV:
    """``fn`` of one or two tensors with torch broadcasting (an ``ew`` vertex)."""
    ir = ctx.ir
    xs = [ctx.force(a)] + ([ctx.force(b)] if b is not None else [])
    for attempt in range(2):
        rank = max(len(x.groups) for x in xs)
        padded = [[()] * (rank - len(x.groups)) + list(x.groups) for x in xs]
        out_groups, maps, ok = [], [{} for _ in xs], True
        for i in range(rank):
            gs = [p[i] for p in padded]
            es = [math.prod(ir.ext[d] for d in g) for g in gs]
            big = [j for j, e in enumerate(es) if e > 1]
            if not big:
                out_groups.append(())
                continue
            ref = gs[big[0]]
            if any([ir.ext[d] for d in gs[j]] != [ir.ext[d] for d in ref] for j in big):
                ok = False
                break
            grp = []
            for pos, d0 in enumerate(ref):
                members = [gs[j][pos] for j in big]
                phys = [(j, d) for j, d in zip(big, members, strict=True) if d in physical(ir, xs[j])]
                if not phys:  # a broadcast in every operand stays one
                    grp.append(d0)
                    continue
                nd = ir.like(phys[0][1])
                for j, d in phys:
                    ir.join(nd, d)
                    maps[j][d] = nd
                grp.append(nd)
            out_groups.append(tuple(grp))
        if ok:
            break
        if attempt:
            raise Unsupported("operands whose axes are split differently")
        xs = [in_torch_order(ir, x) for x in xs]
    main = max(range(len(xs)), key=lambda j: len(maps[j]))
    out = [maps[main][d] for d in physical(ir, xs[main]) if d in maps[main]]
    out += [d for g in out_groups for d in g if d not in out and any(d in m.values() for m in maps)]
    if not out:
        out = [ir.dim(1)]
    axes = [[out.index(m[d]) if d in m else -1 for d in physical(ir, x)] for x, m in zip(xs, maps, strict=True)]
    for x, ax in zip(xs, axes, strict=True):
        if any(a < 0 and ir.ext[d] > 1 for a, d in zip(ax, physical(ir, x), strict=True)):
            raise Unsupported("an operand axis with no place in the result")
    p = {"fn": fn, "n": len(out), "axes": axes} | {k: float(v) for k, v in scalars.items()}
    return TV(ir.add("ew", [x.rec for x in xs], out, p), out_groups)


def _binary(fn, rfn=None):
    def rule(ctx, a, b, alpha=1):
        sa, sb = _scalar(a) if not isinstance(a, TV | Lin | Inp) else None, _scalar(b)
        if isinstance(b, TV | Lin | Inp):
            sb = None
        if alpha != 1 and sb is None:
            raise Unsupported("alpha on a tensor operand")
        if sb is not None:
            s = sb * alpha
            return {"add": lambda: ew(ctx, "affine", a, beta=s), "sub": lambda: ew(ctx, "affine", a, beta=-s),
                    "mul": lambda: ew(ctx, "affine", a, alpha=s),
                    "div": lambda: ew(ctx, "affine", a, alpha=1.0 / s)}[fn]()  # fmt: skip
        if sa is not None:
            return {"add": lambda: ew(ctx, "affine", b, beta=sa), "sub": lambda: ew(ctx, "rsub", b, beta=sa),
                    "mul": lambda: ew(ctx, "affine", b, alpha=sa), "div": lambda: ew(ctx, "rdiv", b, beta=sa)}[fn]()
        return ew(ctx, fn, a, b)

    return rule


def _unary(fn):
    return lambda ctx, x, *a, **k: ew(ctx, fn, x)


def _gelu(ctx, x, approximate="none"):
    return ew(ctx, "gelu_tanh" if approximate == "tanh" else "gelu", x)


def _pow(ctx, x, e):
    if _scalar(e) is None:
        raise Unsupported("a tensor exponent")
    return ew(ctx, "pow", x, alpha=_scalar(e))


def _rsub(ctx, x, s, alpha=1):
    if _scalar(s) is None:
        raise Unsupported("rsub of two tensors")
    return ew(ctx, "rsub", x, beta=_scalar(s) * alpha)
