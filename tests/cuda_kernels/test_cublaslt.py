"""cuBLASLt GEMM path (``cuda_kernels.cublaslt``).

``unit``: argument construction against a fake cuBLASLt (every call recorded), the loader's error, and the
enum values against the installed CUDA headers when there are any. ``gpu``: the einsums turnip emits, fp16, bf16
and fp32 with alpha != 1, against float64 numpy on fresh random inputs with NaN-poisoned outputs; two streams
with separate workspaces agree bitwise."""

from __future__ import annotations

import ctypes
import glob
import os
import re

import numpy as np
import pytest

from cuda_kernels import cublaslt
from cuda_kernels.gemm import cublas_layout, plan_einsum
from cuda_kernels.launch import LibCall, StreamContext

# --------------------------------------------------------------------------------------------- unit tier


class _Fn:
    """A fake C function: records its arguments, returns ``impl(*args)`` or 0."""

    def __init__(self, log, name, impl=None):
        self.log, self.name, self.impl = log, name, impl
        self.argtypes = self.restype = None

    def __call__(self, *args):
        self.log.append((self.name, args))
        return 0 if self.impl is None else self.impl(*args)


class FakeLt:
    """Just enough of libcublasLt to construct and bind an ``LtGemm`` without a GPU."""

    WS = 4 << 20

    def __init__(self, ws=WS, align=16):
        self.log: list = []
        self.attrs: dict = {}  # (object handle, attribute) -> value
        self.next_handle = 0x1000
        self.live: set = set()
        self.ws, self.align = ws, align
        impl = {
            "cublasLtMatmulDescCreate": self._create,
            "cublasLtMatrixLayoutCreate": self._create,
            "cublasLtMatmulPreferenceCreate": self._create,
            "cublasLtCreate": self._create,
            "cublasLtMatmulDescDestroy": self._destroy,
            "cublasLtMatrixLayoutDestroy": self._destroy,
            "cublasLtMatmulPreferenceDestroy": self._destroy,
            "cublasLtMatmulDescSetAttribute": self._set,
            "cublasLtMatrixLayoutSetAttribute": self._set,
            "cublasLtMatmulPreferenceSetAttribute": self._set,
            "cublasLtMatmulAlgoGetHeuristic": self._heuristic,
            "cublasLtMatmulAlgoCapGetAttribute": self._cap,
            "cublasLtGetStatusName": lambda s: b"CUBLAS_STATUS_FAKE",
        }
        for name in cublaslt.SIGNATURES:
            setattr(self, name, _Fn(self.log, name, impl.get(name)))

    def _create(self, out, *rest):
        self.next_handle += 0x10
        out._obj.value = self.next_handle
        self.live.add(self.next_handle)
        return 0

    def _destroy(self, h):
        v = h.value if isinstance(h, ctypes.c_void_p) else h
        assert v in self.live, f"destroy of unknown handle {v}"
        self.live.remove(v)
        return 0

    def _set(self, obj, attr, buf, size):
        val = buf._obj
        assert ctypes.sizeof(val) == size
        self.attrs[(obj.value, attr)] = (type(val), val.value)
        return 0

    def _heuristic(self, h, desc, a, b, c, d, pref, n, res, count):
        r = res[0]
        r.algo.data[0] = 0xA160
        r.workspaceSize = min(self.ws, self.attrs[(pref.value, cublaslt.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)][1])
        r.state = 0
        count._obj.value = 1
        return 0

    def _cap(self, algo, attr, buf, size, written):
        buf._obj.value = self.align
        written._obj.value = size
        return 0

    def calls(self, name):
        return [args for n, args in self.log if n == name]


@pytest.fixture
def fake(monkeypatch):
    lib = FakeLt()
    monkeypatch.setattr(cublaslt, "_LIB", lib)
    return lib


def _layout(subscripts, a_shape, b_shape, out_shape):
    lay = cublas_layout(plan_einsum(subscripts, a_shape, b_shape, out_shape))
    assert lay is not None, subscripts
    return lay


@pytest.mark.unit
def test_signatures_are_declared(monkeypatch):
    """``declare`` types every function the module calls (a fake library records the assignments)."""
    lib = FakeLt()
    cublaslt.declare(lib)
    for name, (res, args) in cublaslt.SIGNATURES.items():
        f = getattr(lib, name)
        assert f.restype is res and f.argtypes == args, name
    assert len(cublaslt.SIGNATURES["cublasLtMatmul"][1]) == 16
    assert cublaslt.SIGNATURES["cublasLtMatmul"][1][14] is ctypes.c_size_t
    src = open(cublaslt.__file__).read()
    used = set(re.findall(r"\b(cublasLt[A-Za-z]+)\(", src))
    assert used <= set(cublaslt.SIGNATURES), used - set(cublaslt.SIGNATURES)


