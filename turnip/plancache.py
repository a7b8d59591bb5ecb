"""Decoding plans built once: ``PlanCache`` keeps the prefill and decode plans of one model under one budget,
GPU count, dtype and block size in memory and on disk, and builds the next one in a background thread.

State: ``plans`` (key -> (taskgraph, memgraph)), ``pending`` (key -> the thread building it), ``errors`` (key
-> the exception a background build raised, handed to ``get``). A key is (``"prefill"`` or
``"prefill+logits"`` (``prefill_kv`` with logits), batch, tokens per prompt) or (``"decode"``, batch, cache
blocks). Invariant: a key is in at most one of ``plans`` and ``errors``; files on disk are named by a hash of
everything that shapes the plan (``path``), so a file never serves a plan built from other settings or other code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

from turnip.decode import (
    DEFAULT_BLOCK,
    DecodeShape,
    context_blocks,
    decode_rows_on,
    decode_step,
    decode_weight_tiles,
    prefill_kv,
    state_inputs,
    writes_rows,
)
from turnip.models import LlamaConfig

PREFILL_TILES_SWITCH = "TURNIP_PREFILL_DECODE_TILES"
DECODE_SPLIT_SWITCH = "TURNIP_DECODE_SPLIT"


def decode_split() -> str:
    """How decode steps on several GPUs are split: ``TURNIP_DECODE_SPLIT=tensor`` (the default until timed on GPUs:
    head and FFN blocks over every GPU), ``auto`` (whole layers per GPU where the step then moves nothing over the
    host links, else tensor) or ``layers``. A step's activations are one row per sequence, so once nothing
    streams the tensor split's vertices (G times a one-GPU step's) set the time: simulated on ``h100-calibrated``,
    LLaMA-65B at batch 16 on 8 GPUs (30 GiB each, cache of 1024 slots) 56.9 ms a step by layers against 239.8 by
    tensor, 7B at batch 1 without a budget on 2 GPUs 13.7 against 28.2; where weights stream, the tensor split
    keeps every host link busy (65B on 4 GPUs: 491.9 against 1258.4 ms)."""
    v = os.environ.get(DECODE_SPLIT_SWITCH, "tensor")
    if v not in ("auto", "layers", "tensor"):
        raise ValueError(f"{DECODE_SPLIT_SWITCH}={v!r}: choose auto, layers or tensor")
    return v


def prefill_decode_tiles_on() -> bool:
    """Whether a generation's prefill tiles the weights as its decode plans do (``decode_weight_tiles``), so that
    the first decode plan takes over the prefill's host weights instead of writing them again: on unless
    ``TURNIP_PREFILL_DECODE_TILES=0``. Measured on an H100 (7B, 6 GiB, batch 1, a prompt of 512, one process):
    time to first token 6.77 s instead of 11.92 (the first decode plan loaded in 0.45 s instead of 5.16), the
    same 174 ms a step (``benchmarks/results/generate/generate_prefill_tiles_h100.md``)."""
    return os.environ.get(PREFILL_TILES_SWITCH, "1") != "0"


class PlanVerifyError(RuntimeError):
    """A plan the memgraph verifier rejects: a compiler bug, never a user error."""


def plan_fingerprint() -> str:
    """The compiler's fingerprint extended by the source of the modules that shape decoding plans (this one
    picks their resident sets)."""
    from turnip.compile import compiler_fingerprint

    h = hashlib.sha256(compiler_fingerprint().encode())
    for f in ("decode.py", "plancache.py", "compile.py"):
        h.update((Path(__file__).parent / f).read_bytes())
    return h.hexdigest()[:12]


class PlanCache:
    """Prefill and decode plans of one model under one budget, GPU count and dtype: built once, kept in
    memory, and saved to / loaded from ``directory`` when given (file names carry a hash of the model's
    config, the plan's shape, the budget, GPUs, dtype and ``plan_fingerprint``). ``prefetch`` builds a plan
    in a background thread; ``get`` waits for it. ``verify``: every plan through the memgraph verifier
    (``PlanVerifyError`` on a violation). ``built`` / ``loaded``: keys built here / read from disk."""

    def __init__(self, cfg: LlamaConfig, budget: int, n_gpus: int = 1, dtype: str = "fp16",
                 block: int = DEFAULT_BLOCK, directory: str | Path | None = None, verify: bool = False,
                 decode: str | None = None):  # fmt: skip
        self.cfg, self.budget, self.n_gpus, self.dtype, self.block = cfg, budget, n_gpus, dtype, block
        if decode not in (None, "auto", "layers", "tensor"):
            raise ValueError(f"decode steps split by auto, layers or tensor, not {decode!r}")
        self.decode = decode  # how decode steps are split (None: ``decode_split()``)
        self.dir = Path(directory) if directory else None
        self.verify = verify
        self.plans: dict[tuple, tuple] = {}
        self.pending: dict[tuple, threading.Thread] = {}
        self.errors: dict[tuple, BaseException] = {}
        self.built: list[tuple] = []
        self.loaded: list[tuple] = []
        self._lock = threading.Lock()

    def path(self, key: tuple) -> Path | None:
        """Where plan ``key`` is saved (None without a directory)."""
        if self.dir is None:
            return None
        what = {"cfg": dataclasses.asdict(self.cfg), "key": list(key), "budget": self.budget, "gpus": self.n_gpus,
                "dtype": self.dtype, "block": self.block, "fingerprint": plan_fingerprint(),
                "prefill_decode_tiles": key[0].startswith("prefill") and prefill_decode_tiles_on(),
                "decode_split": (self.decode or decode_split()) if key[0] == "decode" else None,
                "decode_rows": decode_rows_on() if key[0] == "decode" else None}  # fmt: skip
        h = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
        name = "".join(c if c.isalnum() or c in "-_" else "_" for c in (self.cfg.name or "llama"))
        return self.dir / f"{name}-{key[0].replace('+', '_')}-b{key[1]}-n{key[2]}-{h}.plan"

    def get(self, kind: str, batch: int, n: int):
        """(taskgraph, memgraph) of a ``prefill`` of ``n`` tokens per prompt or a ``decode`` step over ``n``
        cache blocks."""
        key = (kind, batch, n)
        t = self.pending.get(key)
        if t is not None:
            t.join()
        with self._lock:
            if key in self.errors:
                raise self.errors.pop(key)
            if key in self.plans and _current(key, self.plans[key][0]):
                return self.plans[key]
        plan = self._make(key)
        with self._lock:
            self.plans[key] = plan
        return plan

    def prefetch(self, kind: str, batch: int, n: int) -> None:
        """Start building a plan in a background thread (nothing when it is known or under way)."""
        key = (kind, batch, n)
        with self._lock:
            if key in self.plans or key in self.pending and self.pending[key].is_alive():
                return

        def work():
            try:
                plan = self._make(key)
                with self._lock:
                    self.plans[key] = plan
            except BaseException as e:  # noqa: BLE001 - handed to the caller of get
                with self._lock:
                    self.errors[key] = e

        t = threading.Thread(target=work, name=f"turnip-plan-{key}", daemon=True)
        self.pending[key] = t
        t.start()

    def _make(self, key: tuple):
        from turnip.memgraph.io import PlanFormatError, load_plan, save_plan

        p = self.path(key)
        if p is not None and p.is_file():
            try:
                mg, tg = load_plan(p)
                if tg is not None:
                    self.loaded.append(key)
                    return tg, mg
            except PlanFormatError:
                pass  # rebuilt and saved over
        tg, mg = self._build(*key)
        self.built.append(key)
        if p is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            save_plan(p, mg, tg)
        return tg, mg

    def _resident(self, tg, cfg):
        """The decode plan that moves the fewest bytes per step over the host links, of those keeping 3/4, 1/2,
        1/4 or none of the budget for resident weights (a step's activations are a row per sequence, so
        weights may take most of the budget; ties go to the larger resident set)."""
        from turnip.compile import build_with_resident, run_link_nbytes
        from turnip.memgraph.build import BudgetError

        best, err = None, None
        for frac in (3, 2, 1, 0):
            try:
                mg = build_with_resident(tg, self.budget, cfg, resident=str(self.budget * frac // 4))
            except BudgetError as e:
                err = err or e
                continue
            if best is None or run_link_nbytes(mg) < run_link_nbytes(best):
                best = mg
        if best is None:
            raise err
        return best

    def _decode(self, batch: int, n: int):
        """A decode step split as ``decode_split()`` says: ``auto`` takes the layers split where its step moves
        nothing over the host links (every weight and cache block stays on the GPUs), else the tensor split."""
        from turnip.compile import run_link_nbytes
        from turnip.memgraph.build import BuildConfig

        how = (self.decode or decode_split()) if self.n_gpus > 1 else "tensor"
        for split in ("layers", "tensor") if how != "tensor" else ("tensor",):
            tg = decode_step(self.cfg, DecodeShape(batch, n, self.block), self.n_gpus, self.dtype, self.budget,
                             split=split)  # fmt: skip
            keep = state_inputs(tg)  # the cache stays on the GPU when it takes at most a quarter of the budget
            fits = int(tg.nbytes[list(keep)].sum()) <= self.budget * self.n_gpus // 4
            mg = self._resident(tg, BuildConfig(keep_inputs=keep if fits else ()))
            if split == "tensor" or how == "layers" or run_link_nbytes(mg) == 0:
                return tg, mg
        raise AssertionError("unreachable: the tensor split is always taken last")

    def _build(self, kind: str, batch: int, n: int):
        from turnip.compile import build_with_resident
        from turnip.memgraph.build import BuildConfig

        if kind in ("prefill", "prefill+logits"):
            on = prefill_decode_tiles_on()
            tiles = decode_weight_tiles(self.cfg, self.n_gpus, self.dtype, self.budget) if on else None
            tg = prefill_kv(self.cfg, n, batch, self.n_gpus, self.dtype, self.budget, tiles, kind != "prefill")
            mg = build_with_resident(tg, self.budget, BuildConfig(), resident="auto")
        else:
            tg, mg = self._decode(batch, n)
        if self.verify:
            from turnip.memgraph.verify import verify

            bad = verify(mg, tg)
            if bad:
                raise PlanVerifyError(f"{kind} plan (batch {batch}, {n}): {len(bad)} violations, first {bad[0]}")
        return tg, mg


def _current(key: tuple, tg) -> bool:
    """Whether a kept plan was built as the switches say now (a decode step's new rows as outputs or not)."""
    return key[0] != "decode" or writes_rows(tg) == decode_rows_on()


def decode_plan(cfg: LlamaConfig, context: int, batch: int = 1, n_gpus: int = 1, budget_nbytes: int = 6 << 30,
                dtype: str = "fp16", block: int = DEFAULT_BLOCK, verify: bool = False,
                split: str | None = None):  # fmt: skip
    """(taskgraph, memgraph) of the decode step ``turnip generate`` runs for ``batch`` sequences whose new
    token is the ``context``-th (``context_blocks``), built as its ``PlanCache`` builds it: the cache kept on
    the GPUs when it takes at most a quarter of the budget, else streamed from the host; the resident weights
    that move the fewest bytes per step; split as ``split`` says (``PlanCache``'s ``decode``)."""
    plans = PlanCache(cfg, budget_nbytes, n_gpus, dtype, block, verify=verify, decode=split)
    return plans.get("decode", batch, context_blocks(context, block))
