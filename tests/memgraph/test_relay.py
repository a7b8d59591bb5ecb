"""Relayed loads (``BuildConfig.relay_slots``, ``TURNIP_RELAY_LOADS``): a GPU's input loads and reloads taken in
turn by the other GPUs' host links into their relay slots, then copied over; the plan verifies and computes the
same."""

from collections import Counter

import numpy as np
import pytest

from turnip.compile import RELAY_SWITCH, build_with_resident, relay_config
from turnip.memgraph.build import BudgetError, BuildConfig, build_memgraph
from turnip.memgraph.interp import evaluate_taskgraph, random_inputs, random_order, run_memgraph
from turnip.memgraph.plan import KIND_INPUT, KIND_RELOAD, KIND_TRANSFER
from turnip.memgraph.verify import verify
from turnip.models import LLAMA, llama_prefill
from turnip.train import lora_step

pytestmark = pytest.mark.unit


def reaches(mg, a: int, b: int) -> bool:
    """Whether b depends on a, directly or through other vertices."""
    seen, todo = set(), [b]
    while todo:
        v = todo.pop()
        for d in mg.deps(v).tolist():
            if d == a:
                return True
            if d not in seen and d > a:
                seen.add(d)
                todo.append(d)
    return False


def relayed(mg):
    """The relay copies: transfers of no taskgraph vertex, each reading a load on its source GPU."""
    return [v for v in np.flatnonzero((mg.kind == KIND_TRANSFER) & (mg.tg_vertex < 0))]


@pytest.mark.parametrize("split,gpus,slots", [("layers", 2, 2), ("tensor", 3, 1)])
def test_relayed_reloads_verify_and_compute_what_direct_ones_do(split, gpus, slots, rng):
    tg = llama_prefill("tiny", seq=32, n_gpus=gpus, dtype="fp32", head="last", split=split)
    budget = 80 << 10 if split == "layers" else 64 << 10
    mg = build_memgraph(tg, budget, BuildConfig(relay_slots=slots, relay_slot_nbytes=8192))
    direct = build_memgraph(tg, budget)
    xs = relayed(mg)
    assert mg.stats["n_relayed"] == len(xs) > 0 and direct.stats["n_relayed"] == 0
    kinds = Counter()
    for x in xs:
        (r,) = mg.reads(x).tolist()
        kinds[int(mg.kind[r])] += 1
        assert mg.gpu[r] == mg.src_gpu[x] != mg.gpu[x] and mg.tensor[r] == mg.tensor[x]
        assert mg.out_nbytes[r] <= 8192
        # the slot: above the arena, below the budget, one range per (helper, destination, slot)
        assert budget - (gpus - 1) * slots * 8192 <= mg.out_offset[r] < budget
    assert set(kinds) == {KIND_INPUT, KIND_RELOAD}  # first loads and reloads
    every = [int(mg.gpu[v]) for v in np.flatnonzero(mg.kind == KIND_RELOAD)]
    assert set(every) == set(range(gpus))
    assert verify(mg, tg) == []
    inputs = random_inputs(tg, rng)
    ref = evaluate_taskgraph(tg, inputs)
    for _ in range(3):
        out = run_memgraph(mg, tg, inputs, random_order(mg, rng))
        for t, x in out.items():
            np.testing.assert_array_equal(x, ref[t])


def test_a_slot_is_refilled_only_after_its_copy_out(rng):
    """Two reloads through the same slot of the same helper: the second waits for the first's copy out (a
    memory dependency), so no valid order can overwrite a slot still being read."""
    tg = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", head="last", split="layers")
    mg = build_memgraph(tg, 80 << 10, BuildConfig(relay_slots=1, relay_slot_nbytes=8192))
    by_slot: dict[tuple, list[int]] = {}
    for x in relayed(mg):
        (r,) = mg.reads(x).tolist()
        by_slot.setdefault((int(mg.gpu[r]), int(mg.out_offset[r])), []).append(int(x))
    assert any(len(xs) > 1 for xs in by_slot.values())
    for xs in by_slot.values():
        for a, b in zip(xs, xs[1:], strict=False):
            (rb,) = mg.reads(b).tolist()
            assert reaches(mg, a, rb)
    assert verify(mg, tg) == []