@pytest.mark.unit
def test_enum_values():
    """The values from the CUDA 12.6 / 13 headers (also cross-checked by ``test_enums_match_installed_header``)."""
    assert (cublaslt.CUDA_R_32F, cublaslt.CUDA_R_16F, cublaslt.CUBLAS_COMPUTE_32F) == (0, 2, 68)
    assert cublaslt.CUDA_R_16BF == 14 and cublaslt.LT_DTYPE["bf16"] == 14
    assert (cublaslt.CUBLAS_OP_N, cublaslt.CUBLAS_OP_T) == (0, 1)
    assert (cublaslt.CUBLASLT_MATMUL_DESC_TRANSA, cublaslt.CUBLASLT_MATMUL_DESC_TRANSB) == (3, 4)
    assert cublaslt.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT == 5
    assert cublaslt.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET == 6
    assert cublaslt.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES == 1
    assert ctypes.sizeof(cublaslt._HeuristicResult) == 96


def _find_header(name):
    roots = ["/usr/local/cuda/include", "/usr/include"]
    roots += glob.glob("/usr/local/cuda-*/include") + glob.glob("/usr/local/cuda-*/targets/*/include")
    try:
        import nvidia

        for p in nvidia.__path__:
            roots += glob.glob(os.path.join(p, "**", "include"), recursive=True)
    except ImportError:
        pass
    for r in roots:
        f = os.path.join(r, name)
        if os.path.exists(f):
            return f
    return None


@pytest.mark.unit
def test_enums_match_installed_header():
    names = {
        "cublasLt.h": ["CUBLASLT_MATMUL_DESC_TRANSA", "CUBLASLT_MATMUL_DESC_TRANSB",
                       "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET",
                       "CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES", "CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES",
                       "CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES", "CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES",
                       "CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES"],
        "cublas_api.h": ["CUBLAS_COMPUTE_32F", "CUBLAS_OP_N", "CUBLAS_OP_T"],
        "library_types.h": ["CUDA_R_16F", "CUDA_R_32F", "CUDA_R_16BF"],
    }
    checked = 0
    for header, consts in names.items():
        path = _find_header(header)
        if path is None:
            continue
        text = open(path, errors="replace").read()
        for c in consts:
            m = re.search(rf"\b{c}\s*=\s*(\d+)\b", text)
            assert m, f"{c} not found in {path}"
            assert int(m.group(1)) == getattr(cublaslt, c), f"{c}: header {path} says {m.group(1)}"
            checked += 1
    if not checked:
        pytest.skip("no CUDA headers installed")
    if _find_header("cublasLt.h") is None:
        pytest.skip(f"cublasLt.h not installed (checked {checked} values in other headers)")


@pytest.mark.unit
def test_descriptors_for_projection(fake):
    """td,dhe->the: C^T layout (swap), both operands untransposed; transposes, layouts and workspace pref."""
    lay = _layout("td,dhe->the", (300, 256), (256, 4, 64), (300, 4, 64))
    swap, ta, tb, m, n, k, lda, ldb, ldc = lay[:9]
    assert (swap, m, n, k) == (True, 256, 300, 256)
    g = cublaslt.LtGemm(lay, "fp16", 0.125, 8 << 20, handle=0x77)
    (desc_out, compute, scale), = fake.calls("cublasLtMatmulDescCreate")
    assert (compute, scale) == (cublaslt.CUBLAS_COMPUTE_32F, cublaslt.CUDA_R_32F)
    desc = g._desc.value
    assert fake.attrs[(desc, cublaslt.CUBLASLT_MATMUL_DESC_TRANSA)] == (ctypes.c_int32, ta)
    assert fake.attrs[(desc, cublaslt.CUBLASLT_MATMUL_DESC_TRANSB)] == (ctypes.c_int32, tb)
    made = fake.calls("cublasLtMatrixLayoutCreate")
    assert [a[1:] for a in made] == [
        (cublaslt.CUDA_R_16F, *((m, k) if ta == 0 else (k, m)), lda),
        (cublaslt.CUDA_R_16F, *((k, n) if tb == 0 else (n, k)), ldb),
        (cublaslt.CUDA_R_16F, m, n, ldc),
    ]
    assert not fake.calls("cublasLtMatrixLayoutSetAttribute")  # batch == 1
    (pref,), = fake.calls("cublasLtMatmulPreferenceCreate")
    assert fake.attrs[(pref._obj.value, 1)] == (ctypes.c_uint64, 8 << 20)
    (h, d, a_l, b_l, c_l, d_l, _pref, n_req, _res, _cnt), = fake.calls("cublasLtMatmulAlgoGetHeuristic")
    assert (h, d.value, n_req) == (0x77, desc, 1) and c_l is d_l
    assert g.ws_nbytes == FakeLt.WS and g.align == (16, 16, 16, 16)
    assert g._algo.data[0] == 0xA160
    g.close()
    assert fake.live == set(), "descriptors leaked"
    g.close()  # idempotent


