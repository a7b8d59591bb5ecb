"""The data split of a training step: each GPU its share of the sequences, every GPU loading the frozen
weights it reads from the host (replica inputs), the adapters and their updates on GPU 0; it computes what one
GPU computes, and ``auto`` weighs it against the tensor and layers splits."""

from collections import Counter

import numpy as np
import pytest

from turnip.compile import build_with_resident, compile_model, split_candidates
from turnip.memgraph.interp import assemble
from turnip.memgraph.plan import KIND_INPUT, KIND_KERNEL, KIND_TRANSFER
from turnip.memgraph.verify import verify
from turnip.models import LLAMA, llama_prefill
from turnip.runtime import execute, open_backend
from turnip.runtime.weights import random_inputs_for, tile_inputs
from turnip.train import AdapterState, TrainSpec, lora_step, next_token_targets, state_names

pytestmark = pytest.mark.unit


def run_cpu(mg, values, seed: int = 0) -> dict:
    with open_backend("cpu", mg, 3, chaos=0.2, chaos_max_s=0.0002, poison=True) as be:
        be.write_inputs(values)
        execute(mg, be, "nondet", 3, seed=seed)
        return be.read_outputs()


def test_data_split_places_sequences_and_replicates_frozen_weights():
    cfg = LLAMA["tiny"]
    tg = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp32", checkpoint="on", split="data", tiles={"t": 16})
    assert tg.meta["split"] == "data"
    lg = tg.meta["input_blocks"]
    state = {i for _, i in state_names(tg)}
    for name, (_shape, blocks) in lg.items():
        gpus = sorted(int(tg.gpu[v]) for _, v in blocks)
        if name in ("x0", "targets"):  # a block per sequence, sequences round-robin
            assert gpus == [0, 0, 1, 1], name
        elif name in state or name == "adam_step":
            assert set(gpus) == {0}, name  # the state stays on GPU 0, once
        else:  # a frozen weight: each block on both GPUs, the second a replica with the same starts
            assert len(blocks) % 2 == 0 and gpus.count(0) == gpus.count(1), (name, gpus)
            starts = sorted(tuple(st) for st, _ in blocks)
            assert starts[::2] == starts[1::2], name
    moved = {tg.name[int(tg.args(v)[0])] for v in np.flatnonzero(tg.kind == KIND_TRANSFER)}
    frozen = {tg.name[v] for v in np.flatnonzero(tg.kind == KIND_INPUT)} - moved
    assert not any(n.startswith(("L0.wq", "L0.w1", "lm_head")) for n in moved), sorted(moved)[:5]
    assert any(n.startswith("L0.wq") and n.endswith("@gpu1") for n in frozen)
    for v in range(tg.n):  # every vertex of sequence s on GPU s % 2 (its name's first block index is the token tile)
        if tg.kind[v] not in (KIND_TRANSFER, KIND_INPUT) and tg.name[v].startswith(("L1.h[", "dL1.h[")):
            assert int(tg.gpu[v]) == int(tg.name[v].split("[")[1].split(",")[0].rstrip("]")) % 2, tg.name[v]


