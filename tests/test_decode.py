"""Decode plans (``turnip.decode``) and the host side of their cache (``turnip.kvcache``): the plan's shape,
the mask column, the rotation matrices, the prefill that fills the cache, and the cache's round trip."""

import numpy as np
import pytest

from turnip.decode import BIG, DecodeShape, decode_step, prefill_kv, width
from turnip.kvcache import HostCache, constants, merge_inputs, rotations, slot_onehot
from turnip.models import LLAMA
from turnip.reference import REFERENCE, run_reference

pytestmark = pytest.mark.unit

TINY = LLAMA["tiny-gqa"]  # grouped-query attention, LLaMA-3 rope scaling, tied embeddings


def test_decode_plans_are_coarse_and_use_only_specified_ops():
    """The batch rides in the head axis: a step of 16 sequences has the vertices of a step of one; each more
    cache block adds a K and a V input and an sdpa per head block."""
    one = decode_step(TINY, DecodeShape(1, 2, 8), 1, "fp32")
    many = decode_step(TINY, DecodeShape(16, 2, 8), 1, "fp32")
    longer = decode_step(TINY, DecodeShape(1, 3, 8), 1, "fp32")
    assert one.n == many.n and set(one.op) <= set(REFERENCE) | {"input", "transfer"}
    head_blocks = len({(c["layer"], c["h0"]) for c in one.meta["kv"]})
    assert longer.n - one.n == 3 * head_blocks
    kv = one.meta["kv"]
    assert len(kv) == 2 * 2 * head_blocks and sum(c["output"] >= 0 for c in kv) == 2 * head_blocks
    assert all(one.is_output[c["output"]] for c in kv if c["output"] >= 0)


def test_two_gpus_place_head_blocks_round_robin():
    tg = decode_step(TINY, DecodeShape(2, 1, 4), 2, "fp32")
    gpus = {(c["h0"], int(tg.gpu[c["input"]])) for c in tg.meta["kv"]}
    assert {g for _, g in gpus} == {0, 1}


def test_free_slots_are_invisible_to_attention():
    """A slot whose mask column is -BIG gets softmax weight 0 whatever its key and value hold."""
    rng = np.random.default_rng(0)
    dh, F, T, G = 16, 24, 8, 3
    q = np.zeros((1, G, F), np.float32)
    q[..., :dh] = rng.standard_normal((1, G, dh))
    q[..., dh] = 1
    k, v = (np.zeros((T, G, F), np.float32) for _ in range(2))
    k[..., :dh], v[..., :dh] = rng.standard_normal((2, T, G, dh))
    k[5:, :, dh] = -BIG
    p = {"scale": 0.25, "causal": False, "q_off": 0, "k_off": 0, "tk": T}
    want = run_reference("sdpa", [q, k[:5], v[:5]], p | {"tk": 5})
    k[5:, :, :dh] = 50 * rng.standard_normal((3, G, dh))  # garbage in the free slots
    v[5:, :, :dh] = 1e4
    got = run_reference("sdpa", [q, k, v], p)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("pos", [0, 7, 300])
def test_rotation_matrices_are_the_rotary_op(pos):
    x = np.random.default_rng(pos).standard_normal((1, 2, TINY.dh)).astype(np.float32)
    want = run_reference("rotary", [x], TINY.rope_params() | {"pos_off": pos})
    m = rotations(TINY, [pos], "fp32")[0]
    assert m.shape == (width(TINY), TINY.dh) and not m[TINY.dh :].any()
    np.testing.assert_allclose(np.einsum("the,ae->tha", x, m)[..., : TINY.dh], want, rtol=1e-5, atol=1e-6)


def test_a_written_row_clears_its_slots_mask_exactly():
    """The step's write: block + onehot(slot) x (row with +BIG) leaves 0 in the slot's mask column."""
    c = constants(TINY, "fp16")
    cache = HostCache(TINY, 2, 4, "fp16")
    cache.ensure(1)
    blk = cache.blocks[(0, 0, "K")].reshape(4, -1, width(TINY))
    row = np.random.default_rng(1).standard_normal((1, blk.shape[1], width(TINY))).astype(np.float16)
    row[..., TINY.dh] = 0
    row = row + np.tile(c["Ek"], (2, 1))  # (B x Hk, F): each sequence's heads
    new = run_reference("add_n", [blk, run_reference("einsum", [slot_onehot(4, 6, "fp16"), row],
                                                               {"subscripts": "cx,xga->cga"})], {})  # fmt: skip
    assert (new[2, :, TINY.dh] == 0).all() and (np.delete(new, 2, axis=0)[..., TINY.dh] == -BIG).all()
    np.testing.assert_array_equal(new[2, :, : TINY.dh], row[0, :, : TINY.dh])


def test_merge_inputs_move_heads_into_the_sequence_major_axis():
    tg = decode_step(TINY, DecodeShape(3, 1, 4), 1, "fp32")
    (s,) = merge_inputs(tg).values()
    x = np.random.default_rng(0).standard_normal((3, s.shape[3], 5)).astype(np.float32)
    np.testing.assert_array_equal(np.einsum("xgth,tha->xga", s, x)[0], x.reshape(-1, 5))


def test_prefill_outputs_the_cache_and_drops_dead_nodes():
    tg = prefill_kv(TINY, 6, 2, 1, "fp32")
    outs = tg.meta["output_blocks"]
    assert sorted(outs) == sorted(f"L{i}.{w}cache" for i in range(TINY.n_layers) for w in "kv")
    assert outs["L0.kcache"][0] == (12, TINY.kv_heads, TINY.dh)
    assert not any(n.startswith("out") or n.startswith(f"L{TINY.n_layers - 1}.down") for n in tg.name)


def test_host_cache_fill_and_round_trip():
    cfg, B, T, seq = TINY, 2, 4, 6
    cache = HostCache(cfg, B, T, "fp32")
    rng = np.random.default_rng(2)
    kv = {f"L{i}.{w}cache": rng.standard_normal((B * seq, cfg.kv_heads, cfg.dh)).astype(np.float32)
          for i in range(cfg.n_layers) for w in "kv"}  # fmt: skip
    cache.fill(kv, seq, [5, 2])
    k = cache.blocks[(0, 1, "K")]  # slots 4..7
    np.testing.assert_array_equal(k[0, 0, :, : cfg.dh], kv["L0.kcache"][4])
    assert k[0, 0, 0, cfg.dh] == 0 and (k[1:, 0, :, cfg.dh] == -BIG).all() and (k[:, 1, :, cfg.dh] == -BIG).all()
    tg = decode_step(cfg, DecodeShape(B, 2, T), 1, "fp32")
    vals = cache.block_inputs(tg)
    outs = {c["output"]: vals[c["input"]] + 1 for c in tg.meta["kv"] if c["output"] >= 0}
    before = cache.blocks[(1, 1, "V")].copy()
    cache.take(tg, outs)
    np.testing.assert_array_equal(cache.blocks[(1, 1, "V")], before + 1)
    assert cache.nbytes(2) == 2 * cfg.n_layers * 2 * T * B * cfg.kv_heads * width(cfg) * 4
