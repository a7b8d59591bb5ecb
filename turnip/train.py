"""LoRA fine-tuning of a LLaMA-family model as one plan per training step: forward, next-token
cross-entropy, backward (``turnip.autodiff``) and an Adam step on the adapters, lowered into one taskgraph.

A batch of B sequences of S tokens is one token dimension of B * S rows (``seq`` on attention and rotary:
each sequence attends to itself; token tiles are whole sequences). Inputs of a step: the embedded tokens
``x0`` (gathered on the host), the next-token ``targets`` (int32, -1 = no loss, the last position of every
sequence), the frozen weights (names as ``turnip.models.llama_graph``), for every adapter
``L{i}.{m}.lora_A`` / ``lora_B`` (float32 masters) with their Adam moments ``.m`` / ``.v``, and
``adam_step`` (the step number, 1 first). Outputs: ``loss`` (per token, float32), every adapter's gradient
(``.grad``, of the mean loss over the B * (S - 1) predicted tokens) and its new value and moments
(``.new``, ``.m.new``, ``.v.new``): feed them back as the next step's inputs (``AdapterState``).

Adapters follow PEFT: y = W x + (alpha / rank) B A x with A (rank, in) and B (out, rank); in turnip's
layouts A has dims ``k`` + the input's feature dims and B the output's feature dims + ``k``, so A and B
reshape to PEFT's ``lora_A.weight`` / ``lora_B.weight`` (``save_adapters``). With a half-precision model
the adapters compute in that dtype (cast from the float32 masters) and their gradients go back to float32
for Adam.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from turnip.autodiff import backward
from turnip.graph import Graph, lower
from turnip.graph_lower import lean_step_on
from turnip.memgraph.plan import DTYPE_NBYTES, KIND_INPUT, KIND_KERNEL, KIND_TRANSFER
from turnip.models import LlamaConfig, default_tiles, ffn_blocks, split_tiling
from turnip.taskgraph import TaskGraph

MODULES = ("q", "k", "v", "o", "gate", "up", "down")
GROUPS = {"ffn": ("gate", "up", "down"), "attn": ("q", "k", "v", "o")}
HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # fmt: skip
CHECKPOINT = ("auto", "on", "off")


def parse_targets(text: str | tuple) -> tuple[str, ...]:
    """'q,k,v,ffn' -> ('q', 'k', 'v', 'gate', 'up', 'down'); ``ValueError`` names an unknown module."""
    items = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    out: list[str] = []
    for t in items:
        for m in GROUPS.get(t, (t,)):
            if m not in MODULES:
                raise ValueError(f"unknown LoRA target {t!r}; choose from {', '.join(MODULES)}, ffn, attn")
            if m not in out:
                out.append(m)
    if not out:
        raise ValueError("no LoRA targets given")
    return tuple(m for m in MODULES if m in out)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple = ("q", "k", "v", "gate", "up", "down")
    lr: float = 1e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be positive, got {self.rank}")
        parse_targets(self.targets)
        if not self.lr > 0 or not 0 <= self.b1 < 1 or not 0 <= self.b2 < 1 or not self.eps > 0:
            raise ValueError(f"Adam needs lr > 0, 0 <= b1, b2 < 1 and eps > 0; got {self.lr}, {self.b1}, {self.b2}, "
                             f"{self.eps}")  # fmt: skip


@dataclass
class Adapter:
    """One adapted module: its parameters' logical names and shapes."""

    layer: int
    module: str
    a_dims: str
    a_shape: tuple
    b_dims: str
    b_shape: tuple
    names: dict = field(default_factory=dict)  # "A"/"B" -> logical input name

    @property
    def prefix(self) -> str:
        return f"L{self.layer}.{self.module}"


def activation_nbytes(cfg: LlamaConfig, tokens: int, n_layers: int, itemsize: int) -> int:
    """Bytes of the activations a step keeps for its backward without checkpointing (per layer about ten
    hidden-width and four FFN-width values per token)."""
    per_token = 10 * cfg.d_model + 4 * cfg.d_ffn
    return tokens * n_layers * per_token * itemsize


def pick_checkpoint(mode: str, cfg: LlamaConfig, tokens: int, n_layers: int, dtype: str, budget: int | None) -> bool:
    """``auto``: recompute each layer in the backward when the kept activations would pass half the budget."""
    if mode not in CHECKPOINT:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return budget is not None and activation_nbytes(cfg, tokens, n_layers, DTYPE_NBYTES[dtype]) > budget // 2


