"""The masks cuDNN's attention is asked for (``cudnn_sdpa.mask_mode``) against the reference's: where a tile
takes cuDNN, the mask cuDNN documents for that mode (bottom-right aligned causal mask, and a diagonal band
with a left bound for sliding windows) is exactly the keys ``turnip.reference.sdpa`` lets each query see.
No GPU needed: the masks are built here as cuDNN's frontend tests build their reference."""

import numpy as np
import pytest

from cuda_kernels.cudnn_sdpa import mask_mode
from turnip.reference import first_keys, visible_keys

pytestmark = pytest.mark.unit


def cudnn_mask(mode: str, tq: int, tk: int, window: int) -> np.ndarray:
    """(tq, tk) visible keys of a cuDNN mask: ``bottom_right`` hides j > i + tk - tq, ``band`` also hides
    j <= i + tk - tq - window (left bound ``window``, bottom-right aligned)."""
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    d = tk - tq
    if mode == "none":
        return np.ones((tq, tk), dtype=bool)
    vis = j <= i + d
    return vis & (j > i + d - window) if mode == "band" else vis


def reference_mask(tq: int, tk: int, p: dict) -> np.ndarray:
    j = np.arange(tk)[None, :]
    return (j >= first_keys(tq, tk, p)[:, None]) & (j < visible_keys(tq, tk, p)[:, None])


def test_every_mask_cudnn_takes_is_the_reference_mask():
    rng = np.random.default_rng(0)
    taken = set()
    for _ in range(4000):
        tq, tk = int(rng.integers(1, 12)), int(rng.integers(1, 24))
        p = {"causal": True, "q_off": int(rng.integers(0, 30)), "k_off": int(rng.integers(0, 30))}
        if rng.random() < 0.7:
            p["window"] = int(rng.integers(1, 20))
        if visible_keys(tq, tk, p).max() <= 0:
            continue  # a tile no query sees into is never made
        mode = mask_mode(tq, tk, p, band=True)
        if mode is None:
            continue
        taken.add((mode, "window" in p))
        want = reference_mask(tq, tk, p)
        assert np.array_equal(cudnn_mask(mode, tq, tk, p.get("window", 0)), want), (mode, tq, tk, p)
    assert {("band", True), ("bottom_right", False), ("none", True), ("none", False)} <= taken


@pytest.mark.parametrize("tiles", [{"t": 512}, {"t": 512, "kv": 5120}, {"t": 512, "kv": 1024}, {"t": 1024, "kv": 2048}])
def test_the_diagonal_tiles_of_a_sliding_window_take_cudnn(tiles):
    """Mistral's window of 4096 over an 8192-token prompt: every query block's last key range (the one
    holding its diagonal) takes cuDNN; so do the others where the window covers them whole. Where a key
    range can hold the window's blocks (4096 + 512 tokens: 9 blocks of 512), each query block has one
    range, and every tile takes cuDNN."""
    from turnip.models import LlamaConfig, llama_prefill

    cfg = LlamaConfig(128, 1, 2, 256, vocab=64, n_kv_heads=1, head_dim=64, window=4096)
    tg = llama_prefill(cfg, seq=8192, tiles=tiles | {"h": 1, "f": 256}, head="none")
    sdpa = [v for v in range(tg.n) if tg.op[v] == "sdpa"]
    tq = {v: tg.shape[tg.arg_idx[tg.arg_ptr[v]]][0] for v in sdpa}  # the query tile's tokens
    modes = {v: mask_mode(tq[v], tg.params[v]["tk"], tg.params[v], band=True) for v in sdpa}
    p = tg.params
    diagonal = [modes[v] for v in sdpa if p[v]["q_off"] - p[v]["k_off"] == p[v]["tk"] - tq[v]]
    assert len(diagonal) == 8192 // tiles["t"] and all(m in ("band", "bottom_right") for m in diagonal)
    assert list(modes.values()).count(None) <= len(sdpa) // 2
    if tiles.get("kv", 8192) >= 4096 + tiles["t"]:
        assert len(sdpa) == 8192 // tiles["t"] and None not in modes.values()


def test_the_band_is_on_unless_switched_off(monkeypatch):
    """A windowed tile takes cuDNN's band by default and the portable kernel with the switch at 0."""
    from cuda_kernels.cudnn_sdpa import BAND_SWITCH

    p = {"q_off": 1024, "k_off": 0, "causal": True, "window": 512}
    monkeypatch.delenv(BAND_SWITCH, raising=False)
    assert mask_mode(1024, 2048, p) == "band"
    monkeypatch.setenv(BAND_SWITCH, "0")
    assert mask_mode(1024, 2048, p) is None
    assert mask_mode(1024, 2048, {"q_off": 1024, "k_off": 0, "causal": True}) == "bottom_right"
