"""Kernel source generation: elementwise, RMSNorm (and its backward), rotary, cross-entropy, attention and
combine kernels for arrays of rank 1 to 3.

Numba kernels are typed per array rank, and the runtime passes already-shaped views (no reshaping at
launch), so each op's kernel is generated for its operand ranks and index expressions. Generated
sources are compiled once per distinct text (``jit`` caches them). Inside kernels every value is
``np.float32``: float literals would promote to float64, so constants come from ``_CONSTS``.

Thread layout of elementwise kernels (ranks 1-3 of the output, indices named ``a, b, c``): the last
axis ``c`` runs over ``blockIdx.x * blockDim.x + threadIdx.x`` with a grid-stride loop, ``b`` is
``blockIdx.y`` and ``a`` is ``blockIdx.z``. Row kernels (RMSNorm, its backward, cross-entropy) run one
block per row of the last axis with shared-memory tree reductions.

bf16 (``bf16=True`` in the generators): numba has no bfloat16 arrays, so bf16 operands arrive as uint16
views of their bits; loads convert with ``BF2F`` (the bits shifted into a float32) and stores with ``F2BF``
(round to nearest even, NaN kept NaN), device functions defined once here. The fp16/fp32 sources are the
same text as without the option.
"""

from __future__ import annotations

import math
import re

import numpy as np

from cuda_kernels._numba import cuda, simulating

_CONSTS = (
    "    ONE = np.float32(1.0)\n    ZERO = np.float32(0.0)\n    HALF = np.float32(0.5)\n"
    "    NEG_INF = np.float32(-math.inf)\n    POS_INF = np.float32(math.inf)\n"
)
_NAMES = ("a", "b", "c")
_MAX_GRID_YZ = 65535
_MAX_GRID_X = 1 << 20
_SOURCES: dict[str, object] = {}
_BF16_SOURCE = """
def BF2F(u):
    t = cuda.local.array(1, np.uint32)
    t[0] = np.uint32(u) << np.uint32(16)
    return t.view(np.float32)[0]


def F2BF(f):
    t = cuda.local.array(1, np.float32)
    t[0] = f
    b = t.view(np.uint32)[0]
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
"""
_BF16_FUNCS: dict[str, object] = {}


def bf16_functions() -> dict[str, object]:
    """The device functions ``BF2F`` (uint16 bits -> float32) and ``F2BF`` (float32 -> uint16 bits, round
    to nearest even); a one-element local array viewed as the other type is the bit cast (registers only
    on a device, numpy under the simulator)."""
    if not _BF16_FUNCS:
        ns = {"np": np, "cuda": cuda()}
        exec(compile(_BF16_SOURCE, "<cuda_kernels:bf16>", "exec"), ns)  # noqa: S102 - fixed source
        _BF16_FUNCS.update({k: cuda().jit(device=True)(ns[k]) for k in ("BF2F", "F2BF")})
    return _BF16_FUNCS


def jit(src: str, name: str = "kern"):
    """Compile (lazily, per signature) the function ``name`` defined by ``src``; cached by text."""
    d = _SOURCES.get(src)
    if d is None:
        ns = {"np": np, "math": math, "cuda": cuda()}
        if "BF2F(" in src or "F2BF(" in src:
            ns.update(bf16_functions())
        exec(compile(src, f"<cuda_kernels:{name}>", "exec"), ns)  # noqa: S102 - generated source
        d = cuda().jit(ns[name])
        _SOURCES[src] = d
    return d


def out_names(ndim: int) -> tuple[str, ...]:
    """Index variable names of an output of rank ``ndim`` (the last is always ``c``)."""
    if not 1 <= ndim <= 3:
        raise ValueError(f"kernels support arrays of rank 1 to 3, got rank {ndim}")
    return _NAMES[3 - ndim :]


def same_index(ndim: int) -> str:
    return ", ".join(out_names(ndim))


