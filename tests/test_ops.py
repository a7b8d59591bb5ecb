"""The op registry agrees with the numpy references and catches shape mismatches."""

import numpy as np
import pytest

from turnip import ops
from turnip.reference import REFERENCE
from turnip.taskgraph import Builder, ShapeError, UnknownOpError

pytestmark = pytest.mark.unit

CASES = [  # op, input shapes, params
    ("einsum", [(4, 6), (6, 5)], {"subscripts": "td,df->tf"}),
    ("einsum", [(2, 4, 3), (3, 2, 5)], {"subscripts": "hqk,khd->qhd"}),
    ("sdpa", [(4, 2, 8), (6, 2, 8), (6, 2, 8)], {"scale": 0.5, "q_off": 3, "k_off": 0, "tk": 5}),
    ("sdpa", [(4, 2, 8), (6, 2, 8), (6, 2, 8)],
     {"scale": 0.5, "q_off": 3, "k_off": 0, "partial": True, "itemsize": 4}),
    ("attn_combine", [(72,), (72,)], {"tq": 4, "h": 2, "dh": 8, "itemsize": 4}),
    ("concat", [(4, 2, 8), (3, 2, 8)], {}),
    ("add_n", [(4, 6), (4, 6)], {}),
    ("mul", [(4, 6), (4, 6)], {}),
    ("scale", [(4, 6)], {"alpha": 2.0}),
    ("silu", [(4, 6)], {}),
    ("silu_mul", [(4, 6), (4, 6)], {}),
    ("gelu_tanh_mul", [(4, 6), (4, 6)], {}),
    ("softcap", [(4, 6)], {"cap": 2.0}),
    ("sdpa", [(4, 2, 8), (6, 2, 8), (6, 2, 8)], {"scale": 0.5, "q_off": 3, "k_off": 0, "window": 2, "softcap": 3.0}),
    ("rmsnorm", [(4, 6), (6,)], {}),
    ("rmsnorm", [(4, 2, 3, 6), (6,)], {"offset": 1.0}),
    ("add_n", [(4, 2, 3, 6), (2, 3, 6)], {}),
    ("rotary", [(4, 2, 8)], {"pos_off": 2}),
    ("sum_into", [(4, 6), (4, 6)], {}),
    ("mix", [(5,), (3,)], {"n_out": 7}),
]


def test_registry_covers_every_reference():
    assert set(ops.OPS) == set(REFERENCE)


@pytest.mark.parametrize("op,shapes,params", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_out_shape_matches_reference(op, shapes, params, rng):
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    got = REFERENCE[op](xs, params)
    assert ops.check_shapes(op, shapes, got.shape, params) is None
    assert ops.flops(op, shapes, got.shape, params) >= 0


def test_embed_shape_and_einsum_flops():
    assert ops.check_shapes("embed", [(5,), (64, 16)], (5, 16), {}) is None
    assert ops.flops("einsum", [(4, 6), (6, 5)], (4, 5), {"subscripts": "td,df->tf"}) == 2 * 4 * 6 * 5


def test_windowed_attention_counts_only_the_keys_in_the_window():
    """4 queries at positions 3..6 over keys 0..5: causal sees 4 + 5 + 6 + 6 keys; a window of 2, two each but
    the last (its own position is past the keys)."""
    shapes, p = [(4, 2, 8), (6, 2, 8), (6, 2, 8)], {"scale": 0.5, "q_off": 3, "k_off": 0}
    full, win = (ops.flops("sdpa", shapes, (4, 2, 8), p | w) for w in ({}, {"window": 2}))
    assert full / win == (4 + 5 + 6 + 6) / (2 + 2 + 2 + 1)


def test_mismatches_are_named():
    assert "gives (4, 5)" in ops.check_shapes("einsum", [(4, 6), (6, 5)], (5, 4), {"subscripts": "td,df->tf"})
    assert "dim 'd' is 6 and 7" in ops.check_shapes("einsum", [(4, 6), (7, 5)], (4, 5), {"subscripts": "td,df->tf"})
    assert "takes 2 inputs" in ops.check_shapes("mul", [(4,)], (4,), {})
    with pytest.raises(KeyError, match="unknown op"):
        ops.spec("conv9d")


def test_taskgraph_validation_uses_the_registry():
    b = Builder(1)
    x = b.input((4, 6), "fp32", 0, "x")
    w = b.input((6, 5), "fp32", 0, "w")
    y = b.kernel("einsum", [x, w], (4, 5), "fp32", 0, {"subscripts": "td,df->tf"}, name="y")
    tg = b.build(outputs=[y])
    tg.validate()
    assert tg.flops[y] == 2 * 4 * 6 * 5
    tg.shape[y], tg.nbytes[y] = (5, 4), 80
    with pytest.raises(ShapeError, match="vertex 2 .*gives \\(4, 5\\)"):
        tg.validate()
    tg.shape[y], tg.op[y] = (4, 5), "conv9d"
    with pytest.raises(UnknownOpError):
        tg.validate()


def test_gpu_kernels_cover_exactly_the_specification():
    from cuda_kernels.kernels import OPS as GPU_OPS

    assert set(GPU_OPS) == set(REFERENCE) == set(ops.OPS)
