"""Contractions: an einsum of two operands as a (batched) GEMM, run by cuBLAS or a numba tiled kernel.

``plan_einsum`` classifies the subscripts' letters into batch (in both inputs and the output), m (first
input and output), n (second input and output) and k (both inputs, summed). ``CublasGemm`` maps the plan
onto one ``cublasGemmEx`` / ``cublasGemmStridedBatchedEx`` call on raw pointers (no CuPy arrays are
created at launch) with fp32 accumulation, when every group of letters is one strided axis per operand
and one of each operand's two matrix axes has unit stride. ``numba_gemm_source`` generates a 64x64-tile
shared-memory kernel for any plan (the fallback, and the only path under the CUDA simulator).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuda_kernels import _numba
from cuda_kernels.codegen import ld, st

_TM = _TN = 64
_TK = 16


@dataclass(frozen=True, slots=True)
class EinsumPlan:
    subscripts: str
    a: str
    b: str
    out: str
    size: dict  # letter -> extent
    batch: tuple
    m: tuple
    n: tuple
    k: tuple

    def extent(self, letters) -> int:
        return int(np.prod([self.size[c] for c in letters], dtype=np.int64))

    def flops(self) -> int:
        return 2 * self.extent(self.batch + self.m + self.n + self.k)


def plan_einsum(subscripts: str, a_shape: tuple, b_shape: tuple, out_shape: tuple) -> EinsumPlan:
    s = subscripts.replace(" ", "")
    try:
        ins, out = s.split("->")
        a, b = ins.split(",")
    except ValueError:
        raise ValueError(f"einsum {subscripts!r}: need explicit 'x,y->z' with two operands") from None
    size: dict[str, int] = {}
    for letters, shape, what in ((a, a_shape, "first"), (b, b_shape, "second"), (out, out_shape, "output")):
        if len(letters) != len(shape) or len(set(letters)) != len(letters):
            raise ValueError(f"einsum {subscripts!r}: {what} operand {letters!r} vs shape {tuple(shape)}")
        for c, e in zip(letters, shape, strict=True):
            if size.setdefault(c, int(e)) != int(e):
                raise ValueError(f"einsum {subscripts!r}: letter {c!r} has extents {size[c]} and {e}")
    for c in size:
        if (c in a) + (c in b) + (c in out) < 2 or (c not in a and c not in b):
            raise ValueError(f"einsum {subscripts!r}: letter {c!r} must appear in two operands")
    batch = tuple(c for c in out if c in a and c in b)
    m = tuple(c for c in out if c in a and c not in b)
    n = tuple(c for c in out if c in b and c not in a)
    k = tuple(c for c in a if c in b and c not in out)
    return EinsumPlan(s, a, b, out, size, batch, m, n, k)


def _strides(letters: str, size: dict) -> dict:
    st, acc = {}, 1
    for c in reversed(letters):
        st[c] = acc
        acc *= size[c]
    return st


def _merged_stride(group: tuple, letters: str, size: dict):
    """Element stride of ``group`` merged into one axis of an operand, or None when not mergeable.

    Extent-1 letters are dropped; an empty group has stride 0 (its extent is 1)."""
    g = [c for c in group if size[c] > 1]
    if not g:
        return 0
    st = _strides(letters, size)
    for outer, inner in zip(g, g[1:], strict=False):
        if st[outer] != st[inner] * size[inner]:
            return None
    return st[g[-1]]


# cuBLAS enums
_OP_N, _OP_T = 0, 1
_R_16F, _R_32F, _R_16BF = 2, 0, 14
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
CUBLAS_DTYPE = {"fp16": _R_16F, "fp32": _R_32F, "bf16": _R_16BF}


def cublas_layout(p: EinsumPlan):
    """cuBLAS arguments (without pointers) for plan ``p``, or None when no single call computes it.

    Returns (swap, ta, tb, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch) where ``swap``
    means cuBLAS's first operand is the einsum's second input."""
    sz = p.size
    M, N, K, G = p.extent(p.m), p.extent(p.n), p.extent(p.k), p.extent(p.batch)
    st = {}
    for name, letters in (("a", p.a), ("b", p.b), ("c", p.out)):
        for grp, gl in (("m", p.m), ("n", p.n), ("k", p.k), ("g", p.batch)):
            if any(c in letters for c in gl):
                v = _merged_stride(gl, letters, sz)
                if v is None:
                    return None
                st[name + grp] = v
    am, ak, bk, bn = st.get("am", 0), st.get("ak", 0), st.get("bk", 0), st.get("bn", 0)
    cm, cn = st.get("cm", 0), st.get("cn", 0)

    def unit(stride, extent):
        return extent == 1 or stride == 1

    def ld(stride, extent, rows):
        return stride if extent > 1 else max(rows, 1)

    def operand(s_rows, e_rows, s_cols, e_cols):
        """Col-major (rows x cols) view of an operand: (trans, ld, ok)."""
        if unit(s_rows, e_rows):
            lda = ld(s_cols, e_cols, e_rows)
            return _OP_N, lda, lda >= max(1, e_rows)
        if unit(s_cols, e_cols):
            lda = ld(s_rows, e_rows, e_cols)
            return _OP_T, lda, lda >= max(1, e_cols)
        return _OP_N, 0, False

    if unit(cn, N):  # C^T (n x m) col-major = B^T A^T
        swap, mm, nn, ldc = True, N, M, ld(cm, M, N)
        ta, lda, ok1 = operand(bn, N, bk, K)
        tb, ldb, ok2 = operand(ak, K, am, M)
    elif unit(cm, M):  # C (m x n) col-major = A B
        swap, mm, nn, ldc = False, M, N, ld(cn, N, M)
        ta, lda, ok1 = operand(am, M, ak, K)
        tb, ldb, ok2 = operand(bk, K, bn, N)
    else:
        return None
    if not (ok1 and ok2 and ldc >= max(1, mm)):
        return None
    sa, sb = (st.get("bg", 0), st.get("ag", 0)) if swap else (st.get("ag", 0), st.get("bg", 0))
    return swap, ta, tb, mm, nn, K, lda, ldb, ldc, sa, sb, st.get("cg", 0), G


def _ptr(arr) -> int:
    return arr.device_ctypes_pointer.value or 0


class CublasGemm:
    """One cuBLAS call per launch on the caller's stream, through a cuBLAS handle owned per stream.

    CuPy's wrappers set the handle's stream to CuPy's current stream, so each launch enters the
    stream's ``cupy.cuda.ExternalStream``; a handle per stream keeps cuBLAS workspaces from being
    shared by concurrent streams. The first launch on a new stream creates its handle."""

    _handles: dict = {}  # id(stream) -> (stream, ExternalStream, handle)

    def __init__(self, layout, dtype: str, alpha: float):
        self.cublas = _cublas_module()
        (self.swap, self.ta, self.tb, self.m, self.n, self.k, self.lda, self.ldb, self.ldc,
         self.sa, self.sb, self.sc, self.batch) = layout
        self.dt = CUBLAS_DTYPE[dtype]
        self._alpha = np.array([alpha], dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)
        self.alpha_p = self._alpha.ctypes.data
        self.beta_p = self._beta.ctypes.data

    @classmethod
    def _for_stream(cls, stream):
        hit = cls._handles.get(id(stream))
        if hit is None or hit[0] is not stream:
            import cupy

            ptr = int(stream.handle) if stream else 0
            handle = _cublas_create()
            hit = (stream, cupy.cuda.ExternalStream(ptr), handle)
            cls._handles[id(stream)] = hit
        return hit

    def __call__(self, stream, out, a, b) -> None:
        _, ext, h = self._for_stream(stream)
        x, y = (b, a) if self.swap else (a, b)
        with ext:
            if self.batch > 1:
                self.cublas.gemmStridedBatchedEx(
                    h, self.ta, self.tb, self.m, self.n, self.k, self.alpha_p,
                    _ptr(x), self.dt, self.lda, self.sa, _ptr(y), self.dt, self.ldb, self.sb,
                    self.beta_p, _ptr(out), self.dt, self.ldc, self.sc, self.batch,
                    _COMPUTE_32F, _GEMM_DEFAULT)
            else:
                self.cublas.gemmEx(
                    h, self.ta, self.tb, self.m, self.n, self.k, self.alpha_p,
                    _ptr(x), self.dt, self.lda, _ptr(y), self.dt, self.ldb,
                    self.beta_p, _ptr(out), self.dt, self.ldc, _COMPUTE_32F, _GEMM_DEFAULT)


def _cublas_module():
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:
        from cupy.cuda import cublas
    return cublas


def _cublas_create() -> int:
    return _cublas_module().create()


def cupy_usable() -> bool:
    if _numba.simulating():
        return False
    try:
        import cupy  # noqa: F401

        _cublas_module()
    except Exception:
        return False
    return True


def _decompose(var: str, letters: tuple, prefix: str) -> list[str]:
    """Statements splitting merged index ``var`` into one variable per letter (last letter fastest)."""
    if not letters:
        return []
    if len(letters) == 1:
        return [f"{prefix}{letters[0]} = {var}"]
    out, rest = [], var
    for i, c in enumerate(reversed(letters)):
        if i == len(letters) - 1:
            out.append(f"{prefix}{c} = {rest}")
        else:
            out.append(f"{prefix}{c} = ({rest}) % S_{c}")
            rest = f"({rest}) // S_{c}"
    return out


def numba_gemm_source(p: EinsumPlan, bf16: bool = False) -> str:
    """64x64 output tile per 16x16-thread block, 4x4 outputs per thread, k in steps of 16.

    ``kern(a, b, out, alpha, S_<letter>...)``; grid (ceil(N/64), ceil(M/64), batch). ``bf16``: the
    operands and output are bf16 bits (``codegen.ld`` / ``codegen.st``)."""
    letters = sorted(p.size)
    args = ["a", "b", "out", "alpha", *(f"S_{c}" for c in letters)]
    M = " * ".join(f"S_{c}" for c in p.m) or "1"
    N = " * ".join(f"S_{c}" for c in p.n) or "1"
    K = " * ".join(f"S_{c}" for c in p.k) or "1"
    # consecutive threads walk the unit-stride axis of each operand when loading tiles
    a_k_fast = not p.m or (p.a[-1] in p.k)
    b_n_fast = not p.k or (p.b[-1] in p.n)

    def idx(letters_of: str, env: dict) -> str:
        return ", ".join(env.get(c, f"g_{c}") for c in letters_of)

    L = [f"def kern({', '.join(args)}):"]
    L += ["    sa = cuda.shared.array((16, 64), np.float32)",
          "    sb = cuda.shared.array((16, 64), np.float32)",
          f"    M = {M}", f"    N = {N}", f"    K = {K}",
          "    tx = cuda.threadIdx.x", "    ty = cuda.threadIdx.y", "    tid = ty * 16 + tx",
          "    m0 = cuda.blockIdx.y * 64", "    n0 = cuda.blockIdx.x * 64", "    g = cuda.blockIdx.z"]
    L += ["    " + s for s in _decompose("g", p.batch, "g_")]
    L += [f"    c{i}{j} = np.float32(0.0)" for i in range(4) for j in range(4)]
    L += ["    for k0 in range(0, K, 16):", "        for e in range(4):", "            q = tid + e * 256"]
    if a_k_fast:
        L += ["            mm = q // 16", "            kk = q % 16"]
    else:
        L += ["            kk = q // 64", "            mm = q % 64"]
    L += ["            mi = m0 + mm", "            ki = k0 + kk", "            v = np.float32(0.0)",
          "            if mi < M and ki < K:"]
    L += ["                " + s for s in _decompose("mi", p.m, "m_") + _decompose("ki", p.k, "k_")]
    env_a = {**{c: f"m_{c}" for c in p.m}, **{c: f"k_{c}" for c in p.k}}
    L += [f"                v = {ld(f'a[{idx(p.a, env_a)}]', bf16)}", "            sa[kk, mm] = v"]
    if b_n_fast:
        L += ["            kk = q // 64", "            nn = q % 64"]
    else:
        L += ["            nn = q // 16", "            kk = q % 16"]
    L += ["            ni = n0 + nn", "            ki = k0 + kk", "            v = np.float32(0.0)",
          "            if ni < N and ki < K:"]
    L += ["                " + s for s in _decompose("ni", p.n, "n_") + _decompose("ki", p.k, "k_")]
    env_b = {**{c: f"n_{c}" for c in p.n}, **{c: f"k_{c}" for c in p.k}}
    L += [f"                v = {ld(f'b[{idx(p.b, env_b)}]', bf16)}", "            sb[kk, nn] = v",
          "        cuda.syncthreads()", "        for kk in range(16):"]
    L += [f"            a{i} = sa[kk, ty + {16 * i}]" for i in range(4)]
    L += [f"            b{j} = sb[kk, tx + {16 * j}]" for j in range(4)]
    L += [f"            c{i}{j} += a{i} * b{j}" for i in range(4) for j in range(4)]
    L += ["        cuda.syncthreads()"]
    env_c = {**{c: f"m_{c}" for c in p.m}, **{c: f"n_{c}" for c in p.n}}
    for i in range(4):
        for j in range(4):
            L += [f"    mi = m0 + ty + {16 * i}", f"    ni = n0 + tx + {16 * j}", "    if mi < M and ni < N:"]
            L += ["        " + s for s in _decompose("mi", p.m, "m_") + _decompose("ni", p.n, "n_")]
            L += [f"        out[{idx(p.out, env_c)}] = {st(f'c{i}{j} * alpha', bf16)}"]
    return "\n".join(L) + "\n"


def numba_gemm_geometry(p: EinsumPlan) -> tuple[tuple, tuple]:
    M, N, G = p.extent(p.m), p.extent(p.n), p.extent(p.batch)
    if G > 65535:
        raise ValueError(f"einsum {p.subscripts!r}: batch {G} exceeds the grid limit 65535")
    return (-(-N // _TN), -(-M // _TM), G), (16, 16)


def gemm_letters(p: EinsumPlan) -> list[str]:
    """Order of the ``S_<letter>`` size arguments of ``numba_gemm_source``."""
    return sorted(p.size)