def broadcast_index(in_shape: tuple, out_shape: tuple) -> str:
    """Index of an input broadcast against the output numpy-style (trailing axes aligned)."""
    names = out_names(len(out_shape))[len(out_shape) - len(in_shape) :]
    if len(in_shape) > len(out_shape):
        raise ValueError(f"input shape {in_shape} does not broadcast to output shape {out_shape}")
    parts = []
    for nm, si, so in zip(names, in_shape, out_shape[len(out_shape) - len(in_shape) :], strict=True):
        if si == so:
            parts.append(nm)
        elif si == 1:
            parts.append("0")
        else:
            raise ValueError(f"input shape {in_shape} does not broadcast to output shape {out_shape}")
    return ", ".join(parts) if parts else "0"


def flat_index(var: str, ndim: int, arr: str) -> str:
    """Index expression of flat element ``var`` of C-contiguous array ``arr`` of rank ``ndim``."""
    if ndim == 1:
        return var
    if ndim == 2:
        return f"({var}) // {arr}.shape[1], ({var}) % {arr}.shape[1]"
    return (
        f"({var}) // ({arr}.shape[1] * {arr}.shape[2]), (({var}) // {arr}.shape[2]) % {arr}.shape[1], "
        f"({var}) % {arr}.shape[2]"
    )


def unroll() -> int:
    """Elements per thread: loads of all of them are issued before the first store (more bytes in
    flight; 4 on a device, 2 under the simulator so that path is tested too)."""
    return 2 if simulating() else 4


def _suffix(text: str, u: int) -> str:
    return re.sub(r"\b(v\d+|mm)\b", rf"\1_{u}", text)


def elementwise_source(n_in: int, ndim: int, loads: list[str], expr: str, n_scalars: int = 0,
                       pre: tuple[str, ...] = (), unrolled: int | None = None, bf16: bool = False) -> str:
    """Kernel ``kern(out, x0.., s0..)`` writing ``out[a, b, c] = expr`` after ``v_k = loads[k]`` (``bf16``:
    ``out`` holds bf16 bits and the float32 ``expr`` is rounded into it).

    Each thread handles ``unrolled`` elements ``c = base + u * blockDim.x`` of the last axis."""
    U = unroll() if unrolled is None else unrolled
    names = out_names(ndim)
    args = ["out", *(f"x{k}" for k in range(n_in)), *(f"s{k}" for k in range(n_scalars))]
    body = [f"def kern({', '.join(args)}):", _CONSTS.rstrip("\n")]
    if ndim >= 2:
        body.append("    b = cuda.blockIdx.y")
    if ndim == 3:
        body.append("    a = cuda.blockIdx.z")
    body += [
        f"    n = out.shape[{ndim - 1}]",
        "    bd = cuda.blockDim.x",
        f"    base = cuda.blockIdx.x * bd * {U} + cuda.threadIdx.x",
        f"    step = cuda.gridDim.x * bd * {U}",
        "    while base < n:",
    ]
    for u in range(U if loads else 0):
        body += [f"        v{k}_{u} = ZERO" for k in range(len(loads))]
        body += [f"        c = base + {u} * bd", "        if c < n:"]
        body += [f"            v{k}_{u} = {ld}" for k, ld in enumerate(loads)]
    for u in range(U):
        body += [f"        c = base + {u} * bd", "        if c < n:"]
        body += [f"            {_suffix(p, u)}" for p in pre]
        body += [f"            out[{', '.join(names)}] = {st(_suffix(expr, u), bf16)}"]
    body += ["        base += step", ""]
    return "\n".join(body)


def ld(element: str, bf16: bool = False) -> str:
    """A float32 expression of the array element ``element`` (bf16: its uint16 bits, converted)."""
    return f"BF2F({element})" if bf16 else f"np.float32({element})"


def st(value: str, bf16: bool = False) -> str:
    """What to store for the float32 expression ``value`` (bf16: its rounded bits)."""
    return f"F2BF({value})" if bf16 else value


