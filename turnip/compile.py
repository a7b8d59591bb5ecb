"""One call from a model name to a verified-ready plan: ``compile_model``; plus byte-size parsing."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from turnip.memgraph.arena import ALIGN, aligned
from turnip.memgraph.build import BudgetError, BuildConfig, build_memgraph
from turnip.memgraph.plan import KIND_INPUT, KIND_OFFLOAD, KIND_RELOAD, MemGraph
from turnip.models import (
    LLAMA,
    TILE_CHOICE_MARGIN,
    llama_config,
    llama_prefill,
    matmul_example,
    pack_prompts_on,
    random_dag,
    spread_token_tile,
    tile_choice_on,
)
from turnip.taskgraph import TaskGraph

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MODELS = [f"llama-{s}" for s in LLAMA] + ["paper-matmul", "random"]
MODEL_HELP = (f"a preset ({', '.join(MODELS)}) or a Hugging Face LLaMA-family model directory (or its config.json): "
              "the taskgraph follows its config")  # fmt: skip


def resolve_head(model: str, head: str | None) -> str:
    """``auto`` (or None): the last position's logits for a Hugging Face model, hidden states for presets."""
    if head in (None, "auto"):
        return "none" if model in MODELS else "last"
    return head
RANDOM_KERNELS = 200  # kernels of ``--model random``


@functools.cache
def _source_hash() -> bytes:
    root = Path(__file__).parent
    h = hashlib.sha256()
    src = [*root.glob("graph*.py"), *(root / f for f in ("models.py", "hfconfig.py", "taskgraph.py", "fuse.py",
                                                          "train.py", "autodiff.py", "compile.py"))]  # fmt: skip
    for f in sorted([*src, *root.glob("memgraph/*.py")]):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.digest()


def compiler_fingerprint() -> str:
    """Short hash of the compiler's source and of the switches that change what it builds (read at each call):
    plan caches keyed on it never serve a plan built by other code or other switches."""
    from turnip.graph_lower import lean_step_on
    from turnip.train import pack_on, spread_state_on

    h = hashlib.sha256(_source_hash())
    h.update(f"fold={fold_adds_on()} pack={pack_on()} prompts={pack_prompts_on()} spread={spread_state_on()} "
             f"lean={lean_step_on()}".encode())  # fmt: skip
    return h.hexdigest()[:12]


FOLD_SWITCH = "TURNIP_FOLD_ADDS"  # "0": sums stay add_n / sum_into vertices instead of folding into einsums


def fold_adds_on() -> bool:
    """Whether ``make_taskgraph`` folds sums into einsums (``turnip.fuse``): on unless ``TURNIP_FOLD_ADDS=0``
    (measured on an H100: a 7B LoRA step 8-12% faster, a 7B 4K prefill 2%; on two GPUs the same)."""
    return os.environ.get(FOLD_SWITCH, "1") != "0"


RELAY_SWITCH = "TURNIP_RELAY_LOADS"  # "0": off; N: N relay slots on any several-GPU plan; unset: auto (1 slot)
RELAY_SLOT_SHARE = 64  # a relay slot holds at most this fraction (1/N) of the budget
RELAY_SLOTS_SHARE = 1 / 16  # by default, all of a GPU's relay slots take at most this share of the budget


def relay_slots(tg: TaskGraph, budget: int) -> int:
    """Relay slots per GPU served by each other GPU (``BuildConfig.relay_slots``; 0: no relays).
    ``TURNIP_RELAY_LOADS=N`` gives N on any plan of several GPUs, ``0`` none; unset, one where the plan is a
    training step's layers split whose inputs on some GPU pass ``turnip.train.STREAM_SHARE`` of the budget
    (the share past which a stage's weights stream, as ``stage_streams`` decides from the model): its stages
    stream their weights one after another, forward and backward, while the other GPUs' host links idle
    (LLaMA-65B LoRA, 8 x 1K at 24 GiB on four H100s: 6,209 -> 5,004 ms a step;
    ``benchmarks/results/multi_gpu/README.md``). The tensor and data splits load on every GPU at once, and a
    prompt's layers split overlaps its stages over token tiles: there relays only add copies (7B, 4K at 2 GiB on
    4 GPUs, layers split: simulated 322.5 against 310.0 ms)."""
    v = os.environ.get(RELAY_SWITCH, "")
    if v and not v.isdigit():
        raise ValueError(f"{RELAY_SWITCH}={v!r}: expected 0 (off), 1 or a number of slots")
    if tg.n_gpus < 2:
        return 0
    if v:
        return int(v)
    if tg.meta.get("split") != "layers" or not tg.meta.get("train"):
        return 0
    from turnip.train import STREAM_SHARE

    ins = np.flatnonzero(tg.kind == KIND_INPUT)
    per_gpu = np.bincount(tg.gpu[ins], weights=tg.nbytes[ins].astype(np.float64), minlength=tg.n_gpus)
    return int(per_gpu.max() > STREAM_SHARE * budget)


