"""The numpy references themselves: the softmax pieces compose into causal attention, rotary matches a
direct implementation, in-place and test ops behave as documented."""

import math

import numpy as np
import pytest

from tests.cuda_kernels.cases import llama_cases, make_inputs, reference_f64, rel_error, tiny_cases
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


@pytest.mark.parametrize("q0,tq,tk", [(0, 8, 4), (8, 8, 4), (4, 6, 5)])
def test_split_softmax_over_key_tiles_equals_causal_attention(q0, tq, tk):
    rng = np.random.default_rng(1)
    T, h, dh = 16, 3, 8
    q, k, v = (rng.standard_normal((T, h, dh), dtype=np.float32) for _ in range(3))
    qt, scale = q[q0 : q0 + tq], 1 / math.sqrt(dh)
    tiles = [(j, min(j + tk, q0 + tq)) for j in range(0, q0 + tq, tk)]
    S = [R.attn_scores([qt, k[a:b]], dict(scale=scale, causal=True, q_off=q0, k_off=a)) for a, b in tiles]
    m = R.max_n([R.rowmax([s], {}) for s in S], {})
    E = [R.exp_sub([s, m], {}) for s in S]
    l = R.add_n([R.rowsum([e], {}) for e in E], {})
    pv = {"subscripts": "hqk,khd->qhd"}
    o = R.add_n([R.einsum([e, v[a:b]], pv) for e, (a, b) in zip(E, tiles, strict=True)], {})
    out = R.div_rows([o, l], {})
    np.testing.assert_allclose(out, _causal_attention(qt, k, v, q0, scale), rtol=1e-5, atol=1e-5)


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


def test_exp_sub_all_masked_row_gives_zeros():
    s = np.array([[-np.inf, -np.inf], [0.0, 1.0]], dtype=np.float32)
    e = R.exp_sub([s, R.rowmax([s], {})], {})
    np.testing.assert_array_equal(e[0], [0, 0])
    np.testing.assert_allclose(e[1], [math.exp(-1), 1.0], rtol=1e-6)


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
    xs = make_inputs(case, "fp32", np.random.default_rng(3))
    ref32 = R.run_reference(case.op, [x.copy() for x in xs], case.params)
    assert rel_error(ref32, reference_f64(case, xs)) < 1e-5


def test_llama_cases_cover_every_op():
    assert {c.op for c in llama_cases(16)} == set(R.REFERENCE)
    assert {c.op for c in tiny_cases()} == set(R.REFERENCE)
