"""The op registry: for every kernel op its output shape, arithmetic work and numpy implementation.

The tiling pass takes flops from here, taskgraph validation checks output shapes against it, the simulator
reads the resulting per-vertex flops and bytes, and the CPU backend and reference interpreters run the
numpy implementation (``turnip.reference``, which is also what the GPU kernels are tested against).
Shapes are tuples of tile extents; layouts as in ``turnip/reference.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OpSpec:
    name: str
    arity: int | None  # number of inputs; None: one or more
    out_shape: Callable[[list[Shape], dict], Shape]
    flops: Callable[[list[Shape], Shape, dict], float]
    in_place: bool = False  # writes its first input (the accumulator) instead of a new tensor


def _einsum_shape(ins: list[Shape], p: dict) -> Shape:
    """Two operands, and optionally an addend of the output's shape (out = scale * einsum(a, b) + addend)."""
    if len(ins) not in (2, 3):
        raise ValueError(f"einsum {p['subscripts']}: takes two operands and an optional addend, got {len(ins)}")
    ext = _einsum_extents(ins[:2], p)
    out = tuple(ext[l] for l in p["subscripts"].split("->")[1])
    if len(ins) == 3 and tuple(ins[2]) != out:
        raise ValueError(f"einsum {p['subscripts']}: addend {tuple(ins[2])} is not the output's shape {out}")
    return out


def _einsum_extents(ins: list[Shape], p: dict) -> dict[str, int]:
    ext: dict[str, int] = {}
    for letters, shape in zip(p["subscripts"].split("->")[0].split(","), ins, strict=True):
        if len(letters) != len(shape):
            raise ValueError(f"einsum {p['subscripts']}: operand {letters!r} has shape {shape}")
        for l, s in zip(letters, shape, strict=True):
            if ext.setdefault(l, s) != s:
                raise ValueError(f"einsum {p['subscripts']}: dim {l!r} is {ext[l]} and {s}")
    return ext


def _same(ins: list[Shape], p: dict) -> Shape:
    return ins[0]


def _broadcast(ins: list[Shape], p: dict) -> Shape:
    out = max(ins, key=len)
    for s in ins:
        if tuple(out[len(out) - len(s) :]) != tuple(s):
            raise ValueError(f"shapes {ins} do not broadcast")
    return out