def relay_config(cfg: BuildConfig, tg: TaskGraph, budget: int) -> BuildConfig:
    """``cfg`` with ``relay_slots(tg, budget)`` relay slots (none where the caller set some), each the size that
    holds the inputs making up 90% of the input bytes (the largest few, such as a vocabulary table, go direct),
    up to a ``RELAY_SLOT_SHARE``-th of the budget. Unless ``TURNIP_RELAY_LOADS`` asks for them, none where that
    cap leaves most weights too large to relay, or where the slots (one per other GPU) take more than
    ``RELAY_SLOTS_SHARE`` of the budget (LLaMA-65B LoRA on 8 GPUs at 16 GiB: 7 slots of 256 MiB, simulated
    4,707 against 4,277 ms)."""
    slots = 0 if cfg.relay_slots else relay_slots(tg, budget)
    sizes = np.sort(tg.nbytes[tg.kind == KIND_INPUT].astype(np.int64))
    if not slots or not len(sizes):
        return cfg
    covered = np.cumsum(sizes) >= 0.9 * sizes.sum()
    want = aligned(int(sizes[int(np.argmax(covered))]))
    slot = min(want, budget // RELAY_SLOT_SHARE // ALIGN * ALIGN)
    costly = slot < want or (tg.n_gpus - 1) * slots * slot > RELAY_SLOTS_SHARE * budget
    if costly and not os.environ.get(RELAY_SWITCH):
        return cfg
    return dataclasses.replace(cfg, relay_slots=slots, relay_slot_nbytes=slot) if slot else cfg


MAX_NBYTES = 1 << 60  # 1 EiB: larger sizes are typos (and overflow the plan's int64 arrays)


def parse_nbytes(text: str) -> int:
    """'6GiB', '512MiB', '1.5GB', '1e3GiB', '4096' -> bytes (at most ``MAX_NBYTES``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"cannot read a byte size from {text!r}; use a number with an optional unit (B, KB, MB, "
                         "GB, KiB, MiB, GiB, TiB; KiB = 1024 B), e.g. 6GiB, 512MiB, 4096")  # fmt: skip
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not value <= MAX_NBYTES:  # also catches inf from '1e999'
        raise ValueError(f"byte size {text!r} is larger than 1 EiB; use e.g. 6GiB, 512MiB")
    return int(value)


def make_taskgraph(
    model: str,
    seq: int = 4096,
    gpus: int = 1,
    dtype: str = "fp16",
    tiles: dict | None = None,
    seed: int = 0,
    n_layers: int | None = None,
    budget_nbytes: int | None = None,
    head: str | None = None,
    train=None,
    batch: int = 1,
    split: str = "tensor",
    fold: bool | None = None,
) -> TaskGraph:
    """The taskgraph of a named model or a Hugging Face directory / config.json; LLaMA tiles default from
    the budget when it is given; ``head``: ``turnip.models.HEADS`` or auto (``resolve_head``); ``train``: a
    ``turnip.train.TrainSpec`` for one LoRA training step instead of a prefill; ``batch``: prompts of a
    prefill; ``split``: across GPUs by tensor blocks or by layers (``turnip.models.SPLITS``; ``auto`` is
    ``compile_model``'s). ``fold``: sums folded into the einsums producing their terms (``turnip.fuse``;
    None: ``fold_adds_on()``)."""
    tg = _taskgraph(model, seq, gpus, dtype, tiles, seed, n_layers, budget_nbytes, head, train, batch, split)
    return tg if tg.meta.get("model") in ("paper-matmul", "random") else folded(tg, fold)


def folded(tg: TaskGraph, fold: bool | None = None) -> TaskGraph:
    """``tg`` with sums folded into the einsums producing their terms (``turnip.fuse``) where ``fold`` (None:
    ``fold_adds_on()``), else ``tg``."""
    if not (fold_adds_on() if fold is None else fold):
        return tg
    from turnip.fuse import fold_adds

    return fold_adds(tg)


def _taskgraph(model, seq, gpus, dtype, tiles, seed, n_layers, budget_nbytes, head, train, batch, split) -> TaskGraph:
    cfg = llama_config(model)
    if split != "tensor" and cfg is None:
        raise ValueError(f"split {split!r} applies to LLaMA models; {model} has a fixed placement")
    if train is not None:
        from turnip.train import lora_step

        if cfg is None:
            raise ValueError(f"training needs a LLaMA model, not {model!r}")
        return lora_step(cfg, seq, train.batch, gpus, dtype, tiles, n_layers, budget_nbytes, train.lora,
                         train.checkpoint, split)  # fmt: skip
    if cfg is not None:
        hd = resolve_head(model, head)
        if batch > 1 and head in (None, "auto") and hd == "last":
            hd = "all"
        return llama_prefill(cfg, seq=seq, n_gpus=gpus, dtype=dtype, tiles=tiles, n_layers=n_layers,
                             budget_nbytes=budget_nbytes, head=hd, batch=batch, split=split)
    if model == "paper-matmul":
        return matmul_example()
    if model == "random":
        if not 1 <= gpus <= 8:
            raise ValueError(f"n_gpus must be in 1..8, got {gpus}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        return random_dag(np.random.default_rng(seed), n_kernels=RANDOM_KERNELS, n_gpus=gpus)
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


# Compile cost per taskgraph vertex, measured on 2 cores (LLaMA-7B/13B, 1.4K-116K vertices): lowering
# 30-39K vertices/s, BuildMemgraph 15-43K vertices/s (slower with many offloads), 1.7-1.9 KB of host memory
# per vertex at the peak (taskgraph and memgraph both alive). Used only for the estimate shown (and the
# limit applied) before large compiles; the slower figures, so the estimate errs long.
LOWER_VERTICES_PER_S = 34_000
BUILD_VERTICES_PER_S = 20_000
HOST_NBYTES_PER_VERTEX = 2_000
MAX_VERTICES = 2_000_000  # above this (or MAX_COMPILE_S) the CLI refuses to compile without --force
MAX_COMPILE_S = 120.0


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What building a model's plan would cost, computed from the model's shape and tiling alone."""

    vertices: int  # taskgraph vertices before sums fold (turnip.fuse removes up to a fifth; the memgraph adds offloads)
    tiles: dict  # the tiles in effect (given ones over the budget's defaults)
    input_nbytes: int  # bytes of all inputs (weights and token ids)

    @property
    def compile_s(self) -> float:
        return self.vertices / LOWER_VERTICES_PER_S + self.vertices / BUILD_VERTICES_PER_S

    @property
    def lower_s(self) -> float:
        return self.vertices / LOWER_VERTICES_PER_S

    @property
    def host_nbytes(self) -> int:
        return self.vertices * HOST_NBYTES_PER_VERTEX

    def too_large(self) -> bool:
        return self.vertices > MAX_VERTICES or self.compile_s > MAX_COMPILE_S


def _llama_vertices(s, seq: int, G: int, tiles: dict, L: int, head: str = "none", causal: bool = False) -> int:
    """Taskgraph vertices of a LLaMA prefill, counted per op the way ``turnip.graph`` lowers it (inputs,
    kernels, ``sum_into``, ``concat``, ``sdpa``/``attn_combine``, transfers), in O(GPUs) time. ``causal``:
    key ranges end at the query block (the layers split)."""
    tt = int(tiles.get("t", seq))
    T = -(-seq // tt)
    H = -(-s.kv_heads // int(tiles.get("h", s.kv_heads)))
    F = -(-s.d_ffn // int(tiles.get("f", s.d_ffn)))
    P = max(1, int(tiles.get("kv", seq)) // tt)  # key blocks per key range

    def per_gpu(n: int) -> list[int]:  # blocks 0..n-1 placed on GPU b % G
        return [n // G + (r < n % G) for r in range(G)]

    cT, cH, cF = per_gpu(T), per_gpu(H), per_gpu(F)
    g_t = min(T, G)  # GPUs holding token blocks

    def fan_out(nb: int) -> int:  # transfers of T token blocks to the GPUs of nb head/FFN blocks
        g = min(nb, G)
        return T * g - sum(cT[:g])

    def gather(nb: int, cnt: list[int]) -> int:  # transfers of T x nb partials to their token block's GPU
        if nb == 1:  # one block: no accumulation, the output stays on GPU 0 and its reader fetches it
            return T - cT[0]
        return T * nb - sum(a * b for a, b in zip(cT, cnt, strict=True))

    inputs = T + L * (2 + 4 * H + 3 * F) + 1
    gh = min(H, G)  # GPUs holding head blocks
    extra = (T * s.qkv_bias * 3 * H + T * s.o_bias + 2 * T * H * s.qk_norm + 2 * T * s.sandwich  # layer ops
             + (g_t - 1) * s.o_bias + 2 * (gh - 1) * s.qk_norm + 2 * (g_t - 1) * s.sandwich  # weight copies
             + 3 * H * s.qkv_bias + s.o_bias + 2 * s.qk_norm + 2 * s.sandwich)  # weight inputs  # fmt: skip
    m, rem = divmod(T, P)
    sdpa = T + P * m * (m - 1) // 2 + rem * m  # sum over query blocks of their key ranges
    combine = max(0, T - P)
    R = -(-T // P)
    concat = 0 if P == 1 else (R - 1) + (T - (R - 1) * P >= 2)
    if causal:  # every prefix of a range that ends at a query block, where it has two blocks or more
        concat = sum(max(0, min(P, T - r * P) - 1) for r in range(R))
    layer = (
        T + (g_t - 1)  # attention norm and its weight's copies
        + 3 * T * H + fan_out(H)  # q, k, v (one contracted block) and the normed rows sent to them
        + 2 * T * H  # rotary on q and k
        + extra
        + T * H + (T * (H - 1) if H > 1 else 0) + gather(H, cH)  # output projection, partial sums
        + T  # residual
        + T + (g_t - 1)  # FFN norm
        + 2 * T * F + fan_out(F)  # gate, up
        + T * F  # silu_mul
        + T * F + (T * (F - 1) if F > 1 else 0) + gather(F, cF)  # down projection, partial sums
        + T  # residual
    )  # fmt: skip
    attn = 0  # fused attention, per layer: its window (if any) decides its key ranges
    for w in {s.layer_window(i) for i in range(L)}:
        a, c, k = _window_attention(T, P, tt, w) if w else (sdpa, combine, concat)
        attn += H * (a + c + 2 * k) * sum(s.layer_window(i) == w for i in range(L))
    V = -(-s.vocab // int(tiles.get("v", s.vocab)))
    if head == "none":
        out = T + (g_t - 1)  # final norm and its weight's copies
    elif head == "last":  # rows, its copy to GPU 0, norm; the vocabulary blocks and the normed row's copies
        out = 1 + ((T - 1) % G != 0) + 1 + 2 * V + min(V, G) - 1
    else:  # final norm, vocabulary blocks, one GEMM per (token, vocabulary) block, weight copies
        t_gpus = {j % G for j in range(T)}
        out = T + (g_t - 1) + V + T * V + sum(len(t_gpus - {j % G}) for j in range(V))
    if s.logit_softcap:  # the capped logits, one vertex per logits block
        out += V if head == "last" else T * V if head == "all" else 0
    return inputs + L * layer + attn + out + T * (s.embed_scale != 1.0)


def _window_attention(T: int, P: int, tile: int, window: int) -> tuple[int, int, int]:
    """(sdpa, attn_combine, concat) vertices of one head block of a sliding-window attention over ``T`` token
    blocks of ``tile`` in key ranges of ``P`` blocks, as ``turnip.graph_lower.lower_attention`` clips them."""
    sdpa = combine = 0
    spans = set()
    for qi in range(T):
        jmin = max(0, (qi * tile - window + 1) // tile)
        if qi + 1 - jmin <= P:  # one key range holds the window's blocks
            kept = [(jmin, qi + 1)]
        else:
            kept = [(max(j0, jmin), min(j0 + P, T, qi + 1)) for j0 in range(0, qi + 1, P)]
        kept = [(a, b) for a, b in kept if a < b]
        sdpa, combine = sdpa + len(kept), combine + (len(kept) > 1)
        spans |= {(a, b) for a, b in kept if b - a > 1}
    return sdpa, combine, len(spans)


def estimate(
    model: str,
    seq: int = 4096,
    gpus: int = 1,
    dtype: str = "fp16",
    tiles: dict | None = None,
    n_layers: int | None = None,
    budget_nbytes: int | None = None,
    head: str | None = None,
    train=None,
    batch: int = 1,
    split: str = "tensor",
) -> Estimate:
    """The size of ``make_taskgraph(model, ...)`` without building it (exact for LLaMA; the other models
    are small; a training step, a batch and the data split are lowered to count them, about 1 s for 7B at 8 x
    1K). Raises ``ValueError``
    for arguments ``make_taskgraph`` would refuse."""
    from turnip.memgraph.plan import DTYPE_NBYTES
    from turnip.models import llama_tiles

    if train is not None or batch > 1 or split == "data":  # counted by lowering it
        tg = make_taskgraph(model, seq, gpus, dtype, tiles, n_layers=n_layers, budget_nbytes=budget_nbytes,
                            head=head, train=train, batch=batch, split=split)  # fmt: skip
        inputs = int(tg.nbytes[tg.kind == 0].sum())
        return Estimate(tg.n, dict(tg.meta["tiles"]), inputs)

    s = llama_config(model)
    if split != "tensor" and s is None:
        raise ValueError(f"split {split!r} applies to LLaMA models; {model} has a fixed placement")
    if s is not None:
        hd = resolve_head(model, head)
        t = llama_tiles(s, seq, gpus, dtype, tiles, n_layers, budget_nbytes, hd, split)
        L = s.n_layers if n_layers is None else n_layers
        d, nb = s.d_model, DTYPE_NBYTES[dtype]
        weights = s.weight_nbytes(nb, L, head=hd != "none")
        if split == "layers":  # one GPU's vertices, and the hidden state's token tiles sent on at each boundary
            n = _llama_vertices(s, seq, 1, t, L, hd, causal=True) + -(-seq // int(t.get("t", seq))) * (gpus - 1)
        else:
            n = _llama_vertices(s, seq, gpus, t, L, hd)
        return Estimate(n, t, weights + seq * d * nb)
    if model == "paper-matmul":
        return Estimate(15, {}, 6 * 256)
    if model == "random":
        return Estimate(RANDOM_KERNELS * 4, {}, 0)
    raise ValueError(f"unknown model {model!r}; choose from {MODELS}")


def auto_workspace(budget: int, tg: TaskGraph | None = None) -> int:
    """Workspace per stream slot for GPU runs (cuDNN attention asks for a few hundred bytes; GEMMs run
    without one): 1/256 of the budget in 256-byte units, at most 1 MiB (none below a 64 KiB budget:
    kernels that need scratch then take their workspace-free fallback). A training plan's attention backward
    (cuDNN) needs its float32 dq accumulator and row statistics, 4 t h (dh + 2) bytes for a tile of t tokens
    and h query heads, plus 1 MiB: given up to 1/32 of the budget (else the portable kernel runs)."""
    ws = min(1 << 20, budget // 256)
    if tg is not None:
        need = 0
        for v in range(tg.n):
            if tg.op[v] == "sdpa_bwd":
                t, hk, packed = tg.shape[v]
                dh = int(tg.shape[int(tg.args(v)[1])][-1])
                h = hk * (packed // dh - 2)
                need = max(need, 4 * t * h * (dh + 2) + (1 << 20))
        if need:
            ws = max(ws, min(need, budget // 32))
    return ws // 256 * 256


def pipeline_keys(tg: TaskGraph) -> tuple[np.ndarray, np.ndarray]:
    """(phase, token tile) per vertex of a layers-split taskgraph. Tile: the latest of the prompt's token
    tiles (``x0``, ``targets`` blocks) the vertex depends on (weights: 0). Phase 1: the backward of a
    training step (what depends on the loss's gradient, and what only the backward reads or nothing reads:
    recomputed activations, Adam's moments), else 0. No vertex's (phase, tile) is below its dependencies'."""
    n = tg.n
    tile = np.zeros(n, dtype=np.int64)
    phase = np.array([op == "xent_bwd" for op in tg.op], dtype=np.int64)
    for name in ("x0", "targets"):
        blocks = tg.meta.get("input_blocks", {}).get(name, (None, []))[1]
        for i, (_, v) in enumerate(sorted(blocks, key=lambda b: tuple(b[0]))):
            tile[int(v)] = i
    users: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        deps = tg.deps(v)
        if len(deps):
            tile[v] = max(tile[v], int(tile[deps].max()))
            phase[v] = max(phase[v], int(phase[deps].max()))
            for d in deps:
                users[d].append(v)
    if phase.any():
        for v in range(n - 1, -1, -1):  # users come later: one pass in reverse
            if not phase[v] and not tg.is_output[v] and all(phase[u] for u in users[v]):
                phase[v] = 1
    return phase, tile


def pipeline_order(tg: TaskGraph) -> tuple[int, ...]:
    """Order V for a layers split: by phase, then token tile (``pipeline_keys``), construction order within;
    a topological order."""
    phase, tile = pipeline_keys(tg)
    return tuple(int(v) for v in np.lexsort((np.arange(tg.n), tile, phase)))


def add_pipeline_edges(mg: MemGraph, tg: TaskGraph) -> int:
    """Make each GPU of a layers split work through token tiles one after another: the kernels of tile j that
    start a GPU's part of it (no kernel of the same GPU, phase and tile among their dependencies) wait for
    the last kernel of tile j - 1 there (memory edges). Without them a GPU issues every ready tile at once and
    runs them layer by layer, so its first tile reaches the next GPU only when it is nearly done. Edges
    follow compile order (``pipeline_order``), so the graph stays acyclic. Returns the number added."""
    from turnip.memgraph.plan import DEP_MEMORY, KIND_KERNEL, csr

    phase, tile = pipeline_keys(tg)
    kern = np.flatnonzero(mg.kind == KIND_KERNEL)
    tv = mg.tg_vertex[kern]
    key = {int(v): (int(tg.gpu[v]), int(phase[v]), int(tile[v])) for v in tv}
    last: dict = {}  # (gpu, phase, tile) -> its last kernel in compile order
    roots: dict = {}
    for m, v in zip(kern.tolist(), tv.tolist(), strict=True):
        k = key[v]
        last[k] = m
        if not any(key.get(int(d)) == k for d in tg.deps(v)):
            roots.setdefault(k, []).append(m)
    extra: dict[int, list[int]] = {}
    prev: dict = {}
    for k in sorted(last):
        g, p, _ = k
        if (g, p) in prev:
            for m in roots.get(k, []):
                extra.setdefault(m, []).append(prev[(g, p)])
        prev[(g, p)] = last[k]
    if not extra:
        return 0
    lists, kinds = [], []
    mg_old_ptr = mg.dep_ptr
    for v in range(mg.n):
        old = mg.deps(v).tolist()
        add = [u for u in extra.get(v, []) if u not in old]
        lists.append(old + add)
        kinds.append(mg.dep_kind[mg.dep_ptr[v] : mg.dep_ptr[v + 1]].tolist() + [DEP_MEMORY] * len(add))
    mg.dep_ptr, mg.dep_src = csr(lists, mg.dep_src.dtype)
    mg.dep_kind = np.fromiter((k for ks in kinds for k in ks), dtype=mg.dep_kind.dtype, count=len(mg.dep_src))
    mg._succ = None
    count = sum(len(lists[v]) - int(mg_old_ptr[v + 1] - mg_old_ptr[v]) for v in extra)
    mg.stats["n_pipeline_edges"] = count
    return count


def build_with_resident(
    tg: TaskGraph, budget: int, config: BuildConfig | None = None, resident="0", progress=None, workspace="auto"
) -> MemGraph:
    """Build with a resident input set: a byte size per GPU, or ``"auto"``: a quarter of the budget, unless
    keeping it costs more than it saves: where that plan spills activations to the host, the plan with no
    resident inputs is built too and the one moving fewer bytes over the host links per run is kept
    (``run_link_nbytes``: a long prompt under a tight budget spills far more than the weights it keeps); none
    where a quarter leaves too little room for some vertex. ``stats["resident_limit_nbytes"]``: the size used.
    ``workspace``: bytes per stream slot kept for kernels' scratch (``"auto"``: ``auto_workspace``)."""
    cfg = config or BuildConfig()
    if tg.meta.get("train") and not cfg.keep_inputs:  # a training step's state stays on the GPU across steps
        from turnip.train import state_inputs

        keep = state_inputs(tg)
        if int(tg.nbytes[list(keep)].sum()) <= budget // 4:  # else it streams like any input (carried on the host)
            cfg = dataclasses.replace(cfg, keep_inputs=keep)
    ws = auto_workspace(budget, tg) if str(workspace) == "auto" else parse_nbytes(str(workspace))
    cfg = relay_config(dataclasses.replace(cfg, workspace_nbytes=ws), tg, budget)
    pipelined = tg.meta.get("split") == "layers" and tg.n_gpus > 1 and cfg.order is None
    if pipelined:
        cfg = dataclasses.replace(cfg, order=pipeline_order(tg))

    def build(nbytes: int) -> MemGraph:
        try:
            mg = build_memgraph(tg, budget, dataclasses.replace(cfg, resident_nbytes=nbytes), progress=progress)
        except BudgetError:
            if not cfg.relay_slots:
                raise
            # the relay slots left some vertex too little room: without them
            mg = build_memgraph(tg, budget, dataclasses.replace(cfg, resident_nbytes=nbytes, relay_slots=0),
                                progress=progress)  # fmt: skip
        mg.stats["resident_limit_nbytes"] = nbytes  # per GPU: what rebuilds this plan (``resident=str(...)``)
        if pipelined:
            add_pipeline_edges(mg, tg)
        return mg

    if str(resident) != "auto":
        return build(parse_nbytes(str(resident)))
    try:
        mg = build(budget // 4)
    except BudgetError:
        return build(0)
    if tg.meta.get("train"):
        mg = _more_resident(tg, mg, build, budget, cfg.keep_inputs)
    kept = mg.preloaded() & ~np.isin(mg.tensor, list(cfg.keep_inputs))  # a training step's state stays anyway
    if not (mg.kind == KIND_OFFLOAD).any() or not kept.any():
        return mg
    try:
        alt = build(0)
    except BudgetError:
        return mg
    return alt if run_link_nbytes(alt) < run_link_nbytes(mg) else mg


def _more_resident(tg: TaskGraph, mg: MemGraph, build, budget: int, keep) -> MemGraph:
    """A training step reads every frozen weight twice per step, step after step: where the quarter plan
    ``mg`` still streams inputs, the plan keeping every input resident (else half the budget) is built too,
    and the one moving fewer bytes over the host links per step kept."""
    streamed = (mg.kind == KIND_INPUT) & ~mg.preloaded()
    if not streamed.any():
        return mg
    ins = np.flatnonzero(tg.kind == KIND_INPUT)
    ins = ins[~np.isin(ins, list(keep))]
    per_gpu = np.bincount(tg.gpu[ins], weights=[aligned(int(tg.nbytes[v])) for v in ins], minlength=tg.n_gpus)
    for nbytes in (int(per_gpu.max()), budget // 2):
        if nbytes <= budget // 4:
            continue
        try:
            alt = build(nbytes)
        except BudgetError:
            continue
        return alt if run_link_nbytes(alt) < run_link_nbytes(mg) else mg
    return mg


def run_link_nbytes(mg: MemGraph) -> int:
    """Bytes one run of ``mg`` moves between host and GPUs: its inputs not resident, reloads and offloads."""
    k = mg.kind
    moved = ((k == KIND_INPUT) & ~mg.preloaded()) | (k == KIND_RELOAD) | (k == KIND_OFFLOAD)
    return int(mg.out_nbytes[moved].sum())


SPLITS = ("tensor", "layers", "data", "auto")
SPLIT_PROFILE = "h100-calibrated"  # the machine whose predicted makespans pick the split of ``auto``


def split_candidates(model: str, gpus: int, split: str = "auto", n_layers: int | None = None,
                     train: bool = False, seq: int = 0, dtype: str = "fp16", budget_nbytes: int | None = None,
                     tiles: dict | None = None, batch: int = 1) -> list[str]:  # fmt: skip
    """The plans to build, by name (``candidate`` reads one): the split given, or for ``auto`` each where there
    is a choice (a LLaMA model on several GPUs: tensor; layers with at least as many layers as GPUs; data:
    tokens split, weights on every GPU), else the tensor split. With ``tile_choice_on()`` (the default), a
    prefill of one prompt (``seq`` tokens) under the tensor split also as ``tensor t=N``, N its
    ``spread_token_tile``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    cfg = llama_config(model)
    if split != "auto":
        names = [split]
    elif gpus < 2 or cfg is None:
        names = ["tensor"]
    else:
        names = ["tensor"] + (["layers"] if (cfg.n_layers if n_layers is None else n_layers) >= gpus else []) + ["data"]
    spread = None
    if cfg is not None and "tensor" in names and not train and batch == 1 and seq and tile_choice_on():
        spread = spread_token_tile(cfg, seq, gpus, dtype, budget_nbytes, tiles)
    if spread:
        names.insert(names.index("tensor") + 1, f"tensor t={spread}")
    return names


def candidate(name: str, tiles: dict | None = None) -> tuple[str, dict | None]:
    """The split of a ``split_candidates`` name and its tiles: those it names over the given ``tiles``, or
    ``tiles`` where it names none ('tensor t=4096' -> ('tensor', {**tiles, 't': 4096}))."""
    split, *named = name.split()
    more = {k: int(v) for k, v in (x.split("=") for x in named)}
    return split, (tiles or {}) | more if more else tiles


def predict_ms(mg: MemGraph, profile) -> float:
    """The simulated makespan of one run of ``mg`` in ms (nondet, every duration at its mean)."""
    from sim.engine import simulate

    return simulate(mg, profile, "nondet", seed=0, mean_only=True).makespan_ns / 1e6


def build_split(splits: list[str], lower, build, profile=None) -> tuple[TaskGraph, MemGraph]:
    """The plan of the one split given, or of the split whose plan has the smallest predicted makespan
    (``predict_ms`` on ``profile``, default ``SPLIT_PROFILE``): ``lower(split)`` gives a taskgraph,
    ``build(tg)`` its memgraph (``splits``: ``split_candidates`` names). A split whose plan does not fit the
    budget is passed over (its message kept in ``tg.meta["split_failed"]``) unless none fits.
    A plan of other tiles than the given ones (``tensor t=N``) counts ``TILE_CHOICE_MARGIN`` slower: kept only
    where predicted that much faster. ``tg.meta["split_predicted_ms"]``: split -> ms;
    ``tg.meta["split_choice"]``: the name kept."""
    if len(splits) == 1:
        tg = lower(splits[0])
        return tg, build(tg)
    from turnip.machine.profile import load_profile

    name = profile or SPLIT_PROFILE
    prof = load_profile(name) if isinstance(name, str) else name
    plans, failed = {}, {}
    for s in splits:
        tg = lower(s)
        try:
            plans[s] = (tg, build(tg))
        except BudgetError as e:
            failed[s] = e
    if not plans:
        raise failed[splits[0]]
    predicted = {s: round(predict_ms(mg, prof), 3) for s, (_, mg) in plans.items()}
    best = min(predicted, key=lambda s: predicted[s] * (1 + TILE_CHOICE_MARGIN if candidate(s)[1] else 1))
    tg, mg = plans[best]
    tg.meta.update(split_predicted_ms=predicted, split_profile=name if isinstance(name, str) else prof.name,
                   split_choice=best)  # fmt: skip
    if failed:
        tg.meta["split_failed"] = {s: str(e) for s, e in failed.items()}
    return tg, mg


def compile_model(
    model: str,
    seq: int = 4096,
    gpus: int = 1,
    budget: int | str = "6GiB",
    dtype: str = "fp16",
    config: BuildConfig | None = None,
    tiles: dict | None = None,
    progress=None,
    n_layers: int | None = None,
    resident="0",
    workspace="auto",
    train=None,
    split: str = "tensor",
    profile=None,
    batch: int = 1,
    fold: bool | None = None,
) -> tuple[TaskGraph, MemGraph]:
    """Taskgraph and memgraph of a model (``train``: a ``turnip.train.TrainSpec`` for a LoRA training step;
    ``batch``: prompts of ``seq`` tokens prefilled together; ``fold``: sums folded into einsums; as
    ``make_taskgraph``).
    ``split``: tensor, layers, data, or auto (the CLI's default): on several GPUs the plan of each
    split that applies (``split_candidates``) is built and the one with the smallest predicted makespan on
    ``profile`` (a name or a ``MachineProfile``; default ``SPLIT_PROFILE``) is kept (``build_split``)."""
    b = parse_nbytes(budget) if isinstance(budget, str) else budget

    def lower(name: str) -> TaskGraph:
        s, t = candidate(name, tiles)
        return make_taskgraph(model, seq, gpus, dtype, t, n_layers=n_layers, budget_nbytes=b, train=train, split=s,
                              batch=batch, fold=fold)  # fmt: skip

    return build_split(
        split_candidates(model, gpus, split, n_layers, train is not None, seq, dtype, b, tiles, batch),
        lower,
        lambda tg: build_with_resident(tg, b, config, resident, progress, workspace),
        profile,
    )  # fmt: skip
