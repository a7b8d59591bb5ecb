"""The checks made before a plan is loaded (``turnip.runtime.plancheck``) and how ``turnip run`` and
``turnip verify`` report a plan that fails them or the verifier."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.clicall import call
from turnip.compile import compile_model
from turnip.memgraph.io import load_plan, save_plan
from turnip.memgraph.plan import KIND_KERNEL
from turnip.memgraph.verify import verify
from turnip.runtime import PlanError, open_backend
from turnip.runtime.plancheck import check_plan

pytestmark = pytest.mark.cpu_runtime


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """A good llama-tiny plan, the same with one kernel's output at 10^9 (checksum recomputed), and one
    that passes the load checks but not the verifier (a kernel writing over a buffer still in use)."""
    d = tmp_path_factory.mktemp("plans")
    tg, mg = compile_model("llama-tiny", seq=64, budget="300KiB")
    assert verify(mg, tg) == []
    save_plan(d / "good.tplan", mg, tg)
    mg, tg = load_plan(d / "good.tplan")
    v = int(np.flatnonzero(mg.kind == KIND_KERNEL)[0])
    mg.out_offset[v] = 10**9
    save_plan(d / "bad.tplan", mg, tg)
    mg.out_offset[v] = load_plan(d / "good.tplan")[0].out_offset[v]
    for v in np.flatnonzero(mg.kind == KIND_KERNEL)[1:]:
        old = mg.out_offset[v]
        mg.out_offset[v] = 0  # over whatever lives at the bottom of the arena
        try:
            check_plan(mg, tg)
        except PlanError:
            mg.out_offset[v] = old
            continue
        if verify(mg, tg):
            break
        mg.out_offset[v] = old
    assert verify(mg, tg)
    save_plan(d / "racy.tplan", mg, tg)
    return d


def test_a_plan_writing_outside_its_arena_is_refused_in_one_line(plans):
    rc, out, err = call(["run", str(plans / "bad.tplan"), "--backend", "cpu"])
    assert rc == 2 and "Traceback" not in err and "internal error" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "out_offset writes [1000000000" in lines[0]
    assert "kernel#" in lines[0] and "gpu 0's 307200-byte arena" in lines[0]


def test_turnip_verify_reports_the_failed_load_check(plans):
    rc, out, err = call(["verify", str(plans / "bad.tplan")])
    assert rc == 1 and "[load] kernel#" in out and "out_offset" in out


def test_the_verifier_refuses_a_racy_plan_unless_told_not_to(plans):
    rc, out, err = call(["run", str(plans / "racy.tplan"), "--backend", "cpu", "--repeat", "1", "--warmup", "0"])
    assert rc == 2 and "not safe to run" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    rc, out, err = call(["run", str(plans / "racy.tplan"), "--backend", "cpu", "--repeat", "1", "--warmup", "0",
                         "--no-verify"])  # fmt: skip
    assert rc == 0, err  # it runs (its numbers may be wrong: that is what the verifier is for)


def test_a_good_plan_runs_with_and_without_the_verifier(plans):
    for extra in ([], ["--no-verify"]):
        rc, out, err = call(["run", str(plans / "good.tplan"), "--repeat", "1", "--warmup", "0", *extra])
        assert rc == 0 and "time to first token" in out, err
    assert call(["run", "--no-verify"])[0] == 2  # only for plan files


def test_open_backend_cuda_refuses_before_importing_anything_cuda(plans):
    code = f"""
import sys
from turnip.memgraph.io import load_plan
from turnip.runtime import PlanError, open_backend
mg, tg = load_plan({str(plans / "bad.tplan")!r})
try:
    open_backend("cuda", mg)
except PlanError as e:
    assert e.field == "out_offset" and e.v >= 0 and "\\n" not in str(e), e
    bad = [m for m in sys.modules if m.startswith(("numba", "cuda_kernels", "turnip.runtime.cuda", "cupy"))]
    assert not bad, bad
    print("refused", e.label)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("refused kernel#"), r.stderr