def assert_same_step(plans, cfg, batch: int, budget: int, offloads=()) -> None:
    """Every plan of ``plans`` (training steps of ``batch`` sequences of 16 tokens of ``cfg``) verifies under
    ``budget`` and gives the first plan's loss, adapter gradients and new adapters on the CPU backend with
    chaos; the plans in ``offloads`` offload or reload something."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab, size=(batch, 16))
    state = AdapterState.init(plans[0], seed=2, b_std=0.1)
    logical = random_inputs_for(plans[0], seed=1) | state.inputs() | {"targets": next_token_targets(ids)}
    results = []
    for tg in plans:
        mg = build_with_resident(tg, budget, None, "0")
        assert verify(mg, tg) == []
        if any(tg is o for o in offloads):
            assert mg.stats["n_offload"] + mg.stats["n_reload"] > 0
        out = run_cpu(mg, tile_inputs(tg, logical))
        results.append({k: assemble(tg, out, k) for k in tg.meta["output_blocks"]})
    for b in results[1:]:
        assert set(b) == set(results[0])
        for k, a in results[0].items():
            np.testing.assert_allclose(b[k], a, rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("gpus,spread,lean", [(2, "0", "0"), (3, "0", "0"), (2, "1", "0"), (3, "1", "0"),
                                              (2, "0", "1"), (3, "0", "1"), (3, "1", "1")])  # fmt: skip
def test_data_split_training_step_matches_one_gpu(gpus, spread, lean, monkeypatch):
    """Loss, adapter gradients and the new adapters of a data-split step equal the one-GPU step's, under a
    budget that offloads, on the CPU backend with chaos; ``TURNIP_SPREAD_STATE=1``: each layer's adapters,
    their sums and updates on GPU layer % G instead of GPU 0; ``TURNIP_LEAN_STEP=0``: sums across GPUs as
    sum_into chains, the adapters sent where first used (otherwise one add each, sent at the start)."""
    cfg = LLAMA["tiny"]
    one = lora_step(cfg, seq=16, batch=3, n_gpus=1, dtype="fp32", checkpoint="on")
    monkeypatch.setenv("TURNIP_SPREAD_STATE", spread)
    monkeypatch.setenv("TURNIP_LEAN_STEP", lean)
    many = lora_step(cfg, seq=16, batch=3, n_gpus=gpus, dtype="fp32", checkpoint="on", split="data")
    state = {i for _, i in state_names(many)}
    homes = {int(many.gpu[v]) for name, (_, blocks) in many.meta["input_blocks"].items() if name in state
             for _, v in blocks}  # fmt: skip
    assert homes == (set(range(min(gpus, cfg.n_layers))) if spread == "1" else {0}), homes
    assert_same_step([one, many], cfg, 3, 256 << 10, offloads=[many])


def test_lean_step_sends_each_adapter_once_first_and_sums_with_one_add(monkeypatch):
    """The lean step (default; ``TURNIP_LEAN_STEP=0`` turns it off): every transfer of an adapter comes before
    any other kernel, each adapter reaches each other GPU once (the backward reads the forward's cast), every
    gradient is summed across GPUs by one ``add_n`` (no ``sum_into`` left on GPU 0), each update follows its
    sum at once; and a 4-GPU step of a 7B-shaped model has fewer launch units for the host than without it."""
    from turnip.sched.groups import launch_groups

    cfg = LLAMA["tiny"]
    monkeypatch.setenv("TURNIP_LEAN_STEP", "0")
    plain = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp32", checkpoint="on", split="data", tiles={"t": 16})
    plain16 = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp16", checkpoint="on", split="data", tiles={"t": 16})
    monkeypatch.setenv("TURNIP_LEAN_STEP", "1")
    tg = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp32", checkpoint="on", split="data", tiles={"t": 16})
    tg.validate()
    kinds, ops = tg.kind, tg.op
    state = {v for name, (_, blocks) in tg.meta["input_blocks"].items() if ".lora_" in name for _, v in blocks}
    sends = [v for v in range(tg.n) if kinds[v] == KIND_TRANSFER and int(tg.args(v)[0]) in state]
    assert sends and max(sends) < min(v for v in range(tg.n) if kinds[v] == KIND_KERNEL)
    for dtype, want in (("fp16", 1), ("fp32", 1)):  # fp16: the backward reads the forward's casts, sent once
        for p, times in ((lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype=dtype, checkpoint="on", split="data",
                                    tiles={"t": 16}), want),
                         ) + (((plain16, 2),) if dtype == "fp16" else ()):  # fmt: skip
            srcs = [int(p.args(v)[0]) for v in range(p.n) if p.kind[v] == KIND_TRANSFER and ".lora_" in p.name[v]
                    and (p.kind[int(p.args(v)[0])] == KIND_INPUT or p.op[int(p.args(v)[0])] == "cast")]  # fmt: skip
            names = Counter(p.name[s].replace("'", "") for s in srcs)  # a block, its recomputed cast alike
            assert names and set(names.values()) == {times}, (dtype, names)
    grads = {tg.name[v]: v for v in range(tg.n) if tg.name[v].split("[")[0].endswith(".grad")}
    assert grads
    for name, v in grads.items():
        s = int(tg.args(v)[0])
        assert ops[s] == "add_n" and len(tg.args(s)) == 2, name  # GPU 0's term and GPU 1's, moved
        adam = [u for u in range(v + 1, min(v + 8, tg.n)) if ops[u].startswith("adam")]
        assert len(adam) == 3, name  # the update right behind its sum
    assert not any(ops[v] == "sum_into" and tg.gpu[v] == 0 and ".lora_" in tg.name[v] for v in range(tg.n))
    assert_same_step([plain, tg], cfg, 4, 256 << 10, offloads=[tg])
    train = TrainSpec(8)
    units = []
    for lean in ("0", "1"):
        monkeypatch.setenv("TURNIP_LEAN_STEP", lean)
        _, mg = compile_model("llama-7b", 1024, 4, "16GiB", train=train, split="data", n_layers=8, resident="auto")
        gr = launch_groups(mg, wide=True)
        units.append(gr.n_units - int(mg.preloaded().sum()))
    assert units[1] < 0.6 * units[0], units


def test_auto_weighs_the_data_split():
    assert split_candidates("llama-tiny", 2, "auto", train=True) == ["tensor", "layers", "data"]
    assert split_candidates("llama-tiny", 2, "auto") == ["tensor", "layers", "data"]
    assert split_candidates("llama-tiny", 1, "auto", train=True) == ["tensor"]
    tg, mg = compile_model("llama-tiny", 16, 2, 1 << 20, dtype="fp32", split="auto", train=TrainSpec(4))
    assert set(tg.meta["split_predicted_ms"]) == {"tensor", "layers", "data"}
    assert tg.meta["split_predicted_ms"][tg.meta["split"]] == min(tg.meta["split_predicted_ms"].values())
    assert verify(mg, tg) == []


@pytest.mark.parametrize("gpus,split,batch", [(1, "tensor", 4), (2, "data", 4), (2, "layers", 4), (2, "data", 3)])
def test_packed_sequences_compute_what_one_sequence_per_tile_computes(gpus, split, batch):
    """Token tiles of two whole sequences (attention, its backward and rotary each sequence apart; batch 3: the
    last tile holds one): the loss, adapter gradients and new adapters of the one-sequence-per-tile step, with
    fewer vertices."""
    cfg = LLAMA["tiny"]
    plain = lora_step(cfg, seq=16, batch=batch, n_gpus=1, dtype="fp32", checkpoint="on", tiles={"t": 16})
    packed = lora_step(cfg, seq=16, batch=batch, n_gpus=gpus, dtype="fp32", checkpoint="on", split=split,
                       tiles={"t": 32})  # fmt: skip
    assert packed.meta["tiles"]["t"] == 32 and packed.n < plain.n * (1 if gpus == 1 else 1.5)
    ops = [(op, p) for op, p in zip(packed.op, packed.params, strict=True) if op in ("sdpa", "sdpa_bwd", "rotary")]
    assert ops and all(p.get("seq") == 16 for _, p in ops)
    assert_same_step([plain, packed], cfg, batch, 512 << 10)


def test_packing_rule(monkeypatch):
    from turnip.train import pack_sequences

    monkeypatch.setenv("TURNIP_PACK_SEQS", "0")
    assert pack_sequences(1024, 8, 2, "data") == 1
    monkeypatch.setenv("TURNIP_PACK_SEQS", "1")
    assert pack_sequences(1024, 8, 1) == 2 and pack_sequences(1024, 8, 2, "data") == 2
    assert pack_sequences(512, 8, 2, "layers") == 2 and pack_sequences(4096, 8, 1) == 1
    assert pack_sequences(16, 6, 4, "data") == 1 and pack_sequences(16, 12, 2, "tensor") == 6
    tg = lora_step(LLAMA["tiny"], seq=16, batch=4, n_gpus=2, dtype="fp32", split="data")
    assert tg.meta["tiles"]["t"] == 32


@pytest.mark.parametrize("gpus", [1, 2])
def test_packed_prompts_prefill_matches_one_prompt_per_tile(gpus, monkeypatch):
    """A batch of short prompts packed several to a token tile (the default; ``TURNIP_PACK_PROMPTS=0``: one
    a tile): every position's logits, and the KV-cache prefill's keys and values, equal those of one prompt
    per tile."""
    from turnip.decode import prefill_kv
    from turnip.memgraph.interp import evaluate_taskgraph

    cfg = LLAMA["tiny"]
    monkeypatch.setenv("TURNIP_PACK_PROMPTS", "0")
    plain = [llama_prefill(cfg, seq=8, n_gpus=gpus, dtype="fp32", head="all", batch=16, budget_nbytes=1 << 20),
             prefill_kv(cfg, 8, 16, gpus, "fp32", 1 << 20)]  # fmt: skip
    monkeypatch.delenv("TURNIP_PACK_PROMPTS", raising=False)
    packed = [llama_prefill(cfg, seq=8, n_gpus=gpus, dtype="fp32", head="all", batch=16, budget_nbytes=1 << 20),
              prefill_kv(cfg, 8, 16, gpus, "fp32", 1 << 20)]  # fmt: skip
    for a, b in zip(plain, packed, strict=True):
        assert a.meta["tiles"]["t"] == 8 and b.meta["tiles"]["t"] == 32 and b.n < a.n
        logical = random_inputs_for(a, seed=4)
        mg = build_with_resident(b, 256 << 10, None, "0")
        assert verify(mg, b) == []
        got = run_cpu(mg, tile_inputs(b, logical))
        want = evaluate_taskgraph(a, tile_inputs(a, logical))
        for name in a.meta["output_blocks"]:
            np.testing.assert_allclose(assemble(b, got, name), assemble(a, want, name), rtol=1e-4, atol=1e-5,
                                       err_msg=name)  # fmt: skip


@pytest.mark.parametrize("gpus,seq,head,window", [(2, 32, "all", 0), (3, 48, "last", 0), (4, 32, "all", 0),
                                                  (2, 32, "all", 12)])
def test_prompt_split_by_tokens_matches_one_gpu(gpus, seq, head, window):
    """A prompt's data split (token tiles round-robin, every GPU its own copy of each weight, keys and values
    sent to the GPUs of later tokens; a sliding window too): the one-GPU logits, under a budget that offloads,
    on the CPU backend with chaos; no weight crosses between GPUs and each query tile reads keys up to its own
    tile only."""
    import dataclasses

    from turnip.memgraph.interp import evaluate_taskgraph

    cfg = LLAMA["tiny"] if not window else dataclasses.replace(LLAMA["tiny"], window=window)
    one = llama_prefill(cfg, seq=seq, n_gpus=1, dtype="fp32", head=head, tiles={"t": 16})
    many = llama_prefill(cfg, seq=seq, n_gpus=gpus, dtype="fp32", head=head, split="data", tiles={"t": 8})
    assert many.meta["split"] == "data"
    moved = {many.name[int(many.args(v)[0])] for v in np.flatnonzero(many.kind == KIND_TRANSFER)}
    assert moved and {n.split("[")[0].split(".")[-1] for n in moved} <= {"kr", "v", "last"}, moved
    per_gpu = np.bincount(many.gpu[many.kind != KIND_INPUT].astype(int), minlength=gpus)
    assert (per_gpu > 0).all(), per_gpu
    logical = random_inputs_for(one, seed=3)
    mg = build_with_resident(many, 56 << 10, None, "0")
    assert verify(mg, many) == []
    assert mg.stats["n_offload"] + mg.stats["n_reload"] > 0
    got = run_cpu(mg, tile_inputs(many, logical))
    want = evaluate_taskgraph(one, tile_inputs(one, logical))
    for name in one.meta["output_blocks"]:
        np.testing.assert_allclose(assemble(many, got, name), assemble(one, want, name), rtol=1e-4, atol=1e-5,
                                   err_msg=name)  # fmt: skip


def test_a_layers_split_whose_stages_stream_their_weights_takes_two_token_tiles():
    """Where a stage's frozen weights pass three quarters of the budget, each token tile loads them again: the
    layers split packs the batch into two tiles (LLaMA-65B 8 x 1K at 24 GiB on 4 GPUs: four sequences a tile);
    tiles given stay as given; the plan verifies."""
    from turnip.train import stage_streams, train_tiles, two_tiles

    big, seven = LLAMA["65b"], LLAMA["7b"]
    assert stage_streams(big, 4, "fp16", 24 << 30) and not stage_streams(seven, 4, "fp16", 16 << 30)
    assert not stage_streams(big, 1, "fp16", 24 << 30) and not stage_streams(big, 4, "fp16", None)
    assert train_tiles(big, 1024, 8, 4, "fp16", None, 24 << 30, "layers")["t"] == 4096
    assert train_tiles(seven, 1024, 8, 4, "fp16", None, 16 << 30, "layers")["t"] == 1024
    assert train_tiles(big, 1024, 8, 4, "fp16", {"t": 1024}, 24 << 30, "layers")["t"] == 1024
    assert [two_tiles(b) for b in (8, 6, 7, 1)] == [4, 3, 1, 1]
    cfg = LLAMA["tiny"]
    budget = cfg.layer_nbytes(4) * cfg.n_layers // 2  # a stage's weights fill the whole budget
    assert stage_streams(cfg, 2, "fp32", budget)
    tg = lora_step(cfg, seq=16, batch=4, n_gpus=2, dtype="fp32", checkpoint="on", split="layers",
                   budget_nbytes=budget)  # fmt: skip
    assert tg.meta["tiles"]["t"] == 32
    mg = build_with_resident(tg, max(budget, 512 << 10), None, "0")
    assert verify(mg, tg) == []
