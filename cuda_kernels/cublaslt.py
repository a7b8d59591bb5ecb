"""cuBLASLt GEMMs through ctypes: one ``cublasLtMatmul`` call per launch on prebuilt ctypes arguments.

``LtGemm(layout, dtype, alpha, max_ws_nbytes)`` takes the tuple ``cuda_kernels.gemm.cublas_layout(plan)``
returns (column-major cuBLAS terms, ``swap`` meaning cuBLAS's first operand is the einsum's second input),
builds the matmul descriptor, the matrix layouts (strided batch when ``batch > 1``) and asks
``cublasLtMatmulAlgoGetHeuristic`` once for the best algorithm within ``max_ws_nbytes`` of workspace; it
keeps the 64-byte ``cublasLtMatmulAlgo_t`` and the workspace that algorithm needs (``ws_nbytes``).

``LtGemm.bind(c, a, b)`` fixes the device pointers (the einsum's output, first and second input) and
returns a ``LibCall``: ``call(ctx)`` issues ``cublasLtMatmul`` with the stream slot's cuBLASLt handle
(``ctx.handles['cublaslt']``, from ``lt_handle_create``), workspace and stream; every other argument is a
ctypes object built at bind time. Inputs and output are fp16 (CUDA_R_16F), bf16 (CUDA_R_16BF) or fp32
(CUDA_R_32F); accumulation is CUBLAS_COMPUTE_32F (no TF32) with fp32 alpha/beta (beta = 0, or 1 with an
addend: D = alpha A B + C, C another tensor laid out as D).

Host cost (H100, CUDA 13.1, ``benchmarks/cublaslt_speed.py``): ``cublasLtMatmul`` itself takes ~12-17 us per
call (the 16-argument ctypes call is ~2 us of that; the heuristic's other algorithms cost the same), so
``bind`` only saves ~2 us over CuPy's ``cublasGemmEx`` path; the runtime therefore captures each bound call once
into a CUDA graph (``cuda_kernels.launch.capture``) and replays it with ``cuGraphLaunch``: ~3-5 us, same TFLOP/s,
bitwise the same output.

ctypes only: no CuPy, no torch, no numba (``cuda_kernels`` never imports ``turnip``).
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os

from cuda_kernels.launch import LibCall

_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_INT = ctypes.c_int  # C enums (cublasStatus_t, cudaDataType_t, attribute ids, ...) are 4-byte ints
_SIZE = ctypes.c_size_t

# --- enum values, CUDA 12.x / 13.0 headers --------------------------------------------------------------
# Checked against cublasLt.h (CUDA 12.6: typedef enum blocks cublasLtMatmulDescAttributes_t,
# cublasLtMatrixLayoutAttribute_t, cublasLtMatmulPreferenceAttributes_t, cublasLtMatmulAlgoCapAttributes_t),
# cublas_api.h (cublasOperation_t, cublasComputeType_t, cublasStatus_t) and library_types.h
# (cudaDataType_t); the same numbers are used by cuda_kernels.gemm for cublasGemmEx (verified on the
# H100 by benchmarks/probe_launch.py). Re-checked against the CUDA 13 header on the GPU machine when it
# ships one (tests/cuda_kernels/test_cublaslt.py::test_enums_match_installed_header).

# cudaDataType_t (library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
# cublasComputeType_t (cublas_api.h): plain fp32 accumulation; CUBLAS_COMPUTE_32F_FAST_TF32 would be 77
CUBLAS_COMPUTE_32F = 68
# cublasOperation_t (cublas_api.h)
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
# cublasLtMatmulDescAttributes_t: int32_t cublasOperation_t each
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
# cublasLtMatrixLayoutAttribute_t: BATCH_COUNT int32_t, STRIDED_BATCH_OFFSET int64_t (elements)
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6
# cublasLtMatmulPreferenceAttributes_t: uint64_t bytes
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoCapAttributes_t: uint32_t bytes, the alignment an algorithm needs of each pointer
CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES = 16
CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES = 17
CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES = 18
CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES = 19

# cublasStatus_t (cublas_api.h), for messages when cublasLtGetStatusName is unavailable
STATUS_NAMES = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
    16: "CUBLAS_STATUS_LICENSE_ERROR",
}

LT_DTYPE = {"fp16": CUDA_R_16F, "fp32": CUDA_R_32F, "bf16": CUDA_R_16BF}
ITEMSIZE = {"fp16": 2, "fp32": 4, "bf16": 2}


class _Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: ``uint64_t data[8]``."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),  # cublasStatus_t
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


assert ctypes.sizeof(_Algo) == 64 and ctypes.sizeof(_HeuristicResult) == 96
assert _HeuristicResult.workspaceSize.offset == 64 and _HeuristicResult.state.offset == 72

# name -> (restype, argtypes) of every cuBLASLt function used here
SIGNATURES = {
    "cublasLtCreate": (_INT, [_PP]),
    "cublasLtDestroy": (_INT, [_P]),
    "cublasLtGetVersion": (_SIZE, []),
    "cublasLtGetStatusName": (ctypes.c_char_p, [_INT]),
    "cublasLtMatmulDescCreate": (_INT, [_PP, _INT, _INT]),  # (desc*, computeType, scaleType)
    "cublasLtMatmulDescDestroy": (_INT, [_P]),
    "cublasLtMatmulDescSetAttribute": (_INT, [_P, _INT, _P, _SIZE]),
    # (layout*, type, uint64 rows, uint64 cols, int64 ld)
    "cublasLtMatrixLayoutCreate": (_INT, [_PP, _INT, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]),
    "cublasLtMatrixLayoutDestroy": (_INT, [_P]),
    "cublasLtMatrixLayoutSetAttribute": (_INT, [_P, _INT, _P, _SIZE]),
    "cublasLtMatmulPreferenceCreate": (_INT, [_PP]),
    "cublasLtMatmulPreferenceDestroy": (_INT, [_P]),
    "cublasLtMatmulPreferenceSetAttribute": (_INT, [_P, _INT, _P, _SIZE]),
    # (handle, desc, A, B, C, D layouts, preference, requestedAlgoCount, results[], *returnAlgoCount)
    "cublasLtMatmulAlgoGetHeuristic": (
        _INT, [_P, _P, _P, _P, _P, _P, _P, _INT, ctypes.POINTER(_HeuristicResult), ctypes.POINTER(_INT)]),
    # (const algo*, attr, buf, sizeInBytes, size_t* sizeWritten)
    "cublasLtMatmulAlgoCapGetAttribute": (_INT, [_P, _INT, _P, _SIZE, ctypes.POINTER(_SIZE)]),
    # (handle, desc, alpha*, A, Adesc, B, Bdesc, beta*, C, Cdesc, D, Ddesc, algo*, workspace, wsSize, stream)
    "cublasLtMatmul": (_INT, [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _SIZE, _P]),
}

LIB_NAMES = ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so")

_LIB = None
_LIB_PATH = ""


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call: str, status: int, detail: str = ""):
        self.call, self.status = call, int(status)
        super().__init__(f"{call} failed: {status_name(status)} ({int(status)}){' ' + detail if detail else ''}")


def status_name(status: int) -> str:
    lib = _LIB
    if lib is not None:
        try:
            s = lib.cublasLtGetStatusName(int(status))
            if s:
                return s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001 (the name is only for the message)
            pass
    return STATUS_NAMES.get(int(status), "CUBLAS_STATUS_UNKNOWN")


def _check(status: int, call: str, detail: str = "") -> None:
    if status != 0:
        raise CublasLtError(call, status, detail)


def _nvidia_candidates() -> list[str]:
    """``libcublasLt.so*`` inside the ``nvidia`` pip namespace packages (nvidia-cublas-cu12 / cu13 wheels)."""
    try:
        import nvidia
    except ImportError:
        return []
    found: list[str] = []
    for root in list(getattr(nvidia, "__path__", [])):
        found += glob.glob(os.path.join(root, "**", "libcublasLt.so*"), recursive=True)
    # prefer the newest major version, then the versioned names over the bare one
    return sorted(set(found), key=lambda p: (os.path.basename(p).count("."), p), reverse=True)


def declare(lib) -> None:
    """Set restype/argtypes of every function in ``SIGNATURES`` on ``lib``."""
    for name, (res, args) in SIGNATURES.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args


def load(names=LIB_NAMES):
    """Open cuBLASLt (the soname list, then the ``nvidia`` pip packages' lib folders) and type it; once."""
    global _LIB, _LIB_PATH
    if _LIB is not None:
        return _LIB
    tried: list[str] = []
    for name in [*names, *_nvidia_candidates()]:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            tried.append(f"{name} ({e})")
            continue
        try:
            declare(lib)
        except AttributeError as e:  # e.g. a stale library without one of the symbols
            tried.append(f"{name} (missing symbol: {e})")
            continue
        _LIB, _LIB_PATH = lib, name
        return lib
    if not any("nvidia" in t for t in tried):
        tried.append("nvidia pip packages: no libcublasLt.so* found")
    raise RuntimeError("cuBLASLt not found; tried: " + "; ".join(tried))


def library_path() -> str:
    load()
    return _LIB_PATH


def version() -> int:
    """``cublasLtGetVersion()``, e.g. 130000 for 13.0.0."""
    return int(load().cublasLtGetVersion())


def lt_handle_create() -> int:
    """A new cuBLASLt handle (an int) for the current device; release with ``lt_handle_destroy``."""
    lib = load()
    h = _P()
    _check(lib.cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return int(h.value or 0)


def lt_handle_destroy(h: int) -> None:
    if h:
        _check(load().cublasLtDestroy(h), "cublasLtDestroy")


_HEURISTIC_HANDLES: dict = {}  # current CUcontext (int) -> handle used for heuristic queries only
_CUDA = None


def _release_heuristic_handles() -> None:
    """Destroy the heuristic handles (``atexit``: before the CUDA driver goes away at shutdown)."""
    for h in list(_HEURISTIC_HANDLES.values()):
        try:
            lt_handle_destroy(h)
        except Exception:  # noqa: BLE001 (shutdown: nothing can be done about a failed destroy)
            pass
    _HEURISTIC_HANDLES.clear()


atexit.register(_release_heuristic_handles)


def _current_context() -> int:
    global _CUDA
    try:
        if _CUDA is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuCtxGetCurrent.argtypes = [_PP]
            lib.cuCtxGetCurrent.restype = _INT
            _CUDA = lib
        c = _P()
        if _CUDA.cuCtxGetCurrent(ctypes.byref(c)) != 0:
            return 0
        return int(c.value or 0)
    except OSError:
        return 0


def heuristic_handle() -> int:
    """A process-wide cuBLASLt handle per CUDA context, used by ``LtGemm`` for ``AlgoGetHeuristic``."""
    key = _current_context()
    h = _HEURISTIC_HANDLES.get(key)
    if h is None:
        h = _HEURISTIC_HANDLES[key] = lt_handle_create()
    return h


def _set_attr(fn, name: str, obj, attr: int, value) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), name, f"(attribute {attr} = {value.value})")


