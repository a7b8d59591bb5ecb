"""Tiling and placement: the tiled LLaMA computes what a plain numpy LLaMA computes."""

import numpy as np
import pytest

from turnip.memgraph.interp import NP_DTYPE, assemble, evaluate_taskgraph
from turnip.models import LLAMA, llama_prefill, matmul_example, random_dag

pytestmark = pytest.mark.unit


def numpy_llama(w: dict, x0: np.ndarray, s, head: str = "none") -> np.ndarray:
    """A plain LLaMA on Hugging Face 2-D weights (written apart from turnip's graph: flat projections,
    ``repeat_kv``, LLaMA-3 rope scaling by its published formula), with the families' variations of ``s``
    (a ``LlamaConfig``): biases (``bq``.. in ``w``), q/k norms, sliding windows, soft caps, GeGLU, (1 + w)
    norms, the embedding scale and Gemma 2's extra norms."""
    H, Hk, dh = s.n_heads, s.kv_heads, s.dh
    T = x0.shape[0]
    off = getattr(s, "norm_offset", 0.0)

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + s.eps) * (g + off)

    def inv_freq():
        inv = 1.0 / s.rope_theta ** (np.arange(0, dh, 2) / dh)
        if not s.rope_scaling:
            return inv
        factor, lo, hi, old = s.rope_scaling
        out = []
        for f in inv:
            wl = 2 * np.pi / f
            if wl < old / hi:
                out.append(f)
            elif wl > old / lo:
                out.append(f / factor)
            else:
                sm = (old / wl - lo) / (hi - lo)
                out.append((1 - sm) * f / factor + sm * f)
        return np.array(out)

    def rope(x):  # x (T, heads, dh)
        ang = np.arange(T)[:, None] * inv_freq()[None]
        c, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
        return np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)

    def lin(h, p, name, rows):
        y = h @ w[p + "w" + name].reshape(rows, -1).T
        return y + w[p + "b" + name].reshape(-1) if p + "b" + name in w else y

    def cap(x, c):
        return c * np.tanh(x / c) if c else x

    i, j = np.arange(T)[:, None], np.arange(T)[None]
    x = x0 * getattr(s, "embed_scale", 1.0)
    for layer in range(s.n_layers):
        p = f"L{layer}."
        h = rms(x, w[p + "attn_norm"])
        q, k = lin(h, p, "q", H * dh).reshape(T, H, dh), lin(h, p, "k", Hk * dh).reshape(T, Hk, dh)
        if getattr(s, "qk_norm", False):
            q, k = rms(q, w[p + "q_norm"]), rms(k, w[p + "k_norm"])
        q, k = rope(q), rope(k)
        v = lin(h, p, "v", Hk * dh).reshape(T, Hk, dh)
        k, v = np.repeat(k, H // Hk, axis=1), np.repeat(v, H // Hk, axis=1)
        scale = getattr(s, "attn_scale", 0.0) or 1 / np.sqrt(dh)
        sc = cap(np.einsum("ihd,jhd->hij", q, k) * scale, getattr(s, "attn_softcap", 0.0))
        win = s.layer_window(layer) if hasattr(s, "layer_window") else 0
        sc = np.where((j <= i) & ((i - j < win) if win else True), sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        a = np.einsum("hij,jhd->ihd", pr, v).reshape(T, H * dh)
        o = a @ w[p + "wo"].reshape(-1, H * dh).T + (w[p + "bo"] if p + "bo" in w else 0)
        x = x + (rms(o, w[p + "post_attn_norm"]) if getattr(s, "sandwich", False) else o)
        h2 = rms(x, w[p + "ffn_norm"])
        g, u = h2 @ w[p + "w_gate"].T, h2 @ w[p + "w_up"].T
        if getattr(s, "act", "silu") == "silu":
            m = g / (1 + np.exp(-g)) * u
        else:
            m = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * u
        dn = m @ w[p + "w_down"].T
        x = x + (rms(dn, w[p + "post_ffn_norm"]) if getattr(s, "sandwich", False) else dn)
    out = rms(x, w["final_norm"])
    if head == "none":
        return out
    lm = w["tok_embed" if s.tie_embeddings else "lm_head"]
    return cap((out[-1:] if head == "last" else out) @ lm.T, getattr(s, "logit_softcap", 0.0))


def block_inputs(tg, full: dict) -> dict:
    out = {}
    for name, (_shape, blocks) in tg.meta["input_blocks"].items():
        for starts, v in blocks:
            sl = tuple(slice(a, a + n) for a, n in zip(starts, tg.shape[v], strict=True))
            out[v] = full[name][sl].astype(NP_DTYPE[tg.dtype[v]])
    return out


@pytest.mark.parametrize(
    "model,n_gpus,tiles,head",
    [
        ("tiny", 1, None, "none"),
        ("tiny", 2, None, "none"),
        ("tiny", 3, {"t": 5, "h": 1, "f": 48}, "none"),
        ("tiny", 1, {"t": 5, "kv": 10}, "none"),
        ("tiny", 2, {"t": 4, "kv": 4}, "last"),
        ("tiny-gqa", 1, None, "last"),
        ("tiny-gqa", 2, {"t": 5, "h": 1, "kv": 10, "v": 40}, "last"),
        ("tiny-gqa", 3, {"t": 8, "v": 17}, "all"),
        ("tiny", 1, {"t": 6, "v": 10}, "all"),
    ],
)
def test_tiled_llama_matches_numpy(model, n_gpus, tiles, head):
    rng = np.random.default_rng(0)
    s, seq = LLAMA[model], 24
    tg = llama_prefill(model, seq=seq, n_gpus=n_gpus, dtype="fp32", tiles=tiles, head=head)
    full = {name: rng.standard_normal(shape) * 0.3 for name, (shape, _) in tg.meta["input_blocks"].items()}
    full.update({k: 1.0 + 0.1 * full[k] for k in full if k.endswith("norm")})
    vals = evaluate_taskgraph(tg, block_inputs(tg, full))
    got = assemble(tg, vals, "out" if head == "none" else "logits")
    want = numpy_llama(full, full["x0"], s, head)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    if n_gpus > 1:
        assert (tg.kind == 2).any(), "cross-GPU consumers read through transfer vertices"
        assert len(set(tg.gpu.tolist())) == n_gpus


def test_contraction_split_gives_sum_into_groups():
    tg = llama_prefill("tiny", seq=16, dtype="fp32", tiles={"t": 8, "h": 1, "f": 40})
    groups = tg.sum_intos()
    assert groups, "down projection split over f must produce sum_into vertices"
    for acc, members in groups.items():
        assert all(tg.op[m] == "sum_into" and tg.args(m)[0] == acc for m in members)


@pytest.mark.parametrize("kv,per_query_block", [(None, [1, 1, 1, 1]), (16, [1, 1, 2, 2]), (8, [1, 2, 3, 4])])
def test_attention_is_one_fused_vertex_per_key_range(kv, per_query_block):
    tiles = {"t": 8} | ({"kv": kv} if kv else {})
    tg = llama_prefill("tiny", seq=32, dtype="fp32", tiles=tiles, n_layers=1)
    n_head_blocks = -(-LLAMA["tiny"].kv_heads // 2)
    ops = [tg.op[v] for v in range(tg.n)]
    assert ops.count("sdpa") == n_head_blocks * sum(per_query_block)
    assert ops.count("attn_combine") == n_head_blocks * sum(n > 1 for n in per_query_block)
    assert not {"attn_scores", "exp_sub", "rowmax"} & set(ops), "no score tile is materialised"
    for v in np.flatnonzero(np.array(ops) == "sdpa"):
        p, tq = tg.params[v], tg.shape[int(tg.args(v)[0])][0]
        assert p["tk"] <= p["q_off"] + tq - p["k_off"], "no key after the query block's end is read"


def test_big_shapes_and_options():
    tg = llama_prefill("13b", seq=2048, n_gpus=2, n_layers=1)
    assert tg.meta["model"] == "llama-13b" and tg.n_gpus == 2
    assert tg.shape[int(np.flatnonzero(np.array(tg.name) == "L0.wq[0, 0, 0]")[0])] == (20, 128, 5120)
    with pytest.raises(ValueError, match="n_gpus"):
        llama_prefill("7b", n_gpus=9)
    with pytest.raises(ValueError, match="unknown LLaMA size"):
        llama_prefill("3b")


def test_paper_example_and_random_dags_validate(rng):
    tg = matmul_example()
    assert (tg.kind == 1).sum() == 6 and (tg.kind == 2).sum() == 3
    assert ((tg.gpu == 0) & (tg.kind != 2) | (tg.kind == 2) & (tg.gpu == 0)).sum() == 7
    for _ in range(20):
        random_dag(rng, n_gpus=int(rng.integers(1, 4))).validate()


def test_default_tiles_follow_the_budget():
    from turnip.models import default_tiles

    s = LLAMA["7b"]
    assert default_tiles(s, 32768, 1) == {"t": 8192, "h": 16, "f": 5504, "v": 32000}  # no budget given
    assert default_tiles(s, 4096, 1, "fp16", 6 << 30)["t"] == 4096  # capped by the sequence
    assert default_tiles(s, 16384, 1, "fp16", 6 << 30) == {"t": 8192, "h": 16, "f": 5504, "v": 32000}  # whole key range
    assert default_tiles(s, 16384, 1, "fp16", 1 << 30)["t"] == 4096  # FFN activations within 256 MiB
    assert default_tiles(s, 16384, 1, "fp16", 256 << 20)["t"] == 1024
    assert default_tiles(s, 65536, 1, "fp16", 1 << 30)["kv"] == 32768  # K and V ranges within 512 MiB
    assert default_tiles(s, 4096, 8)["h"] == 4 and default_tiles(s, 4096, 8)["f"] == 1376


@pytest.mark.parametrize("model,tiles", [("tiny", {"t": 4}), ("tiny-gqa", {"t": 8, "kv": 8}), ("tiny", None)])
def test_batched_prefill_is_each_prompt_prefilled_alone(model, tiles):
    """Prompts batched in the token dim (several token tiles per prompt, key ranges split) give each prompt's
    own prefill: attention stays within a prompt and positions restart."""
    from turnip.memgraph.interp import assemble, evaluate_taskgraph
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    B, S = 3, 16
    tb = llama_prefill(model, seq=S, dtype="fp32", tiles=tiles, head="all", batch=B)
    one = llama_prefill(model, seq=S, dtype="fp32", tiles=tiles, head="all")
    w = random_inputs_for(tb, seed=1)
    xb = np.random.default_rng(2).standard_normal(w["x0"].shape).astype(np.float32)
    got = assemble(tb, evaluate_taskgraph(tb, tile_inputs(tb, w | {"x0": xb})), "logits")
    for b in range(B):
        ref = assemble(one, evaluate_taskgraph(one, tile_inputs(one, w | {"x0": xb[b * S : (b + 1) * S]})), "logits")
        np.testing.assert_allclose(got[b * S : (b + 1) * S], ref, rtol=1e-5, atol=1e-6)


def test_batched_prefill_refuses_last_logits_and_picks_a_dividing_tile(monkeypatch):
    with pytest.raises(ValueError, match="use --logits all"):
        llama_prefill("tiny", seq=16, head="last", batch=2)
    with pytest.raises(ValueError, match="must divide the prompt length"):
        llama_prefill("tiny", seq=16, tiles={"t": 6}, batch=2)
    tg = llama_prefill("7b", seq=3000, batch=2, n_layers=1, budget_nbytes=6 << 30)  # the prompts packed
    assert tg.meta["tiles"]["t"] == 6000 and tg.meta["batch"] == 2
    monkeypatch.setenv("TURNIP_PACK_PROMPTS", "0")
    tg = llama_prefill("7b", seq=3000, batch=2, n_layers=1, budget_nbytes=6 << 30)
    assert 3000 % tg.meta["tiles"]["t"] == 0