@pytest.mark.unit
def test_batched_layouts(fake):
    """ihd,jhd->hij: batch over h with per-operand strides and BATCH_COUNT on every layout."""
    i, j, h, d = 300, 280, 4, 64
    lay = _layout("ihd,jhd->hij", (i, h, d), (j, h, d), (h, i, j))
    sa, sb, sc, batch = lay[9:]
    assert batch == h and sc == i * j and {sa, sb} == {d}
    g = cublaslt.LtGemm(lay, "fp32", 2.0, 0, handle=1)
    made = fake.calls("cublasLtMatrixLayoutCreate")
    assert all(a[1] == cublaslt.CUDA_R_32F for a in made)
    for lay_obj, stride in zip(g._layouts, (sa, sb, sc), strict=True):
        v = lay_obj.value
        assert fake.attrs[(v, cublaslt.CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT)] == (ctypes.c_int32, batch)
        assert fake.attrs[(v, cublaslt.CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET)] == (ctypes.c_int64, stride)
    assert g.ws_nbytes == 0  # max 0 bytes of workspace
    g.close()


@pytest.mark.unit
@pytest.mark.parametrize("subscripts,shapes", [
    ("td,dhe->the", ((300, 256), (256, 4, 64), (300, 4, 64))),
    ("the,hed->td", ((300, 4, 64), (4, 64, 256), (300, 256))),
    ("hqk,khd->qhd", ((4, 300, 280), (280, 4, 64), (300, 4, 64))),
])
def test_bind_swaps_and_calls_once(fake, subscripts, shapes):
    lay = _layout(subscripts, *shapes)
    g = cublaslt.LtGemm(lay, "fp16", 0.5, 1 << 20, handle=1)
    c, a, b = 0x7000_0000, 0x1000_0000, 0x2000_0000
    lc = g.bind(c, a, b)
    assert isinstance(lc, LibCall) and lc.ws_nbytes == g.ws_nbytes
    args = lc.fn.args
    assert len(args) == 12 and all(isinstance(x, ctypes.c_void_p) for x in args)
    first, second = (b, a) if lay[0] else (a, b)
    assert (args[2].value, args[4].value, args[7].value, args[9].value) == (first, second, c, c)
    assert args[8] is args[10]  # Cdesc doubles as Ddesc
    assert ctypes.c_float.from_address(args[1].value).value == 0.5
    assert ctypes.c_float.from_address(args[6].value).value == 0.0
    assert args[11].value == ctypes.addressof(g._algo)
    fake.log.clear()
    ctx = StreamContext(stream=0x5EED, ws_ptr=0xBEEF00, ws_nbytes=1 << 20, handles={"cublaslt": 0x4A})
    lc(ctx)
    (call,) = fake.log
    name, cargs = call
    assert name == "cublasLtMatmul" and len(cargs) == 16
    assert cargs[0] == 0x4A and cargs[1:13] == args and cargs[13:] == (0xBEEF00, 1 << 20, 0x5EED)


