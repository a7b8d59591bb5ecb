"""Chains of imported records that are one of turnip's fused ops (the ops the LLaMA builder uses, which have GPU
kernels): RMSNorm, rotary embedding, SwiGLU's product, and plain elementwise ops on tensors of one layout.

``fuse(ir)`` rewrites the last record of each chain in place (its op, inputs and params); the records before it
are left for ``live`` to drop when nothing else reads them. Patterns match records only, never torch code, so
any program that computes the same chain is fused:

  rmsnorm   mul(w, mul(x, rsqrt(affine(mean(pow(x, 2)), beta=eps))))       -> rmsnorm(x, w)
  rotary    add(mul(x, cos), mul(cat(neg(x[..., h:]), x[..., :h]), sin))    -> rotary(x), when the constant
            tables are turnip's own for positions 0.. and some theta
  silu_mul  mul(silu(g), u)                                                 -> silu_mul(g, u)
  gelu      0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))                 -> ew gelu_tanh(x)
  add, mul, affine(alpha), silu on operands of the output's layout          -> add_n, mul, scale, silu
"""

from __future__ import annotations

import math

import numpy as np

from turnip.torchimport.ir import IR


def _ew(ir: IR, r: int, fn: str | None = None) -> bool:
    rec = ir.recs[r]
    return rec.op == "ew" and (fn is None or rec.params["fn"] == fn)


def _aligned(ir: IR, r: int) -> bool:
    """Every operand of ew record ``r`` has the output's trailing axes, same extents (numpy broadcasting)."""
    rec = ir.recs[r]
    n = len(rec.dims)
    for j, ax in zip(rec.inputs, rec.params["axes"], strict=True):
        dims = ir.recs[j].dims
        if ax != list(range(n - len(dims), n)) or any(ir.ext[a] != ir.ext[b] for a, b in zip(dims, rec.dims[n - len(dims):], strict=True)):  # noqa: E501
            return False
    return True


def fuse(ir: IR) -> dict[str, int]:
    """Rewrite every chain of ``ir`` that is one fused op; the counts per pattern."""
    done = {"rmsnorm": 0, "rotary": 0, "gelu_tanh": 0, "silu_mul": 0, "plain": 0}
    for r in range(len(ir.recs)):
        if _rmsnorm(ir, r):
            done["rmsnorm"] += 1
        elif _rotary(ir, r):
            done["rotary"] += 1
        elif _gelu_tanh(ir, r):
            done["gelu_tanh"] += 1
    for r in range(len(ir.recs)):
        done["silu_mul"] += _silu_mul(ir, r)
    for r in range(len(ir.recs)):
        done["plain"] += _plain(ir, r)
    return done


def _rmsnorm(ir: IR, r: int) -> bool:
    if not (_ew(ir, r, "mul") and len(ir.recs[r].inputs) == 2):
        return False
    for w, m1 in (ir.recs[r].inputs, ir.recs[r].inputs[::-1]):
        wr = ir.recs[w]
        if wr.op != "input" or wr.value is None or len(wr.dims) != 1 or not _ew(ir, m1, "mul"):
            continue
        for x, rs in (ir.recs[m1].inputs, ir.recs[m1].inputs[::-1]):
            if not _ew(ir, rs, "rsqrt"):
                continue
            a = ir.recs[rs].inputs[0]
            if not (_ew(ir, a, "affine") and ir.recs[a].params.get("alpha", 1.0) == 1.0):
                continue
            mean = ir.recs[a].inputs[0]
            mr = ir.recs[mean]
            if mr.op != "reduce" or mr.params["fn"] != "mean":
                continue
            p = mr.inputs[0]
            pr = ir.recs[p]
            xr = ir.recs[x]
            if not (_ew(ir, p, "pow") and pr.params["alpha"] == 2.0 and pr.inputs == [x]):
                continue
            if mr.params["axis"] != len(pr.dims) - 1 or len(xr.dims) != len(ir.recs[r].dims):
                continue
            mp = ir.recs[m1].params["axes"]
            if mp[ir.recs[m1].inputs.index(x)] != list(range(len(xr.dims))) or len(ir.recs[m1].dims) != len(xr.dims):
                continue
            if not (_aligned(ir, r) and ir.find(wr.dims[0]) == ir.find(xr.dims[-1])):
                continue
            eps = float(ir.recs[a].params.get("beta", 0.0))
            rec = ir.recs[r]
            rec.op, rec.inputs, rec.params = "rmsnorm", [x, w], {"eps": eps}
            return True
    return False


