"""Cost classes: what a kernel op that nothing measured is costed like (training ops on a profile
calibrated on prefills), and which host launch cost it pays."""

import json

import numpy as np
import pytest

from turnip.machine.costs import (
    VertexCosts,
    cost_class,
    kernel_efficiency,
    launch_ns,
    roofline_ns,
    work_of,
)
from turnip.machine.profile import h100, load_profile
from turnip.sched.testing import make_memgraph

pytestmark = pytest.mark.unit

QUIET = {"kernel_excess_mean": 0.0, "kernel_min_ns": 1000}


def row(op, work, ns, match="*", dtype="fp16", cv=0.01):
    return {"op": op, "match": match, "dtype": dtype, "work": work, "ns_mean": ns, "ns_sd": ns * cv, "n": 5}


def profile(tmp_path, kernels, **machine):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "turnip-profile", "version": 1, "machine": QUIET | machine,
                             "kernels": kernels}))  # fmt: skip
    return load_profile(p)


def plan(ops, flops, nbytes, subscripts=None):
    """Independent kernels, one per op; ``subscripts`` for the einsums."""
    n = len(ops)
    mg = make_memgraph(["kernel"] * n, [[]] * n, flops=flops, nbytes=nbytes, ops=ops)
    for v, op in enumerate(ops):
        if op == "einsum":
            mg.params[v] = {"subscripts": subscripts or "td,fd->tf"}
    return mg


def test_attention_backward_is_flop_work_and_pays_attentions_launch():
    assert cost_class("sdpa_bwd") == cost_class("sdpa") == "attention" and cost_class("einsum") == "gemm"
    assert work_of("sdpa_bwd") == "flops" and work_of("rmsnorm_bwd") == work_of("adam_p") == "io_nbytes"
    assert {cost_class(op) for op in ("rmsnorm_bwd", "silu_mul_dg", "cols", "xent", "xent_bwd", "cast",
                                      "adam_m", "adam_v", "adam_p")} == {"memory"}  # fmt: skip
    mg = plan(["sdpa", "sdpa_bwd", "einsum", "cast"], [1e9] * 4, [1 << 20] * 4)
    p = h100()
    assert launch_ns(mg, p).tolist() == [p.attn_launch_ns, p.attn_launch_ns, p.gemm_launch_ns, p.kernel_launch_ns]


def test_attention_backward_borrows_the_forward_table_at_its_own_flops(tmp_path):
    prof = profile(tmp_path, [row("sdpa", 1e9, 20_000.0), row("sdpa", 1e10, 100_000.0, cv=0.05)])
    mg = plan(["sdpa", "sdpa_bwd", "sdpa_bwd"], [1e9, 2.5e9, 1e11], [1 << 10] * 3)
    c = VertexCosts(mg, prof)
    inside = np.exp(np.interp(np.log(2.5e9), np.log([1e9, 1e10]), np.log([20_000.0, 100_000.0])))
    assert c.kernel_ns.tolist() == [20_000, round(inside), 1_000_000]  # beyond: the last point's throughput
    assert c.borrowed.tolist() == [False, True, True] and np.isclose(c.table_cv[2], 0.05)


def test_memory_bound_ops_take_the_median_of_the_measured_memory_bound_ops(tmp_path):
    kern = [row("rmsnorm", 1e6, 10_000.0), row("silu", 1e6, 20_000.0), row("add_n", 1e6, 40_000.0),
            row("einsum", 1e6, 1_000.0, match="td,fd->tf")]  # fmt: skip
    prof = profile(tmp_path, kern)
    # 1e6 bytes read plus written: the three memory-bound tables say 10, 20 and 40 us; the GEMM is not asked
    mg = plan(["adam_p", "rmsnorm_bwd", "silu"], [0.0] * 3, [1_000_000] * 3)
    c = VertexCosts(mg, prof)
    assert c.kernel_ns.tolist() == [20_000, 20_000, 20_000] and c.borrowed.tolist() == [True, True, False]
    # never faster than the roofline at full efficiency (a table faster than HBM)
    big = plan(["cast"], [0.0], [1 << 30])
    too_fast = profile(tmp_path, [row("rmsnorm", 1e9, 1_000.0)])
    assert VertexCosts(big, too_fast).kernel_ns[0] == round(roofline_ns(big, prof)[0]) > 1_000
    # nothing measured in the dtype, or of the class: the roofline x kernel_efficiency
    fp32 = plan(["cast"], [0.0], [1_000_000])
    fp32.dtype[0] = "fp32"
    gemm_only = profile(tmp_path, kern[3:])
    for mg_, prof_ in ((fp32, prof), (plan(["cast"], [0.0], [1_000_000]), gemm_only)):
        c = VertexCosts(mg_, prof_)
        assert not c.covered[0] and c.kernel_ns[0] == max(1000, round(roofline_ns(mg_, prof_)[0] / 0.8))


def test_einsum_of_unmeasured_subscripts_borrows_the_measured_einsums(tmp_path):
    kern = [row("einsum", 1e10, 30_000.0, match="td,fd->tf"), row("einsum", 1e10, 50_000.0, match="tf,df->td"),
            row("sdpa", 1e10, 1_000_000.0)]  # fmt: skip
    c = VertexCosts(plan(["einsum"], [1e10], [1 << 10], "tf,fd->td"), profile(tmp_path, kern))
    assert c.kernel_ns[0] == 40_000 and c.borrowed[0]  # the median of two: their mean


def test_calibration_csv_falls_back_to_the_class_median(tmp_path):
    cal = tmp_path / "cal.csv"
    cal.write_text("op,match,dtype,efficiency\neinsum,*,fp16,1.0\nsdpa,*,fp16,0.5\nrmsnorm,*,fp16,0.6\n"
                   "silu,*,fp16,0.7\nadd_n,*,fp16,0.9\n")  # fmt: skip
    prof = h100().replace(kernel_calibration=str(cal))
    mg = plan(["sdpa_bwd", "cast", "silu", "einsum", "cast"], [1e9] * 5, [1 << 20] * 5)
    mg.dtype[4] = "fp32"  # no fp32 entries: the profile's constant
    assert kernel_efficiency(mg, prof).tolist() == [0.5, 0.7, 0.7, 1.0, 0.8]


def test_every_kernel_of_a_training_step_is_costed_from_the_calibrated_tables():
    from turnip.compile import compile_model
    from turnip.train import TrainSpec

    mg = compile_model("llama-tiny", 16, 1, 96 << 10, train=TrainSpec(2))[1]
    c = VertexCosts(mg, load_profile("h100-calibrated"))
    kern = (c.eng == 0) & np.array([d == "fp16" for d in mg.dtype])
    assert c.covered[kern].all() and not c.borrowed[kern].any()  # calibrate runs training steps: own tables
    assert (c.kernel_ns[c.eng == 0] >= np.rint(roofline_ns(mg, c.prof)[c.eng == 0]) - 1).all()
