"""Text generation: prompts in, tokens out, through a prefill plan that fills the KV cache and decode plans
per (batch, cache blocks) that extend it (``turnip.decode``; design in docs/generate.md).

``generate(model, prompts, ...)`` is the entry point. Plans come from a ``PlanCache`` (in memory, on disk
keyed by model, budget, GPUs, dtype and the compiler's fingerprint; the next bucket's plan built in a
background thread while the current one runs). Prompts of different lengths share a batch: each runs its own
length through the prefill (right-padded, so no prompt token sees a pad) and its gap to the longest prompt
is free cache slots, which attention skips (``turnip.kvcache``). Each sequence's positions are its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from turnip.decode import DEFAULT_BLOCK, DecodeShape, carry_pairs, decode_step, writes_rows
from turnip.kvcache import HostCache, constants, merge_inputs, rotations, slot_onehot
from turnip.models import LlamaConfig
from turnip.plancache import PlanCache

STEP_INPUTS = ("x0", "rot", "W", "Eq", "Ek", "Pv", "Sel")  # the plans' inputs that are not weights
PREFILL_ROUND = 16  # prefill plans per prompt length rounded up to this many tokens
CARRY_ROWS_SWITCH = "TURNIP_CARRY_ROWS"  # "0": a decode step carries its written blocks whole (the old way)


def carry_rows_on() -> bool:
    """Whether a decode step hands its written cache block to the next step by the written slot's rows alone
    (the default; ``TURNIP_CARRY_ROWS=0``: the whole block, 2 x layers x block x batch x heads x head-dim values
    a step, 9.1 GB for 7B at batch 64 with blocks of 256 slots). On an H100 at batch 64 under 6 GiB: 1961 ms a
    decode step against 3067 carrying whole blocks (``benchmarks/results/generate/generate_b64_h100.md``)."""
    return os.environ.get(CARRY_ROWS_SWITCH) != "0"


KEEP_WEIGHTS_SWITCH = "TURNIP_KEEP_WEIGHTS"  # "0": each plan's backend allocates and writes its host weights anew


def keep_weights_on() -> bool:
    """Whether the next plan of a generation (the first decode plan after the prefill, the next cache bucket's)
    takes over the host input region of the plan before it, its weights laid out first in the same order
    (``turnip.runtime.layout.HostInputs``), instead of allocating and writing them again: on unless
    ``TURNIP_KEEP_WEIGHTS=0``. On an H100, 7B under 6 GiB, batch 1, prompt 512, 128 new tokens: 170.0-178.2
    ms a step against 210.2-216.3 (two bucket switches 0.7-1.0 s against 5.6-6.4 s), time to first token
    6.3-7.0 s against 10.3-11.4 (``benchmarks/results/generate/generate_keep_b1_h100.md``)."""
    return os.environ.get(KEEP_WEIGHTS_SWITCH) != "0"


PREFILL_TOKEN_SWITCH = "TURNIP_PREFILL_TOKEN"  # "0": the prefill leaves each prompt's last token to the decode plans


def prefill_token_on() -> bool:
    """Whether the prefill runs the prompts' last tokens too and gives each sequence its first new token
    (``prefill_kv`` with logits), so the first decode step writes slot P (the longest prompt's length) instead
    of P - 1: where P is a multiple of the block size (a prompt of 512, blocks of 256), the decode plan of the
    block holding slot P - 1 otherwise serves one step before the next bucket's plan is loaded. On unless
    ``TURNIP_PREFILL_TOKEN=0``. On H100s (7B, 6 GiB, prompt 512, 128 new tokens, one process a machine): batch 1
    176.1 and 172.4 ms a step against 182.5 and 177.4 on two machines (both orders), 186.3 against 181.9 on a
    third; batch 64 21.1 s to the first token against 50-53 (``benchmarks/results/generate/generate_rows_h100.md``)."""
    return os.environ.get(PREFILL_TOKEN_SWITCH, "1") != "0"


KEEP_CACHE_SWITCH = "TURNIP_KEEP_CACHE"  # "1": kept host regions carry the cache blocks too


def keep_cache_on() -> bool:
    """Whether a decode plan's kept host prefix (``keep_weights_on``) also holds its cache blocks, block by
    block (the written one's host copy made current at the switch), so that the next bucket's plan finds them
    in place and writes only its new last block: ``TURNIP_KEEP_CACHE=1`` (off until measured on GPUs)."""
    return os.environ.get(KEEP_CACHE_SWITCH) == "1"


def cache_prefix(tg) -> tuple[list[int], tuple]:
    """A decode plan's cache block inputs, block-major (block, layer, K/V, head range), and their key: the next
    bucket's plan lists the same blocks first, then its new last block. (The written block's host copy is made
    current before the plan's region is handed over.)"""
    kv = sorted((int(c["j"]), int(c["layer"]), c["which"], int(c["h0"]), int(c["input"])) for c in tg.meta["kv"])
    key = tuple(("kv", j, layer, w, h0, tuple(tg.shape[v]), tg.dtype[v], int(tg.gpu[v])) for j, layer, w, h0, v in kv)
    return [v for *_, v in kv], key


def weight_prefix(tg, names) -> tuple[list[int], tuple]:
    """The taskgraph input vertices of the logical weights ``names`` in a canonical order (layer, name, block
    starts, GPU) and the key of that order (names, starts, shapes, dtypes, GPUs): plans whose weights are tiled and
    placed alike give the same key."""
    blocks = tg.meta["input_blocks"]
    items = sorted((_layer_of(name), name, tuple(int(x) for x in st), int(tg.gpu[v]), int(v))
                   for name in names if name in blocks for st, v in blocks[name][1])  # fmt: skip
    key = tuple((n, st, g, tuple(tg.shape[v]), tg.dtype[v]) for _, n, st, g, v in items)
    return [v for *_, v in items], key


def _layer_of(name: str) -> float:
    """The decoder layer of weight ``name`` (``L{i}.``), layers in order and the rest (head, final norm) last: a
    prefill, which prunes the last layer's FFN and the head, shares all layers but the last with the decode plans."""
    head, _, _ = name.partition(".")
    return int(head[1:]) if head[:1] == "L" and head[1:].isdigit() else float("inf")


def shared_weights(m: Model, a, b) -> float:
    """The fraction of plan ``b``'s weight bytes that lead its host prefix laid out as in plan ``a`` (the bytes
    ``b`` finds in place when it takes over ``a``'s host region): 0 when their weights are tiled apart."""
    from turnip.runtime.layout import common_prefix
    from turnip.runtime.weights import logical_inputs

    la, lb = logical_inputs(a), logical_inputs(b)
    _, ka = weight_prefix(a, [k for k in m.weights if k in la])
    vb, kb = weight_prefix(b, [k for k in m.weights if k in lb])
    k = common_prefix(ka, kb)
    total = sum(int(b.nbytes[v]) for v in vb)
    return sum(int(b.nbytes[v]) for v in vb[:k]) / total if total else 0.0


class GenerateError(ValueError):
    """Bad input to a generation (one line, naming the argument)."""


# ---------------------------------------------------------------- the model's weights on the host


@dataclasses.dataclass
class Model:
    """A model's config, its weights (logical name -> array in the compute dtype: a dict, or a
    ``turnip.runtime.weights.LazyWeights`` making each when asked), the embedding of token ids, its tokenizer
    (or None) and its end-of-sequence ids."""

    cfg: LlamaConfig
    weights: dict
    embed: object  # ids -> (n, d)
    tokenizer: object = None
    eos: tuple = ()
    dtype: str = "fp16"


def weight_names(cfg: LlamaConfig, dtype: str) -> tuple:
    """The logical weight names of a decode plan (those of the prefill are a subset)."""
    from turnip.runtime.weights import logical_inputs

    return tuple(k for k in logical_inputs(_reference_tg(cfg, dtype)) if k not in STEP_INPUTS)


def _reference_tg(cfg: LlamaConfig, dtype: str):
    return decode_step(cfg, DecodeShape(1, 1, 1), 1, dtype)


def load_model(model: str, dtype: str = "fp16", seed: int = 0, random_weights: bool = False) -> Model:
    """A preset (``llama-tiny``: random weights of ``seed``) or a Hugging Face directory with safetensors
    weights, its ``tokenizer.json`` (with the ``tokenizers`` package) and end-of-sequence ids; a directory
    without weights only with ``random_weights``."""
    from turnip.checkpoint import Checkpoint, has_weights
    from turnip.decode import check_decodable
    from turnip.models import llama_config
    from turnip.runtime.weights import NP_OF, lazy_random_inputs, random_embedding

    try:
        cfg = llama_config(model)
    except (ValueError, OSError) as e:
        raise GenerateError(str(e)) from None
    if cfg is None:
        raise GenerateError(f"--model {model}: generation needs a LLaMA-family model (a preset or a Hugging Face "
                            "directory)")  # fmt: skip
    try:
        check_decodable(cfg)
    except ValueError as e:
        raise GenerateError(str(e)) from None
    tg = _reference_tg(cfg, dtype)
    names = set(weight_names(cfg, dtype))
    d = Path(model)
    if d.is_dir() and has_weights(d):
        ck = Checkpoint(d)
        weights = ck.inputs(tg, only=names).arrays()  # shards read by a thread pool (turnip.runtime.loader)
        table = ck.read(tg.meta["embed"]["table"]).astype(NP_OF[dtype])

        def embed(ids):
            return table[np.asarray(ids, dtype=np.int64)]

        return Model(cfg, weights, embed, _tokenizer(d), _eos_ids(d), dtype)
    if d.exists() and not random_weights:
        raise GenerateError(f"--model {model}: no safetensors weights there; pass a model directory with weights "
                            "(or --random-weights for seeded random ones)")  # fmt: skip
    weights = lazy_random_inputs(tg, seed, names)  # made when written: a 65B's 130 GB are never all in memory
    return Model(cfg, weights, random_embedding(tg, seed), None, (), dtype)


def _tokenizer(d: Path):
    f = d / "tokenizer.json"
    if not f.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(f))


def _eos_ids(d: Path) -> tuple:
    """End-of-sequence ids from ``generation_config.json`` or ``config.json``."""
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if f.is_file():
            try:
                e = json.loads(f.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue
            if e is not None:
                return tuple(int(x) for x in (e if isinstance(e, list) else [e]))
    return ()


# ---------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature`` is 0; else softmax(logits / temperature) over the ``top_k`` largest (0: all)
    whose cumulative probability reaches ``top_p``, drawn from ``np.random.default_rng(seed)``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> None:
        if not self.temperature >= 0:
            raise GenerateError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerateError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p must be in (0, 1], got {self.top_p}")


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> np.ndarray:
    """One token id per row of ``logits`` (B, vocab)."""
    z = logits.astype(np.float64)  # numpy's argmax over float64 is the fastest (64 x 32000 fp16 logits: 1.7 ms
    # copied, 2.7 over float32, 10.9 over fp16 as they come)
    if s.temperature == 0:
        return z.argmax(axis=1)
    z = z / s.temperature
    out = np.empty(len(z), dtype=np.int64)
    for i, row in enumerate(z):
        order = np.argsort(-row, kind="stable")
        if s.top_k:
            order = order[: s.top_k]
        p = np.exp(row[order] - row[order[0]])
        p /= p.sum()
        keep = min(len(p), int(np.searchsorted(np.cumsum(p), s.top_p)) + 1)
        p = p[:keep] / p[:keep].sum()
        out[i] = order[rng.choice(keep, p=p)]
    return out


# ---------------------------------------------------------------- the generation loop


@dataclasses.dataclass
class Result:
    """Per sequence its new token ids and text (None without a tokenizer), and the run's figures."""

    ids: list
    text: list
    stats: dict


class _Runner:
    """One plan loaded on a backend: its weights, constants and cache blocks written. ``host``: the host
    input region of the plan before (``HostInputs``; with ``keep_weights_on()``): taken over when its weights
    were laid out as this plan's, else freed; ``reserve``: spare bytes in this plan's region for the next's."""

    def __init__(self, tg, mg, model: Model, cache: HostCache | None, backend: str, streams: int, options: dict,
                 host=None, reserve: int = 0):  # fmt: skip
        from turnip.runtime import open_backend
        from turnip.runtime.loader import write_arrays, write_tiles
        from turnip.runtime.weights import logical_inputs, select_weights, tile_inputs

        self.tg, self.mg = tg, mg
        lg = logical_inputs(tg)
        if keep_weights_on():
            first, key = weight_prefix(tg, [k for k in model.weights if k in lg])
            if cache is not None and keep_cache_on():
                more, more_key = cache_prefix(tg)
                first, key = first + more, key + more_key
            options = options | {"host_first": first, "host_key": key, "host_reserve": reserve, "host_inputs": host}
        elif host is not None:
            host.free()
        self.be = open_backend(backend, mg, streams, **options)
        try:
            kept = set(self.be.adopted)  # weights in place: only resident ones to the GPUs
            self.kept_nbytes = sum(int(tg.nbytes[v]) for v in kept)
            self.be.load_resident(kept)
            blocks = tg.meta["input_blocks"]
            todo = [k for k in model.weights if k in lg and not all(v in kept for _, v in blocks[k][1])]
            write_arrays(self.be, tg, select_weights(model.weights, todo))  # the others, by threads
            if cache is not None:
                self.be.write_inputs(tile_inputs(tg, constants(model.cfg, model.dtype)))
                self.be.write_inputs(merge_inputs(tg))
                write_tiles(self.be, tg, cache.block_inputs(tg, skip=kept, views=True))  # by threads; those
                # found in place were loaded above
        except BaseException:
            self.be.close()
            raise

    def run(self, inputs: dict, policy: str, streams: int, seed: int | None, read: list[str],
            trace: str | None = None) -> dict:  # fmt: skip
        """Write ``inputs``, run the plan once, read the outputs ``read``; ``trace``: the run with its device times,
        written there as a Chrome trace (``turnip.trace``)."""
        from turnip.memgraph.interp import assemble
        from turnip.runtime import execute
        from turnip.runtime.loader import thread_map
        from turnip.runtime.weights import tile_inputs

        t = [time.perf_counter()]
        self.be.write_inputs(tile_inputs(self.tg, inputs))
        t.append(time.perf_counter())
        res = execute(self.mg, self.be, policy, streams, seed=seed, device_times=trace is not None)
        if trace is not None:
            meta = {"plan": self.tg.meta.get("head"), "batch": self.tg.meta.get("batch")}
            res.trace(self.mg, meta).write_chrome(trace)
        t.append(time.perf_counter())
        blocks = self.tg.meta["output_blocks"]
        outs = self.be.read_outputs(only={int(v) for k in read for _, v in blocks[k][1]}, views=True)
        t.append(time.perf_counter())
        out = dict(zip(read, thread_map(lambda k: assemble(self.tg, outs, k), read), strict=True))  # copies: the
        # views into the backend's region are gone once it runs again or closes
        t.append(time.perf_counter())
        self.phases = dict(zip(("write", "run", "read", "assemble"), np.diff(t).tolist(), strict=True))
        return out


class Session:
    """Calls of ``generate`` on one model that keep what a call loaded for the next: the plans (``PlanCache``)
    and the host input region of the call's last plan, the weights written there (pinned memory on a GPU:
    130 GB of LLaMA-65B take about a minute to allocate and write), which the next call's first plan takes over
    where its layout starts alike (``TURNIP_KEEP_WEIGHTS``, on by default). ``generate`` takes the
    ``generate`` arguments but the model, budget, GPUs, dtype and block, fixed here; ``defaults`` are the
    others' defaults. ``close`` (or the end of a ``with`` block) frees the region.

        with Session("llama-7b", budget="6GiB", backend="cuda") as s:
            for batch in batches:
                print(s.generate(batch, max_new_tokens=64).text)
    """

    def __init__(self, model: str | Model, budget: int | str = "6GiB", gpus: int = 1, dtype: str = "fp16",
                 block: int = DEFAULT_BLOCK, plan_dir: str | Path | None = None, seed: int = 0,
                 **defaults):  # fmt: skip
        from turnip.compile import parse_nbytes

        self.model = model if isinstance(model, Model) else load_model(model, dtype, seed)
        self.budget = parse_nbytes(budget) if isinstance(budget, str) else int(budget)
        self.gpus, self.block = gpus, block
        self.plans = PlanCache(self.model.cfg, self.budget, gpus, self.model.dtype, block, plan_dir)
        self.defaults = defaults
        self._host = None

    def generate(self, prompts, max_new_tokens: int = 32, **kw) -> Result:
        fixed = {"model", "budget", "gpus", "dtype", "block", "plans", "plan_dir", "session"} & set(kw)
        if fixed:
            raise GenerateError(f"{', '.join(sorted(fixed))} fixed by the session")
        return generate(self.model, prompts, max_new_tokens, self.budget, self.gpus, self.model.dtype,
                        block=self.block, plans=self.plans, session=self, **(self.defaults | kw))  # fmt: skip

    def take(self):
        """The region the last call left (``HostInputs``, or None), now the caller's."""
        host, self._host = self._host, None
        return host

    def keep(self, host) -> None:
        """``host`` (a detached region) kept for the next call, the one kept before freed."""
        self.close()
        self._host = host

    def close(self) -> None:
        """Free the kept region. Idempotent."""
        if self._host is not None:
            self._host.free()
            self._host = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate(
    model: str | Model, prompts, max_new_tokens: int = 32, budget: int | str = "6GiB", gpus: int = 1,
    dtype: str = "fp16", backend: str = "cpu", sampling: Sampling = Sampling(), stop: tuple = (),
    block: int = DEFAULT_BLOCK, plans: PlanCache | None = None, plan_dir: str | Path | None = None,
    policy: str = "nondet", streams: int = 3, chaos: float = 0.0, seed: int = 0, on_token=None,
    eos: tuple | None = None, profile: str | None = "h100", options: dict | None = None,
    session: Session | None = None, trace: str | None = None,
) -> Result:  # fmt: skip
    """Generate up to ``max_new_tokens`` per prompt (``prompts``: token id lists or strings, strings needing the
    model's tokenizer). A sequence stops at an end-of-sequence id (``eos``; default the model's) or when its
    text ends in one of ``stop``. ``on_token(b, id, text)`` is called for every new token. ``chaos``: the CPU
    backend's random delays (a run's order changes, its tokens must not); ``options``: more backend options
    (``turnip.runtime.open_backend``, e.g. the CPU backend's ``poison``). ``stats``: ttft_s (to the first
    new token, plan builds included), tokens_per_s (new tokens of the batch over the decode time),
    link_nbytes_per_token (host<->GPU bytes of a decode step per sequence), bound_ms (the last decode
    plan's lower bound on ``profile``), plans built / loaded, steps, decode_s (first new token to the last),
    switch_s (the part of decode_s spent loading the next cache bucket's plan), first_plan_s (the part spent
    loading the first decode plan, where the prefill gave the first token: ``prefill_token_on``), weights_kept
    (decode plans that took over the host weights of the plan before: ``keep_weights_on``), kept_nbytes (the bytes they
    found in place, weights and, with ``keep_cache_on``, cache blocks), prefill_s (the prompts' prefill: its plan
    loaded, written, run, the cache taken from it) and prefill_phases_s (its parts: open, write, run, read,
    assemble, close, fill), open_s (per decode plan loaded: loading it and writing its
    weights and cache blocks, in seconds), switch_phases_s (over the bucket switches: the written blocks read
    from the plan, taken into the host cache, the plan closed; with open_s after the first, switch_s),
    decode_steps (steps a decode plan ran), step_phases_s (over those: their inputs made, written, the plan run,
    the logits read and assembled, the written cache rows carried, the next tokens sampled),
    session_kept_nbytes (the bytes the first plan found in place from the call before, ``session``).
    ``session`` (``Session``; with ``keep_weights_on``): the first plan takes over the host input region the
    session's last call left (the weights written there, pinned on a GPU) where its layout starts alike, and
    the last plan's region is left to the session for the next call. ``trace``: the decode step of the last new
    token (if the generation gets there) run with its device times and written to this path as a Chrome trace
    (``turnip.trace``; the other steps run untimed)."""
    from turnip.compile import parse_nbytes

    t0 = time.perf_counter()
    sampling.check()
    if max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if block < 1:
        raise GenerateError(f"--block must be >= 1, got {block}")
    m = model if isinstance(model, Model) else load_model(model, dtype, seed)
    dtype = m.dtype
    ids = _prompt_ids(m, prompts)
    B = len(ids)
    b_nbytes = parse_nbytes(budget) if isinstance(budget, str) else int(budget)
    plans = plans or PlanCache(m.cfg, b_nbytes, gpus, dtype, block, plan_dir)
    mine = (m.cfg, b_nbytes, gpus, dtype, block)
    if (plans.cfg, plans.budget, plans.n_gpus, plans.dtype, plans.block) != mine:
        raise GenerateError("the plan cache was made for another model, budget, GPU count, dtype or block size")
    opts = ({"chaos": chaos} if backend == "cpu" and chaos else {}) | dict(options or {})
    lens = [len(x) for x in ids]
    P = max(lens)
    first = prefill_token_on()  # the prefill gives the first new token: decoding starts at slot P
    k0 = 1 if first else 0  # the first step a decode plan runs
    if k0 < max_new_tokens:
        plans.prefetch("decode", B, (P - 1 + k0) // block + 1)  # the first decode step writes slot P - 1 + k0
    cache = HostCache(m.cfg, B, block, dtype)
    last_nb = (P + max_new_tokens - 2) // block + 1  # the last step's bucket
    spare = lambda nb: cache.nbytes(last_nb) - cache.nbytes(nb) + (64 << 20)  # noqa: E731  # the next plans' cache
    host = session.take() if session is not None else None  # the host input region handed from one plan to the
    # next (``keep_weights_on``): to the first, the one the session's last call left
    session_kept, prefill_s, prefill_phases = 0, 0.0, {}
    out = _Outputs(m.tokenizer, B, set(m.eos if eos is None else eos), stop, on_token)
    rng = np.random.default_rng(sampling.seed)
    cur = np.array([x[-1] for x in ids], dtype=np.int64)
    runner, ttft, t_dec, switch_s, kept, kept_nbytes, open_s = None, None, None, 0.0, 0, 0, []
    first_plan_s = 0.0  # the first decode plan's loading, where it comes after the first token
    switch_phases: dict = {}  # seconds over all bucket switches: the written blocks read, taken, the plan closed
    steps, stopped, last_mg = 0, False, None  # last_mg: the last decode plan's memgraph
    step_phases: dict = {}  # seconds over the decode steps: inputs made, written, run, read, assembled, carried
    try:  # whatever fails, the plan open and the region held now are released below
        if P > 1 or first:
            nxt = (plans.get("decode", B, (P - 1 + k0) // block + 1)[0]  # the first decode plan
                   if keep_weights_on() and k0 < max_new_tokens else None)  # fmt: skip
            t_pre = time.perf_counter()
            run = (backend, streams, opts, policy, seed)
            host, prefill_phases, session_kept, logits = _prefill(m, ids, plans, cache, run, spare(0), nxt, host,
                                                                  first)  # fmt: skip
            prefill_s = time.perf_counter() - t_pre
            if first:
                cur = sample(logits, sampling, rng)
                ttft, t_dec, steps = time.perf_counter() - t0, time.perf_counter(), 1
                stopped = out.add(cur)
        for k in range(k0, 0 if stopped else max_new_tokens):
            slot = P - 1 + k
            nb = slot // block + 1
            if runner is None or runner.tg.meta["decode"]["n_blocks"] != nb:
                t_switch = time.perf_counter()
                if runner is not None:  # the written block back to the host copy, the next bucket's plan loaded
                    rows_out = writes_rows(runner.tg)  # then the host cache has every row already
                    if not rows_out:
                        blocks_out = runner.be.read_outputs(only={o for o, _ in carry_pairs(runner.tg)}, views=True)
                    t = [time.perf_counter()]
                    if not rows_out:
                        cache.take(runner.tg, blocks_out)
                    t.append(time.perf_counter())
                    if keep_weights_on() and keep_cache_on():  # the written block's host copy made current
                        written = {i for _, i in carry_pairs(runner.tg)}
                        runner.be.write_inputs(cache.block_inputs(runner.tg, only=written), load_resident=False)
                    host = runner.be.detach_host_inputs() if keep_weights_on() else None
                    runner.be.close()
                    runner = None
                    t.append(time.perf_counter())
                    for name, a, b in (("read", t_switch, t[0]), ("take", t[0], t[1]), ("close", t[1], t[2])):
                        switch_phases[name] = switch_phases.get(name, 0.0) + b - a
                t_open = time.perf_counter()
                runner, host = _Runner(*plans.get("decode", B, nb), m, cache, backend, streams, opts, host,
                                       spare(nb)), None  # fmt: skip
                open_s.append(time.perf_counter() - t_open)
                last_mg = runner.mg
                if P <= 1 and len(open_s) == 1:  # no prefill: the first decode plan took the session's region
                    session_kept = runner.kept_nbytes
                kept += bool(runner.be.adopted)
                kept_nbytes += runner.kept_nbytes
                if last_nb > nb:  # the generation reaches the next bucket
                    plans.prefetch("decode", B, nb + 1)
                if ttft is not None and len(open_s) > 1:  # a bucket's plan loaded while decoding
                    switch_s += time.perf_counter() - t_switch
                elif ttft is not None:  # the first decode plan, after the prefill's first token
                    first_plan_s = time.perf_counter() - t_switch
            t_step = time.perf_counter()
            inputs = {"x0": m.embed(cur), "rot": rotations(m.cfg, [n - 1 + k for n in lens], dtype)}
            if not writes_rows(runner.tg):  # the old step places its rows by a one-hot slot
                inputs["W"] = slot_onehot(block, slot, dtype)
            t_in = time.perf_counter()
            logits = runner.run(inputs, policy, streams, None if seed is None else seed + k, ["logits"],
                                trace if k == max_new_tokens - 1 else None)["logits"]  # fmt: skip
            t_run = time.perf_counter()
            pairs = carry_pairs(runner.tg)
            if writes_rows(runner.tg):  # the new rows: into the host cache and their block
                cache.put_rows(runner.tg, runner.be.read_outputs(only={o for o, _ in pairs}, views=True), slot)
                runner.be.carry(pairs, rows=(slot % block, 1))
            else:
                runner.be.carry(pairs, rows=(slot % block, 1) if carry_rows_on() else None)
            t_carry = time.perf_counter()
            cur = sample(logits, sampling, rng)
            more = {"inputs": t_in - t_step, "carry": t_carry - t_run, "sample": time.perf_counter() - t_carry}
            for name, sec in (runner.phases | more).items():
                step_phases[name] = step_phases.get(name, 0.0) + sec
            steps = k + 1
            if ttft is None:
                ttft, t_dec = time.perf_counter() - t0, time.perf_counter()
            if out.add(cur):
                break
        t_end = time.perf_counter()
        if session is not None and keep_weights_on() and runner is not None:  # the last plan's region, weights
            # in place, for the next call
            session.keep(_weights_only(runner.be.detach_host_inputs(), runner.tg, m))
    finally:
        if runner is not None:
            runner.be.close()
        if host is not None:
            host.free()
    from turnip.compile import run_link_nbytes
    from turnip.runtime.driver import lower_bound

    n_new = sum(len(x) for x in out.ids)
    dec_s = t_end - t_dec
    stats = {"ttft_s": ttft, "tokens_per_s": (n_new - B) / dec_s if dec_s > 0 and n_new > B else None,
             "decode_s": dec_s, "switch_s": switch_s, "first_plan_s": first_plan_s, "weights_kept": kept,
             "kept_nbytes": kept_nbytes,
             "steps": steps, "new_tokens": n_new, "prefill_s": prefill_s,
             "prefill_phases_s": prefill_phases, "open_s": open_s, "switch_phases_s": switch_phases,
             "step_phases_s": step_phases, "decode_steps": steps - k0 if steps > k0 else 0,
             "link_nbytes_per_token": run_link_nbytes(last_mg) / B if last_mg is not None else None,
             "bound_ms": (lower_bound(last_mg, profile)["lower_bound_ns"] / 1e6
                          if profile and last_mg is not None else None),
             "profile": profile, "plans_built": list(plans.built), "plans_loaded": list(plans.loaded),
             "session_kept_nbytes": session_kept, "total_s": time.perf_counter() - t0}  # fmt: skip
    return Result(out.ids, out.texts if m.tokenizer is not None else [None] * B, stats)


def _weights_only(host, tg, m: Model):
    """``host`` (a detached region of plan ``tg``) claiming its weights alone: a kept cache block
    (``keep_cache_on``) holds this call's keys and values, which no later call may find in place."""
    from turnip.runtime.layout import common_prefix
    from turnip.runtime.weights import logical_inputs

    lg = logical_inputs(tg)
    host.key = host.key[: common_prefix(host.key, weight_prefix(tg, [k for k in m.weights if k in lg])[1])]
    return host


def _prefill(m: Model, ids: list, plans: PlanCache, cache: HostCache, run: tuple, reserve: int = 0, nxt=None,
             host=None, first: bool = False):  # fmt: skip
    """The prompts but their last tokens (``first``: every token) through the prefill plan (right-padded with id
    0 to a multiple of ``PREFILL_ROUND`` tokens: no prompt token sees a pad, token tiles divide the length, and
    prompts of similar lengths share a plan), their keys and values into ``cache``. ``run``: (backend, streams,
    options, policy, seed). ``nxt``: the first decode plan's taskgraph, where the region is to pass on: the
    prefill's host input region (with ``reserve`` spare bytes for that plan's cache) is returned for it when
    at least half of its weights' bytes would be found in place (``shared_weights``), else None; the seconds
    of its phases (the plan opened and its weights written, run, outputs read and assembled, closed, the cache
    filled); the bytes the plan found in place in ``host`` (a region handed to it, or None); and with
    ``first`` the logits (batch, vocab) of each prompt's last token, else None."""
    backend, streams, opts, policy, seed = run
    lens = [len(x) if first else len(x) - 1 for x in ids]  # the tokens each prompt runs through the prefill
    seq = -(-max(lens) // PREFILL_ROUND) * PREFILL_ROUND
    tg, mg = plans.get("prefill+logits" if first else "prefill", len(ids), seq)
    padded = np.zeros((len(ids), seq), dtype=np.int64)
    for b, x in enumerate(ids):
        padded[b, : lens[b]] = x[: lens[b]]
    from turnip.decode import last_token_rows
    from turnip.runtime.weights import logical_inputs, weight_nbytes

    lg = logical_inputs(tg)
    hand = nxt is not None and shared_weights(m, tg, nxt) >= 0.5
    # the decode plans also hold the weights the prefill does not read
    reserve = reserve + sum(weight_nbytes(m.weights, k) for k in m.weights if k not in lg) if hand else 0
    t0 = time.perf_counter()
    r = _Runner(tg, mg, m, None, backend, streams, opts, host=host, reserve=reserve)
    phases = {"open": time.perf_counter() - t0}
    inputs = {"x0": m.embed(padded.reshape(-1))}
    if first:
        inputs["Sel"] = last_token_rows(lens, seq, m.dtype)
    try:
        kv = r.run(inputs, policy, streams, seed, list(tg.meta["output_blocks"]))
        phases |= r.phases
        host = r.be.detach_host_inputs() if hand else None
    finally:
        t1 = time.perf_counter()
        r.be.close()
        phases["close"] = time.perf_counter() - t1
    logits = kv.pop("logits", None)
    t1 = time.perf_counter()
    cache.fill(kv, seq, lens)
    phases["fill"] = time.perf_counter() - t1
    return host, phases, r.kept_nbytes, logits


class _Outputs:
    """The new tokens and text of each sequence; which have stopped (an end-of-sequence id, a stop string)."""

    def __init__(self, tokenizer, batch: int, eos: set, stop: tuple, on_token):
        self.tok, self.eos, self.stop, self.on_token = tokenizer, eos, [s for s in stop if s], on_token
        self.ids: list[list[int]] = [[] for _ in range(batch)]
        self.texts = [""] * batch
        self.done = np.zeros(batch, dtype=bool)

    def add(self, tokens: np.ndarray) -> bool:
        """Append a step's tokens to the sequences still going; True when every sequence has stopped."""
        for b in np.flatnonzero(~self.done):
            t = int(tokens[b])
            self.ids[b].append(t)
            piece = ""
            if self.tok is not None:
                full = self.tok.decode(self.ids[b])
                if not full.endswith("\ufffd"):  # else a character's bytes are still coming: wait for them
                    piece = full[len(os.path.commonprefix([self.texts[b], full])) :]
                    self.texts[b] = full
            if self.on_token is not None:
                self.on_token(int(b), t, piece)
            if t in self.eos or any(self.texts[b].endswith(s) for s in self.stop):
                self.done[b] = True
        return bool(self.done.all())


def _prompt_ids(m: Model, prompts) -> list[np.ndarray]:
    """Token ids per prompt; ``GenerateError`` for an empty batch, an empty prompt or an id out of range."""
    if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        raise GenerateError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if m.tokenizer is None:
                raise GenerateError("text prompts need the model's tokenizer.json and the tokenizers package; pass "
                                    "token ids (--prompt-ids)")  # fmt: skip
            p = m.tokenizer.encode(p).ids
        x = np.asarray(p)
        if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.integer):
            raise GenerateError(f"prompt {i}: needs a non-empty list of integer token ids")
        if x.min() < 0 or x.max() >= m.cfg.vocab:
            bad = int(x[(x < 0) | (x >= m.cfg.vocab)][0])
            raise GenerateError(f"prompt {i}: token id {bad} is outside the vocabulary of {m.cfg.vocab}")
        out.append(x.astype(np.int64))
    return out
