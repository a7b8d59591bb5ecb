"""Sums folded into einsums (``turnip.fuse``): fewer vertices, the same values, plans that verify and run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_train import _step_inputs
from turnip.compile import FOLD_SWITCH, build_with_resident, compiler_fingerprint, make_taskgraph
from turnip.fuse import fold_adds
from turnip.memgraph.interp import evaluate_taskgraph
from turnip.memgraph.verify import verify
from turnip.models import LLAMA, llama_prefill
from turnip.runtime import execute, open_backend
from turnip.runtime.weights import random_inputs_for, tile_inputs
from turnip.taskgraph import Builder
from turnip.train import lora_step


def _named(tg, values: dict) -> dict:
    return {tg.name[t]: x for t, x in values.items() if tg.is_output[t]}


def _run_cpu(tg, mg, values: dict, seeds=range(3)) -> list[dict]:
    outs = []
    with open_backend("cpu", mg, 3, chaos=0.3, chaos_max_s=0.0003, poison=True) as be:
        be.write_inputs(values)
        for seed in seeds:
            execute(mg, be, "nondet", 3, seed=seed)
            outs.append(_named(tg, be.read_outputs()))
    return outs


@pytest.mark.parametrize("n_gpus,split", [(1, "tensor"), (2, "tensor"), (2, "layers")])
def test_folded_training_step_runs_and_matches_the_unfolded_one(n_gpus, split):
    cfg = LLAMA["tiny-gqa"]
    tg = lora_step(cfg, seq=16, batch=2 * n_gpus, n_gpus=n_gpus, dtype="fp32", checkpoint="on", split=split,
                   tiles={"t": 16})  # a sequence per tile: the budget below offloads
    ft = fold_adds(tg)
    ft.validate()
    assert ft.n < 0.9 * tg.n
    assert ft.op.count("add_n") < tg.op.count("add_n") / 2
    if split == "layers" or n_gpus == 1:  # every adapter gradient sums on one GPU: chains, no sum_into left
        assert ft.op.count("sum_into") == 0 < tg.op.count("sum_into")
    else:  # sequences on both GPUs: their partial sums cross GPUs and stay sum_into
        assert 0 < ft.op.count("sum_into") < tg.op.count("sum_into")
    assert any(ft.op[v] == "einsum" and len(ft.args(v)) == 3 for v in range(ft.n))
    mg = build_with_resident(ft, 96 * 1024, None, "0")
    assert mg.stats["n_offload"] > 0
    assert not verify(mg, ft)
    logical, *_ = _step_inputs(tg, cfg, batch=2 * n_gpus)
    ref = _named(tg, evaluate_taskgraph(tg, tile_inputs(tg, logical)))
    runs = _run_cpu(ft, mg, tile_inputs(ft, logical))
    for out in runs:
        assert out.keys() == ref.keys()
        for name, x in out.items():
            # the sums' order changes: fp32 rounding, which Adam's first step (m / sqrt(v)) magnifies
            tol = 1e-4 if ".new" in name else 1e-5
            np.testing.assert_allclose(x, ref[name], rtol=tol, atol=tol * np.abs(ref[name]).max(), err_msg=name)
    for out in runs[1:]:  # the chains fix the order of every sum folded: bitwise equal across runs
        for name, x in out.items():
            if not name.startswith("loss"):
                np.testing.assert_array_equal(x, runs[0][name], err_msg=name)


def test_folded_prefill_matches_and_loses_its_residual_adds():
    tg = llama_prefill(LLAMA["tiny"], seq=32, n_gpus=1, dtype="fp32", n_layers=2)
    ft = fold_adds(tg)
    assert ft.op.count("add_n") < tg.op.count("add_n") and ft.n < tg.n
    mg = build_with_resident(ft, 64 * 1024, None, "0")
    assert not verify(mg, ft)
    logical = random_inputs_for(tg, seed=3)
    ref = _named(tg, evaluate_taskgraph(tg, tile_inputs(tg, logical)))
    (out,) = _run_cpu(ft, mg, tile_inputs(ft, logical), seeds=[0])
    for name, x in out.items():
        np.testing.assert_allclose(x, ref[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _toy():
    """add_n(e1, x, e2) with e1, e2 foldable; add_n(e3, z) with e3 read twice; e4 on another GPU; add_n(e5, x, y)
    (two other terms: nothing saved)."""
    b = Builder(2)
    a, w, x, y, z = (b.input((4, 4), "fp32", 0, name=n) for n in "awxyz")
    e = {i: b.kernel("einsum", [a, w], (4, 4), "fp32", 0, {"subscripts": "ij,jk->ik"}, name=f"e{i}") for i in (1, 2, 3)}
    w1 = b.input((4, 4), "fp32", 1, name="w1")
    e4 = b.kernel("einsum", [b.transfer(a, 1), w1], (4, 4), "fp32", 1, {"subscripts": "ij,jk->ik"}, name="e4")
    s1 = b.kernel("add_n", [e[1], x, e[2]], (4, 4), "fp32", 0, name="s1")
    e5 = b.kernel("einsum", [a, w], (4, 4), "fp32", 0, {"subscripts": "ij,jk->ik"}, name="e5")
    s5 = b.kernel("add_n", [e5, x, y], (4, 4), "fp32", 0, name="s5")
    s2 = b.kernel("add_n", [e[3], z], (4, 4), "fp32", 0, name="s2")
    s3 = b.kernel("mul", [e[3], s2], (4, 4), "fp32", 0, name="s3")
    s4 = b.kernel("add_n", [b.transfer(e4, 0), s1], (4, 4), "fp32", 0, name="s4")
    return b.build(outputs=[s1, s3, s4, s5])


def test_fold_rules_on_a_small_graph():
    tg = _toy()
    ft = fold_adds(tg)
    ft.validate()
    names = {ft.name[v]: v for v in range(ft.n)}
    # s1: x starts the chain, e1 and e2 add onto it; the chain's end keeps the add's name
    assert ft.op[names["s1"]] == "einsum" and len(ft.args(names["s1"])) == 3
    assert "e1" not in names and "e2" not in names
    assert ft.op[names["s5"]] == "add_n" and "e5" in names
    # e3 is read twice and e4 lives on another GPU: their adds stay
    assert ft.op[names["s2"]] == "add_n" and ft.op[names["s4"]] == "add_n"
    assert ft.n == tg.n - 1
    rng = np.random.default_rng(0)
    values = {v: rng.standard_normal(tg.shape[v]).astype(np.float32) for v in range(tg.n) if tg.op[v] == "input"}
    ref = _named(tg, evaluate_taskgraph(tg, values))
    fvalues = {names[tg.name[v]]: x for v, x in values.items()}
    got = _named(ft, evaluate_taskgraph(ft, fvalues))
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-6)


def test_nothing_to_fold_returns_the_graph_itself():
    b = Builder(1)
    a = b.input((2, 2), "fp32", 0)
    tg = b.build(outputs=[b.kernel("add_n", [a, a], (2, 2), "fp32", 0)])
    assert fold_adds(tg) is tg


def test_the_switch_folds_in_make_taskgraph_and_changes_the_fingerprint(monkeypatch):
    """Folding is on by default; ``TURNIP_FOLD_ADDS=0`` or ``fold=False`` keeps the sums."""
    monkeypatch.delenv(FOLD_SWITCH, raising=False)
    folded, fp = make_taskgraph("llama-tiny", 32, n_layers=2), compiler_fingerprint()
    monkeypatch.setenv(FOLD_SWITCH, "0")
    plain = make_taskgraph("llama-tiny", 32, n_layers=2)
    assert compiler_fingerprint() != fp  # read at each call: a switch set later still counts
    assert folded.n < plain.n == make_taskgraph("llama-tiny", 32, n_layers=2, fold=False).n