def _affine_of(ir: IR, r: int, alpha: float, beta: float) -> int | None:
    """The operand of ``r`` when ``r`` is ``alpha * x + beta`` on x's layout, else None."""
    rec = ir.recs[r]
    if not (_ew(ir, r, "affine") and _aligned(ir, r) and len(ir.recs[rec.inputs[0]].dims) == len(rec.dims)):
        return None
    p = rec.params
    ok = abs(p.get("alpha", 1.0) - alpha) <= 1e-6 * abs(alpha) and abs(p.get("beta", 0.0) - beta) <= 1e-6
    return rec.inputs[0] if ok else None


def _gelu_tanh(ir: IR, r: int) -> bool:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as GPT-2's GELU writes it, is one ``ew gelu_tanh``."""
    if not (_ew(ir, r, "mul") and len(ir.recs[r].inputs) == 2 and _aligned(ir, r)):
        return False
    for a, w in (ir.recs[r].inputs, ir.recs[r].inputs[::-1]):
        x, v = _affine_of(ir, a, 0.5, 0.0), _affine_of(ir, w, 1.0, 1.0)
        if x is None or v is None or not _ew(ir, v, "tanh"):
            continue
        s = _affine_of(ir, ir.recs[v].inputs[0], math.sqrt(2.0 / math.pi), 0.0)
        if s is None or not (_ew(ir, s, "add") and _aligned(ir, s) and x in ir.recs[s].inputs):
            continue
        q = ir.recs[s].inputs[1 - ir.recs[s].inputs.index(x)]
        p = _affine_of(ir, q, 0.044715, 0.0)
        if p is None or not (_ew(ir, p, "pow") and ir.recs[p].params["alpha"] == 3.0 and ir.recs[p].inputs == [x]):
            continue
        rec = ir.recs[r]
        rec.inputs, rec.params = [x], {"fn": "gelu_tanh", "n": len(rec.dims), "axes": [list(range(len(rec.dims)))]}
        return True
    return False


def _silu_mul(ir: IR, r: int) -> bool:
    if not (_ew(ir, r, "mul") and len(ir.recs[r].inputs) == 2 and _aligned(ir, r)):
        return False
    a, b = ir.recs[r].inputs
    for s, u in ((a, b), (b, a)):
        if _ew(ir, s, "silu") and _aligned(ir, s) and \
                len(ir.recs[ir.recs[s].inputs[0]].dims) == len(ir.recs[r].dims) == len(ir.recs[u].dims):  # fmt: skip
            rec = ir.recs[r]
            rec.op, rec.inputs, rec.params = "silu_mul", [ir.recs[s].inputs[0], u], {}
            return True
    return False


def _plain(ir: IR, r: int) -> bool:
    rec = ir.recs[r]
    if rec.op != "ew" or not _aligned(ir, r):
        return False
    fn, p = rec.params["fn"], rec.params
    if fn == "add" and len(rec.inputs) == 2 and len(ir.recs[rec.inputs[0]].dims) == len(rec.dims):
        rec.op, rec.params = "add_n", {}
    elif fn == "mul" and len(rec.inputs) == 2 and len(ir.recs[rec.inputs[0]].dims) == len(rec.dims):
        rec.op, rec.params = "mul", {}
    elif fn == "affine" and p.get("beta", 0.0) == 0.0 and len(rec.inputs) == 1:
        rec.op, rec.params = "scale", {"alpha": float(p.get("alpha", 1.0))}
    elif fn == "silu" and len(rec.inputs) == 1:
        rec.op, rec.params = "silu", {}
    else:
        return False
    return True