@pytest.mark.unit
def test_errors_name_call_and_status(fake):
    lay = _layout("td,df->tf", (64, 128), (128, 256), (64, 256))
    g = cublaslt.LtGemm(lay, "fp32", 1.0, 0, handle=1)
    lc = g.bind(0x1000, 0x2000, 0x3000)
    fake.cublasLtMatmul.impl = lambda *a: 7
    with pytest.raises(cublaslt.CublasLtError, match=r"cublasLtMatmul failed: CUBLAS_STATUS_FAKE \(7\)"):
        lc(StreamContext(stream=0, handles={"cublaslt": 1}))
    with pytest.raises(ValueError, match="aligned"):
        g.bind(0x1002, 0x2000, 0x3000)
    fake.cublasLtMatrixLayoutCreate.impl = lambda *a: 3
    with pytest.raises(cublaslt.CublasLtError, match="cublasLtMatrixLayoutCreate failed"):
        cublaslt.LtGemm(lay, "fp32", 1.0, 0, handle=1)
    assert fake.live == {g._desc.value, *(x.value for x in g._layouts)}  # the failed one cleaned up
    fake.cublasLtMatrixLayoutCreate.impl = fake._create
    fake.cublasLtMatmulAlgoGetHeuristic.impl = lambda *a: 15
    with pytest.raises(cublaslt.CublasLtError, match="cublasLtMatmulAlgoGetHeuristic failed"):
        cublaslt.LtGemm(lay, "fp32", 1.0, 0, handle=1)
    g.close()
    assert fake.live == set()


@pytest.mark.unit
def test_loader_error_names_what_was_tried(monkeypatch):
    def fail(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cublaslt, "_LIB", None)
    monkeypatch.setattr(cublaslt.ctypes, "CDLL", fail)
    monkeypatch.setattr(cublaslt, "_nvidia_candidates", lambda: ["/site/nvidia/cu13/lib/libcublasLt.so.13"])
    with pytest.raises(RuntimeError) as e:
        cublaslt.load()
    msg = str(e.value)
    for name in (*cublaslt.LIB_NAMES, "/site/nvidia/cu13/lib/libcublasLt.so.13"):
        assert name in msg


# ---------------------------------------------------------------------------------------------- gpu tier

NP_DTYPE = {"fp16": np.float16, "fp32": np.float32}
TOL = {"fp16": 1e-2, "fp32": 1e-5, "bf16": 2e-2}
try:
    import ml_dtypes

    NP_DTYPE["bf16"] = ml_dtypes.bfloat16
except ImportError:
    pass
T, D, H, E, F = 300, 256, 4, 64, 688
CASES = [
    ("td,dhe->the", (T, D), (D, H, E), (T, H, E)),
    ("the,hed->td", (T, H, E), (H, E, D), (T, D)),
    ("td,df->tf", (T, D), (D, F), (T, F)),
    ("tf,fd->td", (T, F), (F, D), (T, D)),
    ("ihd,jhd->hij", (T, H, E), (280, H, E), (H, T, 280)),
    ("hqk,khd->qhd", (H, T, 280), (280, H, E), (T, H, E)),
    ("td,df->tf", (77, 130), (130, 261), (77, 261)),  # odd extents: 2-byte aligned leading dimensions
    ("td,fd->tf", (T, D), (F, D), (T, F)),  # cuBLAS A transposed, no batch
    ("dt,df->tf", (D, T), (D, F), (T, F)),  # cuBLAS B transposed
]
WS_NBYTES = 32 << 20


def _gpu():
    import cupy as cp

    from cuda_kernels._numba import apply_numpy_shim

    apply_numpy_shim()
    return cp


def _inputs(rng, a_shape, b_shape, dtype):
    a = rng.standard_normal(a_shape).astype(NP_DTYPE[dtype])
    b = rng.standard_normal(b_shape).astype(NP_DTYPE[dtype])
    assert np.abs(a).max() > 0 and np.abs(b).max() > 0
    return a, b


def _rel(got, ref):
    return float(np.linalg.norm(got.astype(np.float64) - ref) / np.linalg.norm(ref))


def _dev(cp, x):
    """A device copy (CuPy has no bfloat16: bf16 travels as its uint16 bits)."""
    return cp.asarray(x.view(np.uint16) if x.dtype == NP_DTYPE.get("bf16") else x)


def _poisoned(cp, shape, dtype):
    """A device array of NaNs in ``dtype`` (bf16: the bits 0x7fc0)."""
    if dtype == "bf16":
        return cp.full(shape, 0x7FC0, dtype=cp.uint16)
    return cp.full(shape, cp.nan, dtype=NP_DTYPE[dtype])


def _host(cp, out, dtype):
    got = cp.asnumpy(out)
    return got.view(NP_DTYPE["bf16"]) if dtype == "bf16" else got


