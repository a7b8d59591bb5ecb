"""Run one ``Case`` on the device (or the simulator) and compare with the float64 reference.

The output is poisoned with NaN before the launch (``sum_into`` starts from its random accumulator), so
an element the kernel failed to write shows up as NaN and fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuda_kernels._numba import cuda
from cuda_kernels.kernels import Launcher, prepare
from tests.cuda_kernels.cases import NP_DTYPE, Case, decoded, for_dtype, make_inputs, reference_f64, rel_error


@dataclass
class Prepared:
    case: Case
    dtype: str
    launcher: Launcher
    host_ins: list
    ins: list  # device arrays
    out: object  # device array


def out_dtype(case: Case, dtype: str):
    return np.float32 if case.op == "mix" else NP_DTYPE[dtype]


def setup(case: Case, dtype: str, rng: np.random.Generator, gemm: str = "auto") -> Prepared:
    c = cuda()
    case = for_dtype(case, dtype)
    xs = make_inputs(case, dtype, rng)
    ins = [c.to_device(x) for x in xs]
    if case.op == "sum_into":
        out = ins[0]
    else:
        out = c.to_device(np.full(case.out_shape, np.nan, dtype=out_dtype(case, dtype)))
    lau = prepare(case.op, case.in_shapes, case.out_shape, "fp32" if case.op == "mix" else dtype,
                  case.params, gemm=gemm)
    return Prepared(case, dtype, lau, xs, ins, out)


def check(case: Case, dtype: str, rng: np.random.Generator, gemm: str = "auto") -> tuple[float, str]:
    """(relative error vs float64 reference, launcher path) of one fresh run."""
    p = setup(case, dtype, rng, gemm)
    ref = reference_f64(p.case, p.host_ins)
    stream = cuda().stream()
    p.launcher(stream, p.out, p.ins)
    stream.synchronize()
    return rel_error(decoded(p.case, p.out.copy_to_host()), decoded(p.case, ref)), p.launcher.path