def _rotary(ir: IR, r: int) -> bool:
    """add(mul(x, cos), mul(cat(neg(x[..., h:]), x[..., :h]), sin)) on x laid out (tokens, ..., head dim)."""
    if not (_ew(ir, r, "add") and len(ir.recs[r].inputs) == 2 and _aligned(ir, r)):
        return False
    for m1, m2 in (ir.recs[r].inputs, ir.recs[r].inputs[::-1]):
        got = _times_const(ir, m1)
        got2 = _times_const(ir, m2)
        if got is None or got2 is None:
            continue
        (x, cos), (c, sin) = got, got2
        cr = ir.recs[c]
        if cr.op != "cat" or len(cr.inputs) != 2 or cr.params["axis"] != len(cr.dims) - 1:
            continue
        neg, lo = cr.inputs
        if not (_ew(ir, neg, "neg") and _is_slice(ir, ir.recs[neg].inputs[0], x, half=1)
                and _is_slice(ir, lo, x, half=0)):  # fmt: skip
            continue
        xr = ir.recs[x]
        if len(xr.dims) < 2 or ir.recs[r].dims.__len__() != len(xr.dims):
            continue
        theta = _rope_theta(cos, sin, ir.ext[xr.dims[0]], ir.ext[xr.dims[-1]])
        if theta is None:
            continue
        rec = ir.recs[r]
        rec.op, rec.inputs, rec.params = "rotary", [x], {"theta": theta}
        return True
    return False


def _times_const(ir: IR, m: int):
    """(x, table) where ``m`` is x times a constant (tokens, head dim) table broadcast over heads, else None."""
    if not (_ew(ir, m, "mul") and len(ir.recs[m].inputs) == 2):
        return None
    for x, c in (ir.recs[m].inputs, ir.recs[m].inputs[::-1]):
        cr = ir.recs[c]
        if cr.op == "input" and cr.value is not None and cr.value.ndim == 2:
            ax = ir.recs[m].params["axes"][ir.recs[m].inputs.index(c)]
            n = len(ir.recs[m].dims)
            if ax == [0, n - 1] and ir.recs[m].params["axes"][ir.recs[m].inputs.index(x)] == list(range(n)):
                return x, cr.value
    return None


def _is_slice(ir: IR, s: int, x: int, half: int) -> bool:
    sr = ir.recs[s]
    if sr.op != "slice" or sr.inputs != [x] or sr.params["axis"] != len(sr.dims) - 1:
        return False
    e = ir.ext[ir.recs[x].dims[-1]]
    return (sr.params["start"], sr.params["stop"]) == ((e // 2, e) if half else (0, e // 2))


def _rope_theta(cos: np.ndarray, sin: np.ndarray, t: int, dh: int) -> float | None:
    """The theta whose rotary tables (turnip.reference.rope_inv_freq, positions 0..t-1) are ``cos`` and ``sin``."""
    from turnip.reference import rope_inv_freq

    if cos.shape != (t, dh) or sin.shape != (t, dh) or t < 2 or dh < 4:
        return None
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)
    inv1 = float(np.arctan2(sin[1, 1], cos[1, 1]))  # position 1's angle at frequency 1: theta^(-2/dh)
    if not 0 < inv1 < 1:
        return None
    theta = float(inv1 ** (-dh / 2.0))
    for cand in (float(f"{theta:.2g}"), float(f"{theta:.3g}"), theta):  # 10000, 500000, ...: as configs give it
        ang = np.arange(t)[:, None] * rope_inv_freq(dh, {"theta": cand})[None, :]
        ang = np.concatenate([ang, ang], axis=1)
        tol = max(1e-3, 4e-7 * t)  # the program's float32 angles drift from exact ones with the position
        if np.allclose(np.cos(ang), cos, atol=tol) and np.allclose(np.sin(ang), sin, atol=tol):
            return cand
    return None


def live(ir: IR) -> list[int]:
    """Records the outputs read, directly or not, in order."""
    seen = set(ir.outputs)
    for r in range(len(ir.recs) - 1, -1, -1):
        if r in seen:
            seen.update(ir.recs[r].inputs)
    return sorted(seen)
