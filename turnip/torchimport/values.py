"""What an exported program's tensors are while they are imported, and the view algebra on them.

- ``TV``: a record of ``turnip.torchimport.ir`` seen through a view: ``groups[i]`` lists the dimension ids
  that make torch axis ``i`` (row-major within the group; empty for a size-1 axis). A dimension in a group
  but not in the record is a broadcast (``expand``); a size-1 dimension of the record may be in no group.
  Views, permutes, squeezes and merging reshapes only change ``groups``; no vertex is made.
- ``Lin``: a contraction of a value with a constant weight, not emitted yet, so that the views and slices
  applied to its output (heads split from a projection, q/k/v cut from one fused weight) are applied to the
  weight on the host instead of copying activations.
- ``Inp``: a user input not placed yet (its first use may split its axes, as a patch embedding does).
Constants are torch tensors (folded when every input of an op is one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from turnip.torchimport.ir import IR


class Unsupported(Exception):
    """An op (or one use of it) with no lowering; the message says why."""


@dataclass
class TV:
    rec: int
    groups: list[tuple[int, ...]]


@dataclass
class Lin:
    x: TV  # contracted over its last torch axis
    w: object  # torch tensor (*out, K)
    b: object  # torch tensor (*out) or None
    perm: tuple[int, ...] | None = None  # torch axes of the value, as a permutation of lead + out


@dataclass
class Inp:
    name: str
    shape: tuple[int, ...]
    is_int: bool


def extents(ir: IR, groups) -> tuple[int, ...]:
    return tuple(math.prod(ir.ext[d] for d in g) for g in groups)


def regroup(ir: IR, groups, shape) -> list[tuple[int, ...]] | None:
    """The groups of ``shape`` over the same dimensions in the same order, or None where an axis would split
    a dimension."""
    seq = [d for g in groups for d in g if ir.ext[d] > 1]
    out, i = [], 0
    for s in shape:
        if s == 1:
            out.append(())
            continue
        grp, n = [], 1
        while n < s and i < len(seq):
            grp.append(seq[i])
            n *= ir.ext[seq[i]]
            i += 1
        if n != s:
            return None
        out.append(tuple(grp))
    return out if i == len(seq) else None


def physical(ir: IR, v: TV) -> list[int]:
    return ir.recs[v.rec].dims


def in_torch_order(ir: IR, v: TV, keep: tuple[int, ...] = ()) -> TV:
    """``v`` as a record whose memory order is the torch order, one dimension per axis (size-1 axes dropped
    except those in ``keep``): ``v`` itself where it already is, else a ``relayout`` vertex (its merged or
    split dimensions kept whole; the dimensions it keeps one-to-one may still be tiled)."""
    dims = physical(ir, v)
    if any(d not in dims for g in v.groups for d in g if ir.ext[d] > 1):
        raise Unsupported("a broadcast (expand) tensor used where it must be materialised")
    seq = [d for g in v.groups for d in g if d in dims]
    if [g for g in v.groups if g and (len(g) > 1 or ir.ext[g[0]] > 1)] == [(d,) for d in dims] and not keep:
        return v
    order = seq + [d for d in dims if d not in seq]
    perm = [dims.index(d) for d in order]
    shape, out, groups = [], [], []
    for i, g in enumerate(v.groups):
        n = math.prod(ir.ext[d] for d in g)
        if len(g) == 1 and n > 1:
            shape.append(-1 - order.index(g[0]))
            nd = ir.like(g[0])
        elif n > 1 or i in keep:
            shape.append(n)
            nd = ir.dim(n)
            ir.keep_whole(nd, *g)
        else:
            groups.append(())
            continue
        out.append(nd)
        groups.append((nd,))
    if not out:
        shape, out = [1], [ir.dim(1)]
    r = ir.add("relayout", [v.rec], out, {"perm": perm, "shape": shape})
    return TV(r, groups)


def single(ir: IR, v: TV, axis: int) -> TV:
    """``v`` with torch ``axis`` one dimension of its record (a relayout where it is not)."""
    g = v.groups[axis]
    if len(g) == 1 and g[0] in physical(ir, v):
        return v
    return in_torch_order(ir, v, keep=(axis,))


def to_numpy(t, dtype: str) -> np.ndarray:
    """A constant tensor as the numpy array of an input of ``dtype`` (integers as int32)."""
    from turnip.reference import _np_dtype

    x = t.detach().cpu()
    if not x.is_floating_point():
        return x.numpy().astype(np.int32)
    return x.float().numpy().astype(_np_dtype(dtype))
