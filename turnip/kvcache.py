"""The host side of a KV cache (layout: ``turnip.decode``, docs/generate.md): the host copy of every block,
filled from a ``prefill_kv`` run, handed to a decode plan's block inputs and taken back from its carried
outputs when the generation moves to the next plan; and the per-step inputs (rotation matrices, the slot's
one-hot) and constants (mask columns, the one-hot merges) a decode plan reads.

State: ``blocks[(layer, j, "K" | "V")]``, arrays (T, B, Hk, F) in the compute dtype. Invariant: a slot's mask
column (index dh) is 0 where the slot holds a token of that sequence and -BIG where it is free; a free slot's
other columns are 0 (a written row adds into it exactly).
"""

from __future__ import annotations

import numpy as np

from turnip.decode import BIG, width
from turnip.models import LlamaConfig
from turnip.reference import rope_inv_freq
from turnip.runtime.loader import thread_map
from turnip.runtime.weights import NP_OF


class HostCache:
    def __init__(self, cfg: LlamaConfig, batch: int, block: int, dtype: str):
        self.cfg, self.batch, self.block, self.dtype = cfg, batch, block, dtype
        self.np_dtype = np.dtype(NP_OF[dtype])
        self.F = width(cfg)
        self.blocks: dict[tuple, np.ndarray] = {}

    def nbytes(self, n_blocks: int) -> int:
        """Bytes of ``n_blocks`` blocks of keys and values over all layers."""
        c = self.cfg
        return 2 * c.n_layers * n_blocks * self.block * self.batch * c.kv_heads * self.F * self.np_dtype.itemsize

    def ensure(self, n_blocks: int) -> None:
        """Blocks 0..n_blocks-1 exist (new ones free: zeros, mask column -BIG), made by threads (at batch 64 a 7B's
        blocks of 256 slots are 570 MB each, their pages first touched here)."""
        new = [(layer, j, w) for layer in range(self.cfg.n_layers) for j in range(n_blocks) for w in "KV"
               if (layer, j, w) not in self.blocks]  # fmt: skip

        def make(key):
            x = np.zeros((self.block, self.batch, self.cfg.kv_heads, self.F), dtype=self.np_dtype)
            x[..., self.cfg.dh] = -BIG
            return key, x

        self.blocks.update(thread_map(make, new))

    def fill(self, kv: dict[str, np.ndarray], seq: int, lens) -> None:
        """Slots [0, lens[b]) of sequence b from a ``prefill_kv`` run over prompts of ``seq`` tokens each
        (``kv``: ``L{i}.kcache`` / ``L{i}.vcache``, (batch * seq, Hk, dh)); a thread per layer and key or value
        at a time."""
        dh, T = self.cfg.dh, self.block
        self.ensure(-(-max(max(lens), 1) // T))

        def copy(item):
            layer, w = item
            x = kv[f"L{layer}.{w.lower()}cache"].reshape(self.batch, seq, self.cfg.kv_heads, dh)
            for b, n in enumerate(lens):
                for s in range(0, n, T):
                    j, e = s // T, min(n, s + T)
                    blk = self.blocks[(layer, j, w)]
                    blk[: e - s, b, :, :dh] = x[b, s:e]
                    blk[: e - s, b, :, dh] = 0

        thread_map(copy, [(layer, w) for layer in range(self.cfg.n_layers) for w in "KV"])

    def block_inputs(self, tg, skip=(), only=None, views: bool = False) -> dict[int, np.ndarray]:
        """The values of a decode plan's block inputs (by taskgraph vertex), but those in ``skip`` (``only``:
        just these): tiles (block, batch x heads, F), or with ``views`` the host blocks' slices themselves
        (block, batch, heads, F; no copy: ``turnip.runtime.loader.write_tiles`` copies them once)."""
        self.ensure(tg.meta["decode"]["n_blocks"])
        out = {}
        for c in tg.meta["kv"]:
            if int(c["input"]) in skip or only is not None and int(c["input"]) not in only:
                continue
            x = self.blocks[(c["layer"], c["j"], c["which"])][:, :, c["h0"] : c["h1"]]
            out[int(c["input"])] = x if views else np.ascontiguousarray(x).reshape(self.block, -1, self.F)
        return out

    def put_rows(self, tg, values: dict[int, np.ndarray], slot: int) -> None:
        """A decode step's new rows (``decode_rows_on``: outputs (1, batch x heads, F), by vertex) into slot
        ``slot`` of its last block."""
        T = self.block
        for c in tg.meta["kv"]:
            if c["output"] >= 0:
                x = values[int(c["output"])].reshape(self.batch, c["h1"] - c["h0"], self.F)
                self.blocks[(c["layer"], c["j"], c["which"])][slot % T, :, c["h0"] : c["h1"]] = x

    def take(self, tg, values: dict[int, np.ndarray]) -> None:
        """The written blocks back from a decode plan's outputs (by vertex; ``read_outputs``), by threads."""

        def copy(c):
            x = values[int(c["output"])].reshape(self.block, self.batch, c["h1"] - c["h0"], self.F)
            self.blocks[(c["layer"], c["j"], c["which"])][:, :, c["h0"] : c["h1"]] = x

        thread_map(copy, [c for c in tg.meta["kv"] if c["output"] >= 0])


def rotations(cfg: LlamaConfig, positions, dtype: str) -> np.ndarray:
    """(B, F, dh): per sequence the rotary embedding at its position as a matrix (rotate-half convention,
    the ``rotary`` op's angles), widened by zero rows to F."""
    dh, half = cfg.dh, cfg.dh // 2
    inv = rope_inv_freq(dh, cfg.rope_params())
    pos = np.asarray(positions, dtype=np.float64)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    m = np.zeros((len(pos), width(cfg), dh), dtype=np.float32)
    i = np.arange(half)
    m[:, i, i] = cos
    m[:, i, i + half] = -sin
    m[:, i + half, i + half] = cos
    m[:, i + half, i] = sin
    return m.astype(NP_OF[dtype])


def slot_onehot(block: int, slot: int, dtype: str) -> np.ndarray:
    """(T, 1): 1 at the step's slot within the last block."""
    w = np.zeros((block, 1), dtype=NP_OF[dtype])
    w[slot % block, 0] = 1
    return w


def constants(cfg: LlamaConfig, dtype: str) -> dict[str, np.ndarray]:
    """The constant logical inputs: ``Eq`` ((Hk, r, F), or (H, F) without grouping: 1 in the mask column of
    queries), ``Ek`` ((Hk, F): +BIG in that of new keys), ``Pv`` (F, dh): values widened with zeros."""
    F, dh, dt = width(cfg), cfg.dh, NP_OF[dtype]
    heads = (cfg.kv_heads, cfg.group) if cfg.group > 1 else (cfg.n_heads,)
    eq, ek = np.zeros((*heads, F), dtype=dt), np.zeros((cfg.kv_heads, F), dtype=dt)
    eq[..., dh], ek[..., dh] = 1, BIG
    return {"Eq": eq, "Ek": ek, "Pv": np.eye(F, dh, dtype=dt)}


def merge_inputs(tg) -> dict[int, np.ndarray]:
    """The one-hot merges S (1, B * heads, B, heads): S[0, b * heads + h, b, h] = 1."""
    dt = NP_OF[tg.meta["dtype"]]
    out = {}
    for v, _ in tg.meta["merge"]:
        _, G, B, hk = tg.shape[v]
        s = np.zeros((G, B * hk), dtype=dt)
        s[np.arange(G), np.arange(G)] = 1
        out[int(v)] = s.reshape(1, G, B, hk)
    return out
