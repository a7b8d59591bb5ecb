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


def test_generated_sources_are_python():
    for nd in (1, 2, 3):
        compile(cg.elementwise_source(2, nd, ["v", "w"], "v0 + v1", 1), "<ew>", "exec")
    for nd in (2, 3):
        compile(cg.rmsnorm_source(nd, 32), "<row>", "exec")
    compile(cg.sdpa_source(8, True), "<sdpa>", "exec")
    compile(cg.combine_source(3), "<combine>", "exec")
    assert cg.broadcast_index((1, 4), (3, 2, 4)) == "0, c"
    with pytest.raises(ValueError):
        cg.broadcast_index((3,), (2, 4))


def test_prepare_rejects_unknown_op_and_dtype():
    with pytest.raises(KernelPrepareError, match="unknown op"):
        prepare("conv", [(1,)], (1,), "fp32", {})
    with pytest.raises(KernelPrepareError, match="bf16"):
        prepare("mul", [(1,), (1,)], (1,), "bf16", {})