def load(k: int, index: str, bf16: bool = False) -> str:
    return ld(f"x{k}[{index}]", bf16)


def block_for(n: int, cap: int = 256) -> int:
    """Threads per block along an axis of ``n`` (warp multiples on a device, exact when simulating)."""
    if simulating():
        return max(1, min(cap, n))
    return max(32, min(cap, -(-n // 32) * 32))


def elementwise_geometry(out_shape: tuple, n_last: int | None = None, per_thread: int = 1) -> tuple[tuple, tuple]:
    """(grid, block) over ``out_shape`` (``n_last`` overrides the x extent; ``per_thread`` elements each)."""
    n = out_shape[-1] if n_last is None else n_last
    blk = block_for(max(-(-n // per_thread), 1))
    gx = max(1, min(-(-n // (blk * per_thread)), _MAX_GRID_X))
    rest = tuple(out_shape[:-1])[::-1]
    for extent in rest:
        if extent > _MAX_GRID_YZ:
            raise ValueError(f"leading axis of length {extent} exceeds the grid limit {_MAX_GRID_YZ}")
    return (gx, *rest), (blk,)


def row_block() -> int:
    return 32 if simulating() else 256


def _tree_sum(block: int, arrays: tuple[str, ...]) -> list[str]:
    """Lines summing the shared arrays ``arrays`` (one slot per thread ``t``, power-of-two ``block``) into
    slot 0: a barrier, then a tree of barriers (no warp shuffles, so the simulator runs it)."""
    L = ["    cuda.syncthreads()", f"    s = {block // 2}", "    while s > 0:", "        if t < s:"]
    L += [f"            {a}[t] = {a}[t] + {a}[t + s]" for a in arrays]
    return L + ["        cuda.syncthreads()", "        s //= 2"]


def rmsnorm_source(ndim: int, block: int, bf16: bool = False, offset: bool = False) -> str:
    """One block per row of the last axis: ``kern(out, x, w, eps)``, a shared-memory tree reduction of
    the sum of squares (no warp shuffles, so the simulator runs it), then the scaled row. ``offset``:
    ``kern(out, x, w, eps, off)`` scales by ``w + off`` (Gemma's norms)."""
    if ndim not in (2, 3):
        raise ValueError(f"row kernels need rank 2 or 3, got rank {ndim}")
    xi = "a, b, j" if ndim == 3 else "b, j"
    L = [f"def kern(out, x, w, eps{', off' if offset else ''}):", _CONSTS.rstrip("\n"),
         f"    sh = cuda.shared.array({block}, np.float32)",
         "    row = cuda.blockIdx.x"]
    L += ["    a = row // x.shape[1]", "    b = row % x.shape[1]"] if ndim == 3 else ["    b = row"]
    U = unroll()
    wj = f"({ld('w[j]', bf16)} + off)" if offset else ld("w[j]", bf16)
    L += ["    t = cuda.threadIdx.x", f"    n = x.shape[{ndim - 1}]", "    acc = ZERO", "    j0 = t",
          "    while j0 < n:"]
    for u in range(U):
        L += [f"        w{u} = ZERO", f"        j = j0 + {u * block}", "        if j < n:",
              f"            v = {ld(f'x[{xi}]', bf16)}", f"            w{u} = v * v"]
    L += [f"        acc = acc + w{u}" for u in range(U)]
    L += [f"        j0 += {block * U}", "    sh[t] = acc", *_tree_sum(block, ("sh",)),
          "    r = ONE / math.sqrt(sh[0] / np.float32(n) + eps)", "    j = t", "    while j < n:",
          f"        out[{xi}] = {st(ld(f'x[{xi}]', bf16) + ' * r * ' + wj, bf16)}",
          f"        j += {block}"]
    return "\n".join(L) + "\n"


ROTARY_HEADS_PER_THREAD = 4


def rotary_source(heads_per_thread: int = ROTARY_HEADS_PER_THREAD, scaled: bool = False,
                  bf16: bool = False, inverse: bool = False) -> str:
    """Grid (ceil(dh/2 / block), t, ceil(h / heads_per_thread)); one angle per thread, applied to
    ``heads_per_thread`` heads. The angle is reduced to [-pi, pi] in float64, then cos/sin in float32.
    ``kern(out, x, pos_off, theta)``; ``scaled`` adds LLaMA-3 rope scaling of the frequency (in float64):
    ``kern(out, x, pos_off, theta, factor, low, high, orig)``; ``inverse`` rotates by minus the angle."""
    H = heads_per_thread
    L = [f"def kern(out, x, pos_off, theta{', factor, low, high, orig' if scaled else ''}):",
         "    half = x.shape[2] // 2",
         "    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    a = cuda.blockIdx.y",
         f"    b0 = cuda.blockIdx.z * {H}", "    if c < half:",
         "        inv = 1.0 / math.pow(theta, (2.0 * c) / x.shape[2])"]
    if scaled:  # turnip.reference.rope_inv_freq, element by element
        L += ["        wl = 6.283185307179586 / inv", "        if wl > orig / low:", "            inv = inv / factor",
              "        elif not (wl < orig / high):", "            sm = (orig / wl - low) / (high - low)",
              "            inv = (1.0 - sm) * inv / factor + sm * inv"]
    L += ["        ang = (pos_off + a) * inv",
         "        ang = ang - 6.283185307179586 * math.floor(ang / 6.283185307179586 + 0.5)",
         "        r = np.float32(ang)", "        cs = math.cos(r)",
         f"        sn = {'-' if inverse else ''}math.sin(r)"]
    for u in range(H):
        L += [f"        p{u} = np.float32(0.0)", f"        q{u} = np.float32(0.0)",
              f"        if b0 + {u} < x.shape[1]:", f"            p{u} = {ld(f'x[a, b0 + {u}, c]', bf16)}",
              f"            q{u} = {ld(f'x[a, b0 + {u}, c + half]', bf16)}"]
    for u in range(H):
        L += [f"        if b0 + {u} < x.shape[1]:",
              f"            out[a, b0 + {u}, c] = {st(f'p{u} * cs - q{u} * sn', bf16)}",
              f"            out[a, b0 + {u}, c + half] = {st(f'q{u} * cs + p{u} * sn', bf16)}"]
    return "\n".join(L) + "\n"


def _row_loads(block: int, loads: dict[str, str], pad: str = "ZERO") -> list[str]:
    """The head of an unrolled loop over the row ``b``'s columns ``j`` (per thread ``t``, ``unroll()``
    columns per trip, each a block apart): ``name{u} = expr`` for every ``loads`` entry (``pad`` past
    the row's end). The caller adds the trip's body and then ``j0 += block * unroll()``."""
    L = ["    j0 = t", "    while j0 < n:"]
    for u in range(unroll()):
        L += [f"        {k}{u} = {pad}" for k in loads]
        L += [f"        j = j0 + {u * block}", "        if j < n:"]
        L += [f"            {k}{u} = {e}" for k, e in loads.items()]
    return L


def rmsnorm_bwd_source(block: int, bf16: bool = False) -> str:
    """dx of RMSNorm, one block per row: ``kern(out, x, w, dy, eps)`` with out, x, dy (rows, d) and w (d,);
    shared-memory tree reductions of sum(x^2) and sum(x w dy), then dx = r w dy - x r^3 mean(x w dy)."""
    x, g = ld("x[b, j]", bf16), f"{ld('dy[b, j]', bf16)} * {ld('w[j]', bf16)}"
    L = ["def kern(out, x, w, dy, eps):", _CONSTS.rstrip("\n"), f"    sx = cuda.shared.array({block}, np.float32)",
         f"    sg = cuda.shared.array({block}, np.float32)", "    b = cuda.blockIdx.x", "    t = cuda.threadIdx.x",
         "    n = x.shape[1]", "    ax = ZERO", "    ag = ZERO", *_row_loads(block, {"p": x, "g": g})]
    for u in range(unroll()):
        L += [f"        ax = ax + p{u} * p{u}", f"        ag = ag + p{u} * g{u}"]
    L += [f"        j0 += {block * unroll()}", "    sx[t] = ax", "    sg[t] = ag", *_tree_sum(block, ("sx", "sg")),
          "    r = ONE / math.sqrt(sx[0] / np.float32(n) + eps)", "    q = r * r * r * (sg[0] / np.float32(n))",
          "    j = t", "    while j < n:", f"        out[b, j] = {st(f'r * {g} - {x} * q', bf16)}",
          f"        j += {block}"]
    return "\n".join(L) + "\n"


def softmax_row_source(block: int, backward: bool, bf16: bool = False) -> str:
    """Cross-entropy of logits z (t, V) against int32 targets tg (t,), one block per row ``b``: each
    thread keeps an online (max, sum of exp) over its columns, a shared-memory tree merges them.
    Forward ``kern(out, z, tg)``: out (t,) float32 = logsumexp(z[b]) - z[b, tg[b]]. ``backward``:
    ``kern(out, z, tg, scale)``, out (t, V) = (softmax(z[b]) - onehot(tg[b])) * scale (``bf16``: z and,
    backward, out are bf16 bits). Rows with tg < 0 give 0 (and read nothing); tg >= V gives NaN, and so
    does a NaN logit."""
    z = ld("z[b, j]", bf16)
    L = [f"def kern(out, z, tg{', scale' if backward else ''}):", _CONSTS.rstrip("\n"),
         f"    sm = cuda.shared.array({block}, np.float32)", f"    sl = cuda.shared.array({block}, np.float32)",
         "    b = cuda.blockIdx.x", "    t = cuda.threadIdx.x", "    n = z.shape[1]", "    k = tg[b]",
         "    if k < 0:"]  # the same for the whole block: its threads leave together
    if backward:
        L += ["        j = t", "        while j < n:", f"            out[b, j] = {st('ZERO', bf16)}",
              f"            j += {block}"]
    else:
        L += ["        if t == 0:", "            out[b] = ZERO"]
    L += ["        return", "    m = NEG_INF", "    l = ZERO", *_row_loads(block, {"w": z}, "NEG_INF")]
    for u in range(unroll()):
        L += [f"        if w{u} > m:", f"            l = l * math.exp(m - w{u}) + ONE", f"            m = w{u}",
              f"        elif w{u} != NEG_INF:", f"            l = l + math.exp(w{u} - m)"]  # NaN: l = NaN
    L += [f"        j0 += {block * unroll()}", "    sm[t] = m", "    sl[t] = l", "    cuda.syncthreads()",
          f"    s = {block // 2}", "    while s > 0:", "        if t < s:", "            m1 = sm[t]",
          "            m2 = sm[t + s]", "            mx = m1 if m1 > m2 else m2", "            if mx > NEG_INF:",
          "                sl[t] = sl[t] * math.exp(m1 - mx) + sl[t + s] * math.exp(m2 - mx)",
          "                sm[t] = mx", "            else:", "                sl[t] = sl[t] + sl[t + s]",
          "        cuda.syncthreads()", "        s //= 2", "    m = sm[0]", "    l = sl[0]"]
    if backward:
        L += ["    il = ONE / l", "    if k >= n:", "        il = np.float32(math.nan)", "    j = t",
              "    while j < n:", f"        p = math.exp({z} - m) * il", "        if j == k:",
              "            p = p - ONE", f"        out[b, j] = {st('p * scale', bf16)}", f"        j += {block}"]
    else:
        zk = ld("z[b, k]", bf16)
        L += ["    if t == 0:", "        if k < n:", f"            out[b] = m + math.log(l) - {zk}", "        else:",
              "            out[b] = np.float32(math.nan)"]
    return "\n".join(L) + "\n"


def sdpa_source(dh: int, partial: bool, group: int = 1, bf16: bool = False, softcap: bool = False) -> str:
    """Fused causal attention, the portable (and simulator) path: one thread per (query row, head),
    online softmax over the visible keys, the row's output accumulated in ``dh`` float32 registers.
    ``kern(o, lse, q, k, v, scale, diag, tk, window, cap)``: query i sees keys max(0, diag + 1 + i - window)
    <= j < min(tk, diag + 1 + i) (``diag`` = q_off - k_off when causal, else tk; ``window``: the sliding
    window, or a number beyond any key range); grid (ceil(tq / block), h). ``softcap``: scores s become
    cap tanh(s / cap). Query head hh reads key/value head hh // ``group`` (grouped-query attention; q, o
    (tq, h, dh), k, v (tk, h / group, dh)). Correct, not fast: the GPU's fast path is cuDNN
    (``cuda_kernels.cudnn_sdpa``)."""
    kv = "hh" if group == 1 else "kh"
    L = ["def kern(o, lse, q, k, v, scale, diag, tk, window, cap):", _CONSTS.rstrip("\n"),
         "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    hh = cuda.blockIdx.y",
         *([] if group == 1 else [f"    kh = hh // {group}"]),
         "    if i < q.shape[0]:", f"        acc = cuda.local.array({dh}, np.float32)",
         f"        for d in range({dh}):", "            acc[d] = ZERO",
         "        m = NEG_INF", "        l = ZERO", "        nvis = diag + 1 + i", "        if nvis > tk:",
         "            nvis = tk", "        lo = diag + 1 + i - window", "        if lo < 0:", "            lo = 0",
         "        for j in range(lo, nvis):", "            s = ZERO", f"            for d in range({dh}):",
         f"                s += {ld('q[i, hh, d]', bf16)} * {ld(f'k[j, {kv}, d]', bf16)}",
         "            s = s * scale", *(["            s = cap * math.tanh(s / cap)"] if softcap else []),
         "            if s > m:", "                c = math.exp(m - s)",
         "                l = l * c", f"                for d in range({dh}):",
         "                    acc[d] = acc[d] * c",
         "                m = s", "            p = math.exp(s - m)", "            l += p",
         f"            for d in range({dh}):", f"                acc[d] += p * {ld(f'v[j, {kv}, d]', bf16)}",
         "        inv = ZERO", "        if l > ZERO:", "            inv = ONE / l",
         f"        for d in range({dh}):", f"            o[i, hh, d] = {st('acc[d] * inv', bf16)}"]
    if partial:
        L += ["        if l > ZERO:", "            lse[hh, i] = m + math.log(l)", "        else:",
              "            lse[hh, i] = NEG_INF"]
    return "\n".join(L) + "\n"


def combine_source(n: int, bf16: bool = False) -> str:
    """Merge ``n`` attention partials: ``kern(out, o0, l0, o1, l1, ...)``, out (tq, h, dh) and each
    o_j (tq, h, dh), l_j (h, tq) float32; thread layout of the elementwise kernels (c = head dim)."""
    args = ", ".join(f"o{j}, l{j}" for j in range(n))
    L = [f"def kern(out, {args}):", _CONSTS.rstrip("\n"), "    b = cuda.blockIdx.y", "    a = cuda.blockIdx.z",
         "    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    if c < out.shape[2]:",
         "        m = NEG_INF"]
    for j in range(n):
        L += [f"        x{j} = l{j}[b, a]", f"        if x{j} > m:", f"            m = x{j}"]
    L += ["        if not (m > NEG_INF and m < POS_INF):", "            m = ZERO", "        tot = ZERO",
          "        acc = ZERO"]
    for j in range(n):
        L += [f"        w = math.exp(x{j} - m)", "        tot += w", f"        acc += w * {ld(f'o{j}[a, b, c]', bf16)}"]
    L += ["        if tot > ZERO:", "            acc = acc / tot", f"        out[a, b, c] = {st('acc', bf16)}"]
    return "\n".join(L) + "\n"