class _Slot:
    """A stream slot: CuPy stream, its own workspace and cuBLASLt handle, as a ``StreamContext``."""

    def __init__(self, cp, ws_nbytes=WS_NBYTES):
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.ws = cp.empty(max(ws_nbytes, 1), dtype=cp.uint8)
        self.handle = cublaslt.lt_handle_create()
        self.ctx = StreamContext(stream=int(self.stream.ptr), ws_ptr=int(self.ws.data.ptr), ws_nbytes=ws_nbytes,
                                 handles={"cublaslt": self.handle})

    def close(self):
        cublaslt.lt_handle_destroy(self.handle)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(NP_DTYPE))
@pytest.mark.parametrize("subscripts,a_shape,b_shape,out_shape", CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_lt_gemm_matches_float64(subscripts, a_shape, b_shape, out_shape, dtype, rng):
    cp = _gpu()
    lay = _layout(subscripts, a_shape, b_shape, out_shape)
    alpha = 0.37
    slot = _Slot(cp)
    try:
        g = cublaslt.LtGemm(lay, dtype, alpha, WS_NBYTES)
        assert 0 <= g.ws_nbytes <= WS_NBYTES
        for _ in range(2):  # twice, fresh inputs and fresh poison each time
            a, b = _inputs(rng, a_shape, b_shape, dtype)
            ref = alpha * np.einsum(subscripts, a.astype(np.float64), b.astype(np.float64))
            da, db = _dev(cp, a), _dev(cp, b)
            out = _poisoned(cp, out_shape, dtype)
            cp.cuda.Device().synchronize()
            lc = g.bind(out.data.ptr, da.data.ptr, db.data.ptr)
            lc(slot.ctx)
            slot.stream.synchronize()
            got = _host(cp, out, dtype)
            assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} outputs not written"
            err = _rel(got, ref)
            assert err <= TOL[dtype], f"{subscripts} {dtype} {g.what}: relative error {err:.3g}"
        g.close()
    finally:
        slot.close()