def _sdpa_shape(ins: list[Shape], p: dict) -> Shape:
    """q (tq, h, dh) or (tq, hk, r, dh) (grouped-query: h = hk * r query heads), k and v (tk, hk, dh)."""
    from turnip.reference import packed_sequences

    qs, (tk_all, hk, dk), vs = ins
    if len(qs) not in (3, 4) or len(ins[1]) != 3:
        raise ValueError(f"q {qs} must be (tq, h, dh) or (tq, hk, r, dh), k {ins[1]} (tk, hk, dh)")
    tq, h, dh = qs[0], math.prod(qs[1:-1]), qs[-1]
    tk = int(p.get("tk", tk_all))
    if dk != dh or qs[1] != hk and len(qs) == 4 or h % hk or tuple(vs) != (tk_all, hk, dh) or not 0 < tk <= tk_all:
        raise ValueError(f"q {ins[0]}, k {ins[1]}, v {ins[2]} (tk {tk}) do not match")
    if packed_sequences(tq, p) > 1 and (p.get("partial", False) or tk_all != tq or tk != tq):
        raise ValueError(f"q {qs}, k {ins[1]}: packed sequences of {p['seq']} need all {tq} keys, no partial")
    if p.get("partial", False):
        return (tq * h * dh + h * tq * 4 // int(p["itemsize"]),)
    return tuple(qs)


def _sdpa_flops(ins: list[Shape], out: Shape, p: dict) -> float:
    """4 flops per (query, key, head dim) pair a row sees (q k^T and p v, keys of its window only), plus the
    softmax (and the cap of soft-capped scores)."""
    from turnip.reference import key_pairs, packed_sequences

    tq, h, dh = ins[0][0], math.prod(ins[0][1:-1]), ins[0][-1]
    tk_all = ins[1][0]
    n = packed_sequences(tq, p)
    pairs = float(key_pairs(tq // n, tq // n, p) * n if n > 1 else key_pairs(tq, int(p.get("tk", tk_all)), p))
    return pairs * h * (4.0 * dh + 5.0 + 3.0 * (float(p.get("softcap", 0.0)) > 0))


def _combine_shape(ins: list[Shape], p: dict) -> Shape:
    tq, h, dh = p["tq"], p["h"], p["dh"]
    n = tq * h * dh + h * tq * 4 // int(p["itemsize"])
    if any(tuple(s) != (n,) for s in ins):
        raise ValueError(f"partials {ins} are not ({n},) for (tq, h, dh) = {(tq, h, dh)}")
    r = int(p.get("r", 1))  # grouped-query: output (tq, h / r, r, dh)
    return (tq, h, dh) if r == 1 else (tq, h // r, r, dh)


def _concat_shape(ins: list[Shape], p: dict) -> Shape:
    rest = ins[0][1:]
    if any(tuple(s[1:]) != tuple(rest) for s in ins):
        raise ValueError(f"concat of {ins}: trailing dims differ")
    return (sum(s[0] for s in ins), *rest)


def _rows_shape(ins: list[Shape], p: dict) -> Shape:
    a, b = int(p["start"]), int(p["stop"])
    if not 0 <= a < b <= ins[0][0]:
        raise ValueError(f"rows [{a}, {b}) of a tile of {ins[0][0]} rows")
    return (b - a, *ins[0][1:])


def _sdpa_bwd_shape(ins: list[Shape], p: dict) -> Shape:
    """q, o, do (t, h, dh) or (t, hk, r, dh); k, v (t, hk, dh), as many keys as queries -> (t, hk, (r + 2) dh):
    per token and key-value head, the query heads' dq, then dk, then dv."""
    qs, ks, vs, os_, dos = (tuple(s) for s in ins)
    if len(qs) not in (3, 4) or len(ks) != 3 or vs != ks or os_ != qs or dos != qs:
        raise ValueError(f"q {qs}, k {ks}, v {vs}, o {os_}, do {dos} do not match")
    t, hk, dh = ks
    h = math.prod(qs[1:-1])
    if qs[0] != t or qs[-1] != dh or h % hk or (len(qs) == 4 and qs[1] != hk):
        raise ValueError(f"q {qs} and k {ks} do not match (sdpa_bwd needs as many keys as queries)")
    return (t, hk, (h // hk + 2) * dh)


def _sdpa_bwd_flops(ins: list[Shape], out: Shape, p: dict) -> float:
    """Recomputed scores and softmax, then dv, dp, dq, dk: 10 flops per visible (query, key, head dim)."""
    from turnip.reference import packed_sequences, visible_keys

    tq, h, dh = ins[0][0], math.prod(ins[0][1:-1]), ins[0][-1]
    n = packed_sequences(tq, p)
    pairs = float(visible_keys(tq // n, tq // n, p).sum()) * n
    return pairs * h * (10.0 * dh + 8.0)


def _cols_shape(ins: list[Shape], p: dict) -> Shape:
    a, b, tail = int(p["start"]), int(p["stop"]), tuple(int(x) for x in p["tail"])
    n = ins[0][-1]
    if not 0 <= a < b <= n or math.prod(tail) != b - a:
        raise ValueError(f"columns [{a}, {b}) of a last dim of {n} as trailing shape {tail}")
    return (*ins[0][:-1], *tail)


def _xent_shape(ins: list[Shape], p: dict) -> Shape:
    (t, _), tg = ins
    if tuple(tg) != (t,) or len(ins[0]) != 2:
        raise ValueError(f"logits {ins[0]} must be (t, V) and targets {tg} ({t},)")
    return (t,)


def _xent_bwd_shape(ins: list[Shape], p: dict) -> Shape:
    _xent_shape(ins, p)
    return ins[0]


def _n(shape: Shape) -> int:
    return math.prod(shape)


def _per_elem(k: float) -> Callable[[list[Shape], Shape, dict], float]:
    return lambda ins, out, p: k * _n(out)


OPS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        OpSpec("einsum", None, _einsum_shape,
               lambda ins, out, p: 2.0 * _n(tuple(_einsum_extents(ins[:2], p).values())) + _n(out) * (len(ins) - 2)),
        OpSpec("add_n", None, _broadcast, lambda ins, out, p: float(_n(out) * len(ins))),
        OpSpec("mul", 2, _broadcast, _per_elem(1)),
        OpSpec("scale", 1, _same, _per_elem(1)),
        OpSpec("silu", 1, _same, _per_elem(4)),
        OpSpec("silu_mul", 2, _same, _per_elem(5)),
        OpSpec("gelu_tanh_mul", 2, _same, _per_elem(9)),
        OpSpec("softcap", 1, _same, _per_elem(3)),
        OpSpec("rmsnorm", 2, _same, _per_elem(4)),
        OpSpec("rotary", 1, _same, _per_elem(6)),
        OpSpec("embed", 2, lambda ins, p: (ins[0][0], ins[1][1]), _per_elem(0)),
        OpSpec("sum_into", 2, _same, _per_elem(1), in_place=True),
        OpSpec("sdpa", 3, _sdpa_shape, _sdpa_flops),
        OpSpec("attn_combine", None, _combine_shape, lambda ins, out, p: 4.0 * _n(out) * len(ins)),
        OpSpec("concat", None, _concat_shape, _per_elem(0)),
        OpSpec("rows", 1, _rows_shape, _per_elem(0)),
        OpSpec("rmsnorm_bwd", 3, _same, _per_elem(8)),
        OpSpec("silu_mul_dg", 3, _same, _per_elem(8)),
        OpSpec("sdpa_bwd", 5, _sdpa_bwd_shape, _sdpa_bwd_flops),
        OpSpec("cols", 1, _cols_shape, _per_elem(0)),
        OpSpec("xent", 2, _xent_shape, lambda ins, out, p: 4.0 * _n(ins[0])),
        OpSpec("xent_bwd", 2, _xent_bwd_shape, _per_elem(4)),
        OpSpec("cast", 1, _same, _per_elem(1)),
        OpSpec("adam_m", 2, _same, _per_elem(3)),
        OpSpec("adam_v", 2, _same, _per_elem(4)),
        OpSpec("adam_p", 4, _broadcast, _per_elem(6)),
        OpSpec("mix", None, lambda ins, p: (p["n_out"],), lambda ins, out, p: 2.0 * _n(out) * len(ins)),
    )
}  # fmt: skip


def spec(op: str) -> OpSpec:
    try:
        return OPS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r}; known: {sorted(OPS)}") from None


def flops(op: str, in_shapes: list[Shape], out_shape: Shape, params: dict) -> float:
    return float(spec(op).flops([tuple(s) for s in in_shapes], tuple(out_shape), params))


def check_shapes(op: str, in_shapes: list[Shape], out_shape: Shape, params: dict) -> str | None:
    """None if ``out_shape`` is what ``op`` produces from ``in_shapes``; else what is wrong."""
    s = spec(op)
    if s.arity is not None and len(in_shapes) != s.arity:
        return f"{op} takes {s.arity} inputs, got {len(in_shapes)}"
    if not in_shapes:
        return f"{op} needs at least one input"
    try:
        want = tuple(s.out_shape([tuple(x) for x in in_shapes], params))
    except (ValueError, KeyError, IndexError) as e:
        return f"{op} inputs {list(map(tuple, in_shapes))}: {e}"
    if want != tuple(out_shape):
        return f"{op} of inputs {list(map(tuple, in_shapes))} gives {want}, vertex says {tuple(out_shape)}"
    return None


def reference(op: str):
    """The numpy implementation (``turnip.reference``)."""
    from turnip.reference import REFERENCE

    spec(op)
    return REFERENCE[op]


def _add_import_ops() -> None:
    """The ops of graphs imported from PyTorch (``turnip.torchimport.kernels``)."""
    from turnip.torchimport.kernels import SPECS

    OPS.update({n: OpSpec(n, arity, shape, work) for n, arity, shape, work in SPECS})


_add_import_ops()
