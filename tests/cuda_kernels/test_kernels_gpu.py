"""Every kernel on a real GPU at LLaMA-7B tile sizes (512 tokens; grouped-query attention, rope scaling and
row slices at LLaMA-3-8B shapes), fp32, fp16 and bf16, fresh random inputs, NaN-poisoned outputs, relative
error against the float64 reference; GEMMs through cuBLAS and through numba."""

import numpy as np
import pytest

from tests.cuda_kernels.cases import DTYPES, FP32_ONLY, TOLERANCE, llama_cases

pytestmark = pytest.mark.gpu

CASES = llama_cases(512)
PARAMS = [
    pytest.param(c, g, id=f"{c.name}-{g}")
    for c in CASES
    for g in (("cublas", "numba") if c.contraction else ("auto",))
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case,gemm", PARAMS)
def test_kernel_matches_reference(case, gemm, dtype, rng):
    from tests.cuda_kernels.harness import check

    if case.op in FP32_ONLY and dtype != "fp32":
        pytest.skip(f"{case.op} is defined on float32")
    err, path = check(case, dtype, rng, gemm=gemm)
    if case.contraction:
        assert path.removesuffix("+add") == ("cublas" if gemm == "cublas" else "numba-gemm")
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype} {path}: relative error {err:.3g}"


@pytest.mark.parametrize("graph", [False, True], ids=["direct", "graph"])
@pytest.mark.parametrize("fast", [False, True], ids=["numba", "fast"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bound_launch_matches_reference(case, dtype, fast, graph, rng):
    """The runtime's path: bind once, one driver call (or library call, or graph replay) per launch."""
    from tests.cuda_kernels.harness import check_bound

    if case.op in FP32_ONLY and dtype != "fp32":
        pytest.skip(f"{case.op} is defined on float32")
    err, path = check_bound(case, dtype, rng, fast=fast, graph=graph)
    if case.op == "sdpa":  # soft-capped scores, masks cuDNN cannot express: the portable kernel
        from cuda_kernels.cudnn_sdpa import mask_mode

        tk = case.params.get("tk", case.in_shapes[1][0])
        cudnn = not case.params.get("softcap") and mask_mode(case.in_shapes[0][0], tk, case.params) is not None
        assert path == ("cudnn" if dtype in ("fp16", "bf16") and cudnn else "kernel")
    if case.op in ("concat", "rows"):
        assert path == "memcpy"
    if case.params.get("inverse") or case.params.get("offset"):  # CUDA C++ rotary has no inverse, its rmsnorm
        assert path == "kernel"  # no weight offset: the numba kernels take them
    elif case.op == "add_n" and len(set(case.in_shapes)) > 1:  # a broadcast bias: numba's elementwise kernel
        assert path == "kernel"
    elif fast and case.op in ("rmsnorm", "rotary", "silu_mul", "silu", "mul", "scale", "add_n", "sum_into", "embed"):
        assert path == "nvrtc", f"{case.name} {dtype}: the fast kernels did not take it"
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype} {path}: relative error {err:.3g}"


GQA = [c for c in llama_cases(256) if c.name.endswith(("_gqa", "_gqa_range", "_gqa_partial"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GQA, ids=[c.name for c in GQA])
def test_portable_grouped_query_attention(case, dtype, rng, monkeypatch):
    """The numba sdpa / combine kernels (what runs where cuDNN cannot), grouped-query, bound and launched."""
    from cuda_kernels import cudnn_sdpa
    from tests.cuda_kernels.harness import check_bound

    monkeypatch.setattr(cudnn_sdpa, "supports", lambda *a, **k: False)
    err, path = check_bound(case, dtype, rng)
    assert path == "kernel"
    assert err <= TOLERANCE[dtype], f"{case.name} {dtype} {path}: relative error {err:.3g}"


def test_launch_compiles_nothing_and_streams_agree(rng):
    """After prepare, launching (on two streams, cuBLAS and numba kernels) adds no compiled overloads."""
    from cuda_kernels import codegen
    from cuda_kernels._numba import cuda, to_host
    from tests.cuda_kernels.harness import setup

    preps = [setup(c, "fp16", rng) for c in llama_cases(128) if c.op in ("einsum", "sdpa", "rmsnorm")]
    n_overloads = sum(len(d.overloads) for d in codegen._SOURCES.values())
    results = []
    for s in (cuda().stream(), cuda().stream()):
        for p in preps:
            p.launcher(s, p.out, p.ins)
        s.synchronize()
        results.append([to_host(p.out) for p in preps])
    assert sum(len(d.overloads) for d in codegen._SOURCES.values()) == n_overloads
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
