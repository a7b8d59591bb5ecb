"""Taskgraph validation: every malformed graph gets a typed error naming the vertex."""

import numpy as np
import pytest

from turnip.taskgraph import (
    Builder,
    CycleError,
    GpuRangeError,
    ShapeError,
    SizeError,
    UnknownOpError,
)

pytestmark = pytest.mark.unit


def chain(n_gpus=1):
    b = Builder(n_gpus)
    x = b.input((4,), "fp32", 0, "x")
    y = b.kernel("mix", [x], (4,), "fp32", 0, {"n_out": 4}, name="y")
    z = b.kernel("mix", [y], (4,), "fp32", 0, {"n_out": 4}, name="z")
    return b, (x, y, z)


def test_valid_chain_and_csr():
    b, (x, y, z) = chain()
    tg = b.build(outputs=[z])
    tg.validate()
    assert tg.args(z).tolist() == [y] and tg.nbytes.tolist() == [16, 16, 16]
    assert tg.arg_ptr.dtype == np.int64 and tg.is_output[z]


def test_cycle_names_vertices():
    b, (x, y, z) = chain()
    tg = b.build()
    tg.arg_idx[tg.arg_ptr[y]] = z  # y now reads z, z reads y
    with pytest.raises(CycleError) as e:
        tg.validate()
    assert set(e.value.cycle) == {y, z} and "cycle" in str(e.value)


def test_unknown_op():
    b, (x, y, z) = chain()
    tg = b.build()
    tg.op[y] = "conv9d"
    with pytest.raises(UnknownOpError, match="vertex 1 .*conv9d"):
        tg.validate()


def test_shape_mismatch():
    b, (x, y, z) = chain()
    tg = b.build()
    tg.nbytes[z] = 20
    with pytest.raises(ShapeError, match="vertex 2"):
        tg.validate()


def test_size_must_be_positive():
    b = Builder(1)
    b.input((0,), "fp32", 0, "empty")
    with pytest.raises(SizeError, match="vertex 0 .*must be > 0"):
        b.build().validate()


def test_gpu_out_of_range_and_cross_gpu_read():
    b, (x, y, z) = chain(n_gpus=2)
    tg = b.build()
    tg.gpu[z] = 5
    with pytest.raises(GpuRangeError, match="gpu 5 outside 0..1"):
        tg.validate()
    tg.gpu[z] = 1
    tg.src_gpu[z] = 1
    with pytest.raises(GpuRangeError, match="without a transfer"):
        tg.validate()


def test_sum_into_depends_on_accumulator_only_and_consumers_on_all_writers():
    b = Builder(1)
    x = b.input((4,), "fp32", 0, "x")
    acc = b.kernel("mix", [x], (4,), "fp32", 0, {"n_out": 4})
    parts = [b.kernel("mix", [x], (4,), "fp32", 0, {"n_out": 4}) for _ in range(2)]
    s = [b.sum_into(acc, p) for p in parts]
    out = b.kernel("mix", [acc], (4,), "fp32", 0, {"n_out": 4})
    tg = b.build(outputs=[out])
    tg.validate()
    assert tg.deps(s[1]) == [acc, parts[1]]
    assert sorted(tg.deps(out)) == sorted([acc, *s])