def lora_graph(
    cfg: LlamaConfig, seq: int, batch: int = 1, dtype: str = "fp16", n_layers: int | None = None,
    lora: LoraConfig = LoraConfig(), checkpoint: bool = False, keep_casts: bool = False,
) -> tuple[Graph, list[Adapter]]:  # fmt: skip
    """The logical graph of one LoRA training step (module doc) and its adapters. ``ValueError`` for a model
    whose layers are not plain LLaMA's (``LlamaConfig.extras``: sliding windows, biases, ...). ``keep_casts``:
    with ``checkpoint``, the backward reads each adapter's cast from the forward instead of recomputing it
    (the lean data split, which sends each adapter to the other GPUs once)."""
    s = cfg
    if cfg.extras():
        raise ValueError(f"LoRA training runs plain LLaMA layers; {cfg.name or 'this model'} has "
                         f"{', '.join(cfg.extras())}")  # fmt: skip
    L = s.n_layers if n_layers is None else n_layers
    H, Hk, r, e, d, f = s.n_heads, s.kv_heads, s.group, s.dh, s.d_model, s.d_ffn
    n = batch * seq
    g = Graph(dtype=dtype)
    with g.layer_scope(-1):  # layers: -1 before the first decoder layer, L after the last (``Graph.layer_scope``)
        x = g.input("x0", "td", (n, d))
        step = g.input("adam_step", "", (), dtype="fp32")
    with g.layer_scope(L):  # read by the loss
        targets = g.input("targets", "t", (n,), dtype="int32")
    rope = s.rope_params()
    targets_set = set(lora.targets)
    adapters: list[Adapter] = []
    compute: dict[int, int] = {}  # adapter tensor used in the graph -> its float32 master input

    def param(name: str, dims: str, shape) -> int:
        p = g.input(name, dims, shape, dtype="fp32")
        c = p if dtype == "fp32" else g.cast(p, dtype, name=name + ".c")
        compute[c] = p
        return c

    def adapt(layer: int, mod: str, xin: int, y: int) -> int:
        if mod not in targets_set:
            return y
        ti, to = g.t(xin), g.t(y)
        ad = Adapter(layer, mod, "k" + ti.dims[1:], (lora.rank, *ti.shape[1:]), to.dims[1:] + "k",
                     (*to.shape[1:], lora.rank))  # fmt: skip
        ad.names = {"A": f"{ad.prefix}.lora_A", "B": f"{ad.prefix}.lora_B"}
        a = param(ad.names["A"], ad.a_dims, ad.a_shape)
        b = param(ad.names["B"], ad.b_dims, ad.b_shape)
        adapters.append(ad)
        ha = g.einsum(f"{ti.dims},{ad.a_dims}->tk", xin, a, name=f"{ad.prefix}.ax")
        lo = g.einsum(f"tk,{ad.b_dims}->{to.dims}", ha, b, scale=lora.scale, name=f"{ad.prefix}.bax")
        return g.map("add_n", y, lo, name=f"{ad.prefix}.y")

    if r == 1:
        q_sub, q_w, o_w = "td,hed->the", ("hed", (H, e, d)), ("dhe", (d, H, e))
    else:
        q_sub, q_w, o_w = "td,hred->thre", ("hred", (Hk, r, e, d)), ("dhre", (d, Hk, r, e))
    segments: list[list[int]] = []
    for i in range(L):
        g.layer = i
        first = len(g.nodes)
        p = f"L{i}."
        h = g.rmsnorm(x, g.input(p + "attn_norm", "d", (d,)), eps=s.eps, name=p + "h")
        q = adapt(i, "q", h, g.einsum(q_sub, h, g.input(p + "wq", *q_w), name=p + "q"))
        k = adapt(i, "k", h, g.einsum("td,hed->the", h, g.input(p + "wk", "hed", (Hk, e, d)), name=p + "k"))
        v = adapt(i, "v", h, g.einsum("td,hed->the", h, g.input(p + "wv", "hed", (Hk, e, d)), name=p + "v"))
        qr = g.rotary(q, name=p + "qr", seq=seq, **rope)
        kr = g.rotary(k, name=p + "kr", seq=seq, **rope)
        a = g.attention(qr, kr, v, name=p + "attn", seq=seq)
        o_sub = f"{g.t(a).dims},d{g.t(a).dims[1:]}->td"
        o = adapt(i, "o", a, g.einsum(o_sub, a, g.input(p + "wo", *o_w), name=p + "o"))
        x = g.map("add_n", x, o, name=p + "x1")
        h2 = g.rmsnorm(x, g.input(p + "ffn_norm", "d", (d,)), eps=s.eps, name=p + "h2")
        gate = adapt(i, "gate", h2, g.einsum("td,fd->tf", h2, g.input(p + "w_gate", "fd", (f, d)), name=p + "gate"))
        up = adapt(i, "up", h2, g.einsum("td,fd->tf", h2, g.input(p + "w_up", "fd", (f, d)), name=p + "up"))
        m = g.map("silu_mul", gate, up, name=p + "m")
        down = adapt(i, "down", m, g.einsum("tf,df->td", m, g.input(p + "w_down", "df", (d, f)), name=p + "down"))
        x = g.map("add_n", x, down, name=p + "x2")
        segments.append(list(range(first, len(g.nodes))))
    g.layer = L
    hn = g.rmsnorm(x, g.input("final_norm", "d", (d,)), eps=s.eps, name="out")
    w = g.input("tok_embed" if s.tie_embeddings else "lm_head", "vd", (s.vocab, d))
    logits = g.einsum("td,vd->tv", hn, w, name="logits")
    loss = g.xent(logits, targets, name="loss")
    dlogits = g.xent_bwd(logits, targets, name="dlogits")
    wrt = list(compute)
    if keep_casts:  # the backward reads the forward's cast of each adapter, not a recomputed one
        segments = [[x for x in seg if x not in compute] for seg in segments]
    grads = backward(g, {logits: dlogits}, wrt, recompute=segments if checkpoint else None)
    n_pred = batch * (seq - 1) if seq > 1 else batch
    outs = [loss]
    for c in wrt:
        if c not in grads:
            raise ValueError(f"adapter {g.t(compute[c]).name} does not reach the loss")
        pm = compute[c]
        name = g.t(pm).name
        t = g.t(pm)
        with g.layer_scope(g.nodes[pm].layer):  # the adapter's gradient and update stay with its layer
            gr = g.cast(grads[c], "fp32", alpha=1.0 / n_pred, name=name + ".grad")
            m0 = g.input(name + ".m", t.dims, t.shape, dtype="fp32")
            mm = g.map("adam_m", m0, gr, b1=lora.b1, name=name + ".m.new")
            v0 = g.input(name + ".v", t.dims, t.shape, dtype="fp32")
            vv = g.map("adam_v", v0, gr, b2=lora.b2, name=name + ".v.new")
            new = g.map("adam_p", pm, mm, vv, step, lr=lora.lr, b1=lora.b1, b2=lora.b2, eps=lora.eps,
                        name=name + ".new")  # fmt: skip
        outs += [gr, mm, vv, new]
    g.outputs = outs
    return g, adapters