class LtGemm:
    """One (strided-batched) GEMM of a fixed layout and dtype, algorithm chosen once at construction.

    ``layout``: ``(swap, ta, tb, m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batch)`` from
    ``cuda_kernels.gemm.cublas_layout``; C (m x n, column-major) = alpha * op(A) op(B) where cuBLAS's A is the
    einsum's second input when ``swap``. ``handle``: a cuBLASLt handle for the heuristic query (default:
    one per CUDA context, shared). ``algo_index``: take the heuristic's n-th choice instead of its best (for
    measurements). Raises ``CublasLtError`` if no algorithm fits ``max_ws_nbytes``."""

    def __init__(self, layout, dtype: str, alpha: float, max_ws_nbytes: int, handle: int | None = None,
                 algo_index: int = 0):
        if dtype not in LT_DTYPE:
            raise ValueError(f"LtGemm: dtype {dtype!r} not in {sorted(LT_DTYPE)}")
        (self.swap, self.ta, self.tb, self.m, self.n, self.k, self.lda, self.ldb, self.ldc,
         self.sa, self.sb, self.sc, self.batch) = (bool(layout[0]), *map(int, layout[1:]))
        if self.ta not in (CUBLAS_OP_N, CUBLAS_OP_T) or self.tb not in (CUBLAS_OP_N, CUBLAS_OP_T):
            raise ValueError(f"LtGemm: transposes {self.ta}, {self.tb} must be CUBLAS_OP_N/T")
        self.dtype, self.alpha = dtype, float(alpha)
        self.max_ws_nbytes = int(max_ws_nbytes)
        self.algo_index = int(algo_index)
        self._lib = load()
        self._desc = _P()
        self._layouts: list = []  # A, B, C (C doubles as D)
        self._closed = False
        self.what = (f"cublasLt {dtype} {'T' if self.ta else 'N'}{'T' if self.tb else 'N'} "
                     f"m={self.m} n={self.n} k={self.k}" + (f" batch={self.batch}" if self.batch > 1 else ""))
        try:
            self._build(self.max_ws_nbytes, heuristic_handle() if handle is None else int(handle))
        except BaseException:
            self.close()
            raise

    def _build(self, max_ws: int, handle: int) -> None:
        lib, dt = self._lib, LT_DTYPE[self.dtype]
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate")
        for attr, op in ((CUBLASLT_MATMUL_DESC_TRANSA, self.ta), (CUBLASLT_MATMUL_DESC_TRANSB, self.tb)):
            _set_attr(lib.cublasLtMatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute", self._desc, attr,
                      ctypes.c_int32(op))
        a_rc = (self.m, self.k) if self.ta == CUBLAS_OP_N else (self.k, self.m)
        b_rc = (self.k, self.n) if self.tb == CUBLAS_OP_N else (self.n, self.k)
        for (rows, cols), ld, stride in ((a_rc, self.lda, self.sa), (b_rc, self.ldb, self.sb),
                                         ((self.m, self.n), self.ldc, self.sc)):
            lay = _P()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dt, rows, cols, ld), "cublasLtMatrixLayoutCreate",
                   f"(rows={rows} cols={cols} ld={ld})")
            self._layouts.append(lay)
            if self.batch > 1:
                fn, name = lib.cublasLtMatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute"
                _set_attr(fn, name, lay, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, ctypes.c_int32(self.batch))
                _set_attr(fn, name, lay, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.c_int64(stride))
        a_l, b_l, c_l = self._layouts
        pref = _P()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            _set_attr(lib.cublasLtMatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute", pref,
                      CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(max_ws))
            want = self.algo_index + 1
            results, count = (_HeuristicResult * want)(), _INT(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self._desc, a_l, b_l, c_l, c_l, pref, want,
                                                      results, ctypes.byref(count)),
                   "cublasLtMatmulAlgoGetHeuristic", self.what)
        finally:
            _check(lib.cublasLtMatmulPreferenceDestroy(pref), "cublasLtMatmulPreferenceDestroy")
        if count.value <= self.algo_index:
            raise CublasLtError("cublasLtMatmulAlgoGetHeuristic", 15,
                                f"{self.what}: {count.value} algorithm(s) returned, wanted index {self.algo_index}")
        res = results[self.algo_index]
        _check(res.state, "cublasLtMatmulAlgoGetHeuristic (result state)", self.what)
        self.n_algos = int(count.value)
        self._result = res
        self._algo = res.algo
        self.ws_nbytes = int(res.workspaceSize)
        self.waves = float(res.wavesCount)
        self.align = tuple(self._cap_u32(a) for a in (CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES,
                                                      CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES,
                                                      CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES,
                                                      CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES))
        # prebuilt ctypes arguments shared by every bind
        self._alpha = ctypes.c_float(self.alpha)
        self._beta = ctypes.c_float(0.0)
        self._beta1 = ctypes.c_float(1.0)
        self._alpha_p = _P(ctypes.addressof(self._alpha))
        self._beta_p = _P(ctypes.addressof(self._beta))
        self._beta1_p = _P(ctypes.addressof(self._beta1))
        self._algo_p = _P(ctypes.addressof(self._algo))

    def _cap_u32(self, attr: int) -> int:
        v, written = ctypes.c_uint32(0), _SIZE(0)
        _check(self._lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.addressof(self._algo), attr, ctypes.byref(v),
                                                           ctypes.sizeof(v), ctypes.byref(written)),
               "cublasLtMatmulAlgoCapGetAttribute", f"(attribute {attr})")
        return int(v.value)

    def bind(self, c_ptr: int, a_ptr: int, b_ptr: int, addend_ptr: int | None = None) -> LibCall:
        """A ``LibCall`` computing out (``c_ptr``) = alpha * einsum(first ``a_ptr``, second ``b_ptr``), plus
        the tensor at ``addend_ptr`` (laid out as the output: cuBLASLt's C operand, beta 1) when given."""
        if self._closed:
            raise RuntimeError(f"{self.what}: bind after close()")
        x, y = (int(b_ptr), int(a_ptr)) if self.swap else (int(a_ptr), int(b_ptr))
        src = int(c_ptr) if addend_ptr is None else int(addend_ptr)
        for ptr, al, name in ((x, self.align[0], "A"), (y, self.align[1], "B"), (src, self.align[2], "C"),
                              (int(c_ptr), self.align[3], "D")):
            if al > 1 and ptr % al:
                raise ValueError(f"{self.what}: cuBLAS operand {name} pointer {ptr:#x} not {al}-byte aligned "
                                 "as the chosen algorithm needs")
        a_l, b_l, c_l = self._layouts
        c, d = _P(src), _P(int(c_ptr))
        beta = self._beta_p if addend_ptr is None else self._beta1_p
        pre = (self._desc, self._alpha_p, _P(x), a_l, _P(y), b_l, beta, c, c_l, d, c_l, self._algo_p)
        matmul, what = self._lib.cublasLtMatmul, self.what

        def call(ctx):
            st = matmul(ctx.handles["cublaslt"], *pre, ctx.ws_ptr, ctx.ws_nbytes, ctx.stream)
            if st:
                raise CublasLtError("cublasLtMatmul", st, what)

        call.owner = self  # the descriptors live as long as any bound call
        call.args = pre  # for inspection: the 12 arguments between the handle and the workspace
        return LibCall(call, self.ws_nbytes, what, capturable=True, lib="cublaslt")

    def close(self) -> None:
        """Destroy the descriptors (idempotent). Calls bound from this object must not run afterwards."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        lib = self._lib
        errs = []
        for lay in reversed(self._layouts):
            if lay.value:
                errs.append(lib.cublasLtMatrixLayoutDestroy(lay))
        self._layouts = []
        if self._desc.value:
            errs.append(lib.cublasLtMatmulDescDestroy(self._desc))
            self._desc = _P()
        bad = [e for e in errs if e]
        if bad:
            raise CublasLtError("cublasLt*Destroy", bad[0], self.what)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown, or a destroy error nobody can handle)
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

