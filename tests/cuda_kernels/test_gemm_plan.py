"""Einsum classification, the cuBLAS argument mapping (checked by emulating column-major cuBLAS in
numpy), and that every generated kernel source is valid Python. No numba needed."""

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from cuda_kernels import codegen as cg
from cuda_kernels import gemm as gm
from cuda_kernels.kernels import KernelPrepareError, prepare

pytestmark = pytest.mark.unit

SIZES = dict(t=5, d=6, f=7, h=3, q=4, k=5, i=4, j=5, b=2, l=3)


def _shape(letters):
    return tuple(SIZES[c] for c in letters)


def _emulate(layout, a, b, alpha):
    """cublasGemmStridedBatchedEx on flat column-major buffers, in float64."""
    swap, ta, tb, m, n, k, lda, ldb, ldc, sa, sb, sc, batch = layout
    x, y = (b, a) if swap else (a, b)
    x, y = x.reshape(-1).astype(np.float64), y.reshape(-1).astype(np.float64)
    out = np.zeros(max(1, sc * (batch - 1) + ldc * (n - 1) + m))
    e = 8
    for g in range(batch):
        X = as_strided(x[g * sa :], (m, k), (e, lda * e) if ta == 0 else (lda * e, e))
        Y = as_strided(y[g * sb :], (k, n), (e, ldb * e) if tb == 0 else (ldb * e, e))
        C = as_strided(out[g * sc :], (m, n), (e, ldc * e))
        C[...] = alpha * (X @ Y)
    return out


@pytest.mark.parametrize("subs", [
    "td,df->tf", "tf,fd->td", "td,fd->tf", "dt,df->tf", "dt,fd->tf", "td,df->ft",
    "hqk,khd->qhd", "ihd,jhd->hij", "td,tf->df", "bij,bjk->bik", "td,d->t", "t,f->tf",
])
def test_cublas_layout_reproduces_einsum(subs):
    rng = np.random.default_rng(0)
    a_l, rest = subs.split(",")
    b_l, o_l = rest.split("->")
    a, b = rng.standard_normal(_shape(a_l)), rng.standard_normal(_shape(b_l))
    p = gm.plan_einsum(subs, a.shape, b.shape, _shape(o_l))
    layout = gm.cublas_layout(p)
    assert layout is not None, subs
    want = 0.5 * np.einsum(subs, a, b)
    got = _emulate(layout, a, b, 0.5)[: want.size].reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_unmergeable_groups_have_no_cublas_layout():
    p = gm.plan_einsum("ikj,kl->ijl", (2, 3, 4), (3, 5), (2, 4, 5))
    assert (p.m, p.n, p.k) == (("i", "j"), ("l",), ("k",))
    assert gm.cublas_layout(p) is None


@pytest.mark.parametrize("subs,shapes", [
    ("td,df->tf", ((2, 3), (4, 5), (2, 5))), ("td,df", ((2, 3), (3, 5), (2, 5))),
    ("td,dq->tf", ((2, 3), (3, 5), (2, 5))),
])
def test_bad_einsums_are_rejected(subs, shapes):
    with pytest.raises(ValueError):
        gm.plan_einsum(subs, *shapes)


@pytest.mark.parametrize("subs", ["td,df->tf", "hqk,khd->qhd", "ihd,jhd->hij", "ikj,kl->ijl"])
def test_numba_gemm_source_is_python(subs):
    a_l, rest = subs.split(",")
    b_l, o_l = rest.split("->")
    p = gm.plan_einsum(subs, _shape(a_l), _shape(b_l), _shape(o_l))
    compile(gm.numba_gemm_source(p), "<gemm>", "exec")
    src = gm.numba_gemm_source(p, bf16=True)
    compile(src, "<gemm>", "exec")
    assert src.count("BF2F(") == 2 and src.count("F2BF(") == 16 and "np.float32(a[" not in src