def hoist_sends(tg: TaskGraph) -> TaskGraph:
    """``tg`` renumbered for the data split's launch groups (``turnip.sched.groups``, which follow compile
    order), its dependencies unchanged:

    - the inputs that other GPUs read, or their casts (the adapters, cast to the compute dtype on the GPU that
      keeps them), and their transfers come first: every GPU receives its adapters at the
      step's start, not just before their first use, so a kernel reading an adapter follows its transfer and
      may join the group of its other operand (a copy before the group's head) instead of starting one;
    - each adapter's update (the gradient's cast and the Adam kernels) comes right after the gradient's last
      term, not after the whole backward: it joins the group of that sum and frees its memory early.

    Costs each GPU its adapters for the whole step (7B rank 16: about 20 MB), which the backward reads again."""
    from turnip.taskgraph import reordered

    k, op, n = tg.kind, tg.op, tg.n
    args = [tg.args(v).tolist() for v in range(n)]
    casts = {v for v in range(n) if k[v] == KIND_KERNEL and op[v] == "cast" and args[v]
             and all(k[a] == KIND_INPUT for a in args[v])}  # fmt: skip
    sends = [v for v in range(n) if k[v] == KIND_TRANSFER and (args[v][0] in casts or k[args[v][0]] == KIND_INPUT)]
    srcs = {args[v][0] for v in sends}
    first = sorted(srcs | {a for c in srcs for a in args[c]} | set(sends))
    adam = {v for v in range(n) if op[v] in ("adam_m", "adam_v", "adam_p")}
    tail = adam | {a for v in adam for a in args[v] if op[a] == "cast" and a not in casts}
    if not sends and not tail:
        return tg
    chosen = set(first)
    base = first + [v for v in range(n) if v not in chosen]
    ins = {a for v in tail for a in args[v] if k[a] == KIND_INPUT and a not in chosen}  # the moments, the step
    key: list[tuple] = [()] * n  # (place in ``base``, 0); an update's: (its latest operand's place, 1, its own)
    readers: dict[int, list[int]] = {a: [] for a in ins}
    for i, v in enumerate(base):
        for a in args[v]:
            if a in ins:
                readers[a].append(v)
        if v in tail:
            key[v] = (max((key[a][0] for a in args[v] if a not in ins), default=i), 1, i)
        elif v not in ins:
            key[v] = (i, 0, i)
    for i, v in enumerate(base):  # an update's inputs just before the first reader's place: before the head of
        if v in ins:  # the group the update joins (a copy there becomes the head's dependency)
            key[v] = (min(key[r][0] for r in readers[v]), -1, i)
    return reordered(tg, sorted(range(n), key=key.__getitem__))


