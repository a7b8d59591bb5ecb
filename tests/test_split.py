"""The layers split: decoder layers in contiguous stages over GPUs, placed by each node's layer; it computes
what the tensor split computes; ``auto`` keeps the plan with the smaller predicted makespan."""

import re

import numpy as np
import pytest

from tests.test_split_data import assert_same_step
from turnip.compile import build_with_resident, compile_model, estimate, make_taskgraph, pipeline_order
from turnip.memgraph.interp import assemble, evaluate_taskgraph
from turnip.memgraph.plan import KIND_TRANSFER
from turnip.memgraph.verify import verify
from turnip.models import LLAMA, llama_prefill
from turnip.runtime import execute, open_backend
from turnip.runtime.weights import random_inputs_for, tile_inputs
from turnip.train import lora_step

pytestmark = pytest.mark.unit
LAYER = re.compile(r"^d*L(\d+)\.")


def expected_gpu(name: str, n_layers: int, n_gpus: int) -> int:
    """Where the layers split puts a vertex, from its name: layer i's (forward, backward ``d...``, recomputed
    ``...'``, adapters and their updates) on GPU i * n_gpus // n_layers; the gradient of a layer's output
    ``dL{i}.x2`` is summed by the next layer, its reader; the prompt and the Adam step number on GPU 0; the
    rest (final norm, LM head, loss, targets) on the last."""
    m = LAYER.match(name)
    if m:
        i = int(m.group(1)) + (name.startswith(f"dL{m.group(1)}.x2[") and "/" not in name)
        return min(i, n_layers - 1) * n_gpus // n_layers
    return 0 if name.startswith(("x0", "adam_step")) else n_gpus - 1


def check_placement(tg, n_layers: int) -> None:
    G = tg.n_gpus
    for v in range(tg.n):
        if tg.kind[v] == KIND_TRANSFER:  # only the hidden state (and its gradient) and the step number move
            assert re.match(r"^d?L\d+\.x2\[|^adam_step", tg.name[v]), tg.name[v]
            continue
        assert tg.gpu[v] == expected_gpu(tg.name[v], n_layers, G), (tg.name[v], int(tg.gpu[v]))


def run_cpu(tg, mg, values, seed: int = 0) -> dict:
    with open_backend("cpu", mg, 3, chaos=0.2, chaos_max_s=0.0002, poison=True) as be:
        be.write_inputs(values)
        execute(mg, be, "nondet", 3, seed=seed)
        return be.read_outputs()


@pytest.mark.parametrize("head", ["none", "last"])
def test_layers_split_prefill_places_layers_and_matches_the_tensor_split(head):
    tg = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", head=head, split="layers")
    check_placement(tg, 2)
    assert tg.meta["split"] == "layers" and (tg.kind == KIND_TRANSFER).sum() == 32 // tg.meta["tiles"]["t"]
    mg = build_with_resident(tg, 48 * 1024, None, "0")
    assert mg.stats["n_offload"] > 0 and mg.stats["n_pipeline_edges"] > 0
    assert verify(mg, tg) == []
    logical = random_inputs_for(tg, seed=3)
    out = run_cpu(tg, mg, tile_inputs(tg, logical))
    ref = evaluate_taskgraph(tg, tile_inputs(tg, logical))
    name = "out" if head == "none" else "logits"
    got = assemble(tg, out, name)
    np.testing.assert_allclose(got, assemble(tg, ref, name), rtol=1e-5, atol=1e-6)
    tt = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", head=head, split="tensor")
    want = assemble(tt, evaluate_taskgraph(tt, tile_inputs(tt, logical)), name)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_layers_split_training_step_places_every_vertex_and_matches_one_gpu():
    """Every vertex of a 2-layer LoRA step (forward, recomputed forward, backward, adapters, Adam) on its
    layer's GPU; the loss and adapter gradients equal the one-GPU step's."""
    cfg = LLAMA["tiny"]
    one = lora_step(cfg, seq=16, batch=2, n_gpus=1, dtype="fp32", checkpoint="on")
    two = lora_step(cfg, seq=16, batch=2, n_gpus=2, dtype="fp32", checkpoint="on", split="layers")
    check_placement(two, 2)
    assert any(n.endswith("'[0, 0]") for n in two.name) and any(n.startswith("dL0.") for n in two.name)
    assert_same_step([one, two], cfg, 2, 1 << 20)


