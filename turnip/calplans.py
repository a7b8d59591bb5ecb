"""The plans ``turnip calibrate`` measures (``turnip.calibrate``) and the simulator's fit replays (``sim.fit``).

A ``KernelPlan`` is one calibration plan: a model, prompt length, tiles, layers, LM head and, for a LoRA
training step, its batch. ``kernel_plans`` is the list ``turnip calibrate`` runs; ``plan_graph`` builds a
plan's taskgraph and memgraph (every weight resident); ``recorded_plan`` reads a plan back from its row in a
profile's ``calibration.plans``. Nothing here touches a GPU or the simulator: the measuring side and the fit
both import it, and neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONFIGS = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"  # model config files by name


@dataclass(frozen=True)
class KernelPlan:
    """One calibration plan: a model (preset or config path), prompt length, tiles, layers, LM head."""

    model: str
    seq: int
    tiles: dict
    layers: int = 1
    head: str = "none"
    batch: int = 0  # > 0: a LoRA training step of this many sequences of ``seq`` tokens (rank 16, q,k,v,ffn)


def kernel_plans(quick: bool = False) -> list[KernelPlan]:
    """Prompt lengths and tiles chosen apart from the validation grid's defaults (1K..32K, default tiles):
    token tiles 512..8192, head blocks of 4..16 heads, FFN blocks of 1376..5504 columns, key ranges split or
    whole, grouped-query layers (LLaMA-3-8B shapes) and LM heads."""
    gqa = str(CONFIGS / "llama3-8b.json")
    plans = [
        KernelPlan("llama-7b", 3072, {"t": 512, "h": 8, "f": 1376}),
        KernelPlan("llama-7b", 6144, {"t": 1536, "h": 16, "f": 2752}),
        KernelPlan("llama-7b", 12288, {"t": 3072, "h": 16, "f": 5504}),
        KernelPlan("llama-7b", 12288, {"t": 6144, "h": 4, "f": 5504, "kv": 6144}),
        KernelPlan("llama-7b", 24576, {"t": 8192, "h": 8, "f": 2752}),
        # attention over 7K-query tiles of every head against up to 28K keys (the largest attention and FFN
        # kernels; about 40% of its time is attention: what attention sustains at the power limit)
        KernelPlan("llama-7b", 28672, {"t": 7168, "h": 32, "f": 11008}),
        KernelPlan("llama-7b", 2560, {"t": 2560, "h": 16, "f": 11008}, head="last"),
    ]
    if Path(gqa).exists():
        plans += [KernelPlan(gqa, 6144, {"t": 2048, "h": 4, "f": 7168, "v": 32064}, head="last"),
                  KernelPlan(gqa, 20480, {"t": 5120, "h": 4, "f": 3584})]  # fmt: skip
    # training steps (their backward ops, LoRA's small GEMMs, the loss, Adam) at sequence lengths and head/FFN
    # blocks apart from the training benchmark's (1K and 4K sequences, whole heads and FFN)
    # (two layers: the second's backward goes through the frozen projections to the first's input; one long
    # sequence: attention's backward at the tile sizes long training sequences use)
    # eight layers: long enough on every stream slot to hold the GPU at its power limit
    plans.append(KernelPlan("llama-7b", 6144, {"t": 3072, "h": 16, "f": 5504}, layers=8))
    plans += [KernelPlan("llama-7b", 1536, {"h": 16, "f": 5504}, layers=2, batch=3),
              KernelPlan("llama-7b", 2560, {"h": 8, "f": 2752}, layers=2, batch=2),
              KernelPlan("llama-7b", 6144, {"h": 16, "f": 5504}, layers=2, batch=1)]  # fmt: skip
    if quick:  # every other plan, always with the two that hold the GPU at its power limit (attention, 8 layers)
        return [p for i, p in enumerate(plans) if i % 2 == 0 or p.seq == 28672 or p.layers == 8]
    return plans


def recorded_plan(row: dict) -> KernelPlan:
    """The ``KernelPlan`` a recorded plan row (``calibration.plans[i]``) describes (a config file by its name,
    looked up in ``benchmarks/configs``)."""
    model = row["model"]
    if model.endswith(".json"):
        model = str(CONFIGS / model)
    return KernelPlan(model, int(row["seq"]), dict(row["tiles"]), int(row.get("layers", 1)), row.get("head", "none"),
                      int(row.get("batch", 0)))  # fmt: skip


def plan_graph(p: KernelPlan, dtype: str = "fp16"):
    """The calibration plan's taskgraph and memgraph: every weight resident, room for the rest."""
    from turnip.compile import build_with_resident, make_taskgraph

    train = None
    if p.batch:
        from turnip.train import TrainSpec

        train = TrainSpec(p.batch, checkpoint="on")
    tg = make_taskgraph(p.model, p.seq, 1, dtype, p.tiles, n_layers=p.layers, head=p.head, train=train)
    inputs = int(sum(int(np.prod(tg.shape[v])) for v in np.flatnonzero(tg.kind == 0))) * 4
    return tg, build_with_resident(tg, 3 * inputs + (4 << 30), None, str(inputs + (1 << 20)))