def test_generated_sources_are_python():
    for nd in (1, 2, 3):
        compile(cg.elementwise_source(2, nd, ["v", "w"], "v0 + v1", 1), "<ew>", "exec")
    for nd in (2, 3):
        compile(cg.rmsnorm_source(nd, 32), "<row>", "exec")
        compile(cg.rmsnorm_source(nd, 32, bf16=True), "<row>", "exec")
    for args in ((8, True), (8, False, 4, True), (16, True, 2)):
        compile(cg.sdpa_source(*args), "<sdpa>", "exec")
    compile(cg.combine_source(3), "<combine>", "exec")
    compile(cg.combine_source(2, bf16=True), "<combine>", "exec")
    for scaled in (False, True):
        compile(cg.rotary_source(scaled=scaled, bf16=scaled), "<rotary>", "exec")
    assert cg.broadcast_index((1, 4), (3, 2, 4)) == "0, c"
    with pytest.raises(ValueError):
        cg.broadcast_index((3,), (2, 4))


def test_prepare_rejects_unknown_op_and_dtype():
    with pytest.raises(KernelPrepareError, match="unknown op"):
        prepare("conv", [(1,)], (1,), "fp32", {})
    with pytest.raises(KernelPrepareError, match="fp8"):
        prepare("mul", [(1,), (1,)], (1,), "fp8", {})


def test_bf16_sources_convert_every_access_and_keep_fp16_text():
    """bf16 kernels read through BF2F and write through F2BF; the fp16/fp32 text has neither."""
    src = cg.elementwise_source(2, 2, [cg.load(0, "b, c", True), cg.load(1, "c", True)], "v0 * v1", bf16=True)
    assert "BF2F(x0[b, c])" in src and "BF2F(x1[c])" in src and "= F2BF(v0_0 * v1_0)" in src
    assert "BF2F" not in cg.elementwise_source(2, 2, [cg.load(0, "b, c"), cg.load(1, "c")], "v0 * v1")
    gqa = cg.sdpa_source(8, False, 4)
    assert "kh = hh // 4" in gqa and "k[j, kh, d]" in gqa and "v[j, kh, d]" in gqa and "q[i, hh, d]" in gqa
    assert "kh" not in cg.sdpa_source(8, False)
    assert "orig / low" in cg.rotary_source(scaled=True) and "orig" not in cg.rotary_source()


class _DevPtr:
    """Just what ``bind`` reads of a device array: its pointer."""

    def __init__(self, ptr):
        import ctypes

        self.device_ctypes_pointer = ctypes.c_void_p(ptr)


@pytest.mark.parametrize("dtype,itemsize", [("fp32", 4), ("fp16", 2), ("bf16", 2)])
def test_rows_and_concat_bind_to_capturable_device_copies(dtype, itemsize, monkeypatch):
    from cuda_kernels import kernels, launch

    if dtype not in kernels.DTYPES:
        pytest.skip("bf16 needs ml_dtypes")
    calls = []

    class FakeDriver:
        def cuMemcpyDtoDAsync_v2(self, dst, src, nbytes, stream):
            calls.append((dst, src, nbytes, stream))
            return 0

    monkeypatch.setattr(launch, "driver", FakeDriver)
    lau = prepare("rows", [(10, 3, 4)], (2, 3, 4), dtype, {"start": 7, "stop": 9})
    assert lau.path == "memcpy"
    call = lau.bind(_DevPtr(0x10000), [_DevPtr(0x90000)])
    assert call.capturable
    call(launch.StreamContext(stream=5))
    assert calls == [(0x10000, 0x90000 + 7 * 12 * itemsize, 2 * 12 * itemsize, 5)]
    calls.clear()
    lau = prepare("concat", [(2, 4), (3, 4)], (5, 4), dtype, {})
    lau.bind(_DevPtr(0x10000), [_DevPtr(0x20000), _DevPtr(0x30000)])(launch.StreamContext(stream=6))
    assert calls == [(0x10000, 0x20000, 8 * itemsize, 6), (0x10000 + 8 * itemsize, 0x30000, 12 * itemsize, 6)]
    with pytest.raises(KernelPrepareError, match="rows"):
        prepare("rows", [(10, 3)], (2, 3), dtype, {"start": 9, "stop": 11})


def test_bf16_arrays_reach_numba_kernels_as_their_bits():
    from cuda_kernels import kernels

    if "bf16" not in kernels.DTYPES:
        pytest.skip("bf16 needs ml_dtypes")
    x = np.array([1.0, -2.0], dtype=kernels.DTYPES["bf16"])
    assert kernels._bits(x).dtype == np.uint16 and kernels._bits(x).tolist() == [0x3F80, 0xC000]
    y = np.ones(2, np.float16)
    assert kernels._bits(y) is y and kernels._bits(3) == 3
