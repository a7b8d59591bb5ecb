"""Run one ``Case`` on the device (or the simulator) and compare with the float64 reference.

The output is poisoned with NaN before the launch (``sum_into`` starts from its random accumulator), so
an element the kernel failed to write shows up as NaN and fails the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cuda_kernels._numba import cuda, to_device, to_host
from cuda_kernels.kernels import Launcher, prepare
from tests.cuda_kernels.cases import (
    NP_DTYPE,
    Case,
    decoded,
    for_dtype,
    make_inputs,
    reference_f64,
    rel_error,
    vertex_dtype,
)


@dataclass
class Prepared:
    case: Case
    dtype: str
    launcher: Launcher
    host_ins: list
    ins: list  # device arrays
    out: object  # device array


def out_dtype(case: Case, dtype: str):
    return NP_DTYPE[vertex_dtype(case, dtype)]


def setup(case: Case, dtype: str, rng: np.random.Generator, gemm: str = "auto") -> Prepared:
    case = for_dtype(case, dtype)
    xs = make_inputs(case, dtype, rng)
    ins = [to_device(x) for x in xs]
    if case.op == "sum_into":
        out = ins[0]
    else:
        out = to_device(np.full(case.out_shape, np.nan, dtype=out_dtype(case, dtype)))
    lau = prepare(case.op, case.in_shapes, case.out_shape, vertex_dtype(case, dtype), case.params, gemm=gemm)
    return Prepared(case, dtype, lau, xs, ins, out)


def check(case: Case, dtype: str, rng: np.random.Generator, gemm: str = "auto") -> tuple[float, str]:
    """(relative error vs float64 reference, launcher path) of one fresh run."""
    p = setup(case, dtype, rng, gemm)
    ref = reference_f64(p.case, p.host_ins)
    stream = cuda().stream()
    p.launcher(stream, p.out, p.ins)
    stream.synchronize()
    return rel_error(decoded(p.case, to_host(p.out)), decoded(p.case, ref)), p.launcher.path


def check_bound(case: Case, dtype: str, rng: np.random.Generator, fast: bool = False,
                graph: bool = False) -> tuple[float, str]:
    """Like ``check``, through the runtime's path: ``Launcher.bind`` once, then one raw launch or library
    call on a stream with a workspace of its own (``fast``: the CUDA C++ kernels where they cover the op;
    ``graph``: captured into a CUDA graph and replayed, where the bound launch can be captured)."""
    from cuda_kernels.kernels import prepare, standalone_context
    from cuda_kernels.launch import LibCall, capture, capture_stream, destroy_graph, driver, launch_raw

    p = setup(case, dtype, rng)
    lau = prepare(p.case.op, p.case.in_shapes, p.case.out_shape, p.launcher.dtype, p.case.params, fast=fast)
    ref = reference_f64(p.case, p.host_ins)
    stream = cuda().stream()
    b = lau.bind(p.out, p.ins)
    ctx = standalone_context(stream, max(getattr(b, "ws_nbytes", 0), 1 << 20), getattr(b, "lib", None))
    if graph and (not isinstance(b, LibCall) or b.capturable):
        ex = capture(b, ctx, capture_stream())
        assert driver().cuGraphLaunch(ex, ctx.stream) == 0
        stream.synchronize()
        destroy_graph(ex)
    elif isinstance(b, LibCall):
        b(ctx)
    else:
        assert launch_raw(b, int(stream.handle)) == 0
    stream.synchronize()
    return rel_error(decoded(p.case, to_host(p.out)), decoded(p.case, ref)), lau.path