@pytest.mark.gpu
@pytest.mark.parametrize("ws_nbytes", [0, WS_NBYTES])
def test_fp32_is_not_tf32(rng, ws_nbytes):
    """Inputs whose low mantissa bits matter: TF32 (10-bit mantissa) would miss by ~1e-4."""
    cp = _gpu()
    m = n = k = 512
    lay = _layout("td,df->tf", (m, k), (k, n), (m, n))
    a = (1.0 + rng.random((m, k)) * 2.0**-12).astype(np.float32) * rng.choice([-1.0, 1.0], (m, k)).astype(np.float32)
    b = (1.0 + rng.random((k, n)) * 2.0**-12).astype(np.float32) * rng.choice([-1.0, 1.0], (k, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    slot = _Slot(cp, max(ws_nbytes, 1))
    try:
        g = cublaslt.LtGemm(lay, "fp32", 1.0, ws_nbytes)
        da, db = cp.asarray(a), cp.asarray(b)
        out = cp.full((m, n), cp.nan, dtype=cp.float32)
        cp.cuda.Device().synchronize()
        g.bind(out.data.ptr, da.data.ptr, db.data.ptr)(slot.ctx)
        slot.stream.synchronize()
        got = cp.asnumpy(out)
        assert np.isfinite(got).all()
        err = _rel(got, ref)
        assert err <= 1e-5, f"fp32 relative error {err:.3g} (TF32?)"
        g.close()
    finally:
        slot.close()


@pytest.mark.gpu
def test_two_streams_separate_workspaces_agree(rng):
    """One LtGemm bound twice, launched interleaved on two streams, each with its own workspace and handle."""
    cp = _gpu()
    cases = [
        ("tf,fd->td", (128, 11008), (11008, 128), (128, 128)),  # long k: split-k algorithms use workspace
        ("td,df->tf", (T, D), (D, F), (T, F)),
        ("ihd,jhd->hij", (T, H, E), (280, H, E), (H, T, 280)),
    ]
    slots = [_Slot(cp), _Slot(cp)]
    try:
        for subscripts, a_shape, b_shape, out_shape in cases:
            g = cublaslt.LtGemm(_layout(subscripts, a_shape, b_shape, out_shape), "fp16", 0.5, WS_NBYTES)
            a, b = _inputs(rng, a_shape, b_shape, "fp16")
            da, db = cp.asarray(a), cp.asarray(b)
            outs = [cp.full(out_shape, cp.nan, dtype=cp.float16) for _ in slots]
            cp.cuda.Device().synchronize()
            calls = [g.bind(o.data.ptr, da.data.ptr, db.data.ptr) for o in outs]
            for _ in range(5):
                for lc, s in zip(calls, slots, strict=True):
                    lc(s.ctx)
            for s in slots:
                s.stream.synchronize()
            r0, r1 = (cp.asnumpy(o) for o in outs)
            assert np.isfinite(r0).all() and np.isfinite(r1).all()
            np.testing.assert_array_equal(r0, r1)
            ref = 0.5 * np.einsum(subscripts, a.astype(np.float64), b.astype(np.float64))
            assert _rel(r0, ref) <= TOL["fp16"]
            g.close()
    finally:
        for s in slots:
            s.close()


@pytest.mark.gpu
def test_matches_cublas_gemm_path(rng):
    """Same result as the current CuPy cuBLAS path (``CublasGemm``) within fp16 rounding."""
    _gpu()
    from cuda_kernels._numba import cuda
    from cuda_kernels.gemm import CublasGemm

    c = cuda()
    subscripts, a_shape, b_shape, out_shape = CASES[0]
    lay = _layout(subscripts, a_shape, b_shape, out_shape)
    a, b = _inputs(rng, a_shape, b_shape, "fp16")
    da, db = c.to_device(a), c.to_device(b)
    o1 = c.to_device(np.full(out_shape, np.nan, np.float16))
    o2 = c.to_device(np.full(out_shape, np.nan, np.float16))
    s = c.stream()
    CublasGemm(lay, "fp16", 0.25)(s, o1, da, db)
    g = cublaslt.LtGemm(lay, "fp16", 0.25, WS_NBYTES)
    ws = c.device_array(max(g.ws_nbytes, 1), dtype=np.uint8)
    h = cublaslt.lt_handle_create()
    try:
        ctx = StreamContext(stream=int(s.handle), ws_ptr=ws.device_ctypes_pointer.value, ws_nbytes=g.ws_nbytes,
                            handles={"cublaslt": h})
        g.bind(o2.device_ctypes_pointer.value, da.device_ctypes_pointer.value, db.device_ctypes_pointer.value)(ctx)
        s.synchronize()
    finally:
        cublaslt.lt_handle_destroy(h)
    r1, r2 = o1.copy_to_host(), o2.copy_to_host()
    assert np.isfinite(r2).all()
    assert _rel(r2, r1.astype(np.float64)) <= 2e-3


@pytest.mark.gpu
def test_graph_replay_matches_plain_call(rng):
    """A bound call captured into a CUDA graph (``cuda_kernels.launch.capture``, as the runtime does at
    plan load) is bitwise equal to the plain call and reads the buffers' current contents at each replay."""
    from cuda_kernels.launch import capture, capture_stream, destroy_graph, driver

    cp = _gpu()
    subscripts, a_shape, b_shape, out_shape = CASES[4]  # batched, transposed A
    lay = _layout(subscripts, a_shape, b_shape, out_shape)
    slot = _Slot(cp)
    try:
        g = cublaslt.LtGemm(lay, "fp16", 0.7, 0)
        da, db = cp.empty(a_shape, cp.float16), cp.empty(b_shape, cp.float16)
        plain_out, graph_out = cp.empty(out_shape, cp.float16), cp.empty(out_shape, cp.float16)
        plain = g.bind(plain_out.data.ptr, da.data.ptr, db.data.ptr)
        bound = g.bind(graph_out.data.ptr, da.data.ptr, db.data.ptr)
        assert bound.capturable
        ex = capture(bound, slot.ctx, capture_stream())
        for _ in range(2):
            a, b = _inputs(rng, a_shape, b_shape, "fp16")
            da.set(a)
            db.set(b)
            for o in (plain_out, graph_out):
                o.fill(cp.nan)
            cp.cuda.Device().synchronize()
            plain(slot.ctx)
            assert driver().cuGraphLaunch(ex, slot.ctx.stream) == 0
            cp.cuda.Device().synchronize()
            ref = 0.7 * np.einsum(subscripts, a.astype(np.float64), b.astype(np.float64))
            r = cp.asnumpy(plain_out)
            assert np.isfinite(r).all() and _rel(r, ref) <= TOL["fp16"]
            np.testing.assert_array_equal(cp.asnumpy(graph_out), r)
        destroy_graph(ex)
        g.close()
    finally:
        slot.close()
