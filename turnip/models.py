"""Model builders: the paper's 3-GPU matmul example, LLaMA prefill, and random DAGs for property tests."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from turnip.graph import Graph, Tiling, lower
from turnip.memgraph.plan import DTYPE_NBYTES
from turnip.taskgraph import Builder, TaskGraph


@dataclass(frozen=True)
class LlamaConfig:
    """A LLaMA-family decoder (LLaMA 1-3, Mistral, Qwen 2/2.5/3, Phi-3, Gemma 1/2): the named presets, or
    any Hugging Face ``config.json`` through ``from_hf`` (``turnip.hfconfig``). ``n_kv_heads`` below
    ``n_heads`` is grouped-query attention (0: as many as query heads); ``head_dim`` 0: ``d_model //
    n_heads``; ``rope_scaling``: () or LLaMA-3's (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings). The family's variations (all off by default, plain LLaMA):
    ``window`` > 0: causal sliding-window attention (query i sees keys i - window < j <= i) in the layers
    ``window_layers`` (all when empty); ``qkv_bias`` / ``o_bias``: projection biases; ``qk_norm``: RMSNorm
    of each query and key head over the head dim before rotary (Qwen 3); ``act``: ``silu`` (SwiGLU) or
    ``gelu_tanh`` (GeGLU); ``norm_offset``: RMSNorm weights are ``offset + w`` (Gemma: 1); ``embed_scale``:
    the embedded prompt times it (Gemma: sqrt(d)); ``attn_scale``: the score scale (0: 1 / sqrt(head_dim));
    ``attn_softcap`` / ``logit_softcap``: scores / final logits capped as c tanh(x / c) (0: off);
    ``sandwich``: norms after attention and after the FFN too (Gemma 2); ``arch``: the Hugging Face
    ``model_type``, which names the checkpoint's tensors (``turnip.hfconfig.hf_source``)."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ffn: int
    vocab: int = 32000
    n_kv_heads: int = 0
    head_dim: int = 0
    eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()
    tie_embeddings: bool = False
    name: str = ""
    window: int = 0
    window_layers: tuple = ()
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    sandwich: bool = False
    arch: str = "llama"

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dh(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: multi-head attention)."""
        return self.n_heads // self.kv_heads

    def rope_params(self) -> dict:
        """The ``rotary`` op's frequency params (``turnip.reference.rope_inv_freq``)."""
        p = {"theta": float(self.rope_theta)}
        if self.rope_scaling:
            f, lo, hi, orig = self.rope_scaling
            p |= {"rope_factor": float(f), "rope_low": float(lo), "rope_high": float(hi), "rope_orig": float(orig)}
        return p

    def layer_window(self, layer: int) -> int:
        """The sliding window of decoder ``layer`` (0: full causal attention)."""
        return self.window if self.window and (not self.window_layers or layer in self.window_layers) else 0

    def extras(self) -> list[str]:
        """The variations on plain LLaMA this config has, by field name (what LoRA training refuses)."""
        plain = LlamaConfig(1, 1, 1, 1)
        keys = ("window", "qkv_bias", "o_bias", "qk_norm", "act", "norm_offset", "embed_scale", "attn_scale",
                "attn_softcap", "logit_softcap", "sandwich")  # fmt: skip
        return [k for k in keys if getattr(self, k) != getattr(plain, k)]

    def layer_nbytes(self, itemsize: int) -> int:
        """Bytes of one decoder layer's weights (biases and extra norms included)."""
        d, e, H, Hk = self.d_model, self.dh, self.n_heads, self.kv_heads
        n = 2 * d + d * e * (2 * H + 2 * Hk) + 3 * d * self.d_ffn
        n += (H + 2 * Hk) * e * self.qkv_bias + d * self.o_bias + 2 * e * self.qk_norm + 2 * d * self.sandwich
        return n * itemsize

    def weight_nbytes(self, itemsize: int, n_layers: int | None = None, head: bool = True) -> int:
        """Bytes of the weights a prefill reads on the GPU: layers, final norm, the LM head if any."""
        L = self.n_layers if n_layers is None else n_layers
        d = self.d_model
        return L * self.layer_nbytes(itemsize) + (d + (self.vocab * d if head else 0)) * itemsize

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict; ``ValueError`` (one line) names the field turnip cannot
        run (``turnip.hfconfig.config_fields``)."""
        from turnip.hfconfig import config_fields

        return cls(**config_fields(cfg, name), name=name)


LlamaShape = LlamaConfig  # the presets' old name

LLAMA = {
    "7b": LlamaConfig(4096, 32, 32, 11008, name="llama-7b"),
    "13b": LlamaConfig(5120, 40, 40, 13824, name="llama-13b"),
    "65b": LlamaConfig(8192, 80, 64, 22016, name="llama-65b"),
    "tiny": LlamaConfig(64, 2, 4, 160, vocab=64, name="llama-tiny"),
    "tiny-gqa": LlamaConfig(64, 2, 4, 160, vocab=96, n_kv_heads=2, rope_theta=500000.0, name="llama-tiny-gqa",
                            rope_scaling=(8.0, 1.0, 4.0, 32.0), tie_embeddings=True),  # fmt: skip
}
# the tile sizes a LLaMA prefill takes (the hidden and head dimensions stay whole: norms and rotary need them)
LLAMA_TILES = {"t": "tokens", "h": "key-value heads", "f": "FFN columns", "kv": "key range in tokens, a multiple of t",
               "v": "vocabulary rows of the LM head"}  # fmt: skip
# across GPUs: blocks of heads, FFN and vocabulary; whole decoder layers; or token tiles (whole sequences in
# training), every GPU loading the frozen weights it reads
SPLITS = ("tensor", "layers", "data")
HEADS = ("none", "last", "all")  # LM head: none (final hidden states out), last position's logits, all positions'


def read_config_json(f: Path) -> dict:
    """A ``config.json`` as a dict; ``ValueError`` naming the file when it is unreadable or not an object."""
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: cannot read the config: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: the config is not a JSON object")
    return cfg


def load_config(path: str | Path) -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face model directory or ``config.json`` file."""
    path = Path(path)
    f = path / "config.json" if path.is_dir() else path
    if not f.is_file():
        raise ValueError(f"{path}: no config.json (a Hugging Face model directory or its config.json is needed)")
    cfg = read_config_json(f)
    name = path.resolve().name if path.is_dir() else path.stem
    if name == "config":
        name = path.resolve().parent.name
    return LlamaConfig.from_hf(cfg, name=f"hf:{name}")


