"""Mutated plans on the CPU backend: each is refused at load (``PlanError``, one line), refused by the
verifier, or runs and gives the original plan's outputs; none raises anything else or writes outside its
arenas (the CPU backend's guard regions stay intact). Mutations are made in memory; every tenth goes
through the file format (``save_plan``/``load_plan``, checksum recomputed) and must meet the same fate."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnip.compile import compile_model
from turnip.memgraph.interp import random_inputs
from turnip.memgraph.io import load_plan, save_plan
from turnip.memgraph.plan import KIND_INPUT, KIND_OFFLOAD, KIND_RELOAD
from turnip.memgraph.verify import verify
from turnip.ops import OPS
from turnip.runtime import PlanError, execute, open_backend
from turnip.runtime.plancheck import check_plan
from turnip.train import TrainSpec

pytestmark = [pytest.mark.property, pytest.mark.cpu_runtime]

PLANS = {
    "prefill-1gpu": dict(gpus=1, budget="1MiB"),
    "prefill-2gpu": dict(gpus=2, budget="1MiB"),
    "offload": dict(gpus=1, budget="40KiB", workspace="0"),
    "lora": dict(gpus=1, budget="2MiB", train=TrainSpec(batch=1)),
}
EXAMPLES = int(os.environ.get("TURNIP_FUZZ_EXAMPLES", 500))  # per plan
ARRAYS = ("kind", "gpu", "src_gpu", "tensor", "tg_vertex", "out_offset", "out_nbytes", "host_offset", "in_ptr",
          "in_idx", "dep_ptr", "dep_src", "dep_kind", "lock_group", "flops", "outputs", "budget_nbytes")  # fmt: skip
OUTCOMES: Counter = Counter()


@dataclasses.dataclass
class Case:
    tg: object
    mg: object
    inputs: dict
    outputs: dict


_CASES: dict[str, Case] = {}


def case(name: str) -> Case:
    if name not in _CASES:
        tg, mg = compile_model("llama-tiny", seq=16, dtype="fp32", n_layers=1, **PLANS[name])
        assert verify(mg, tg) == []
        inputs = random_inputs(tg, np.random.default_rng(0))
        for v, x in inputs.items():  # Adam's second moments are never negative (else the step's sqrt is NaN)
            if tg.name[v].split("[")[0].endswith(".v"):
                inputs[v] = np.abs(x)
        _CASES[name] = Case(tg, mg, inputs, run(mg, inputs))
    return _CASES[name]


def run(mg, inputs) -> dict:
    with open_backend("cpu", mg, 2) as be:
        be.write_inputs(inputs)
        execute(mg, be, "nondet", 2, seed=0, stall_s=10.0)
        outs = be.read_outputs()
        assert be.guards_intact(), "a run wrote outside its arenas"
    return outs


def clone(mg, tg):
    mg2 = dataclasses.replace(mg, **{k: getattr(mg, k).copy() for k in ARRAYS}, op=list(mg.op),
                              params=[dict(p) for p in mg.params], shape=list(mg.shape), dtype=list(mg.dtype),
                              stats=dict(mg.stats), _succ=None)  # fmt: skip
    tg2 = dataclasses.replace(tg, params=[dict(p) for p in tg.params], shape=list(tg.shape),
                              is_output=tg.is_output.copy(), op=list(tg.op))  # fmt: skip
    return mg2, tg2


def _set(a: np.ndarray, i: int, x) -> None:
    if a.dtype.kind in "iu":
        info = np.iinfo(a.dtype)
        x = int(min(max(int(x), info.min), info.max))
    a[i] = x


def mutate(data, mg, tg) -> str:
    """Change one thing of ``mg`` (or ``tg``) in place; returns what, for the failure message."""
    n = mg.n
    draw = data.draw
    field = draw(st.sampled_from(["out_offset", "out_offset", "out_nbytes", "host_offset", "kind", "gpu", "src_gpu",
                                  "tensor", "tg_vertex", "in_idx", "in_ptr", "dep_src", "dep_ptr", "dep_kind",
                                  "lock_group", "outputs", "flops", "budget_nbytes", "n_gpus", "host_nbytes",
                                  "stats", "op", "params", "params", "shape", "dtype", "tg.params", "tg.shape",
                                  "tg.is_output", "array_dtype"]))  # fmt: skip
    if field == "n_gpus":
        mg.n_gpus = draw(st.sampled_from([0, 1, 2, 3, 65]))
        return f"n_gpus={mg.n_gpus}"
    if field == "host_nbytes":
        mg.host_nbytes = draw(st.sampled_from([0, mg.host_nbytes // 2, mg.host_nbytes + 256, -1]))
        return f"host_nbytes={mg.host_nbytes}"
    if field == "stats":
        k = draw(st.sampled_from(["host_input_nbytes", "workspace_slot_nbytes", "workspace_slots"]))
        mg.stats[k] = draw(st.sampled_from([0, 1, 256, 4096, 1 << 20, -5, 2.5, "x", mg.stats.get(k, 0) // 2]))
        return f"stats[{k}]={mg.stats[k]!r}"
    if field == "array_dtype":
        k = draw(st.sampled_from(ARRAYS))
        setattr(mg, k, getattr(mg, k).astype(draw(st.sampled_from([np.float64, np.int64, np.int16]))))
        return f"{k} as {getattr(mg, k).dtype}"
    if field.startswith("tg."):
        t = draw(st.integers(0, tg.n - 1))
        if field == "tg.params":
            tg.params[t] = {**tg.params[t], draw(st.sampled_from(["scale", "eps", "causal", "x"])): 0.5}
        elif field == "tg.shape":
            tg.shape[t] = (*tg.shape[t][:-1], tg.shape[t][-1] * 2)
        else:
            tg.is_output[t] = not tg.is_output[t]
        return f"{field}[{t}]"
    if field in ("op", "params", "shape", "dtype"):
        v = draw(st.integers(0, n - 1))
        if field == "op":
            mg.op[v] = draw(st.sampled_from([*sorted(OPS), "nope", 3]))
        elif field == "params":
            p = mg.params[v]
            keys = sorted(p) or ["scale"]
            k = draw(st.sampled_from([*keys, "scale", "tk", "causal", "subscripts", "tail", "itemsize"]))
            x = draw(st.sampled_from([None, 0, -1, 1, 2, 0.5, float("nan"), "ab,bc->ac", [1, 2], True, "x"]))
            if draw(st.booleans()) and k in p:
                del p[k]
            else:
                p[k] = x
        elif field == "shape":
            s = list(mg.shape[v]) or [1]
            i = draw(st.integers(0, len(s) - 1))
            s[i] = draw(st.sampled_from([0, 1, 2 * s[i], s[i] + 1, -s[i], "8"]))
            mg.shape[v] = tuple(s)
        else:
            mg.dtype[v] = draw(st.sampled_from(["fp16", "bf16", "fp32", "int32", "fp64", None]))
        return f"{field}[{v}]={getattr(mg, field)[v]!r}"
    a = getattr(mg, field)
    if len(a) == 0:
        return "nothing"
    i = draw(st.integers(0, len(a) - 1))
    old = int(a[i]) if a.dtype.kind in "iu" else float(a[i])
    if field == "out_offset" or field == "host_offset":
        cands = [0, old + 256, old - 256, old + 4, -1, 10**9, int(mg.budget_nbytes.max()), int(a.max())]
        x = draw(st.sampled_from(cands + [int(a[draw(st.integers(0, n - 1))])]))
    elif field == "flops":
        x = draw(st.sampled_from([0.0, old * 2, -1.0, float("nan"), float("inf")]))
    elif field == "budget_nbytes":
        x = draw(st.sampled_from([old // 2, old - 4096, old + 4096, 0, old * 2]))
    else:
        x = draw(st.sampled_from([old + 1, old - 1, -1, 0, n, n - 1, 1 << 30, draw(st.integers(-2, n + 2))]))
    _set(a, i, x)
    return f"{field}[{i}]: {old} -> {a[i]}"


def outcome(mg, tg) -> str:
    """'load' (refused by the load checks), 'verify' (by the verifier) or 'ok'."""
    try:
        check_plan(mg, tg)
    except PlanError as e:
        assert "\n" not in str(e) and str(e)
        return "load"
    return "verify" if verify(mg, tg) else "ok"


@pytest.mark.parametrize("name", list(PLANS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(data=st.data())
def test_a_mutated_plan_is_refused_or_runs_as_before(name, data, tmp_path):
    c = case(name)
    mg, tg = clone(c.mg, c.tg)
    what = mutate(data, mg, tg)
    got = outcome(mg, tg)
    if sum(OUTCOMES[k] for k in ("load", "verify", "ok")) % 10 == 0:
        path = tmp_path / "m.tplan"
        save_plan(path, mg, tg)
        mg, tg = load_plan(path)
        assert outcome(mg, tg) == got, what
        OUTCOMES["through a file"] += 1
    OUTCOMES[got] += 1
    if got == "ok":
        outs = run(mg, c.inputs)
        assert outs.keys() == c.outputs.keys(), what
        for t, x in outs.items():
            np.testing.assert_allclose(x, c.outputs[t], rtol=1e-6, atol=1e-6, err_msg=what)


def test_the_fuzz_outcomes(capsys):
    """Prints the counts of outcomes (run after the fuzz tests above, in this module)."""
    if not OUTCOMES:
        pytest.skip("the fuzz tests did not run")
    total = OUTCOMES["load"] + OUTCOMES["verify"] + OUTCOMES["ok"]
    with capsys.disabled():
        print(f"\nplan fuzz: {total} mutations: {OUTCOMES['load']} refused at load, {OUTCOMES['verify']} refused by "
              f"the verifier, {OUTCOMES['ok']} ran as before ({OUTCOMES['through a file']} through a plan file)")
    assert OUTCOMES["load"] and OUTCOMES["ok"]


def test_host_kinds_cover_the_plans():
    """The offloading plan has offloads and reloads and the 2-GPU plan transfers, so both are fuzzed."""
    off, two = case("offload").mg, case("prefill-2gpu").mg
    assert (off.kind == KIND_OFFLOAD).any() and (off.kind == KIND_RELOAD).any() and (off.kind == KIND_INPUT).any()
    assert (two.src_gpu != two.gpu).any()