def test_relays_by_default_where_a_layers_split_streams_and_the_switch_overrides(monkeypatch):
    """Unset, ``TURNIP_RELAY_LOADS`` gives one slot where a training step's layers split has inputs on a GPU
    passing three quarters of the budget (its stages stream, one after another) and none elsewhere (a prompt, the
    tensor split, roomy budgets, one GPU) or where the slots would cost too much (capped below the weights' size,
    or together past a share of the budget); N forces N on any several-GPU plan, 0 none; the slot holds all but
    the largest inputs."""
    from turnip import compile as comp

    layers = lora_step(LLAMA["tiny"], seq=16, batch=2, n_gpus=2, dtype="fp32", checkpoint="on", split="layers")
    prompt = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", head="last", split="layers")
    tensor = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32", head="last", split="tensor")
    one = llama_prefill("tiny", seq=32, n_gpus=1, dtype="fp32", head="last")
    ins = layers.kind == KIND_INPUT
    per_gpu = int(np.bincount(layers.gpu[ins], weights=layers.nbytes[ins]).max())
    tight, roomy = per_gpu, 2 * per_gpu  # inputs of a GPU: all of the budget, half of it
    monkeypatch.delenv(RELAY_SWITCH, raising=False)
    assert relay_config(BuildConfig(), layers, tight).relay_slots == 0  # a 64th of these budgets holds no weight
    monkeypatch.setattr(comp, "RELAY_SLOT_SHARE", 4)
    monkeypatch.setattr(comp, "RELAY_SLOTS_SHARE", 0.01)
    assert relay_config(BuildConfig(), layers, tight).relay_slots == 0  # the slot takes 5% of the budget
    monkeypatch.setattr(comp, "RELAY_SLOTS_SHARE", 0.25)
    assert relay_config(BuildConfig(), layers, tight).relay_slots == 1
    assert relay_config(BuildConfig(), layers, roomy).relay_slots == 0
    assert relay_config(BuildConfig(), prompt, tight).relay_slots == 0
    assert relay_config(BuildConfig(), tensor, tight).relay_slots == 0
    assert relay_config(BuildConfig(), one, tight).relay_slots == 0
    monkeypatch.setattr(comp, "RELAY_SLOT_SHARE", 64)
    monkeypatch.setenv(RELAY_SWITCH, "2")
    cfg = relay_config(BuildConfig(), tensor, 1 << 20)
    sizes = np.sort(tensor.nbytes[tensor.kind == KIND_INPUT])
    assert cfg.relay_slots == 2 and sizes[0] <= cfg.relay_slot_nbytes <= min(sizes[-1] + 255, (1 << 20) // 64)
    assert relay_config(BuildConfig(), one, 1 << 20).relay_slots == 0
    mg = build_with_resident(prompt, 80 << 10, None, "0")
    assert mg.stats["relay_slots"] == 2 and mg.stats["n_relayed"] > 0 and verify(mg, prompt) == []
    monkeypatch.setenv(RELAY_SWITCH, "0")
    assert relay_config(BuildConfig(), layers, tight).relay_slots == 0
    monkeypatch.setenv(RELAY_SWITCH, "yes")
    with pytest.raises(ValueError, match="TURNIP_RELAY_LOADS='yes'"):
        relay_config(BuildConfig(), layers, tight)


def test_slots_that_take_half_the_budget_are_refused_in_one_line():
    tg = llama_prefill("tiny", seq=32, n_gpus=3, dtype="fp32", head="last")
    with pytest.raises(BudgetError, match="relay slots of 16384 bytes take half of a budget of 65536 bytes"):
        build_memgraph(tg, 64 << 10, BuildConfig(relay_slots=1, relay_slot_nbytes=16384))


def test_a_layers_split_training_step_with_relayed_loads_matches_one_gpu(monkeypatch):
    """Loss, adapter gradients and new adapters of a layers-split LoRA step whose loads and reloads are relayed
    equal the one-GPU step's (CPU backend, chaos)."""
    from tests.test_split_data import assert_same_step
    from turnip import compile as comp

    cfg = LLAMA["tiny"]
    one = lora_step(cfg, seq=16, batch=2, n_gpus=1, dtype="fp32", checkpoint="on")
    two = lora_step(cfg, seq=16, batch=2, n_gpus=2, dtype="fp32", checkpoint="on", split="layers")
    monkeypatch.setenv(RELAY_SWITCH, "1")
    monkeypatch.setattr(comp, "RELAY_SLOT_SHARE", 8)
    mg = build_with_resident(two, 256 << 10, None, "0")
    assert mg.stats["n_relayed"] > 0 and mg.stats["n_reload"] > 0
    kinds = {int(mg.kind[int(mg.reads(x)[0])]) for x in relayed(mg)}
    assert kinds == {KIND_INPUT, KIND_RELOAD}
    assert_same_step([one, two], cfg, 2, 256 << 10, offloads=[two])
