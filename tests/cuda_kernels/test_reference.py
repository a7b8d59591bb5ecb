"""The numpy references themselves: the softmax pieces compose into causal attention, rotary matches a
direct implementation, in-place and test ops behave as documented."""

import math

import numpy as np
import pytest

from tests.cuda_kernels.cases import decoded, for_dtype, llama_cases, make_inputs, reference_f64, rel_error, tiny_cases
from turnip import reference as R

pytestmark = pytest.mark.unit


def _causal_attention(q, k, v, q_off, scale):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    qi = q_off + np.arange(q.shape[0])[:, None]
    s = np.where(qi >= np.arange(k.shape[0])[None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


@pytest.mark.parametrize("q0,tq,kv", [(0, 8, 16), (8, 8, 4), (4, 6, 5), (10, 6, 16)])
def test_key_ranges_combine_into_causal_attention(q0, tq, kv):
    """sdpa over key ranges [a, a + kv) up to the query block's end, merged by attn_combine, is causal
    attention of the query block over the whole prefix; one range alone needs no combine."""
    rng = np.random.default_rng(1)
    T, h, dh = 16, 3, 8
    q, k, v = (rng.standard_normal((T, h, dh), dtype=np.float32) for _ in range(3))
    qt, scale = q[q0 : q0 + tq], 1 / math.sqrt(dh)
    want = _causal_attention(qt, k, v, q0, scale)
    ranges = [(a, min(a + kv, q0 + tq)) for a in range(0, q0 + tq, kv)]
    common = {"scale": scale, "causal": True, "q_off": q0, "itemsize": 4}
    parts = [R.sdpa([qt, k[a:b], v[a:b]], common | {"k_off": a, "partial": len(ranges) > 1}) for a, b in ranges]
    out = parts[0] if len(parts) == 1 else R.attn_combine(parts, {"tq": tq, "h": h, "dh": dh, "itemsize": 4})
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_sdpa_reads_only_tk_keys_and_reports_log_sum_exp():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((6, 2, 4), dtype=np.float32) for _ in range(3))
    p = {"scale": 0.5, "causal": True, "q_off": 2, "k_off": 0, "tk": 4, "partial": True, "itemsize": 4}
    k2, v2 = k.copy(), v.copy()
    k2[4:], v2[4:] = np.nan, np.nan  # rows past tk are never read
    o, lse = R.split_partial(R.sdpa([q, k2, v2], p), 6, 2, 4)
    s = np.einsum("ihd,jhd->hij", q, k[:4]) * 0.5
    s = np.where(np.arange(4)[None, None, :] <= 2 + np.arange(6)[None, :, None], s, -np.inf)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-5)
    assert np.isfinite(o).all()


def test_rows_without_visible_keys_give_zero_and_minus_infinity():
    q, k, v = (np.ones((3, 1, 2), np.float32) for _ in range(3))
    p = {"scale": 1.0, "causal": True, "q_off": 0, "k_off": 2, "partial": True, "itemsize": 4}
    o, lse = R.split_partial(R.sdpa([q, k, v], p), 3, 1, 2)
    assert np.isneginf(lse[0, :2]).all() and np.isfinite(lse[0, 2])
    np.testing.assert_array_equal(o[:2], 0)
    merged = R.attn_combine([R.sdpa([q, k, v], p)] * 2, {"tq": 3, "h": 1, "dh": 2, "itemsize": 4})
    np.testing.assert_array_equal(merged[:2], 0)
    np.testing.assert_allclose(merged[2], 1.0)


def test_rotary_matches_pairwise_rotation():
    rng = np.random.default_rng(2)
    t, h, dh, off, theta = 5, 2, 8, 37, 500.0
    x = rng.standard_normal((t, h, dh), dtype=np.float32)
    out = R.rotary([x], {"pos_off": off, "theta": theta})
    half = dh // 2
    want = np.empty((t, h, dh))
    for i in range(t):
        for j in range(half):
            ang = (off + i) * theta ** (-2 * j / dh)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[i, :, j].astype(np.float64), x[i, :, j + half].astype(np.float64)
            want[i, :, j], want[i, :, j + half] = a * c - b * s, b * c + a * s
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_sum_into_is_in_place():
    acc, x = np.ones((2, 3), np.float16), np.full((2, 3), 2, np.float16)
    assert R.sum_into([acc, x], {}) is acc
    np.testing.assert_array_equal(acc, 3)


def test_mix_small_example():
    out = R.mix([np.array([1.0, 2.0], np.float32), np.zeros(0, np.float32)], {"n_out": 3})
    np.testing.assert_allclose(out, 0.5 * np.tanh(1 + np.array([1.0, 2.0, 1.0])), rtol=1e-6)
    assert out.dtype == np.float32


def test_unknown_op_names_it():
    with pytest.raises(KeyError, match="nope"):
        R.run_reference("nope", [], {})


@pytest.mark.parametrize("case", tiny_cases(), ids=lambda c: c.name)
def test_float64_reference_agrees_with_float32_reference(case):
    case = for_dtype(case, "fp32")
    xs = make_inputs(case, "fp32", np.random.default_rng(3))
    ref32 = R.run_reference(case.op, [x.copy() for x in xs], case.params)
    assert rel_error(decoded(case, ref32), decoded(case, reference_f64(case, xs))) < 1e-5


def test_llama_cases_cover_every_op():
    assert {c.op for c in llama_cases(16)} == set(R.REFERENCE)
    assert {c.op for c in tiny_cases()} == set(R.REFERENCE)


