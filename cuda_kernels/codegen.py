"""Kernel source generation: elementwise, RMSNorm, rotary, attention and combine kernels for arrays of rank 1 to 3.

Numba kernels are typed per array rank, and the runtime passes already-shaped views (no reshaping at
launch), so each op's kernel is generated for its operand ranks and index expressions. Generated
sources are compiled once per distinct text (``jit`` caches them). Inside kernels every value is
``np.float32``: float literals would promote to float64, so constants come from ``_CONSTS``.

Thread layout of elementwise kernels (ranks 1-3 of the output, indices named ``a, b, c``): the last
axis ``c`` runs over ``blockIdx.x * blockDim.x + threadIdx.x`` with a grid-stride loop, ``b`` is
``blockIdx.y`` and ``a`` is ``blockIdx.z``. RMSNorm runs one block per row of the last axis.
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


def jit(src: str, name: str = "kern"):
    """Compile (lazily, per signature) the function ``name`` defined by ``src``; cached by text."""
    d = _SOURCES.get(src)
    if d is None:
        ns = {"np": np, "math": math, "cuda": cuda()}
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
                       pre: tuple[str, ...] = (), unrolled: int | None = None) -> str:
    """Kernel ``kern(out, x0.., s0..)`` writing ``out[a, b, c] = expr`` after ``v_k = loads[k]``.

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
        body += [f"            out[{', '.join(names)}] = {_suffix(expr, u)}"]
    body += ["        base += step", ""]
    return "\n".join(body)


def load(k: int, index: str) -> str:
    return f"np.float32(x{k}[{index}])"


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


def rmsnorm_source(ndim: int, block: int) -> str:
    """One block per row of the last axis: ``kern(out, x, w, eps)``, a shared-memory tree reduction of
    the sum of squares (no warp shuffles, so the simulator runs it), then the scaled row."""
    if ndim not in (2, 3):
        raise ValueError(f"row kernels need rank 2 or 3, got rank {ndim}")
    xi = "a, b, j" if ndim == 3 else "b, j"
    L = ["def kern(out, x, w, eps):", _CONSTS.rstrip("\n"), f"    sh = cuda.shared.array({block}, np.float32)",
         "    row = cuda.blockIdx.x"]
    L += ["    a = row // x.shape[1]", "    b = row % x.shape[1]"] if ndim == 3 else ["    b = row"]
    U = unroll()
    L += ["    t = cuda.threadIdx.x", f"    n = x.shape[{ndim - 1}]", "    acc = ZERO", "    j0 = t",
          "    while j0 < n:"]
    for u in range(U):
        L += [f"        w{u} = ZERO", f"        j = j0 + {u * block}", "        if j < n:",
              f"            v = np.float32(x[{xi}])", f"            w{u} = v * v"]
    L += [f"        acc = acc + w{u}" for u in range(U)]
    L += [f"        j0 += {block * U}", "    sh[t] = acc", "    cuda.syncthreads()", f"    s = {block // 2}",
          "    while s > 0:", "        if t < s:", "            sh[t] = sh[t] + sh[t + s]",
          "        cuda.syncthreads()",
          "        s //= 2", "    r = ONE / math.sqrt(sh[0] / np.float32(n) + eps)", "    j = t", "    while j < n:",
          f"        out[{xi}] = np.float32(x[{xi}]) * r * np.float32(w[j])", f"        j += {block}"]
    return "\n".join(L) + "\n"


ROTARY_HEADS_PER_THREAD = 4


def rotary_source(heads_per_thread: int = ROTARY_HEADS_PER_THREAD) -> str:
    """Grid (ceil(dh/2 / block), t, ceil(h / heads_per_thread)); one angle per thread, applied to
    ``heads_per_thread`` heads. The angle is reduced to [-pi, pi] in float64, then cos/sin in float32."""
    H = heads_per_thread
    L = ["def kern(out, x, pos_off, theta):", "    half = x.shape[2] // 2",
         "    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    a = cuda.blockIdx.y",
         f"    b0 = cuda.blockIdx.z * {H}", "    if c < half:",
         "        inv = 1.0 / math.pow(theta, (2.0 * c) / x.shape[2])",
         "        ang = (pos_off + a) * inv",
         "        ang = ang - 6.283185307179586 * math.floor(ang / 6.283185307179586 + 0.5)",
         "        r = np.float32(ang)", "        cs = math.cos(r)", "        sn = math.sin(r)"]
    for u in range(H):
        L += [f"        p{u} = np.float32(0.0)", f"        q{u} = np.float32(0.0)",
              f"        if b0 + {u} < x.shape[1]:", f"            p{u} = np.float32(x[a, b0 + {u}, c])",
              f"            q{u} = np.float32(x[a, b0 + {u}, c + half])"]
    for u in range(H):
        L += [f"        if b0 + {u} < x.shape[1]:", f"            out[a, b0 + {u}, c] = p{u} * cs - q{u} * sn",
              f"            out[a, b0 + {u}, c + half] = q{u} * cs + p{u} * sn"]
    return "\n".join(L) + "\n"



def sdpa_source(dh: int, partial: bool) -> str:
    """Fused causal attention, the portable (and simulator) path: one thread per (query row, head),
    online softmax over the visible keys, the row's output accumulated in ``dh`` float32 registers.
    ``kern(o, lse, q, k, v, scale, diag, tk)``: query i sees keys j < min(tk, diag + 1 + i) (``diag`` =
    q_off - k_off when causal, else tk); grid (ceil(tq / block), h). Correct, not fast: the GPU's fast
    path is cuDNN (``cuda_kernels.cudnn_sdpa``)."""
    L = ["def kern(o, lse, q, k, v, scale, diag, tk):", _CONSTS.rstrip("\n"),
         "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    hh = cuda.blockIdx.y",
         "    if i < q.shape[0]:", f"        acc = cuda.local.array({dh}, np.float32)",
         f"        for d in range({dh}):", "            acc[d] = ZERO",
         "        m = NEG_INF", "        l = ZERO", "        nvis = diag + 1 + i", "        if nvis > tk:",
         "            nvis = tk", "        for j in range(nvis):", "            s = ZERO",
         f"            for d in range({dh}):", "                s += np.float32(q[i, hh, d]) * np.float32(k[j, hh, d])",
         "            s = s * scale", "            if s > m:", "                c = math.exp(m - s)",
         "                l = l * c", f"                for d in range({dh}):",
         "                    acc[d] = acc[d] * c",
         "                m = s", "            p = math.exp(s - m)", "            l += p",
         f"            for d in range({dh}):", "                acc[d] += p * np.float32(v[j, hh, d])",
         "        inv = ZERO", "        if l > ZERO:", "            inv = ONE / l",
         f"        for d in range({dh}):", "            o[i, hh, d] = acc[d] * inv"]
    if partial:
        L += ["        if l > ZERO:", "            lse[hh, i] = m + math.log(l)", "        else:",
              "            lse[hh, i] = NEG_INF"]
    return "\n".join(L) + "\n"


def combine_source(n: int) -> str:
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
        L += [f"        w = math.exp(x{j} - m)", "        tot += w", f"        acc += w * np.float32(o{j}[a, b, c])"]
    L += ["        if tot > ZERO:", "            acc = acc / tot", "        out[a, b, c] = acc"]
    return "\n".join(L) + "\n"