def train_tiles(cfg: LlamaConfig, seq: int, batch: int, n_gpus: int, dtype: str, tiles: dict | None,
                budget_nbytes: int | None, split: str = "tensor", n_layers: int | None = None) -> dict:  # fmt: skip
    """Tiles of a training step: whole sequences per token tile (``pack_sequences``; two tiles where a layers
    split's stages stream their weights: ``stage_streams``), the vocabulary whole (the
    loss reads whole rows of logits), key-value heads and FFN columns in one block per GPU (a step has many
    token tiles to overlap; fewer, larger blocks keep the plan small: 7B at 8 x 1K is 35K vertices), split further only
    where a block of FFN weights would pass an eighth of the budget (tiny models: two blocks, as their
    prefill). The layers and data splits tile as one GPU does. Given tiles override; ``t`` must be a multiple
    of ``seq``."""
    per_tile = pack_sequences(seq, batch, n_gpus, split)
    if split == "layers" and stage_streams(cfg, n_gpus, dtype, budget_nbytes, n_layers):
        per_tile = two_tiles(batch)
    if split in ("layers", "data"):
        n_gpus = 1
    if cfg.d_model <= 256:
        t = {k: v for k, v in default_tiles(cfg, seq, n_gpus, dtype, budget_nbytes).items() if k in ("h", "f")}
    else:
        G = max(1, n_gpus)
        t = {"h": -(-cfg.kv_heads // G), "f": -(-cfg.d_ffn // ffn_blocks(cfg, dtype, budget_nbytes, G))}
    t["t"] = seq * per_tile
    for k, v in (tiles or {}).items():
        if k in ("v", "kv"):
            raise ValueError(f"tile {k} is not used in training (the vocabulary and key ranges stay whole)")
        if k not in ("t", "h", "f"):
            raise ValueError(f"unknown tile {k!r}; training tiles are h (key-value heads) and f (FFN columns)")
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"tile {k}={v!r} must be a positive integer")
        if k == "t" and (v % seq or v > seq * batch):
            raise ValueError(f"training keeps sequences whole in token tiles: t must be a multiple of {seq} (the "
                             f"sequence length) up to {seq * batch} (the batch)")  # fmt: skip
        t[k] = int(v)
    return t


SPREAD_SWITCH = "TURNIP_SPREAD_STATE"  # "1": the data split keeps layer i's adapters and their updates on GPU i % G


def spread_state_on() -> bool:
    """Whether a training step's data split spreads the adapters, their moments, gradient sums and Adam updates
    over the GPUs by layer (``TURNIP_SPREAD_STATE=1``; off: all on GPU 0). Off by default: on four H100s a 7B
    8 x 1K step took 289.9 ms with it against 302.0 without (two processes, within that host's spread), and
    ``h100-calibrated`` predicts it slower (211 -> 245 ms, ``benchmarks/results/multi_gpu/README.md``)."""
    return os.environ.get(SPREAD_SWITCH) == "1"


PACK_TOKENS = 2048  # packed token tiles of a training step grow to this many tokens


def pack_on() -> bool:
    """Whether training packs several short sequences per token tile: on unless ``TURNIP_PACK_SEQS=0``
    (measured on H100s, 7B LoRA 8 x 1K under 16 GiB: one GPU 775 -> 722 ms, two GPUs with the data split
    587 -> 384 ms)."""
    return os.environ.get("TURNIP_PACK_SEQS", "1") != "0"


STREAM_SHARE = 0.75  # a layers split stage streams its weights when they pass this share of the budget


def stage_streams(cfg: LlamaConfig, n_gpus: int, dtype: str, budget_nbytes: int | None,
                  n_layers: int | None = None) -> bool:  # fmt: skip
    """Whether a stage of the layers split over ``n_gpus`` GPUs holds more frozen weights than
    ``STREAM_SHARE`` of the budget: they cannot stay on the GPU, and every token tile loads them again."""
    if n_gpus < 2 or budget_nbytes is None:
        return False
    L = cfg.n_layers if n_layers is None else n_layers
    stage = -(-L // n_gpus) * cfg.layer_nbytes(DTYPE_NBYTES[dtype])
    return stage > STREAM_SHARE * budget_nbytes


def two_tiles(batch: int) -> int:
    """Sequences per token tile for two tiles (the most that divides ``batch`` into at least two): a layers
    split whose stages stream their weights loads each weight once per tile and pass, so it trades the
    pipeline's fill for fewer loads (LLaMA-65B, 8 x 1K at 24 GiB per GPU on four H100s: 8,971 ms a step with a
    sequence per tile, 6,118 with four; ``benchmarks/results/multi_gpu/README.md``)."""
    k = max(1, batch // 2)
    while batch % k:
        k -= 1
    return k


def pack_sequences(seq: int, batch: int, n_gpus: int, split: str = "tensor") -> int:
    """Sequences per token tile of a training step: one, or with ``pack_on()`` as many as fit ``PACK_TOKENS``
    tokens, dividing the batch and leaving tiles to overlap: at least two, one per GPU, two per stage of the
    layers split. Fewer, larger tiles: fewer vertices for the host to issue, larger GEMMs."""
    if not pack_on() or seq >= PACK_TOKENS:
        return 1
    tiles = 2 * n_gpus if split == "layers" else max(2, n_gpus)
    k = max(1, min(PACK_TOKENS // seq, batch // tiles))
    while batch % k:
        k -= 1
    return k


@dataclass(frozen=True)
class TrainSpec:
    """What makes a plan a training step: sequences per batch, the adapters, activation checkpointing."""

    batch: int = 1
    lora: LoraConfig = LoraConfig()
    checkpoint: str = "auto"


def lora_step(
    cfg: LlamaConfig, seq: int, batch: int = 1, n_gpus: int = 1, dtype: str = "fp16", tiles: dict | None = None,
    n_layers: int | None = None, budget_nbytes: int | None = None, lora: LoraConfig = LoraConfig(),
    checkpoint: str = "auto", split: str = "tensor",
) -> TaskGraph:  # fmt: skip
    """The taskgraph of one LoRA training step (module doc). ``split``: ``"tensor"``: sequences round-robin
    over GPUs, each weight block on one GPU and sent to the others; ``"layers"``: decoder layer i of L on GPU
    floor(i * n_gpus / L) with its backward, adapters and their updates, the loss and LM head on the last;
    ``"data"``: sequences round-robin over GPUs, every GPU loading each frozen weight it reads from the host
    (a replica input), the adapters, their gradients' sums and updates on GPU 0 (the adapters' blocks are
    sent to the others; each GPU sums its sequences' gradients and sends the sum back)."""
    from turnip.models import check_llama_args

    lora.check()
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    if seq < 2:
        raise ValueError(f"training needs sequences of at least 2 tokens, got {seq}")
    check_llama_args(cfg, seq, n_gpus, dtype, None, n_layers, split=split)
    L = cfg.n_layers if n_layers is None else n_layers
    ck = pick_checkpoint(checkpoint, cfg, batch * seq, L, dtype, budget_nbytes)
    t = train_tiles(cfg, seq, batch, n_gpus, dtype, tiles, budget_nbytes, split, n_layers)
    lean = split == "data" and lean_step_on()
    g, adapters = lora_graph(cfg, seq, batch, dtype, n_layers, lora, ck, keep_casts=lean)
    state = {i for _, i in _state_pairs(adapters)}
    frozen = {n.out.name for n in g.nodes if n.op == "input" and "t" not in n.out.dims and n.out.name not in state}
    tg = lower(g, split_tiling(t, n_gpus, split, L, "thf", replicate=frozen, spread=spread_state_on()))
    if lean:
        tg = hoist_sends(tg)
    tg.meta.update(
        model=cfg.name or "llama", seq=seq, batch=batch, n_gpus=n_gpus, dtype=dtype, head="train", split=split,
        embed={"input": "x0", "table": "model.embed_tokens.weight"},
        train={"lora": asdict(lora) | {"targets": list(lora.targets)}, "checkpoint": ck, "n_layers": L,
               "predicted_tokens": batch * (seq - 1),
               "adapters": [{"layer": a.layer, "module": a.module, "A": a.names["A"], "B": a.names["B"],
                             "a_shape": list(a.a_shape), "b_shape": list(a.b_shape)} for a in adapters]},
    )  # fmt: skip
    return tg


# ---------------------------------------------------------------- across steps


def state_names(tg: TaskGraph) -> list[tuple[str, str]]:
    """(output, input) logical names of the state a step hands to the next: every adapter and its moments."""
    return _state_pairs(tg.meta["train"]["adapters"])


def _state_pairs(adapters) -> list[tuple[str, str]]:
    out = []
    for a in adapters:
        names = (a["A"], a["B"]) if isinstance(a, dict) else (a.names["A"], a.names["B"])
        for k in names:
            out += [(k + ".new", k), (k + ".m.new", k + ".m"), (k + ".v.new", k + ".v")]
    return out


def carry_pairs(tg: TaskGraph) -> list[tuple[int, int]]:
    """(output tensor, input tensor) per block of the state (``state_names``), for ``backend.carry``."""
    outs, ins = tg.meta["output_blocks"], tg.meta["input_blocks"]
    pairs = []
    for o, i in state_names(tg):
        src = dict((tuple(st), v) for st, v in outs[o][1])
        pairs += [(int(src[tuple(st)]), int(v)) for st, v in ins[i][1]]
    return pairs


def state_inputs(tg: TaskGraph) -> tuple[int, ...]:
    """The input tensors of the state: kept resident on the GPU, so steps hand it over without the host."""
    return tuple(i for _, i in carry_pairs(tg))


# ---------------------------------------------------------------- host side


def next_token_targets(ids: np.ndarray) -> np.ndarray:
    """Targets of a batch of token ids (B, S): each position's next token, -1 at the last position."""
    ids = np.asarray(ids)
    t = np.full(ids.shape, -1, dtype=np.int32)
    t[:, :-1] = ids[:, 1:]
    return t.reshape(-1)


@dataclass
class AdapterState:
    """The trainable state between steps: every adapter matrix (float32), its Adam moments, the step count."""

    params: dict  # logical name -> array
    m: dict
    v: dict
    step: int = 0

    @classmethod
    def init(cls, tg: TaskGraph, seed: int = 0, b_std: float = 0.0) -> AdapterState:
        """PEFT's initialisation: A uniform in +-1/sqrt(fan in) (kaiming_uniform with a = sqrt(5)), B zero
        (``b_std`` > 0: normal instead, for tests where B must not be zero)."""
        rng = np.random.default_rng(seed)
        params = {}
        for a in tg.meta["train"]["adapters"]:
            fan_in = math.prod(a["a_shape"][1:])
            bound = 1.0 / math.sqrt(fan_in)
            params[a["A"]] = rng.uniform(-bound, bound, size=a["a_shape"]).astype(np.float32)
            b = rng.standard_normal(a["b_shape"]) * b_std if b_std else np.zeros(a["b_shape"])
            params[a["B"]] = b.astype(np.float32)
        zeros = {k: np.zeros_like(x) for k, x in params.items()}
        return cls(params, zeros, {k: x.copy() for k, x in zeros.items()}, 0)

    def inputs(self) -> dict[str, np.ndarray]:
        """The logical inputs of the next step."""
        out = dict(self.params)
        out |= {k + ".m": x for k, x in self.m.items()}
        out |= {k + ".v": x for k, x in self.v.items()}
        out["adam_step"] = np.array(self.step + 1, dtype=np.float32)
        return out

    def take(self, outputs: dict[str, np.ndarray]) -> None:
        """Set the adapters and moments from a step's outputs (logical name -> array)."""
        for k in self.params:
            self.params[k] = outputs[k + ".new"]
            self.m[k] = outputs[k + ".m.new"]
            self.v[k] = outputs[k + ".v.new"]

    def update(self, outputs: dict[str, np.ndarray]) -> None:
        """Take a step's outputs as the new state, one step on."""
        self.take(outputs)
        self.step += 1


def peft_name(logical: str) -> str:
    """'L3.q.lora_A' -> 'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' (PEFT's key)."""
    layer, mod, which = logical.split(".")
    return f"base_model.model.model.layers.{layer[1:]}.{HF_MODULE[mod]}.{which}.weight"


def save_adapters(path: str | Path, state: AdapterState, tg: TaskGraph, base_model: str = "") -> Path:
    """Write the adapters as a PEFT adapter directory (``adapter_model.safetensors`` and
    ``adapter_config.json``); written to a temporary name and renamed, so a failure leaves nothing."""
    from turnip.runtime.weights import write_safetensors

    path = Path(path)
    tr = tg.meta["train"]
    lo = tr["lora"]
    tensors = {}
    for a in tr["adapters"]:
        A, B = state.params[a["A"]], state.params[a["B"]]
        tensors[peft_name(a["A"])] = np.ascontiguousarray(A.reshape(A.shape[0], -1))
        tensors[peft_name(a["B"])] = np.ascontiguousarray(B.reshape(-1, B.shape[-1]))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo["rank"], "lora_alpha": lo["alpha"],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "target_modules": sorted({HF_MODULE[m].split(".")[1] for m in lo["targets"]}),
        "base_model_name_or_path": base_model, "init_lora_weights": True, "use_rslora": False,
    }  # fmt: skip
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    write_safetensors(tmp / "adapter_model.safetensors", tensors)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


class Stepper:
    """Runs training steps of a loaded plan: per step only the tokens (``x0``, ``targets``) and the step
    number go in and the per-token losses come out; the adapters and their moments pass from one step to
    the next inside the backend (``backend.carry``: device copies when they are resident)."""

    def __init__(self, tg: TaskGraph, mg, backend, state: AdapterState):
        from turnip.runtime.weights import tile_inputs

        self.tg, self.mg, self.be, self.state = tg, mg, backend, state
        self.pairs = carry_pairs(tg)
        self.n_pred = tg.meta["train"]["predicted_tokens"]
        backend.write_inputs(tile_inputs(tg, {k: x for k, x in state.inputs().items() if k != "adam_step"}))

    def step(self, x0: np.ndarray, targets: np.ndarray, policy: str = "nondet", streams: int = 5, seed=None,
             stall_s: float = 120.0, grads: bool = False, device_times: bool = False,
             ordered_sums: bool = True):  # fmt: skip
        """One step; returns (mean loss, RunResult, {name: gradient} when ``grads``). ``device_times``: read
        every vertex's device times back (for traces; costs a driver call per vertex); ``ordered_sums``: partial
        sums added in compile order (bitwise reproducible; ``turnip.runtime.execute``)."""
        from turnip.runtime import execute
        from turnip.runtime.weights import tile_inputs

        step = np.array(self.state.step + 1, dtype=np.float32)
        self.be.write_inputs(tile_inputs(self.tg, {"x0": x0, "targets": targets, "adam_step": step}))
        res = execute(self.mg, self.be, policy, streams, seed=seed, stall_s=stall_s, device_times=device_times,
                      ordered_sums=ordered_sums)
        got = self._read(["loss", *(k + ".grad" for k in self.state.params if grads)])
        loss = float(got.pop("loss").astype(np.float64).sum() / self.n_pred)
        self.be.carry(self.pairs)
        self.state.step += 1
        return loss, res, {k[: -len(".grad")]: g for k, g in got.items()}

    def fetch(self) -> AdapterState:
        """The state after the last step, read back from the backend."""
        if self.state.step:
            self.state.take(self._read([o for o, _ in state_names(self.tg)]))
        return self.state

    def _read(self, names: list[str]) -> dict[str, np.ndarray]:
        """These logical outputs of the last step, read from the backend (only their tiles)."""
        from turnip.memgraph.interp import assemble

        blocks = self.tg.meta["output_blocks"]
        outs = self.be.read_outputs(only={int(v) for k in names for _, v in blocks[k][1]})
        return {k: assemble(self.tg, outs, k) for k in names}