def test_pipeline_order_is_topological_and_tile_major():
    tg = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", split="layers")
    order = pipeline_order(tg)
    pos = np.empty(tg.n, dtype=np.int64)
    pos[list(order)] = np.arange(tg.n)
    assert sorted(order) == list(range(tg.n))
    assert all(pos[d] < pos[v] for v in range(tg.n) for d in tg.deps(v))
    last = tg.name.index("L1.x2[0, 0]")  # token tile 0 leaves the last layer before tile 1 enters the first
    assert pos[last] < pos[tg.name.index("L0.h[1, 0]")]


def test_layers_split_needs_as_many_layers_as_gpus():
    with pytest.raises(ValueError, match="1 layer cannot fill 2 GPUs"):
        llama_prefill("tiny", seq=32, n_gpus=2, n_layers=1, split="layers")
    from turnip.compile import split_candidates

    assert split_candidates("llama-tiny", 2, "auto", n_layers=1) == ["tensor", "data"]
    assert split_candidates("llama-tiny", 1, "auto") == ["tensor"]
    assert split_candidates("llama-tiny", 2, "auto") == ["tensor", "layers", "data"]


@pytest.mark.parametrize("slower", ["tensor", "layers", "data"])
def test_auto_keeps_the_plan_predicted_faster(monkeypatch, slower):
    import turnip.compile as tc

    real = tc.predict_ms
    seen = {}

    def predict(mg, prof):  # called once per split, in split_candidates' order
        ms = real(mg, prof)
        split = ("tensor", "layers", "data")[len(seen)]
        seen[split] = ms
        return ms * (10.0 if split == slower else 1.0)

    monkeypatch.setattr(tc, "predict_ms", predict)
    tg, mg = compile_model("llama-tiny", 32, 2, 1 << 20, dtype="fp32", split="auto")
    pred = tg.meta["split_predicted_ms"]
    assert set(pred) == set(seen) == {"tensor", "layers", "data"}
    assert tg.meta["split"] != slower and pred[tg.meta["split"]] == min(pred.values())
    assert tg.meta["split_profile"] == "h100-calibrated"