def test_grouped_query_attention_is_attention_over_repeated_key_heads():
    """q (t, hk, r, dh) against k, v (t, hk, dh) is multi-head attention with each key/value head repeated r
    times in place (query head i reads key head i // r), partials and their combine included."""
    rng = np.random.default_rng(5)
    t, hk, r, dh = 6, 2, 3, 4
    q = rng.standard_normal((t, hk, r, dh), dtype=np.float32)
    k, v = (rng.standard_normal((t, hk, dh), dtype=np.float32) for _ in range(2))
    p = {"scale": 0.5, "causal": True, "q_off": 0, "k_off": 0}
    want = R.sdpa([q.reshape(t, hk * r, dh), np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)], p)
    np.testing.assert_allclose(R.sdpa([q, k, v], p), want.reshape(t, hk, r, dh), rtol=1e-6)
    pp = p | {"partial": True, "itemsize": 4}
    parts = [R.sdpa([q, k[a:b], v[a:b]], pp | {"k_off": a}) for a, b in ((0, 2), (2, 6))]
    merged = R.attn_combine(parts, {"tq": t, "h": hk * r, "dh": dh, "itemsize": 4, "r": r})
    np.testing.assert_allclose(merged, want.reshape(t, hk, r, dh), rtol=1e-5, atol=1e-6)


def test_rope_scaling_off_is_plain_rotary_and_on_keeps_high_frequencies():
    x = np.random.default_rng(6).standard_normal((3, 2, 2, 16), dtype=np.float32)
    plain = R.rotary([x], {"pos_off": 40, "theta": 500000.0})
    off = R.rotary([x], {"pos_off": 40, "theta": 500000.0, "rope_factor": 0, "rope_low": 1.0})
    np.testing.assert_array_equal(plain, off)
    np.testing.assert_allclose(plain, R.rotary([x.reshape(3, 4, 16)], {"pos_off": 40, "theta": 500000.0})
                               .reshape(x.shape))
    p = {"theta": 500000.0, "rope_factor": 8.0, "rope_low": 1.0, "rope_high": 4.0, "rope_orig": 8192}
    inv, scaled = R.rope_inv_freq(16, {"theta": 500000.0}), R.rope_inv_freq(16, p)
    wl = 2 * np.pi / inv
    np.testing.assert_array_equal(scaled[wl < 2048], inv[wl < 2048])
    np.testing.assert_allclose(scaled[wl > 8192], inv[wl > 8192] / 8.0)
    mid = (wl >= 2048) & (wl <= 8192)
    assert mid.any() and np.all((scaled[mid] < inv[mid]) & (scaled[mid] > inv[mid] / 8.0))


def test_rows_is_a_contiguous_slice():
    x = np.arange(24, dtype=np.float16).reshape(4, 3, 2)
    out = R.rows([x], {"start": 3, "stop": 4})
    assert out.flags.c_contiguous and out.shape == (1, 3, 2)
    np.testing.assert_array_equal(out, x[3:4])


@pytest.mark.parametrize("q_shape,hk,p", [
    ((5, 2, 4), 2, {"scale": 0.5, "causal": True, "q_off": 0, "k_off": 0}),
    ((5, 2, 3, 4), 2, {"scale": 0.375, "causal": True, "q_off": 0, "k_off": 0}),
    ((6, 4, 4), 2, {"scale": 0.5, "causal": True, "q_off": 1, "k_off": 3}),  # rows 0, 1 see no key
    ((4, 1, 2, 4), 1, {"scale": 0.25, "causal": False, "q_off": 0, "k_off": 0}),
], ids=["mha", "gqa", "gqa_offsets", "mqa_full"])  # fmt: skip
def test_sdpa_bwd_is_the_gradient_of_sdpa(q_shape, hk, p):
    """In float64, sdpa_bwd's dq, dk, dv (from o = sdpa(q, k, v) and do) match central differences of
    L = sum(do * sdpa(q, k, v)); a key/value head's dk, dv sum over its group."""
    from unittest import mock

    rng = np.random.default_rng(7)
    t, dh = q_shape[0], q_shape[-1]
    q = rng.standard_normal(q_shape)
    k, v = (rng.standard_normal((t, hk, dh)) for _ in range(2))
    do = rng.standard_normal(q_shape)
    r = math.prod(q_shape[1:-1]) // hk
    with mock.patch.object(R, "_f32", lambda x: x.astype(np.float64, copy=False)):
        out = R.sdpa_bwd([q, k, v, R.sdpa([q, k, v], p), do], p)

        def loss(xs):
            return float(np.sum(do * R.sdpa(xs, p)))

        def numeric(i):
            xs = [q.copy(), k.copy(), v.copy()]
            g = np.empty_like(xs[i])
            for idx in np.ndindex(g.shape):
                x0, eps = xs[i][idx], 1e-6
                xs[i][idx] = x0 + eps
                up = loss(xs)
                xs[i][idx] = x0 - eps
                g[idx] = (up - loss(xs)) / (2 * eps)
                xs[i][idx] = x0
            return g

        assert out.shape == (t, hk, (r + 2) * dh) and out.dtype == np.float64
        np.testing.assert_allclose(out[..., : r * dh].reshape(q_shape), numeric(0), rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(out[..., r * dh : (r + 1) * dh], numeric(1), rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(out[..., (r + 1) * dh :], numeric(2), rtol=1e-6, atol=1e-8)
