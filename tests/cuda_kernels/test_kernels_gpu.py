"""Every kernel on a real GPU at LLaMA-7B tile sizes (512 tokens), fresh random inputs, NaN-poisoned
outputs, relative error against the float64 reference; GEMMs through cuBLAS and through numba."""

import numpy as np
import pytest

from tests.cuda_kernels.cases import TOLERANCE, llama_cases

pytestmark = pytest.mark.gpu

CASES = llama_cases(512)
PARAMS = [
    pytest.param(c, g, id=f"{c.name}-{g}")
    for c in CASES
    for g in (("cublas", "numba") if c.contraction else ("auto",))
]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case,gemm", PARAMS)
def test_kernel_matches_reference(case, gemm, dtype, rng):
    from tests.cuda_kernels.harness import check

    if case.op == "mix" and dtype == "fp16":
        pytest.skip("mix is defined on float32 vectors")
    err, path = check(case, dtype, rng, gemm=gemm)
    if case.contraction:
        assert path == ("cublas" if gemm == "cublas" else "numba-gemm")
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype} {path}: relative error {err:.3g}"


@pytest.mark.parametrize("graph", [False, True], ids=["direct", "graph"])
@pytest.mark.parametrize("fast", [False, True], ids=["numba", "fast"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bound_launch_matches_reference(case, dtype, fast, graph, rng):
    """The runtime's path: bind once, one driver call (or library call, or graph replay) per launch."""
    from tests.cuda_kernels.harness import check_bound

    if case.op == "mix" and dtype == "fp16":
        pytest.skip("mix is defined on float32 vectors")
    err, path = check_bound(case, dtype, rng, fast=fast, graph=graph)
    if case.op == "sdpa":
        assert path == ("cudnn" if dtype == "fp16" else "kernel")
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype} {path}: relative error {err:.3g}"


def test_launch_compiles_nothing_and_streams_agree(rng):
    """After prepare, launching (on two streams, cuBLAS and numba kernels) adds no compiled overloads."""
    from cuda_kernels import codegen
    from cuda_kernels._numba import cuda
    from tests.cuda_kernels.harness import setup

    preps = [setup(c, "fp16", rng) for c in llama_cases(128) if c.op in ("einsum", "sdpa", "rmsnorm")]
    n_overloads = sum(len(d.overloads) for d in codegen._SOURCES.values())
    results = []
    for s in (cuda().stream(), cuda().stream()):
        for p in preps:
            p.launcher(s, p.out, p.ins)
        s.synchronize()
        results.append([p.out.copy_to_host() for p in preps])
    assert sum(len(d.overloads) for d in codegen._SOURCES.values()) == n_overloads
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
