"""``sdpa_bwd`` beyond the shared case tables: the cuDNN backward's strides over turnip's buffers (no device
needed), and, on a GPU, the cuDNN path at LLaMA-7B sizes against the float64 reference, part by part."""

import math

import numpy as np
import pytest

from tests.cuda_kernels.cases import NP_DTYPE, make_inputs, reference_f64, rel_error, sdpa_bwd_cases

CUDNN_TOLERANCE = {"fp16": 2e-2, "bf16": 3e-2}


def _view(flat: np.ndarray, dim_stride, base: int = 0) -> np.ndarray:
    dim, stride = dim_stride
    return np.lib.stride_tricks.as_strided(flat[base:], shape=dim, strides=[s * flat.itemsize for s in stride])


@pytest.mark.unit
@pytest.mark.parametrize("hk,r", [(3, 1), (2, 4), (1, 3)], ids=["mha", "gqa", "mqa"])
def test_cudnn_backward_layout_addresses_turnip_buffers(hk, r):
    """cuDNN's (b, head, s, d) element of Q, K, Stats, dQ and dK is turnip's element of query head b hq + head
    (its key/value head: that over r) at token s."""
    from cuda_kernels.cudnn_sdpa import bwd_layout

    t, dh = 5, 8
    h = hk * r
    lay = bwd_layout(t, hk, r, dh)
    b, hq = lay["q"][0][:2]
    hv = lay["kv"][0][1]
    assert b * hq == h and b * hv == hk and lay["dkv"][0] == lay["kv"][0]

    def bhsd(x, heads):  # (t, b * heads, d) -> (b, heads, t, d)
        return x.reshape(t, b, heads, -1).transpose(1, 2, 0, 3)

    q, k = np.arange(t * h * dh).reshape(t, h, dh), np.arange(t * hk * dh).reshape(t, hk, dh)
    out = np.arange(t * hk * (r + 2) * dh).reshape(t, hk, (r + 2) * dh)
    stats = np.arange(h * t).reshape(h, t)
    np.testing.assert_array_equal(_view(q.ravel(), lay["q"]), bhsd(q, hq))
    np.testing.assert_array_equal(_view(k.ravel(), lay["kv"]), bhsd(k, hv))
    np.testing.assert_array_equal(_view(stats.ravel(), lay["stats"]), stats.reshape(b, hq, t, 1))
    np.testing.assert_array_equal(_view(out.ravel(), lay["dq"]), bhsd(out[..., : r * dh].reshape(t, h, dh), hq))
    for part in (r, r + 1):  # dK, dV: the same strides from their own column
        want = bhsd(out[..., part * dh : (part + 1) * dh], hv)
        np.testing.assert_array_equal(_view(out.ravel(), lay["dkv"], part * dh), want)


def _run(case, dtype, rng, ws_nbytes: int, bound: bool):
    """(launcher, output on the host, inputs on the host) of one fresh run."""
    from cuda_kernels._numba import cuda, to_device, to_host
    from cuda_kernels.kernels import prepare, standalone_context

    xs = make_inputs(case, dtype, rng)
    ins = [to_device(x) for x in xs]
    out = to_device(np.full(case.out_shape, np.nan, dtype=NP_DTYPE[dtype]))
    lau = prepare(case.op, case.in_shapes, case.out_shape, dtype, case.params, ws_nbytes=ws_nbytes)
    stream = cuda().stream()
    if bound:
        b = lau.bind(out, ins)
        b(standalone_context(stream, max(b.ws_nbytes, 256), b.lib))
    else:
        lau(stream, out, ins)
    stream.synchronize()
    return lau, to_host(out), xs


CUDNN_CASES = sdpa_bwd_cases(1024, 32, 8, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("bound", [False, True], ids=["run", "bound"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("case", CUDNN_CASES, ids=[c.name for c in CUDNN_CASES])
def test_cudnn_backward_matches_reference(case, dtype, bound, rng, record_property):
    """cuDNN forward (stats) + backward at t=1024, 32 query heads of 128 (multi-head, and 8 key/value heads),
    given a workspace large enough: dq, dk and dv each within tolerance of the float64 reference."""
    from cuda_kernels import cudnn_sdpa

    if not cudnn_sdpa.usable() or dtype not in NP_DTYPE:
        pytest.skip("cuDNN frontend (or ml_dtypes for bf16) not available")
    lau, out, xs = _run(case, dtype, rng, 1 << 30, bound)
    assert lau.path == "cudnn"
    ref = reference_f64(case, xs)
    dh = case.in_shapes[1][-1]
    r = case.out_shape[-1] // dh - 2
    for name, a, b in (("dq", 0, r), ("dk", r, r + 1), ("dv", r + 1, r + 2)):
        err = rel_error(out[..., a * dh : b * dh], ref[..., a * dh : b * dh])
        record_property(f"err_{name}", err)
        assert err <= CUDNN_TOLERANCE[dtype], f"{case.name} {dtype} {name}: relative error {err:.3g}"


@pytest.mark.gpu
def test_cudnn_backward_workspace_and_fallback():
    """The cuDNN backward asks for at least its float32 dQ accumulator plus the stats; a plan with the
    default 1 MiB per slot gets the portable kernels instead."""
    from cuda_kernels import cudnn_sdpa
    from cuda_kernels.kernels import prepare

    if not cudnn_sdpa.usable():
        pytest.skip("cuDNN frontend not available")
    t, h, dh = 4096, 32, 128
    g = cudnn_sdpa.CudnnSdpaBwd(t, h, 1, dh, "fp16", 1 / math.sqrt(dh), "bottom_right")
    print(f"cuDNN sdpa_bwd workspace t={t} h={h} dh={dh} fp16: {g.ws_nbytes} bytes")
    assert g.ws_nbytes >= h * t * 4 + h * t * dh * 4
    case = sdpa_bwd_cases(256, 8, 8, 128)[0]
    assert prepare(case.op, case.in_shapes, case.out_shape, "fp16", case.params, ws_nbytes=1 << 20).path == "kernel"
