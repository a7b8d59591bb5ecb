"""Every kernel under the CUDA simulator, tiny shapes, against the float64 reference: fp32, fp16 and bf16
(numba kernels on the bits of bf16 arrays), grouped-query attention, rope scaling, row slices."""

import pytest

from tests.cuda_kernels.cases import DTYPES, FP32_ONLY, TOLERANCE, tiny_cases

pytestmark = pytest.mark.cudasim

CASES = tiny_cases()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_kernel_matches_reference(case, dtype, rng):
    from tests.cuda_kernels.harness import check

    if case.op in FP32_ONLY and dtype != "fp32":
        pytest.skip(f"{case.op} is defined on float32")
    err, path = check(case, dtype, rng)
    assert path != "cublas"
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype}: relative error {err:.3g}"


def test_gemm_cublas_unavailable_under_simulator():
    from cuda_kernels.kernels import KernelPrepareError, prepare

    with pytest.raises(KernelPrepareError, match="cuBLAS"):
        prepare("einsum", [(4, 8), (8, 4)], (4, 4), "fp32", {"subscripts": "td,df->tf"}, gemm="cublas")
