"""Decoding plans: a decode step of a LLaMA-family model over a KV cache held as blocks of carried state, and
the prefill variant that outputs every layer's keys and values for the cache (docs/generate.md).

A decode step takes one new token per sequence (batch B) and the cache of ``n_blocks`` blocks of ``block``
(T) slots. Every block is a taskgraph input per (decoder layer, key-value head block, token block, K or V) of
shape (T, B * Hk_b, F): slot-major, then sequence, then head, with the head dim widened from dh to F =
dh + ``PAD`` by a mask column (index dh) and zeros. The mask column holds 0 in a written slot and -``BIG``
in a free one (never written, a gap after a shorter prompt); queries carry 1 there, so a free slot's score
is scale * (q.k - BIG) and its softmax weight underflows to exactly 0. Attention therefore needs no
per-step parameter: the lengths live in the cache, and one plan serves every step of its bucket.

The step writes its new key and value rows into the last block (the only one a step of the bucket can
write): ``W`` (T, 1), one-hot at the step's slot, places the row (einsum) and an ``add_n`` adds it into the
block; the new key carries +BIG in its mask column, so the slot's -BIG becomes 0 exactly. The new last
blocks are outputs, carried into the block inputs for the next step (``carry_pairs``, as a LoRA step
carries its adapters). Positions arrive as per-sequence rotation matrices ``rot`` (B, F, dh): rotary
embedding is linear, so one batched einsum rotates (and widens) q and k.

Attention per key-value head block: the sequences ride in the head axis (B * Hk_b key-value heads, each
sequence's query heads reading its own), so one fused ``sdpa`` per cache block covers the whole batch
(split-K over blocks, merged by ``attn_combine``). The kernels' operand shapes are (1, B * Hk_b, r, F) and
(T, B * Hk_b, F): the projections' (B, Hk_b, r, F) and (B, Hk_b, F) hold the same bytes, and since no op
reshapes, a one-hot einsum (``S``, (1, B * Hk_b, B, Hk_b)) moves them across. Only ops of
``turnip.reference`` are used, so every backend runs decode plans as it runs prefills.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from turnip.graph import Graph, Tiling, TilingError, lower
from turnip.graph import _Lowering as _BaseLowering
from turnip.memgraph.plan import DTYPE_NBYTES
from turnip.models import LlamaConfig, batch_tiles, default_tiles, llama_graph, llama_tiles, split_tiling
from turnip.taskgraph import TaskGraph

PAD = 8  # head-dim columns added to cached keys and values: the mask column and alignment
BIG = 16384.0  # the mask magnitude: exact in fp16 and bf16, exp(-BIG * scale) is 0 in float32
DEFAULT_BLOCK = 256  # cache slots per block


ROWS_SWITCH = "TURNIP_DECODE_ROWS"  # "0": a decode step writes its new rows into a new last block (the old way)


def decode_rows_on() -> bool:
    """Whether decode steps output the new key and value rows alone (unless ``TURNIP_DECODE_ROWS=0``): every
    cache block is then read-only in the step, the new rows get an ``sdpa`` of their own (one slot) merged by
    ``attn_combine`` with the blocks', and the caller copies the rows into the block between steps
    (``backend.carry`` with ``rows``). The step no longer makes a new last block per (layer, head block, K or
    V): at batch 64 (7B, blocks of 256) those are 9.1 GB a step, offloaded to the host under 6 GiB. On an H100
    (7B, 6 GiB, prompt 512, 128 new tokens, same process): batch 64 734.8 ms a step against 767.3 (0.90 of the
    bound against 0.86; 679.4 ms of plan run against 727.2), batch 1 172.8 against 169.7
    (``benchmarks/results/generate/generate_rows_h100.md``)."""
    import os

    return os.environ.get(ROWS_SWITCH, "1") != "0"


def check_decodable(cfg: LlamaConfig) -> None:
    """``ValueError`` naming what decode plans do not run: they take plain LLaMA layers (GQA, rope scaling
    and tied embeddings included)."""
    if cfg.extras():
        raise ValueError(f"generation runs plain LLaMA layers; {cfg.name or 'this model'} has "
                         f"{', '.join(cfg.extras())}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """The shape of a decode plan: ``batch`` sequences, ``n_blocks`` cache blocks of ``block`` slots."""

    batch: int
    n_blocks: int
    block: int = DEFAULT_BLOCK

    @property
    def slots(self) -> int:
        return self.n_blocks * self.block


def width(cfg: LlamaConfig) -> int:
    """F: the cached head dim (dh plus the mask column and padding)."""
    return cfg.dh + PAD


def decode_tiles(cfg: LlamaConfig, n_gpus: int, dtype: str, budget_nbytes: int | None) -> dict:
    """Key-value heads and FFN columns in one block per GPU (a step's activations are a row per sequence, so
    fewer, larger blocks cost nothing but save vertices), split further in multiples of the GPU count where
    a block's weights would pass an eighth of the budget, as ``turnip.train.train_tiles`` does; tiny models
    (d_model <= 256) and the LM head's vocabulary blocks as their prefill (``default_tiles``)."""
    t = default_tiles(cfg, 1, n_gpus, dtype, budget_nbytes)
    out = {k: t[k] for k in ("h", "f", "v")}
    if cfg.d_model <= 256:
        return out
    G, nb, d = n_gpus, DTYPE_NBYTES[dtype], cfg.d_model
    cap = None if budget_nbytes is None else budget_nbytes // 8

    def tile(n: int, unit_nbytes: int) -> int:
        k = min(G, n)
        while cap is not None and k < n and -(-n // k) * unit_nbytes > cap:
            k = min(n, k + G)
        return -(-n // k)

    out["h"] = tile(cfg.kv_heads, (2 * cfg.group + 2) * cfg.dh * d * nb)  # wq, wo of the group; wk, wv
    out["f"] = tile(cfg.d_ffn, 3 * d * nb)
    return out


def decode_weight_tiles(cfg: LlamaConfig, n_gpus: int, dtype: str, budget_nbytes: int | None) -> dict:
    """The head and FFN tiles of the decode steps (``decode_tiles``): a prefill tiled so lays its weights out as
    the decode plans do, and the first decode plan finds them in the prefill's host region
    (``turnip.generation.shared_weights``)."""
    t = decode_tiles(cfg, n_gpus, dtype, budget_nbytes)
    return {k: t[k] for k in ("h", "f")}


def decode_graph(cfg: LlamaConfig, shape: DecodeShape, dtype: str = "fp16", rows: bool = False) -> Graph:
    """The logical decode step (module doc); weights named as ``turnip.models.llama_graph``'s. ``rows``: the
    step outputs its new rows instead of writing them into the last block (``decode_rows_on``): no ``W`` input,
    and new keys keep 0 in their mask column (no ``Ek``), so a row attends as a written slot."""
    check_decodable(cfg)
    B, s = shape.batch, cfg
    H, Hk, r, e, d, F = s.n_heads, s.kv_heads, s.group, s.dh, s.d_model, width(cfg)
    g = Graph(dtype=dtype)
    with g.layer_scope(-1):
        x = g.input("x0", "td", (B, d))
        rot = g.input("rot", "tae", (B, F, e))
        w = None if rows else g.input("W", "cx", (shape.block, 1))
    if r == 1:
        q_sub, q_w, o_sub, o_w = "td,hed->the", ("hed", (H, e, d)), "the,dhe->td", ("dhe", (d, H, e))
        qd, qs = "the", (B, H, e)
    else:
        q_sub, q_w, o_sub, o_w = "td,hred->thre", ("hred", (Hk, r, e, d)), "thre,dhre->td", ("dhre", (d, Hk, r, e))
        qd, qs = "thre", (B, Hk, r, e)
    qa = qd[:-1] + "a"
    with g.layer_scope(-1):  # the mask constants span every dim but the batch (kernels merge trailing dims)
        eq = g.input("Eq", qa[1:], (*qs[1:-1], F))
        ek = None if rows else g.input("Ek", "ha", (Hk, F))
        pv = g.input("Pv", "ae", (F, e))
    for i in range(s.n_layers):
        g.layer = i
        p = f"L{i}."
        h = g.rmsnorm(x, g.input(p + "attn_norm", "d", (d,)), eps=s.eps, name=p + "h")
        q = g.einsum(q_sub, h, g.input(p + "wq", *q_w), name=p + "q")
        k = g.einsum("td,hed->the", h, g.input(p + "wk", "hed", (Hk, e, d)), name=p + "k")
        v = g.einsum("td,hed->the", h, g.input(p + "wv", "hed", (Hk, e, d)), name=p + "v")
        qr = g.einsum(f"{qd},tae->{qa}", q, rot, name=p + "qr")
        qm = g.map("add_n", qr, eq, name=p + "qm")
        km = g.einsum("the,tae->tha", k, rot, name=p + "kr")
        if ek is not None:
            km = g.map("add_n", km, ek, name=p + "km")
        vm = g.einsum("the,ae->tha", v, pv, name=p + "vm")
        att = g._new("cache_attention", (qm, km, vm) if rows else (qm, km, vm, w), qa, (*qs[:-1], F),
                     {"scale": 1.0 / float(np.sqrt(e)), "n_blocks": shape.n_blocks, "block": shape.block,
                      "rows": rows}, name=p + "attn")  # fmt: skip
        a = g.cols(att, 0, e, qd, qs, name=p + "a")
        x = g.map("add_n", x, g.einsum(o_sub, a, g.input(p + "wo", *o_w), name=p + "o"), name=p + "x1")
        h2 = g.rmsnorm(x, g.input(p + "ffn_norm", "d", (d,)), eps=s.eps, name=p + "h2")
        gate = g.einsum("td,fd->tf", h2, g.input(p + "w_gate", "fd", (s.d_ffn, d)), name=p + "gate")
        up = g.einsum("td,fd->tf", h2, g.input(p + "w_up", "fd", (s.d_ffn, d)), name=p + "up")
        m = g.map("silu_mul", gate, up, name=p + "m")
        x = g.map("add_n", x, g.einsum("tf,df->td", m, g.input(p + "w_down", "df", (d, s.d_ffn)), name=p + "down"),
                  name=p + "x2")  # fmt: skip
    g.layer = s.n_layers
    hn = g.rmsnorm(x, g.input("final_norm", "d", (d,)), eps=s.eps, name="out")
    head = g.input("tok_embed" if s.tie_embeddings else "lm_head", "vd", (s.vocab, d))
    g.outputs = [g.einsum("td,vd->tv", hn, head, name="logits")]
    return g


class _DecodeLowering(_BaseLowering):
    """The prefill's lowering plus ``cache_attention``: per key-value head block, the cache's block inputs,
    the write of the new rows into the last block, one ``sdpa`` per block and their ``attn_combine``."""

    def __init__(self, g: Graph, tiling: Tiling, batch: int):
        super().__init__(g, tiling)
        self.batch = batch
        self.kv: list[dict] = []  # per cache block: layer, j, h0, h1, which, input vertex, output vertex (-1: none)
        self.merge: dict = {}  # (gpu, heads of the block) -> the one-hot S input
        self.carried: list[int] = []

    def run(self) -> TaskGraph:
        base = self.T
        pinned = [dataclasses.replace(base, pin=k) for k in range(base.n_gpus)] if base.parallel == "layers" else None
        for node in self.g.nodes:
            if pinned is not None:  # the layers split: each node on its layer's GPU (constants on the first)
                self.T = pinned[base.stage(node.layer)]
            getattr(self, "_" + ("map" if node.op in _elementwise() else node.op))(node)
        self.T = base
        outs = [v for x in self.g.outputs for v in self.blocks[x].values()] + self.carried
        ins = [n.out.id for n in self.g.nodes if n.op == "input"]
        return self.b.build(outputs=outs, meta={"tiles": dict(self.T.tiles), "input_blocks": self.block_map(ins),
                                                "output_blocks": self.block_map(self.g.outputs)})  # fmt: skip

    def _cache_attention(self, node) -> None:
        b, T = self.b, self.T
        rows_out = node.params.get("rows", False)  # the new rows are outputs, every block read-only
        q, k, v, w = (*node.inputs, None) if rows_out else node.inputs
        t = node.out
        qt = self.g.t(q)
        B, F = self.batch, t.shape[-1]
        r = t.shape[2] if len(t.shape) == 4 else 1
        nb, blk, layer = node.params["n_blocks"], node.params["block"], node.layer
        itemsize = DTYPE_NBYTES[t.dtype]
        out = {}
        for idx in self.grid(t):
            coords = dict(zip(t.dims, idx, strict=True))
            gpu = T.place(coords)
            h0, h1 = T.span("h", qt.shape[1], coords["h"])
            G = B * (h1 - h0)
            S = self._merge_input(gpu, h1 - h0)
            name = f"{t.name}[{coords['h']}]"
            qsub, qshape = ("xgth,thra->xgra", (1, G, r, F)) if r > 1 else ("xgth,tha->xga", (1, G, F))
            qv = b.kernel("einsum", [S, self.block(q, coords, gpu)], qshape, t.dtype, gpu, {"subscripts": qsub},
                          name=name + ".q")  # fmt: skip
            msub = {"subscripts": "xgth,tha->xga"}
            rows = [b.kernel("einsum", [S, self.block(x, coords, gpu)], (1, G, F), t.dtype, gpu, msub,
                             name=f"{name}.{c}new") for x, c in ((k, "k"), (v, "v"))]  # fmt: skip
            wv = None if rows_out else self.block(w, {}, gpu)
            parts = []
            split = nb > 1 or rows_out  # partial results merged by attn_combine
            pshape = (G * r * F + G * r * 4 // itemsize,) if split else qshape
            scale = node.params["scale"]
            for j in range(nb):
                kv = []
                for which, row in zip("KV", rows, strict=True):
                    bname = f"L{layer}.{which}{j}[{coords['h']}]"
                    x_in = b.input((blk, G, F), t.dtype, gpu, name=bname)
                    x_out = -1
                    if j == nb - 1 and rows_out:  # the step's slot: the new row, an output copied in after the step
                        x_out = row
                        self.carried.append(x_out)
                    elif j == nb - 1:  # the step's slot: the new row added into the block
                        put = b.kernel("einsum", [wv, row], (blk, G, F), t.dtype, gpu, {"subscripts": "cx,xga->cga"},
                                       name=bname + ".row")  # fmt: skip
                        x_out = b.kernel("add_n", [x_in, put], (blk, G, F), t.dtype, gpu, {}, name=bname + ".new")
                        self.carried.append(x_out)
                    self.kv.append({"layer": layer, "j": j, "h0": h0, "h1": h1, "which": which, "input": x_in,
                                    "output": x_out})  # fmt: skip
                    kv.append(x_in if x_out < 0 or rows_out else x_out)
                p = _sdpa_params(scale, blk, split, itemsize)
                parts.append(b.kernel("sdpa", [qv, *kv], pshape, t.dtype, gpu, p, name=f"{name}.A{j}"))
            if rows_out:  # the new rows attend as one more block of one slot
                p = _sdpa_params(scale, 1, split, itemsize)
                parts.append(b.kernel("sdpa", [qv, *rows], pshape, t.dtype, gpu, p, name=f"{name}.Anew"))
            o = parts[0]
            if split:
                p = {"tq": 1, "h": G * r, "dh": F, "itemsize": itemsize} | ({"r": r} if r > 1 else {})
                o = b.kernel("attn_combine", parts, qshape, t.dtype, gpu, p, name=name + ".o")
            osub = "xgth,xgra->thra" if r > 1 else "xgth,xga->tha"
            out[idx] = b.kernel("einsum", [S, o], self.bshape(t, idx), t.dtype, gpu, {"subscripts": osub},
                                name=name)  # fmt: skip
        self.blocks[t.id] = out

    def _merge_input(self, gpu: int, heads: int) -> int:
        """The one-hot S of ``heads`` key-value heads per sequence on ``gpu`` (one input shared by its layers)."""
        key = (gpu, heads)
        if key not in self.merge:
            G = self.batch * heads
            dtype = self.g.dtype
            self.merge[key] = self.b.input((1, G, self.batch, heads), dtype, gpu, name=f"S{heads}@{gpu}")
        return self.merge[key]


def _sdpa_params(scale: float, tk: int, partial: bool, itemsize: int) -> dict:
    """An ``sdpa`` over one cache block of ``tk`` slots for the step's one query row per head."""
    return {"scale": scale, "causal": False, "q_off": 0, "k_off": 0, "tk": tk, "partial": partial,
            "itemsize": itemsize}


def _elementwise():
    from turnip.graph import ELEMENTWISE

    return ELEMENTWISE


def decode_step(
    cfg: LlamaConfig, shape: DecodeShape, n_gpus: int = 1, dtype: str = "fp16", budget_nbytes: int | None = None,
    tiles: dict | None = None, split: str = "tensor", rows: bool | None = None,
) -> TaskGraph:  # fmt: skip
    """The taskgraph of one decode step (module doc). ``tg.meta["kv"]``: the cache blocks (layer, block j,
    heads [h0, h1), K or V, input vertex, output vertex or -1: the new last block, or with ``rows`` the new
    row, (1, B * heads, F)); ``tg.meta["merge"]``: the S inputs. ``rows`` (None: ``decode_rows_on()``): the
    step outputs its new rows (``decode_graph``). ``split``:
    ``tensor`` (head, FFN and vocabulary blocks over every GPU) or ``layers`` (whole decoder layers per GPU, tiled
    as on one GPU, with their cache blocks: a step passes one row per sequence from GPU to GPU, and has the
    vertices of a one-GPU step)."""
    if shape.batch < 1 or shape.n_blocks < 1 or shape.block < 1:
        raise ValueError(f"a decode step needs batch, cache blocks and block size >= 1, got {shape}")
    if not 1 <= n_gpus <= 8:
        raise ValueError(f"n_gpus must be in 1..8, got {n_gpus}")
    if dtype not in DTYPE_NBYTES or dtype == "int32":
        raise ValueError(f"dtype must be fp16, bf16 or fp32, got {dtype!r}")
    if split not in ("tensor", "layers"):
        raise ValueError(f"a decode step splits by tensor or layers, not {split!r}")
    rows = decode_rows_on() if rows is None else bool(rows)
    g = decode_graph(cfg, shape, dtype, rows)
    if split == "layers":
        t = decode_tiles(cfg, 1, dtype, budget_nbytes) | dict(tiles or {})
        tiling = Tiling(t, n_gpus=n_gpus, parallel="layers", n_layers=cfg.n_layers)
    else:
        t = decode_tiles(cfg, n_gpus, dtype, budget_nbytes) | dict(tiles or {})
        tiling = Tiling(t, n_gpus=n_gpus, parallel="hfv")
    lw = _DecodeLowering(g, tiling, shape.batch)
    tg = lw.run()
    tg.validate()
    tg.meta.update(model=cfg.name or "llama", n_gpus=n_gpus, dtype=dtype, head="decode", split=split,
                   batch=shape.batch, embed={"input": "x0", "table": "model.embed_tokens.weight"}, arch=cfg.arch,
                   decode={"n_blocks": shape.n_blocks, "block": shape.block, "width": width(cfg), "big": BIG,
                           "rows": rows},
                   kv=lw.kv, merge=[[int(v), int(k[1])] for k, v in lw.merge.items()])  # fmt: skip
    return tg


def writes_rows(tg: TaskGraph) -> bool:
    """Whether decode step ``tg`` outputs its new rows (``decode_rows_on``) rather than a new last block."""
    return bool(tg.meta["decode"].get("rows", False))


def carry_pairs(tg: TaskGraph) -> list[tuple[int, int]]:
    """(new last block, or new row, and its block input) per written cache block, for ``backend.carry``."""
    return [(int(c["output"]), int(c["input"])) for c in tg.meta["kv"] if c["output"] >= 0]


def state_inputs(tg: TaskGraph) -> tuple[int, ...]:
    """The cache block inputs of a decode step."""
    return tuple(int(c["input"]) for c in tg.meta["kv"])


def context_blocks(context: int, block: int = DEFAULT_BLOCK) -> int:
    """Cache blocks of the step whose new token is the ``context``-th of its sequence (it writes slot
    ``context - 1``): the bucket ``turnip generate`` runs that step in."""
    if context < 1 or block < 1:
        raise ValueError(f"a decode step needs a context and a block size >= 1, got {context} and {block}")
    return (context - 1) // block + 1


def decode_vertices(cfg: LlamaConfig, n_blocks: int, n_gpus: int = 1, dtype: str = "fp16",
                    budget_nbytes: int | None = None) -> int:  # fmt: skip
    """Taskgraph vertices of ``decode_step`` over ``n_blocks`` cache blocks (any batch and block size), from
    the step of one block: each further block adds a K and a V input and an ``sdpa`` per (layer, key-value
    head block), and more than one block an ``attn_combine`` each (a step with new rows as outputs,
    ``decode_rows_on``, has one already)."""
    rows = decode_rows_on()
    n, heads = _one_block(cfg, n_gpus, dtype, budget_nbytes, rows)
    return n + (n_blocks - 1) * 3 * heads + (heads if n_blocks > 1 and not rows else 0)


@functools.lru_cache(maxsize=32)
def _one_block(cfg: LlamaConfig, n_gpus: int, dtype: str, budget_nbytes: int | None, rows: bool) -> tuple[int, int]:
    """Vertices of a one-block step and its (layer, key-value head block) pairs."""
    tg = decode_step(cfg, DecodeShape(1, 1, 1), n_gpus, dtype, budget_nbytes, rows=rows)
    return tg.n, len(tg.meta["kv"]) // 2


def cache_nbytes(tg: TaskGraph) -> int:
    """Bytes of a decode step's cache blocks (all GPUs)."""
    return int(tg.nbytes[list(state_inputs(tg))].sum())


# ---------------------------------------------------------------- the prefill that fills the cache


def prefill_kv(
    cfg: LlamaConfig, seq: int, batch: int = 1, n_gpus: int = 1, dtype: str = "fp16",
    budget_nbytes: int | None = None, tiles: dict | None = None, logits: bool = False,
) -> TaskGraph:  # fmt: skip
    """A prefill of ``batch`` prompts of ``seq`` tokens (one after another in the token dim) whose outputs
    are every layer's rotated keys ``L{i}.kr`` and values ``L{i}.v`` (tokens, Hk, dh): what the cache holds.
    Nodes that reach no output (the last layer's FFN, the final norm) are dropped. ``tiles``: given tiles over
    the prefill's defaults (``decode_weight_tiles``: the weights tiled as the decode steps tile them).
    ``logits``: also the LM head's logits (batch, vocab) of one position per prompt, its last token's: the
    input ``Sel`` (batch, batch * seq) is one-hot at each prompt's last position (``last_token_rows``), an
    einsum over tokens picks those rows of the final norm's output (one product per sum: exact), so prompts
    of different lengths share the plan and the prefill gives each sequence its first new token."""
    check_decodable(cfg)
    t = llama_tiles(cfg, seq, n_gpus, dtype, tiles, None, budget_nbytes, "none", "tensor")
    t = batch_tiles(cfg, seq, batch, n_gpus, dtype, budget_nbytes, t, tiles)
    g = llama_graph(cfg, seq, dtype, None, "none", batch)
    outs = []
    for n in g.nodes:
        if n.op == "attention":
            outs += [n.inputs[1], n.inputs[2]]
    if logits:
        hn = g.outputs[0]  # the final norm over every token
        with g.layer_scope(-1):
            sel = g.input("Sel", "st", (batch, batch * seq))
        with g.layer_scope(cfg.n_layers):
            w = g.input("tok_embed" if cfg.tie_embeddings else "lm_head", "vd", (cfg.vocab, cfg.d_model))
            last = g.einsum("st,td->sd", sel, hn, name="last")
            outs.append(g.einsum("sd,vd->sv", last, w, name="logits"))
    g.outputs = outs
    g = prune(g)
    for n in g.nodes:  # the cache's names, whatever the graph called them
        if n.op != "input" and n.out.id in g.outputs and n.out.name != "logits":
            i = g.outputs.index(n.out.id)
            n.out = dataclasses.replace(n.out, name=f"L{i // 2}.{'kv'[i % 2]}cache")
    tg = lower(g, split_tiling(t, n_gpus, "tensor", cfg.n_layers, "hftv"))
    embed = {"input": "x0", "table": "model.embed_tokens.weight"}
    tg.meta.update(model=cfg.name or "llama", seq=seq, batch=batch, n_gpus=n_gpus, dtype=dtype,
                   head="kv+logits" if logits else "kv",
                   split="tensor", embed=embed, arch=cfg.arch)  # fmt: skip
    return tg


def last_token_rows(lens, seq: int, dtype: str) -> np.ndarray:
    """``Sel`` of a ``prefill_kv`` with logits: (batch, batch * seq), one-hot at prompt b's last token, row
    b * seq + lens[b] - 1."""
    from turnip.reference import _np_dtype

    lens = np.asarray(lens, dtype=np.int64)
    if lens.min() < 1 or lens.max() > seq:
        raise ValueError(f"prompt lengths {lens.tolist()} must lie in [1, {seq}]")
    out = np.zeros((len(lens), len(lens) * seq), dtype=_np_dtype(dtype))
    out[np.arange(len(lens)), np.arange(len(lens)) * seq + lens - 1] = 1
    return out


def prune(g: Graph) -> Graph:
    """``g`` without the nodes that reach no output (ids renumbered, order kept)."""
    need = set(g.outputs)
    for n in reversed(g.nodes):
        if n.out.id in need:
            need.update(n.inputs)
    keep = [n for n in g.nodes if n.out.id in need]
    new_id = {n.out.id: i for i, n in enumerate(keep)}
    out = Graph(dtype=g.dtype)
    for n in keep:
        t = dataclasses.replace(n.out, id=new_id[n.out.id])
        out.nodes.append(dataclasses.replace(n, inputs=tuple(new_id[i] for i in n.inputs), out=t))
    out.outputs = [new_id[i] for i in g.outputs]
    return out


__all__ = ["BIG", "DEFAULT_BLOCK", "PAD", "ROWS_SWITCH", "DecodeShape", "TilingError", "cache_nbytes", "carry_pairs",
           "check_decodable", "context_blocks", "decode_graph", "decode_rows_on", "decode_step", "decode_vertices",
           "last_token_rows", "prefill_kv", "prune", "state_inputs", "width", "writes_rows"]  # fmt: skip