def test_cli_prints_both_predictions_and_the_plan_keeps_the_split(tmp_path, capsys):
    from turnip.cli import main
    from turnip.memgraph.io import load_plan

    plan = tmp_path / "p.tplan"
    argv = ["compile", "--model", "llama-tiny", "--seq", "32", "--gpus", "2", "--budget", "1MiB", "--dtype", "fp32"]
    assert main([*argv, "-o", str(plan)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("split"))
    m = re.search(r"split\s+(\w+) \(predicted ([\d.]+) ms; (\w+) ([\d.]+) ms; (\w+) ([\d.]+) ms, on h100-calib", line)
    assert m and {m.group(1), m.group(3), m.group(5)} == {"tensor", "layers", "data"}, line
    assert float(m.group(2)) <= min(float(m.group(4)), float(m.group(6))), line
    tg = load_plan(str(plan))[1]
    assert tg.meta["split"] == m.group(1) and set(tg.meta["split_predicted_ms"]) == {"tensor", "layers", "data"}
    assert main([*argv, "--split", "layers", "--layers", "1"]) == 2
    assert "1 layer cannot fill 2 GPUs" in capsys.readouterr().err
    assert main(["run", str(plan), "--split", "tensor"]) == 2
    assert "--split" in capsys.readouterr().err


def test_7b_layers_split_has_fewer_vertices_than_the_tensor_split_on_4_gpus():
    """Counted without building (exact for a prefill; the estimate is checked against a lowering), and a
    4-layer LoRA step lowered."""
    kw = {"budget_nbytes": 6 << 30}
    t, l4 = (estimate("llama-7b", 16384, 4, split=s, **kw).vertices for s in ("tensor", "layers"))
    assert l4 < t
    tg = make_taskgraph("llama-7b", 4096, 4, n_layers=4, split="layers", fold=False, **kw)
    assert estimate("llama-7b", 4096, 4, n_layers=4, split="layers", **kw).vertices == tg.n
    from turnip.train import TrainSpec

    t, l4 = (make_taskgraph("llama-7b", 1024, 4, n_layers=4, train=TrainSpec(4), split=s, **kw).n
             for s in ("tensor", "layers"))  # fmt: skip
    assert l4 < t / 2


def test_compile_model_prefills_a_batch():
    """``compile_model(batch=B)``: B prompts of ``seq`` tokens in one plan, as `turnip compile --batch` builds."""
    from turnip.compile import compile_model
    from turnip.memgraph.verify import verify

    tg, mg = compile_model("llama-tiny", seq=64, gpus=2, budget="64MiB", batch=3)
    assert tg.meta["batch"] == 3 and verify(mg, tg) == []
    assert tg.meta["output_blocks"]["out"][0] == (3 * 64, 64)


def test_spread_token_tile_gives_every_gpu_a_token_tile_where_the_default_does_not():
    from turnip.models import SPREAD_MIN_TILE, default_tiles, spread_token_tile

    s, b = LLAMA["65b"], 30 << 30
    assert default_tiles(s, 16384, 4, "fp16", b)["t"] == 8192  # two token tiles for four GPUs
    assert spread_token_tile(s, 16384, 4, "fp16", b) == 4096
    assert spread_token_tile(s, 16384, 2, "fp16", b) is None  # two tiles for two GPUs already
    assert spread_token_tile(s, 32768, 4, "fp16", b) is None
    assert spread_token_tile(s, 8192, 4, "fp16", b) is None  # 2048 would be below SPREAD_MIN_TILE
    assert SPREAD_MIN_TILE == 4096
    assert spread_token_tile(s, 16384, 4, "fp16", b, {"t": 8192}) is None  # a given tile stays
    assert spread_token_tile(s, 16384, 1, "fp16", b) is None


@pytest.mark.parametrize("slower", ["tensor", "tensor t=16"])
def test_tile_choice_builds_the_spread_tile_too_and_keeps_the_plan_predicted_faster(monkeypatch, slower):
    """Each way round, one plan predicted ten times slower: the other is kept."""
    import turnip.compile as tc
    from turnip.cli.compile_cmds import split_line, split_summary

    monkeypatch.setattr(tc, "spread_token_tile", lambda cfg, seq, gpus, *a: seq // 2)  # tiny models have none
    monkeypatch.setenv("TURNIP_TILE_CHOICE", "0")
    assert tc.split_candidates("llama-tiny", 2, "tensor", seq=32) == ["tensor"]
    monkeypatch.delenv("TURNIP_TILE_CHOICE")
    assert tc.split_candidates("llama-tiny", 2, "tensor", seq=32) == ["tensor", "tensor t=16"]
    assert tc.split_candidates("llama-tiny", 2, "tensor", seq=32, batch=2) == ["tensor"]
    assert tc.split_candidates("llama-tiny", 2, "tensor", train=True, seq=32) == ["tensor"]
    assert tc.candidate("tensor t=16") == ("tensor", {"t": 16}) and tc.candidate("data") == ("data", None)
    assert tc.candidate("tensor t=16", {"h": 2, "t": 8}) == ("tensor", {"h": 2, "t": 16})
    assert tc.candidate("data", {"h": 2}) == ("data", {"h": 2})
    real, seen = tc.predict_ms, []

    def predict(mg, prof):
        seen.append(mg)
        return real(mg, prof) * (10.0 if ("tensor", "tensor t=16")[len(seen) - 1] == slower else 1.0)

    monkeypatch.setattr(tc, "predict_ms", predict)
    tg, mg = compile_model("llama-tiny", 32, 2, 1 << 20, dtype="fp32", split="tensor")
    verify(mg)
    keep = "tensor t=16" if slower == "tensor" else "tensor"
    assert tg.meta["split_choice"] == keep and tg.meta["split"] == "tensor"
    assert set(tg.meta["split_predicted_ms"]) == {"tensor", "tensor t=16"}
    assert seen[0].n != seen[1].n and mg is seen[("tensor", "tensor t=16").index(keep)]  # tiles of 16 tokens, not 8
    assert split_line(split_summary(tg)).startswith(f"{keep} (predicted ")


@pytest.mark.parametrize("faster, keep", [(0.97, "tensor"), (0.94, "tensor t=16")])
def test_the_spread_tile_is_kept_only_where_predicted_the_margin_faster(monkeypatch, faster, keep):
    import turnip.compile as tc

    monkeypatch.setattr(tc, "spread_token_tile", lambda cfg, seq, gpus, *a: seq // 2)
    spread = tc.compile_model("llama-tiny", 32, 2, 1 << 20, dtype="fp32", split="tensor", tiles={"t": 16})[1].n
    monkeypatch.setattr(tc, "predict_ms", lambda mg, prof: 100.0 * (faster if mg.n == spread else 1.0))
    tg, mg = tc.compile_model("llama-tiny", 32, 2, 1 << 20, dtype="fp32", split="tensor")
    verify(mg)
    assert tg.meta["split_choice"] == keep and tc.TILE_CHOICE_MARGIN == 0.05
    from turnip.cli.compile_cmds import split_line, split_summary

    note = "tensor t=16 97.0 ms (not kept: less than 5% faster)"
    assert (note in split_line(split_summary(tg))) == (keep == "tensor")