def test_good_compiled_plans_pass(plans):
    mg, tg = load_plan(plans / "good.tplan")
    check_plan(mg, tg)
    with open_backend("cpu", mg) as be:
        assert be.guards_intact()


@pytest.mark.parametrize(
    "field, value, what",
    [
        ("kind", 9, "kind 9"),
        ("gpu", 1, "gpu"),
        ("dep_src", -1, "dep_src"),
        ("in_idx", 10**6, "in_idx"),
        ("out_nbytes", 12, "out_nbytes"),
    ],
)
def test_each_field_is_named(plans, field, value, what):
    mg, tg = load_plan(plans / "good.tplan")
    a = getattr(mg, field)
    i = len(a) // 2
    a[i] = value
    with pytest.raises(PlanError) as e:
        check_plan(mg, tg)
    assert what in str(e.value) and "\n" not in str(e.value)


def test_a_cycle_and_bad_params_are_refused(plans):
    mg, tg = load_plan(plans / "good.tplan")
    last = mg.n - 1
    mg.dep_src[mg.dep_ptr[1] - 1 if mg.dep_ptr[1] else 0] = last  # vertex 0 or 1 now waits on the last one
    if mg.dep_ptr[1] == 0:
        v = int(np.flatnonzero(np.diff(mg.dep_ptr))[0])
        mg.dep_src[mg.dep_ptr[v]] = last
    with pytest.raises(PlanError, match="cycle"):
        check_plan(mg, tg)
    mg, tg = load_plan(plans / "good.tplan")
    v = next(v for v in range(mg.n) if mg.op[v] == "einsum")
    mg.params[v]["scale"] = "0.5"
    with pytest.raises(PlanError, match="scale"):
        check_plan(mg)
    mg.params[v]["scale"] = 0.5 if tg.params[mg.tg_vertex[v]].get("scale") != 0.5 else 0.25
    check_plan(mg)  # well typed, but not what the taskgraph says
    with pytest.raises(PlanError, match="differs from taskgraph vertex"):
        check_plan(mg, tg)


def test_an_offload_of_another_tensors_buffer_is_caught_by_both():
    """Found by the fuzz test: an offload reading a same-shaped buffer of another tensor passed both."""
    from turnip.memgraph.plan import KIND_OFFLOAD

    tg, mg = compile_model("llama-tiny", seq=16, dtype="fp32", n_layers=1, budget="40KiB", workspace="0")
    v = int(np.flatnonzero(mg.kind == KIND_OFFLOAD)[0])
    i = int(mg.in_ptr[v])
    mg.in_idx[i] = next(b for b in range(v) if mg.shape[b] == mg.shape[mg.in_idx[i]] and mg.tensor[b] != mg.tensor[v])
    assert any("offloads a buffer of another tensor" in str(x) for x in verify(mg, tg))
    with pytest.raises(PlanError, match="not its own tensor"):
        check_plan(mg)


def test_adam_decay_rates_outside_zero_to_one_are_refused():
    """b1, b2 in [0, 1) and eps >= 0: outside, Adam's bias corrections divide by zero or take a square root
    of a negative number (NaN parameters after one step)."""
    from turnip.compile import compile_model
    from turnip.train import LoraConfig, TrainSpec

    tg, mg = compile_model("llama-tiny", seq=16, budget="64MiB", dtype="fp32",
                           train=TrainSpec(1, LoraConfig(2), "off"))  # fmt: skip
    check_plan(mg, tg)
    v = next(v for v in range(mg.n) if mg.op[v] == "adam_p")
    for key, bad in (("b2", 1.5), ("b1", -0.1), ("b2", 1.0), ("eps", -1e-8)):
        good = mg.params[v][key]
        mg.params[v][key] = bad
        with pytest.raises(PlanError, match=key):
            check_plan(mg)
        mg.params[v][key] = good
