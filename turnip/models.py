"""Model builders: the paper's 3-GPU matmul example, LLaMA prefill, and random DAGs for property tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnip.graph import Graph, Tiling, lower
from turnip.memgraph.plan import DTYPE_NBYTES
from turnip.taskgraph import Builder, TaskGraph


@dataclass(frozen=True)
class LlamaShape:
    d_model: int
    n_layers: int
    n_heads: int
    d_ffn: int
    vocab: int = 32000


LLAMA = {
    "7b": LlamaShape(4096, 32, 32, 11008),
    "13b": LlamaShape(5120, 40, 40, 13824),
    "65b": LlamaShape(8192, 80, 64, 22016),
    "tiny": LlamaShape(64, 2, 4, 160, vocab=64),
}
# the tile sizes a LLaMA prefill takes (the hidden and head dimensions stay whole: norms and rotary need them)
LLAMA_TILES = {"t": "tokens", "h": "heads", "f": "FFN columns", "kv": "key range in tokens, a multiple of t"}


def check_llama_args(
    shape: LlamaShape,
    seq: int,
    n_gpus: int,
    dtype: str,
    tiles: dict | None,
    n_layers: int | None,
    t_tile: int | None = None,
) -> None:
    """Raise ``ValueError`` naming the first bad argument of a LLaMA prefill (``t_tile``: the token tile in
    effect, given or default; when known, a given ``kv`` must be a multiple of it)."""
    if not 1 <= n_gpus <= 8:
        raise ValueError(f"n_gpus must be in 1..8, got {n_gpus}")
    if dtype not in ("fp16", "fp32"):
        raise ValueError(f"dtype must be fp16 or fp32, got {dtype!r}")
    if seq < 1:
        raise ValueError(f"seq must be positive, got {seq}")
    if n_layers is not None and not 1 <= n_layers <= shape.n_layers:
        raise ValueError(f"n_layers must be in 1..{shape.n_layers} for this model, got {n_layers}")
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


def default_tiles(
    shape: LlamaShape, seq: int, n_gpus: int, dtype: str = "fp16", budget_nbytes: int | None = None
) -> dict:
    """Heads and FFN in max(2, GPUs) blocks; the largest token tile ``t`` of 8192..1024 (else 512) whose
    FFN activations (gate, up, product and a partial of the down projection: 4 * t * f_block values)
    take at most a quarter of the budget (8192 without a budget). Attention is fused (no score tiles), so
    larger tiles cost no masked work; fewer, larger vertices cost less host launch time and make larger
    GEMMs. Key ranges (``kv``) stay whole unless a head block's keys and values for the whole sequence,
    twice over (the blocks and their concatenation), exceed half of the budget."""
    if shape.d_model <= 256:
        return {"t": max(8, seq // 4), "h": max(1, shape.n_heads // 2), "f": -(-shape.d_ffn // 2)}
    blocks = max(2, n_gpus)
    h, f = max(1, shape.n_heads // blocks), -(-shape.d_ffn // blocks)
    nb = DTYPE_NBYTES[dtype]
    t = 8192
    if budget_nbytes is not None:
        fits = [c for c in (8192, 4096, 2048, 1024) if 4 * c * f * nb <= budget_nbytes // 4]
        t = fits[0] if fits else 512
    t = min(seq, t)
    tiles = {"t": t, "h": h, "f": f}
    if budget_nbytes is not None:
        per_token = 4 * h * (shape.d_model // shape.n_heads) * nb  # K and V, blocks and concatenation
        kv = max(t, (budget_nbytes // 2 // per_token) // t * t)
        if kv < seq:
            tiles["kv"] = kv
    return tiles


def llama_graph(size: str = "7b", seq: int = 4096, dtype: str = "fp16", n_layers: int | None = None) -> Graph:
    """Logical LLaMA prefill: embedding, ``n_layers`` decoder layers, final norm (hidden states out)."""
    if size not in LLAMA:
        raise ValueError(f"unknown LLaMA size {size!r}; choose from {sorted(LLAMA)}")
    s = LLAMA[size]
    L = s.n_layers if n_layers is None else n_layers
    H, dh = s.n_heads, s.d_model // s.n_heads
    g = Graph(dtype=dtype)
    ids = g.input("ids", "t", (seq,), dtype="int32")
    x = g.embed(ids, g.input("tok_embed", "vd", (s.vocab, s.d_model)), name="x0")
    for i in range(L):
        p = f"L{i}."
        h = g.rmsnorm(x, g.input(p + "attn_norm", "d", (s.d_model,)), name=p + "h")
        q, k, v = (
            g.einsum("td,dhe->the", h, g.input(p + w, "dhe", (s.d_model, H, dh)), name=p + n)
            for w, n in (("wq", "q"), ("wk", "k"), ("wv", "v"))
        )
        a = g.attention(g.rotary(q, name=p + "qr"), g.rotary(k, name=p + "kr"), v, name=p + "attn")
        x = g.map(
            "add_n",
            x,
            g.einsum("the,hed->td", a, g.input(p + "wo", "hed", (H, dh, s.d_model)), name=p + "o"),
            name=p + "x1",
        )
        h2 = g.rmsnorm(x, g.input(p + "ffn_norm", "d", (s.d_model,)), name=p + "h2")
        gate = g.einsum("td,df->tf", h2, g.input(p + "w_gate", "df", (s.d_model, s.d_ffn)), name=p + "gate")
        up = g.einsum("td,df->tf", h2, g.input(p + "w_up", "df", (s.d_model, s.d_ffn)), name=p + "up")
        m = g.map("silu_mul", gate, up, name=p + "m")
        down = g.einsum("tf,fd->td", m, g.input(p + "w_down", "fd", (s.d_ffn, s.d_model)), name=p + "down")
        x = g.map("add_n", x, down, name=p + "x2")
    g.outputs = [g.rmsnorm(x, g.input("final_norm", "d", (s.d_model,)), name="out")]
    return g


def llama_prefill(
    size: str = "7b",
    seq: int = 4096,
    n_gpus: int = 1,
    dtype: str = "fp16",
    tiles: dict | None = None,
    n_layers: int | None = None,
    budget_nbytes: int | None = None,
) -> TaskGraph:
    """LLaMA prefill tiled over ``n_gpus`` (heads and FFN split across GPUs, tokens tiled); the default
    token tile grows with ``budget_nbytes`` when it is given (``default_tiles``)."""
    shape = LLAMA.get(size)
    if shape is None:
        raise ValueError(f"unknown LLaMA size {size!r}; choose from {sorted(LLAMA)}")
    check_llama_args(shape, seq, n_gpus, dtype, tiles, n_layers)  # before default_tiles uses them
    t = default_tiles(shape, seq, n_gpus, dtype, budget_nbytes) | dict(tiles or {})
    check_llama_args(shape, seq, n_gpus, dtype, tiles, n_layers, int(t.get("t", seq)))
    tg = lower(llama_graph(size, seq, dtype, n_layers), Tiling(t, n_gpus=n_gpus, parallel="hft"))
    tg.meta.update(model=f"llama-{size}", seq=seq, n_gpus=n_gpus, dtype=dtype)
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