def llama_config(model: str) -> LlamaConfig | None:
    """A model argument as a LLaMA config: ``llama-7b`` (a preset), a Hugging Face directory or a
    ``config.json``; None for the other named models."""
    if model.startswith("llama-") and model[6:] in LLAMA:
        return LLAMA[model[6:]]
    if model in ("paper-matmul", "random") or model.startswith("llama-") and not Path(model).exists():
        return None
    if Path(model).exists():
        return load_config(model)
    return None


def check_split(split: str, n_gpus: int, n_layers: int) -> None:
    """``ValueError`` for a split that is not one of ``SPLITS``, or layers over more GPUs than layers."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "layers" and n_layers < n_gpus:
        few = f"{n_layers} layer{'s' if n_layers > 1 else ''}"
        raise ValueError(f"the layers split puts whole decoder layers on GPUs: {few} cannot fill {n_gpus} GPUs; use "
                         f"the tensor split or at most {n_layers} GPU{'s' if n_layers > 1 else ''}")  # fmt: skip


def check_llama_args(
    shape: LlamaConfig,
    seq: int,
    n_gpus: int,
    dtype: str,
    tiles: dict | None,
    n_layers: int | None,
    t_tile: int | None = None,
    head: str = "none",
    split: str = "tensor",
) -> None:
    """Raise ``ValueError`` naming the first bad argument of a LLaMA prefill or training step
    (``t_tile``: the token tile in effect, given or default; when known, a given ``kv`` must be a multiple of
    it)."""
    if not 1 <= n_gpus <= 8:
        raise ValueError(f"n_gpus must be in 1..8, got {n_gpus}")
    if dtype not in ("fp16", "bf16", "fp32"):
        raise ValueError(f"dtype must be fp16, bf16 or fp32, got {dtype!r}")
    if seq < 1:
        raise ValueError(f"seq must be positive, got {seq}")
    if head not in HEADS:
        raise ValueError(f"LM head must be one of {HEADS}, got {head!r}")
    if n_layers is not None and not 1 <= n_layers <= shape.n_layers:
        raise ValueError(f"n_layers must be in 1..{shape.n_layers} for this model, got {n_layers}")
    check_split(split, n_gpus, shape.n_layers if n_layers is None else n_layers)
    for k, v in (tiles or {}).items():
        if k not in LLAMA_TILES:
            names = ", ".join(f"{n} ({what})" for n, what in LLAMA_TILES.items())
            raise ValueError(f"unknown tile {k!r}; LLaMA tiles are {names}")
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"tile {k}={v!r} must be a positive integer")
    kv = (tiles or {}).get("kv")
    if kv is not None and t_tile is not None and kv % t_tile:
        up = -(-kv // t_tile) * t_tile
        raise ValueError(f"tile kv={kv} must be a multiple of the token tile t={t_tile} (e.g. kv={up})")


def llama_tiles(
    shape: LlamaConfig, seq: int, n_gpus: int, dtype: str, tiles: dict | None, n_layers: int | None,
    budget_nbytes: int | None, head: str = "none", split: str = "tensor",
) -> dict:  # fmt: skip
    """The tiles a LLaMA prefill takes: the given ones over ``default_tiles``, every argument checked
    (``ValueError`` naming the first bad one; the given tiles before the defaults use them). The layers
    split tiles as one GPU does, with at least ``n_gpus`` token tiles where the prompt allows (the stages
    need work to overlap)."""
    check_llama_args(shape, seq, n_gpus, dtype, tiles, n_layers, head=head, split=split)
    if split == "layers":
        t = default_tiles(shape, seq, 1, dtype, budget_nbytes, token_tiles=n_gpus) | dict(tiles or {})
    elif split == "data":
        t = sequence_tiles(shape, seq, n_gpus, dtype, budget_nbytes) | dict(tiles or {})
    else:
        t = default_tiles(shape, seq, n_gpus, dtype, budget_nbytes) | dict(tiles or {})
    check_llama_args(shape, seq, n_gpus, dtype, tiles, n_layers, int(t.get("t", seq)), head=head, split=split)
    return t


MIN_PIPELINE_TILE = 512  # the layers split's token tile stays at least this (where the prompt is longer)


def default_tiles(
    shape: LlamaConfig, seq: int, n_gpus: int, dtype: str = "fp16", budget_nbytes: int | None = None,
    token_tiles: int = 1,
) -> dict:  # fmt: skip
    """Key-value heads and FFN in max(2, GPUs) blocks; the largest token tile ``t`` of 8192..1024 (else 512)
    whose FFN activations (gate, up, product and a partial of the down projection: 4 * t * f_block values)
    take at most a quarter of the budget (8192 without a budget). Attention is fused (no score tiles), so
    larger tiles cost no masked work; fewer, larger vertices cost less host launch time and make larger
    GEMMs. ``token_tiles``: at least that many token tiles (``t`` a power of two, at least 512) where the
    prompt allows. Key ranges (``kv``) stay whole unless a head block's keys and values for the whole
    sequence, twice over (the blocks and their concatenation), exceed half of the budget. The LM head's
    vocabulary rows (``v``) in one block per GPU, smaller where a block would pass an eighth of the budget."""
    nb = DTYPE_NBYTES[dtype]
    G = max(1, n_gpus)
    v_blocks = G
    if budget_nbytes is not None:
        v_blocks = max(G, -(-shape.vocab * shape.d_model * nb // max(1, budget_nbytes // 8)))
    v = -(-shape.vocab // v_blocks)
    if shape.d_model <= 256:
        return {"t": max(8, seq // 4), "h": max(1, shape.kv_heads // 2), "f": -(-shape.d_ffn // 2), "v": v}
    blocks = max(2, n_gpus)
    h, f = max(1, shape.kv_heads // blocks), -(-shape.d_ffn // blocks)
    t = 8192
    if budget_nbytes is not None:
        fits = [c for c in (8192, 4096, 2048, 1024) if 4 * c * f * nb <= budget_nbytes // 4]
        t = fits[0] if fits else 512
    if token_tiles > 1:
        t = min(t, max(MIN_PIPELINE_TILE, 1 << (max(1, seq // token_tiles).bit_length() - 1)))
    t = min(seq, t)
    tiles = {"t": t, "h": h, "f": f, "v": v}
    if budget_nbytes is not None:
        per_token = 4 * h * shape.dh * nb  # K and V, blocks and concatenation
        kv = max(t, (budget_nbytes // 2 // per_token) // t * t)
        if kv < seq:
            tiles["kv"] = kv
    return tiles


SPREAD_MIN_TILE = 4096  # the tensor split's token tile tried for a long prompt stays at least this
TILE_CHOICE_MARGIN = 0.05  # the spread tile's plan is kept only where predicted this much faster
TILE_CHOICE_SWITCH = "TURNIP_TILE_CHOICE"


def tile_choice_on() -> bool:
    """Whether a compile also builds the tensor split with ``spread_token_tile`` and keeps that plan where it is
    predicted ``TILE_CHOICE_MARGIN`` faster: yes unless ``TURNIP_TILE_CHOICE=0``. Measured on one H100 quad
    (``turnip run``, medians): LLaMA-65B, 16K prompt, 30 GiB per GPU, t=4096 against 8192: predicted 7.3% faster,
    ran 1,163-1,169 ms against 1,268-1,273 (8.2%); LLaMA-7B 16K at 6 GiB and 1 GiB per GPU, predicted 3.3% and
    2.7% faster (so not kept), ran 1.5% faster and 5.2% slower: the smaller tile's extra vertices are host work,
    which the profile underestimates on these hosts."""
    return os.environ.get(TILE_CHOICE_SWITCH, "1") != "0"


def spread_token_tile(shape: LlamaConfig, seq: int, n_gpus: int, dtype: str, budget_nbytes: int | None,
                      tiles: dict | None = None) -> int | None:  # fmt: skip
    """Under the tensor split a token block of the residual stream (its sums of partials, norms and adds) sits on
    GPU block % n_gpus, so a prompt in fewer token tiles than GPUs leaves that work, and the partials sent to it,
    on a few GPUs. The largest power-of-two token tile of at least ``SPREAD_MIN_TILE`` that gives every GPU a
    token tile, where the default one (``default_tiles``) gives fewer and ``tiles`` gives none; else None.
    Smaller tiles cost more vertices (host time): whether it pays is the simulator's call (``turnip.compile``)."""
    if n_gpus < 2 or "t" in (tiles or {}) or shape.d_model <= 256:
        return None
    t = default_tiles(shape, seq, n_gpus, dtype, budget_nbytes)["t"]
    if -(-seq // t) >= n_gpus:
        return None
    spread = 1 << ((seq // n_gpus).bit_length() - 1)
    return spread if SPREAD_MIN_TILE <= spread < t else None


PACK_PROMPTS_SWITCH = "TURNIP_PACK_PROMPTS"  # "0": one prompt per token tile in a batched prefill


def pack_prompts_on() -> bool:
    """Whether batched prefills pack short prompts several to a token tile: on unless ``TURNIP_PACK_PROMPTS=0``
    (measured on four H100s, LLaMA-65B, 8 prompts of 1K at 30 GiB per GPU, one machine: 1,148.5 ms with a
    prompt per tile, 750.2 packed; 45,140 vertices against 7,683)."""
    return os.environ.get(PACK_PROMPTS_SWITCH, "1") != "0"


def batch_tiles(shape: LlamaConfig, seq: int, batch: int, n_gpus: int, dtype: str, budget_nbytes: int | None,
                tiles: dict, given: dict | None = None, split: str = "tensor") -> dict:  # fmt: skip
    """``tiles`` of a prefill of ``batch`` prompts of ``seq`` tokens: a token tile that does not divide ``seq``
    becomes the largest that does (a ``given`` one is refused), key ranges a multiple of it; then, under the
    tensor split with no token tile given, the prompts packed (``pack_prompts``)."""
    t = dict(tiles)
    if batch > 1 and seq % t["t"]:
        if given and "t" in given:
            raise ValueError(f"tile t={t['t']} must divide the prompt length {seq} when prompts are batched")
        t["t"] = max(c for c in range(1, t["t"] + 1) if seq % c == 0)  # the largest tile that divides seq
        if "kv" in t:
            t["kv"] = max(t["t"], t["kv"] // t["t"] * t["t"])
    if split == "tensor" and not (given and "t" in given):
        t = pack_prompts(shape, seq, batch, n_gpus, dtype, budget_nbytes, t)
    return t


SNAKE_MIN_TILE = 2048  # a prompt's data split takes two token tiles per GPU where each holds this many tokens


def sequence_tiles(shape: LlamaConfig, seq: int, n_gpus: int, dtype: str, budget_nbytes: int | None) -> dict:
    """Tiles of a prompt split by tokens (the data split of a prefill): at least ``n_gpus`` token tiles where the
    prompt allows (``default_tiles``' rule for the layers split), two per GPU where each holds at least
    ``SNAKE_MIN_TILE`` tokens (placed back and forth: causal attention's work balanced), key-value heads whole
    and the FFN in as few blocks as keep one block's three weight matrices within an eighth of the budget: each
    GPU runs whole layers on its tokens, so larger blocks only save vertices."""
    t = default_tiles(shape, seq, 1, dtype, budget_nbytes, token_tiles=n_gpus)
    if n_gpus > 1 and seq // t["t"] <= n_gpus and seq >= 2 * n_gpus * SNAKE_MIN_TILE:  # two tiles a GPU, placed
        t["t"] = min(t["t"], 1 << ((seq // (2 * n_gpus)).bit_length() - 1))  # back and forth (Tiling.snake)
    if shape.d_model <= 256:
        return t
    return t | {"h": shape.kv_heads, "f": -(-shape.d_ffn // ffn_blocks(shape, dtype, budget_nbytes))}


def ffn_blocks(shape: LlamaConfig, dtype: str, budget_nbytes: int | None, step: int = 1) -> int:
    """FFN column blocks, a multiple of ``step`` (the GPU count where blocks go round-robin): the fewest that keep
    one block's three weight matrices within an eighth of the budget (``step`` without a budget)."""
    blocks, nb = step, DTYPE_NBYTES[dtype]
    if budget_nbytes is not None:
        while blocks < shape.d_ffn and 3 * shape.d_model * -(-shape.d_ffn // blocks) * nb > budget_nbytes // 8:
            blocks += step
    return blocks


def pack_prompts(shape: LlamaConfig, seq: int, batch: int, n_gpus: int, dtype: str, budget_nbytes: int | None,
                 tiles: dict) -> dict:  # fmt: skip
    """``tiles`` of a batched prefill (``batch`` prompts of ``seq`` tokens), with ``pack_prompts_on()`` and a
    token tile holding one whole prompt: the tile grown to as many whole prompts as the budget's token tile for
    the batch's tokens holds (``default_tiles``), so a batch of 64 prompts of 512 tokens is a few tiles, not 64
    (attention and rotary keep each prompt apart: ``turnip.reference.packed``)."""
    if not pack_prompts_on() or batch < 2 or tiles.get("t") != seq or "kv" in tiles:
        return tiles
    cap = default_tiles(shape, seq * batch, n_gpus, dtype, budget_nbytes)["t"]
    k = max(1, min(batch, cap // seq))
    return tiles | {"t": seq * k}


def split_tiling(tiles: dict, n_gpus: int, split: str, n_layers: int, parallel: str,
                 replicate=frozenset(), snake: bool = False, spread: bool = False) -> Tiling:  # fmt: skip
    """The ``Tiling`` of a split: blocks of the ``parallel`` letters round-robin (tensor), whole layers
    (layers), or token tiles round-robin (``snake``: back and forth) with the ``replicate`` inputs loaded by
    every GPU that reads them (data)."""
    if split == "layers":
        return Tiling(tiles, n_gpus=n_gpus, parallel="layers", n_layers=n_layers)
    if split == "data":
        return Tiling(tiles, n_gpus=n_gpus, parallel="t", replicate=frozenset(replicate), snake=snake, spread=spread)
    return Tiling(tiles, n_gpus=n_gpus, parallel=parallel)


def llama_graph(
    cfg: LlamaConfig | str = "7b", seq: int = 4096, dtype: str = "fp16", n_layers: int | None = None,
    head: str = "none", batch: int = 1,
) -> Graph:  # fmt: skip
    """Logical LLaMA prefill in Hugging Face weight layouts (a checkpoint loads by reshapes): the embedded
    prompt ``x0`` (gathered on the host from the embedding table), ``n_layers`` decoder layers, the final
    norm; then hidden states out (``head="none"``) or the LM head's logits of the last position
    (``"last"``) or of all positions (``"all"``). Grouped-query attention keeps query heads as (key-value
    head, group) axes, letters ``h`` and ``r``, so a key-value head block carries its query heads. ``batch``
    > 1: that many prompts of ``seq`` tokens one after another in the token dim (each attends to itself;
    positions restart), with every position's output (head none or all). The config's family variations
    use existing ops where one serves: biases ``L{i}.bq`` .. ``bo`` as ``add_n`` over an input broadcast
    over tokens, per-head q/k norms (``q_norm``, ``k_norm``) as ``rmsnorm`` over the head dim, the
    embedding scale as ``scale``; Gemma 2's extra norms are ``post_attn_norm`` and ``post_ffn_norm``."""
    s = LLAMA[cfg] if isinstance(cfg, str) else cfg
    L = s.n_layers if n_layers is None else n_layers
    H, Hk, r, e, d = s.n_heads, s.kv_heads, s.group, s.dh, s.d_model
    if batch > 1 and head == "last":
        raise ValueError(f"the last position's logits are for one prompt; with a batch of {batch} use --logits all "
                         "(every position's) or none")  # fmt: skip
    sq = {"seq": seq} if batch > 1 else {}
    g = Graph(dtype=dtype)
    with g.layer_scope(-1):
        x = g.input("x0", "td", (batch * seq, d))
        if s.embed_scale != 1.0:  # in the compute dtype, as transformers scales (Gemma)
            x = g.map("scale", x, alpha=float(_rounded(s.embed_scale, dtype)), name="x0s")
    rope = s.rope_params()
    if r == 1:
        q_sub, q_w, o_sub, o_w = "td,hed->the", ("hed", (H, e, d)), "the,dhe->td", ("dhe", (d, H, e))
    else:
        q_sub, q_w, o_sub, o_w = "td,hred->thre", ("hred", (Hk, r, e, d)), "thre,dhre->td", ("dhre", (d, Hk, r, e))
    nk = {"eps": s.eps, "offset": s.norm_offset}
    for i in range(L):
        g.layer = i  # the nodes of decoder layer i (``Graph.layer_scope``)
        p = f"L{i}."

        def norm(y, w, name, shape=(d,), dims="d", p=p):
            return g.rmsnorm(y, g.input(p + w, dims, shape), name=p + name, **nk)

        def proj(sub, y, w, wdims, wshape, name, bias=False, p=p):
            out = g.einsum(sub, y, g.input(p + w, wdims, wshape), name=p + name)
            if bias:  # the bias broadcasts over tokens: its dims are the output's but the first
                o = g.t(out)
                out = g.map("add_n", out, g.input(p + "b" + w[1:], o.dims[1:], o.shape[1:]), name=p + name + "b")
            return out

        h = norm(x, "attn_norm", "h")
        q = proj(q_sub, h, "wq", *q_w, "q", s.qkv_bias)
        k, v = (proj("td,hed->the", h, w, "hed", (Hk, e, d), n, s.qkv_bias) for w, n in (("wk", "k"), ("wv", "v")))
        if s.qk_norm:  # per head over the head dim, before rotary (Qwen 3)
            q, k = norm(q, "q_norm", "qn", (e,), "e"), norm(k, "k_norm", "kn", (e,), "e")
        a = g.attention(g.rotary(q, name=p + "qr", **rope, **sq), g.rotary(k, name=p + "kr", **rope, **sq), v,
                        name=p + "attn", scale=s.attn_scale, window=s.layer_window(i), softcap=s.attn_softcap,
                        **sq)  # fmt: skip
        o = proj(o_sub, a, "wo", *o_w, "o", s.o_bias)
        if s.sandwich:
            o = norm(o, "post_attn_norm", "on")
        x = g.map("add_n", x, o, name=p + "x1")
        h2 = norm(x, "ffn_norm", "h2")
        gate = g.einsum("td,fd->tf", h2, g.input(p + "w_gate", "fd", (s.d_ffn, d)), name=p + "gate")
        up = g.einsum("td,fd->tf", h2, g.input(p + "w_up", "fd", (s.d_ffn, d)), name=p + "up")
        m = g.map("silu_mul" if s.act == "silu" else "gelu_tanh_mul", gate, up, name=p + "m")
        down = g.einsum("tf,df->td", m, g.input(p + "w_down", "df", (d, s.d_ffn)), name=p + "down")
        if s.sandwich:
            down = norm(down, "post_ffn_norm", "dn")
        x = g.map("add_n", x, down, name=p + "x2")
    g.layer = L  # after the last layer: final norm and LM head
    final = g.input("final_norm", "d", (d,))
    if head == "none":
        g.outputs = [g.rmsnorm(x, final, name="out", **nk)]
        return g
    w = g.input("tok_embed" if s.tie_embeddings else "lm_head", "vd", (s.vocab, d))
    if head == "last":
        hn = g.rmsnorm(g.rows(x, seq - 1, seq, name="last"), final, name="out", **nk)
        logits = g.einsum("sd,vd->sv", hn, w, name="logits_raw" if s.logit_softcap else "logits")
    else:
        out = g.rmsnorm(x, final, name="out", **nk)
        logits = g.einsum("td,vd->tv", out, w, name="logits_raw" if s.logit_softcap else "logits")
    if s.logit_softcap:  # Gemma 2: the final logits capped (the output keeps the name ``logits``)
        logits = g.map("softcap", logits, cap=s.logit_softcap, name="logits")
    g.outputs = [logits]
    return g


def _rounded(x: float, dtype: str) -> float:
    """``x`` rounded to ``dtype`` (fp16, bf16 or fp32)."""
    from turnip.reference import _np_dtype

    return float(np.asarray(x, dtype=np.float32).astype(_np_dtype(dtype)).astype(np.float64))


def llama_prefill(
    size: LlamaConfig | str = "7b",
    seq: int = 4096,
    n_gpus: int = 1,
    dtype: str = "fp16",
    tiles: dict | None = None,
    n_layers: int | None = None,
    budget_nbytes: int | None = None,
    head: str = "none",
    batch: int = 1,
    split: str = "tensor",
) -> TaskGraph:
    """LLaMA prefill tiled over ``n_gpus``; the default token tile grows with ``budget_nbytes`` when it is
    given (``default_tiles``). ``split``: ``"tensor"``: key-value head blocks, FFN and vocabulary blocks
    split across GPUs; ``"layers"``: decoder layer i of L on GPU floor(i * n_gpus / L), the prompt's
    embedding on GPU 0 and the final norm and LM head on the last (a pipeline: only the hidden state crosses
    GPUs); ``"data"``: token tiles round-robin over GPUs, each GPU loading every weight (replica inputs) and
    running whole layers on its tokens; only keys and values cross, to the GPUs of later tokens
    (``sequence_tiles``). ``size``: a preset name or a ``LlamaConfig``. ``batch``: prompts of ``seq`` tokens each
    (``llama_graph``); the token tile then divides ``seq``."""
    if isinstance(size, str):
        shape = LLAMA.get(size)
        if shape is None:
            raise ValueError(f"unknown LLaMA size {size!r}; choose from {sorted(LLAMA)}")
    else:
        shape = size
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    t = llama_tiles(shape, seq, n_gpus, dtype, tiles, n_layers, budget_nbytes, head, split)
    t = batch_tiles(shape, seq, batch, n_gpus, dtype, budget_nbytes, t, tiles, split)
    graph = llama_graph(shape, seq, dtype, n_layers, head, batch)
    frozen = {n.out.name for n in graph.nodes if n.op == "input" and "t" not in n.out.dims}
    tg = lower(graph, split_tiling(t, n_gpus, split, shape.n_layers if n_layers is None else n_layers, "hftv",
                                   replicate=frozen, snake=batch == 1))  # fmt: skip
    name = shape.name or (f"llama-{size}" if isinstance(size, str) else "llama")
    tg.meta.update(model=name, seq=seq, batch=batch, n_gpus=n_gpus, dtype=dtype, head=head, split=split,
                   embed={"input": "x0", "table": "model.embed_tokens.weight"}, arch=shape.arch)  # fmt: skip
    return tg


def matmul_example(unit_nbytes: int = 256) -> TaskGraph:
    """The paper's 3-GPU X×Y example: each GPU multiplies its X_g and Y_g blocks, GPU 0 sums the
    partials (two transfers in, the first sum also re-reading X_0), and the result goes back to GPU 1 (a
    third transfer) for a final kernel. Six kernels, three transfers, unit-size fp32 tensors; GPU 0 handles
    seven tensors (two inputs, five created)."""
    n = unit_nbytes // 4
    b = Builder(3)

    def mix(args, gpu, name):
        return b.kernel("mix", args, (n,), "fp32", gpu, {"n_out": n}, name=name)

    xs = [(b.input((n,), "fp32", g, f"X{g}"), b.input((n,), "fp32", g, f"Y{g}")) for g in range(3)]
    parts = [mix(list(xy), g, f"P{g}") for g, xy in enumerate(xs)]
    t1, t2 = b.transfer(parts[1], 0, "P1@gpu0"), b.transfer(parts[2], 0, "P2@gpu0")
    z1 = mix([parts[0], t1, xs[0][0]], 0, "Z1")
    z = mix([z1, t2], 0, "Z")
    out = mix([b.transfer(z, 1, "Z@gpu1")], 1, "out")
    tg = b.build(outputs=[out], meta={"model": "paper-matmul"})
    tg.validate()
    return tg


def random_dag(
    rng: np.random.Generator,
    n_kernels: int = 30,
    n_gpus: int = 1,
    max_args: int = 3,
    max_elems: int = 512,
    p_sum_into: float = 0.15,
    n_inputs: int | None = None,
) -> TaskGraph:
    """Random DAG of ``mix`` kernels on fp32 vectors of random sizes, with inputs, transfers between
    GPUs and sum_into groups; a random subset of sinks are outputs."""
    b = Builder(n_gpus)
    moves: dict = {}
    n_in = n_inputs if n_inputs is not None else max(2, n_kernels // 4)
    live = []
    for i in range(n_in):
        n = int(rng.integers(1, max_elems + 1))
        live.append(b.input((n,), "fp32", int(rng.integers(n_gpus)), f"in{i}"))
    used = set()
    for i in range(n_kernels):
        gpu = int(rng.integers(n_gpus))
        k = int(rng.integers(1, max_args + 1))
        args = [live[int(j)] for j in rng.choice(len(live), size=min(k, len(live)), replace=False)]
        used.update(args)
        args = [b.to_gpu(a, gpu, moves) for a in args]
        n = int(rng.integers(1, max_elems + 1))
        v = b.kernel("mix", args, (n,), "fp32", gpu, {"n_out": n}, name=f"k{i}")
        if rng.random() < p_sum_into:
            for j in range(int(rng.integers(1, 4))):
                pa = [b.to_gpu(live[int(rng.integers(len(live)))], gpu, moves)]
                part = b.kernel("mix", pa, (n,), "fp32", gpu, {"n_out": n}, name=f"k{i}.p{j}")
                b.sum_into(v, part, name=f"k{i}+={j}")
        live.append(v)
    sinks = [v for v in live[n_in:] if v not in used]
    outs = [v for v in sinks if rng.random() < 0.5] or sinks[-1:]
    tg = b.build(outputs=outs, meta={"model": "random"})
    tg.validate()
    return tg
