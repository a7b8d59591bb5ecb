"""Kernel source generation: elementwise, row-reduction and rotary kernels for arrays of rank 1 to 3.

Numba kernels are typed per array rank, and the runtime passes already-shaped views (no reshaping at
launch), so each op's kernel is generated for its operand ranks and index expressions. Generated
sources are compiled once per distinct text (``jit`` caches them). Inside kernels every value is
``np.float32``: float literals would promote to float64, so constants come from ``_CONSTS``.

Thread layout of elementwise kernels (ranks 1-3 of the output, indices named ``a, b, c``): the last
axis ``c`` runs over ``blockIdx.x * blockDim.x + threadIdx.x`` with a grid-stride loop, ``b`` is
``blockIdx.y`` and ``a`` is ``blockIdx.z``. Row kernels run one block per row of the last axis.
"""

from __future__ import annotations

import math

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


def elementwise_source(n_in: int, ndim: int, loads: list[str], expr: str, n_scalars: int = 0,
                       pre: tuple[str, ...] = ()) -> str:
    """Kernel ``kern(out, x0.., s0..)`` writing ``out[a, b, c] = expr`` after ``v_k = loads[k]``."""
    names = out_names(ndim)
    args = ["out", *(f"x{k}" for k in range(n_in)), *(f"s{k}" for k in range(n_scalars))]
    body = [f"def kern({', '.join(args)}):", _CONSTS.rstrip("\n")]
    if ndim >= 2:
        body.append("    b = cuda.blockIdx.y")
    if ndim == 3:
        body.append("    a = cuda.blockIdx.z")
    body += [
        f"    n = out.shape[{ndim - 1}]",
        "    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x",
        "    step = cuda.gridDim.x * cuda.blockDim.x",
        "    while c < n:",
    ]
    body += [f"        v{k} = {ld}" for k, ld in enumerate(loads)]
    body += [f"        {p}" for p in pre]
    body += [f"        out[{', '.join(names)}] = {expr}", "        c += step", ""]
    return "\n".join(body)


def load(k: int, index: str) -> str:
    return f"np.float32(x{k}[{index}])"


def block_for(n: int, cap: int = 256) -> int:
    """Threads per block along an axis of ``n`` (warp multiples on a device, exact when simulating)."""
    if simulating():
        return max(1, min(cap, n))
    return max(32, min(cap, -(-n // 32) * 32))


def elementwise_geometry(out_shape: tuple, n_last: int | None = None) -> tuple[tuple, tuple]:
    """(grid, block) for an elementwise kernel over ``out_shape`` (``n_last`` overrides the x extent)."""
    n = out_shape[-1] if n_last is None else n_last
    blk = block_for(max(n, 1))
    gx = max(1, min(-(-n // blk), _MAX_GRID_X))
    rest = tuple(out_shape[:-1])[::-1]
    for extent in rest:
        if extent > _MAX_GRID_YZ:
            raise ValueError(f"leading axis of length {extent} exceeds the grid limit {_MAX_GRID_YZ}")
    return (gx, *rest), (blk,)


def row_block() -> int:
    return 32 if simulating() else 256


def row_source(kind: str, ndim: int, block: int) -> str:
    """One block per row of the last axis. kind: 'max' | 'sum' (-> out[row]) | 'rmsnorm' (-> out[row, :]).

    rmsnorm: ``kern(out, x, w, eps)``; the others ``kern(out, x)``.
    """
    if ndim not in (2, 3):
        raise ValueError(f"row kernels need rank 2 or 3, got rank {ndim}")
    comb = {"max": "max({0}, {1})", "sum": "{0} + {1}", "rmsnorm": "{0} + {1}"}[kind]
    init = "NEG_INF" if kind == "max" else "ZERO"
    val = "v * v" if kind == "rmsnorm" else "v"
    xi = "a, b, j" if ndim == 3 else "b, j"
    oi = "a, b" if ndim == 3 else "b"
    args = "out, x, w, eps" if kind == "rmsnorm" else "out, x"
    L = [f"def kern({args}):", _CONSTS.rstrip("\n"), f"    sh = cuda.shared.array({block}, np.float32)",
         "    row = cuda.blockIdx.x"]
    L += ["    a = row // x.shape[1]", "    b = row % x.shape[1]"] if ndim == 3 else ["    b = row"]
    L += [
        "    t = cuda.threadIdx.x",
        f"    n = x.shape[{ndim - 1}]",
        f"    acc = {init}",
        "    j = t",
        "    while j < n:",
        f"        v = np.float32(x[{xi}])",
        f"        acc = {comb.format('acc', val)}",
        f"        j += {block}",
        "    sh[t] = acc",
        "    cuda.syncthreads()",
        f"    s = {block // 2}",
        "    while s > 0:",
        "        if t < s:",
        f"            sh[t] = {comb.format('sh[t]', 'sh[t + s]')}",
        "        cuda.syncthreads()",
        "        s //= 2",
    ]
    if kind == "rmsnorm":
        L += [
            "    r = ONE / math.sqrt(sh[0] / np.float32(n) + eps)",
            "    j = t",
            "    while j < n:",
            f"        out[{xi}] = np.float32(x[{xi}]) * r * np.float32(w[j])",
            f"        j += {block}",
        ]
    else:
        L += ["    if t == 0:", f"        out[{oi}] = sh[0]"]
    return "\n".join(L) + "\n"


ROTARY_SOURCE = """
def kern(out, x, pos_off, theta):
    half = x.shape[2] // 2
    c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    a = cuda.blockIdx.z
    if c < half:
        inv = 1.0 / math.pow(theta, (2.0 * c) / x.shape[2])
        ang = (pos_off + a) * inv
        cs = np.float32(math.cos(ang))
        sn = np.float32(math.sin(ang))
        x1 = np.float32(x[a, b, c])
        x2 = np.float32(x[a, b, c + half])
        out[a, b, c] = x1 * cs - x2 * sn
        out[a, b, c + half] = x2 * cs + x1 * sn
"""

CAUSAL_MASK_SOURCE = """
def kern(s, q_off, k_off, c0):
    c = c0 + cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    b = cuda.blockIdx.y
    a = cuda.blockIdx.z
    if c < s.shape[2] and q_off + b < k_off + c:
        s[a, b, c] = -math.inf
"""
