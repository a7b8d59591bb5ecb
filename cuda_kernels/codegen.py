"""Kernel source generation: elementwise, row-reduction and rotary kernels for arrays of rank 1 to 3.

Numba kernels are typed per array rank, and the runtime passes already-shaped views (no reshaping at
launch), so each op's kernel is generated for its operand ranks and index expressions. Generated
sources are compiled once per distinct text (``jit`` caches them). Inside kernels every value is
``np.float32``: float literals would promote to float64, so constants come from ``_CONSTS``.

Thread layout of elementwise kernels (ranks 1-3 of the output, indices named ``a, b, c``): the last
axis ``c`` runs over ``blockIdx.x * blockDim.x + threadIdx.x`` with a grid-stride loop, ``b`` is
``blockIdx.y * blockDim.y + threadIdx.y`` (several rows per block when rows are short) and ``a`` is
``blockIdx.z``. Row kernels run a power-of-two group of threads per row, several rows per block.
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


def unroll(dtype: str = "fp32") -> int:
    """Elements per thread: loads of all of them are issued before the first store, 16 bytes of each
    operand per thread in flight (8 fp16 or 4 fp32 elements on a device; 2 under the simulator so that
    path is tested too)."""
    if simulating():
        return 2
    return 8 if dtype == "fp16" else 4


def _suffix(text: str, u: int) -> str:
    return re.sub(r"\b(v\d+|mm)\b", rf"\1_{u}", text)


def elementwise_source(n_in: int, ndim: int, loads: list[str], expr: str, n_scalars: int = 0,
                       pre: tuple[str, ...] = (), unrolled: int | None = None) -> str:
    """Kernel ``kern(out, x0.., s0..)`` writing ``out[a, b, c] = expr`` after ``v_k = loads[k]``.

    Each thread handles ``unrolled`` elements ``c = base + u * blockDim.x`` of the last axis; rank >= 2
    outputs put several rows ``b`` in one block (``threadIdx.y``), so short rows still fill blocks."""
    U = unroll() if unrolled is None else unrolled
    names = out_names(ndim)
    args = ["out", *(f"x{k}" for k in range(n_in)), *(f"s{k}" for k in range(n_scalars))]
    body = [f"def kern({', '.join(args)}):", _CONSTS.rstrip("\n")]
    ind = "    "
    if ndim >= 2:
        body.append("    b = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y")
    if ndim == 3:
        body.append("    a = cuda.blockIdx.z")
    if ndim >= 2:
        body.append(f"    if b < out.shape[{ndim - 2}]:")
        ind = "        "
    body += [
        f"{ind}n = out.shape[{ndim - 1}]",
        f"{ind}bd = cuda.blockDim.x",
        f"{ind}base = cuda.blockIdx.x * bd * {U} + cuda.threadIdx.x",
        f"{ind}step = cuda.gridDim.x * bd * {U}",
        f"{ind}while base < n:",
    ]
    i2, i3 = ind + "    ", ind + "        "
    for u in range(U if loads else 0):
        body += [f"{i2}v{k}_{u} = ZERO" for k in range(len(loads))]
        body += [f"{i2}c = base + {u} * bd", f"{i2}if c < n:"]
        body += [f"{i3}v{k}_{u} = {ld}" for k, ld in enumerate(loads)]
    for u in range(U):
        body += [f"{i2}c = base + {u} * bd", f"{i2}if c < n:"]
        body += [f"{i3}{_suffix(p, u)}" for p in pre]
        body += [f"{i3}out[{', '.join(names)}] = {_suffix(expr, u)}"]
    body += [f"{i2}base += step", ""]
    return "\n".join(body)


def load(k: int, index: str) -> str:
    return f"np.float32(x{k}[{index}])"


def block_for(n: int, cap: int = 256) -> int:
    """Threads per block along an axis of ``n`` (warp multiples on a device, exact when simulating)."""
    if simulating():
        return max(1, min(cap, n))
    return max(32, min(cap, -(-n // 32) * 32))


def _block_threads() -> int:
    return 8 if simulating() else 256


def elementwise_geometry(out_shape: tuple, n_last: int | None = None, per_thread: int = 1,
                         rows_in_block: bool = False) -> tuple[tuple, tuple]:
    """(grid, block) over ``out_shape`` (``n_last`` overrides the x extent; ``per_thread`` elements each).

    ``rows_in_block``: the block's y extent covers several indices of axis -2 (grid y = their blocks)."""
    n = out_shape[-1] if n_last is None else n_last
    blk = block_for(max(-(-n // per_thread), 1))
    gx = max(1, min(-(-n // (blk * per_thread)), _MAX_GRID_X))
    rest = list(tuple(out_shape[:-1])[::-1])
    by = 1
    if rows_in_block and rest:
        by = max(1, min(_block_threads() // blk, rest[0]))
        rest[0] = -(-rest[0] // by)
    for extent in rest:
        if extent > _MAX_GRID_YZ:
            raise ValueError(f"leading axis of length {extent} exceeds the grid limit {_MAX_GRID_YZ}")
    return (gx, *rest), ((blk, by) if by > 1 else (blk,))


def row_geometry(rows: int, n: int, per_thread: int) -> tuple[tuple, tuple]:
    """Row kernels: (grid, block) with block (threads per row, rows per block)."""
    tpr = 1
    while tpr * per_thread * 2 < n and tpr < (16 if simulating() else 256):
        tpr *= 2
    if not simulating():
        tpr = max(tpr, 32)
    rpb = max(1, _block_threads() // tpr) if not simulating() else 2
    return (max(1, -(-rows // rpb)),), (tpr, rpb)


def row_source(kind: str, ndim: int, tpr: int, rpb: int, per_thread: int) -> str:
    """``rpb`` rows per block, ``tpr`` threads per row (x), ``per_thread`` loads in flight per thread.

    kind: 'max' | 'sum' (-> out[row]) | 'rmsnorm' (-> out[row, :]); rmsnorm: ``kern(out, x, w, eps)``,
    the others ``kern(out, x)``. On a device a row's partials combine by warp shuffles, then (rows
    wider than a warp) through shared memory; the simulator, which has no shuffles, uses a shared tree.
    """
    if ndim not in (2, 3):
        raise ValueError(f"row kernels need rank 2 or 3, got rank {ndim}")
    comb = {"max": "max({0}, {1})", "sum": "{0} + {1}", "rmsnorm": "{0} + {1}"}[kind]
    init = "NEG_INF" if kind == "max" else "ZERO"
    val = "v * v" if kind == "rmsnorm" else "v"
    xi = "a, b, j" if ndim == 3 else "b, j"
    oi = "a, b" if ndim == 3 else "b"
    args = "out, x, w, eps" if kind == "rmsnorm" else "out, x"
    U, T = per_thread, tpr
    L = [f"def kern({args}):", _CONSTS.rstrip("\n"), "    t = cuda.threadIdx.x", "    ry = cuda.threadIdx.y",
         f"    row = cuda.blockIdx.x * {rpb} + ry",
         "    nrows = x.shape[0] * x.shape[1]" if ndim == 3 else "    nrows = x.shape[0]",
         f"    n = x.shape[{ndim - 1}]", f"    acc = {init}", "    a = 0", "    b = row",
         "    if row < nrows:"]
    if ndim == 3:
        L += ["        a = row // x.shape[1]", "        b = row % x.shape[1]"]
    L += ["        j0 = t", "        while j0 < n:"]
    for u in range(U):
        L += [f"            w{u} = {init}", f"            j = j0 + {u * T}", "            if j < n:",
              f"                v = np.float32(x[{xi}])", f"                w{u} = {val}"]
    L += [f"            acc = {comb.format('acc', f'w{u}')}" for u in range(U)]
    L += [f"            j0 += {T * U}"]
    if simulating():
        L += [f"    sh2 = cuda.shared.array({T * rpb}, np.float32)", f"    sh2[ry * {T} + t] = acc",
              "    cuda.syncthreads()", f"    s = {T // 2}", "    while s > 0:", "        if t < s:",
              f"            sh2[ry * {T} + t] = {comb.format(f'sh2[ry * {T} + t]', f'sh2[ry * {T} + t + s]')}",
              "        cuda.syncthreads()", "        s //= 2", f"    acc = sh2[ry * {T}]"]
    else:
        L += [f"    off = {min(T, 32) // 2}", "    while off > 0:",
              f"        acc = {comb.format('acc', 'cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)')}",
              "        off //= 2"]
    W = T // 32
    if W > 1 and not simulating():
        L += [f"    sh = cuda.shared.array({W * rpb}, np.float32)", "    if t % 32 == 0:",
              f"        sh[ry * {W} + t // 32] = acc", "    cuda.syncthreads()", f"    acc = sh[ry * {W}]"]
        L += [f"    acc = {comb.format('acc', f'sh[ry * {W} + {i}]')}" for i in range(1, W)]
    L += ["    if row < nrows:"]
    if kind == "rmsnorm":
        L += ["        r = ONE / math.sqrt(acc / np.float32(n) + eps)", "        j0 = t", "        while j0 < n:"]
        for u in range(U):
            L += [f"            p{u} = ZERO", f"            q{u} = ZERO", f"            j = j0 + {u * T}",
                  "            if j < n:", f"                p{u} = np.float32(x[{xi}])",
                  f"                q{u} = np.float32(w[j])"]
        for u in range(U):
            L += [f"            j = j0 + {u * T}", "            if j < n:",
                  f"                out[{xi}] = p{u} * r * q{u}"]
        L += [f"            j0 += {T * U}"]
    else:
        L += ["        if t == 0:", f"            out[{oi}] = acc"]
    return "\n".join(L) + "\n"


ROTARY_HEADS_PER_THREAD = 4


def rotary_source(heads_per_thread: int = ROTARY_HEADS_PER_THREAD) -> str:
    """Grid (ceil(dh/2 / block x), ceil(t / block y), ceil(h / heads_per_thread)); one angle per thread,
    applied to ``heads_per_thread`` heads. The angle is reduced to [-pi, pi] in float64, then cos/sin in
    float32."""
    H = heads_per_thread
    L = ["def kern(out, x, pos_off, theta):", "    half = x.shape[2] // 2",
         "    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
         "    a = cuda.blockIdx.y * cuda.blockDim.y + cuda.threadIdx.y",
         f"    b0 = cuda.blockIdx.z * {H}", "    if c < half and a < x.shape[0]:",
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

# Row b's masked columns start at q_off - k_off + 1 + b; the grid covers the widest row (row 0).
CAUSAL_MASK_SOURCE = """
def kern(s, q_off, k_off):
    b = cuda.blockIdx.y
    a = cuda.blockIdx.z
    c = q_off - k_off + 1 + b
    if c < 0:
        c = 0
    c += cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if c < s.shape[2] and q_off + b < k_off + c:
        s[a, b, c] = -math.inf
"""
