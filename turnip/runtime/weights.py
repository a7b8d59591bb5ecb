"""Model inputs: logical tensors (``x0``, ``L0.wq`` ...) to the taskgraph's input tiles.

- ``random_inputs_for(tg, seed)``: random inputs, quickly even for 7B shapes: values are cut from one
  seeded pool of normal numbers at random offsets (the embedded prompt ``x0`` and weights scaled by 0.02,
  norm weights near 1); ``iter_random_inputs`` yields them one tensor at a time and ``write_streaming``
  writes such a stream into a loaded backend (peak host memory: the pinned input region plus one tensor).
- ``write_safetensors(path, tensors)``: a numpy-only writer of the safetensors format (8-byte little-endian
  header length, JSON header of ``dtype``/``shape``/``data_offsets``, raw little-endian data; bfloat16 as
  BF16); ``turnip.checkpoint.Checkpoint`` reads such files.
- ``hf_name`` / ``hf_shape`` / ``from_hf``: Hugging Face LLaMA names and layouts to ours (below).
- Reading weight files into these logical inputs is ``turnip.checkpoint``'s (``Checkpoint.iter_inputs``,
  ``iter_weights``, ``load_weights``: a ``.safetensors`` file with either set of names, or a sharded Hugging
  Face model directory), which uses the names, layouts and dtypes here; this module never imports it.
  ``Checkpoint.inputs`` is such a stream that ``write_streaming`` reads on threads straight into the host
  input region (``turnip.runtime.loader``).
- ``tile_inputs(tg, logical)``: {taskgraph input tensor: tile} as views, ready for ``write_inputs``.
- ``write_random_inputs(backend, tg, seed)``: what ``write_streaming`` of ``iter_random_inputs`` writes, the
  same bytes, filled by a thread pool straight into the backend's host input region (``RandomInputs``: such a
  stream as an object that ``write_streaming`` hands to it).

Logical inputs of a LLaMA-family model (d model width, H query heads, Hk key/value heads, r = H / Hk,
e head dim, f FFN width, V vocabulary). Every weight is the Hugging Face tensor reshaped (same bytes):

| ours | shape | Hugging Face | conversion |
|---|---|---|---|
| ``x0`` | (seq, d) | rows of ``model.embed_tokens.weight`` (V, d) picked by token ids | host gather |
| ``L{i}.attn_norm`` | (d,) | ``model.layers.{i}.input_layernorm.weight`` | as is |
| ``L{i}.wq`` | (H, e, d); GQA (Hk, r, e, d) | ``...self_attn.q_proj.weight`` (H*e, d) | reshape |
| ``L{i}.wk`` / ``wv`` | (Hk, e, d) | ``...self_attn.k_proj.weight`` / ``v_proj`` (Hk*e, d) | reshape |
| ``L{i}.wo`` | (d, H, e); GQA (d, Hk, r, e) | ``...self_attn.o_proj.weight`` (d, H*e) | reshape |
| ``L{i}.ffn_norm`` | (d,) | ``...post_attention_layernorm.weight`` | as is |
| ``L{i}.w_gate`` / ``w_up`` | (f, d) | ``...mlp.gate_proj.weight`` / ``up_proj`` | as is |
| ``L{i}.w_down`` | (d, f) | ``...mlp.down_proj.weight`` | as is |
| ``final_norm`` | (d,) | ``model.norm.weight`` | as is |
| ``lm_head`` | (V, d) | ``lm_head.weight`` | as is |
| ``tok_embed`` | (V, d) | ``model.embed_tokens.weight`` (the LM head when embeddings are tied) | as is |

Compute dtypes (``tg.dtype`` of an input vertex): fp16, bf16 (``ml_dtypes.bfloat16``), fp32, int32.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

_ST_DTYPES = {"F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
              "I32": np.int32, "I64": np.int64, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}  # fmt: skip
NP_OF = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp32": np.float32, "int32": np.int32}


def logical_inputs(tg) -> dict[str, tuple]:
    """Logical input name -> (shape, [(block starts, taskgraph input vertex), ...])."""
    return tg.meta.get("input_blocks", {})


def compute_dtype(tg, name: str) -> np.dtype:
    """The numpy dtype the taskgraph computes logical input ``name`` in."""
    return np.dtype(NP_OF[tg.dtype[logical_inputs(tg)[name][1][0][1]]])


def tile_inputs(tg, logical: dict) -> dict[int, np.ndarray]:
    """Cut logical tensors into the taskgraph's input tiles (views; no copy). Unknown names are ignored."""
    out = {}
    for name, (shape, blocks) in logical_inputs(tg).items():
        if name not in logical:
            continue
        x = logical[name]
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"input {name!r}: shape {tuple(x.shape)}, the model expects {tuple(shape)}")
        for starts, v in blocks:
            sl = tuple(slice(s, s + n) for s, n in zip(starts, tg.shape[v], strict=True))
            out[int(v)] = x[sl]
    return out


def random_inputs_for(tg, seed: int = 0, pool_elems: int = 1 << 22, ids=None) -> dict[str, np.ndarray]:
    """Random logical inputs for a taskgraph: ``x0`` and weights ~0.02 * N(0, 1), norm weights
    1 + 0.1 * N(0, 1), int32 inputs below the vocabulary. Each tensor is a slice of a seeded normal pool at
    a random offset (``x0`` of token ``ids``: rows of the random embedding table, see below)."""
    return dict(iter_random_inputs(tg, seed, pool_elems, ids))


def vocab_size(tg) -> int | None:
    """Rows of the model's embedding table or LM head (None for a graph with neither)."""
    lg = logical_inputs(tg)
    return next((lg[k][0][0] for k in ("tok_embed", "lm_head") if k in lg), None)


def _random_pool(seed: int, pool_elems: int) -> tuple[np.random.Generator, np.ndarray]:
    """The generator of a seed's random inputs and its normal pool (its first draw), doubled so that any
    offset below ``pool_elems`` has ``pool_elems`` values after it."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(pool_elems).astype(np.float32)
    return rng, np.concatenate([z, z])


def _row_offsets(seed: int, pool_elems: int, n_rows: int) -> np.ndarray:
    """Where each row of the random embedding table starts in the pool."""
    return np.random.default_rng([seed, 1]).integers(pool_elems, size=n_rows)


def random_embedding(tg, seed: int = 0, pool_elems: int = 1 << 22):
    """``ids -> x0``: the rows of ``iter_random_inputs``'s random embedding table for token ids, the same
    values it gives, with the pool and row offsets made once (a training loop embeds every batch)."""
    lg = logical_inputs(tg)
    vocab = vocab_size(tg)
    x0 = tg.meta["embed"]["input"]
    dt, d = compute_dtype(tg, x0), lg[x0][0][1]
    pool = (0.02 * _random_pool(seed, pool_elems)[1]).astype(dt)
    row_off = _row_offsets(seed, pool_elems, vocab)

    def rows(ids) -> np.ndarray:
        ids = check_ids(ids, vocab, f"token ids for {x0!r}")
        return pool[row_off[ids][:, None] + np.arange(d)]

    return rows


def iter_random_inputs(tg, seed: int = 0, pool_elems: int = 1 << 22, ids=None):
    """``random_inputs_for`` one logical tensor at a time: (name, array) pairs, each made when asked for.
    The embedding table (``tok_embed``) is a random table whose row r is cut at an offset drawn for r, so
    with ``ids`` (token ids, one per row of ``x0``) ``x0`` is those rows of the same table: a token embeds
    the same way for a seed whatever the prompt."""
    for name, shape, x, pool, offs in _random_recipes(tg, seed, pool_elems, ids):
        if x is None:
            x = np.empty(math.prod(shape), dtype=pool.dtype)
            _copy_pieces(x, pool, offs, pool_elems, 0)
        yield name, x.reshape(shape)


class LazyWeights(Mapping):
    """Logical weights made each time one is asked for, never kept: ``weights[name]`` makes the array, ``nbytes``
    and ``shape`` answer without making it. For models whose arrays and a backend's pinned copy of them would not
    fit in host memory together (LLaMA-65B: 130 GB each): a writer takes one array, copies its tiles and drops it
    (``turnip.runtime.loader.write_arrays``). ``only(names)``: the same, restricted to ``names``."""

    def __init__(self, specs: dict, make):
        self._specs, self._make = specs, make  # name -> (shape, dtype); make(name) -> array

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._specs:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self):
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def shape(self, name: str) -> tuple:
        return tuple(self._specs[name][0])

    def nbytes(self, name: str) -> int:
        shape, dt = self._specs[name]
        return math.prod(shape) * np.dtype(dt).itemsize

    def only(self, names) -> LazyWeights:
        keep = set(names)
        return LazyWeights({k: v for k, v in self._specs.items() if k in keep}, self._make)


def weight_nbytes(weights, name: str) -> int:
    """Bytes of logical weight ``name`` of a dict of arrays or a ``LazyWeights``, without making it."""
    return weights.nbytes(name) if isinstance(weights, LazyWeights) else int(np.asarray(weights[name]).nbytes)


def select_weights(weights, names):
    """``weights`` restricted to ``names`` (in the mapping's order), made lazily where they are lazy."""
    if isinstance(weights, LazyWeights):
        return weights.only(names)
    keep = set(names)
    return {k: x for k, x in weights.items() if k in keep}


def lazy_random_inputs(tg, seed: int = 0, names=None, pool_elems: int = 1 << 22) -> LazyWeights:
    """``iter_random_inputs``' tensors (of ``names``, default all) as a ``LazyWeights``: the same values, each
    made from the seed's pool when asked for (the pool and every tensor's piece offsets drawn now)."""
    want = None if names is None else set(names)
    specs, ready, recipes = {}, {}, {}
    for name, shape, x, pool, offs in _random_recipes(tg, seed, pool_elems, None):
        if want is not None and name not in want:
            continue
        if x is not None:
            specs[name], ready[name] = (tuple(shape), x.dtype), x
        else:
            specs[name], recipes[name] = (tuple(shape), pool.dtype), (pool, offs)

    def make(name):
        if name in ready:
            return ready[name]
        pool, offs = recipes[name]
        shape = specs[name][0]
        x = np.empty(math.prod(shape), dtype=pool.dtype)
        _copy_pieces(x, pool, offs, pool_elems, 0)
        return x.reshape(shape)

    return LazyWeights(specs, make)


def _random_recipes(tg, seed: int, pool_elems: int, ids):
    """``iter_random_inputs``'s draws, in order: (name, shape, array, pool, offsets) per logical input. int32
    inputs and embedded rows come made (array; pool and offsets None); any other tensor as None, its pool
    and the pool offsets of its ``pool_elems``-long pieces (flat piece k is ``pool[offs[k]:][:pool_elems]``)."""
    rng, z = _random_pool(seed, pool_elems)
    pools: dict = {}
    lg = logical_inputs(tg)
    vocab = vocab_size(tg)
    x0 = (tg.meta.get("embed") or {}).get("input")
    if ids is not None:
        if x0 not in lg:
            raise ValueError("token ids were given but the taskgraph has no embedded input (tg.meta['embed'])")
        ids = check_ids(ids, vocab, f"token ids for {x0!r}")
        if ids.shape != (lg[x0][0][0],):
            raise ValueError(f"{ids.size} token ids (shape {ids.shape}); {x0!r} takes {lg[x0][0][0]} (the "
                             "taskgraph's sequence length)")  # fmt: skip
    n_rows = vocab if vocab is not None else int(ids.max()) + 1 if ids is not None and ids.size else 0
    row_off = _row_offsets(seed, pool_elems, n_rows)  # the table's rows
    for name, (shape, blocks) in lg.items():
        dt = np.dtype(NP_OF[tg.dtype[blocks[0][1]]])
        if dt == np.int32:
            yield name, shape, rng.integers(0, vocab or 1, size=shape, dtype=np.int32), None, None
            continue
        norm = name.endswith("norm")
        pool = pools.get((dt, norm))
        if pool is None:
            pool = pools[(dt, norm)] = (1.0 + 0.1 * z if norm else 0.02 * z).astype(dt)
        if name == "tok_embed" or name == x0 and ids is not None:
            rows = row_off if name == "tok_embed" else row_off[ids]
            x = np.empty(shape, dtype=dt)
            for i, o in enumerate(rows.tolist()):
                x[i] = pool[o : o + shape[1]]
            yield name, shape, x, None, None
            continue
        offs = [int(rng.integers(pool_elems)) for _ in range(0, math.prod(shape), pool_elems)]
        yield name, shape, None, pool, offs


def _copy_pieces(dst: np.ndarray, pool: np.ndarray, offs: list, pool_elems: int, a: int) -> None:
    """Fill 1-D ``dst`` with elements ``a, a + 1, ...`` of the flat tensor made of ``pool`` pieces at ``offs``
    (a few large slice copies, which release the GIL)."""
    i, end = a, a + dst.size
    while i < end:
        k, j = divmod(i, pool_elems)
        m = min(pool_elems - j, end - i)
        dst[i - a : i - a + m] = pool[offs[k] + j : offs[k] + j + m]
        i += m


def check_ids(ids, n_rows: int | None, what: str, error: type[Exception] = ValueError) -> np.ndarray:
    """Token ids as int64, after checking they are integers in [0, n_rows) (``error`` names the first bad
    one); ``n_rows`` None: only below zero is out of range."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise error(f"{what}: ids must be integers, got dtype {ids.dtype}")
    flat = ids.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= (n_rows if n_rows is not None else np.iinfo(np.int64).max)))
    if bad.size:
        i = int(bad[0])
        raise error(f"{what}: id {int(flat[i])} at position {i} is outside [0, {n_rows}) ({bad.size} ids out of "
                    "range)")  # fmt: skip
    return ids.astype(np.int64, copy=False)


def write_streaming(backend, tg, tensors) -> int:
    """Write logical inputs into a loaded backend one at a time: each (name, array) of ``tensors`` is cut
    into its tiles, copied into the backend's host input region (pinned memory on a GPU) and dropped, so
    the host holds the region plus one tensor, never a second copy of the model. A stream that knows a
    faster way in (``write_into(backend, tg)``: ``RandomInputs``, a checkpoint's ``Checkpoint.inputs``)
    takes it. Returns bytes written."""
    if hasattr(tensors, "write_into"):
        return tensors.write_into(backend, tg)
    n = 0
    for name, x in tensors:
        tiles = tile_inputs(tg, {name: x})
        backend.write_inputs(tiles)
        n += sum(int(t.nbytes) for t in tiles.values())
        del tiles, x
    return n


class RandomInputs:
    """``iter_random_inputs(tg, seed, ids=ids)`` less the names in ``skip``, as an object: iterating it
    yields the (name, array) pairs, and ``write_streaming`` of it is ``write_random_inputs`` (threads)."""

    __slots__ = ("tg", "seed", "ids", "skip")

    def __init__(self, tg, seed: int = 0, ids=None, skip=()):
        self.tg, self.seed, self.ids, self.skip = tg, seed, ids, frozenset(skip)

    def __iter__(self):
        return ((k, x) for k, x in iter_random_inputs(self.tg, self.seed, ids=self.ids) if k not in self.skip)

    def write_into(self, backend, tg) -> int:
        return write_random_inputs(backend, tg, self.seed, self.skip, ids=self.ids)


def write_random_inputs(backend, tg, seed: int = 0, skip=(), threads: int | None = None, ids=None,
                        pool_elems: int = 1 << 22) -> int:  # fmt: skip
    """``write_streaming(backend, tg, iter_random_inputs(tg, seed, pool_elems, ids))`` less the names in
    ``skip``, bit for bit, at memory speed: every offset is drawn on this thread in the same order, then
    ``threads`` workers (default min(16, cores)) copy pool pieces straight into the backend's host input
    region (``host_in``), one tensor per task, with no copy of the tensor (extra host memory: a row of a
    tensor per thread, where a row spans two pool pieces). int32 inputs and
    embedded rows are written here through ``write_inputs(..., load_resident=False)``; resident inputs are
    loaded to the GPUs at the end, on this thread (``load_resident``). A backend without ``host_in`` gets
    ``write_streaming``. A backend that pins its region while it is filled (``pin_while_filling``: the CUDA
    backend's registered region) hears of every tile as it is written. Returns bytes written
    (tiles of skipped names not counted)."""
    from concurrent.futures import ThreadPoolExecutor

    from turnip.runtime.layout import input_vertices

    region = getattr(backend, "host_in", None)
    if region is None:
        return write_streaming(backend, tg, iter(RandomInputs(tg, seed, ids, skip)))
    mg, lay = backend.mg, backend.lay
    host = {t: lay.host_offset[vs[0]] for t, vs in input_vertices(mg).items()}
    lg = logical_inputs(tg)
    written, n, futures = [], 0, []
    recipes = [r for r in _random_recipes(tg, seed, pool_elems, ids) if r[0] not in skip]
    fills = {r[0]: [(starts, tuple(tg.shape[t]), host[t]) for starts, t in lg[r[0]][1] if t in host]
             for r in recipes if r[2] is None}  # fmt: skip
    writes = [(host[t], int(tg.nbytes[t])) for name in fills for _, t in lg[name][1] if t in host]
    with pinned_while_filled(backend, writes) as pinner:
        ex = ThreadPoolExecutor(threads or min(16, os.cpu_count() or 1), thread_name_prefix="turnip-fill")
        try:
            for i, (name, shape, x, pool, offs) in enumerate(recipes):
                recipes[i] = None  # a made array is dropped once written
                blocks = [(starts, int(t)) for starts, t in lg[name][1]]
                if x is not None:
                    backend.write_inputs(tile_inputs(tg, {name: x}), load_resident=False)
                else:
                    futures.append(ex.submit(_fill_tiles, region, fills[name], shape, pool, offs, pool_elems, pinner))
                written += [t for _, t in blocks]
                n += sum(int(tg.nbytes[t]) for _, t in blocks)
            for f in futures:
                f.result()
        finally:  # no thread writes on once the fill ends or fails (before the pinner finishes or is abandoned)
            ex.shutdown(wait=True, cancel_futures=True)
    backend.load_resident(written)
    return n


@contextlib.contextmanager
def pinned_while_filled(backend, writes: list):
    """A fill of ``writes`` ((byte offset in the host input region, bytes) each) into ``backend``: the backend's
    ``PiecePinner`` (``turnip.runtime.hostmem``; None for a backend that pins no region while it is filled),
    told of each write by the block, finished when the block ends, abandoned (nothing left registered) if it
    raises."""
    pinner = backend.pin_while_filling(writes) if hasattr(backend, "pin_while_filling") else None
    if pinner is None:
        yield None
        return
    try:
        yield pinner
    except BaseException:
        pinner.abandon()
        raise
    pinner.finish()


def _fill_tiles(region: np.ndarray, tiles: list, shape: tuple, pool: np.ndarray, offs: list, pool_elems: int,
                pinner=None) -> None:  # fmt: skip
    """One tensor's tiles, each (starts, tile shape, byte offset in ``region``), into ``region``: a tile that is
    one flat range of the tensor as ``_copy_pieces``, any other as ``_copy_rows``. Copies go through unsigned
    integer views (the same bytes; no dtype-specific copy loop that might hold the GIL). Each tile written is
    announced to ``pinner`` (``turnip.runtime.hostmem.PiecePinner``) where one is given."""
    u = np.dtype(f"u{pool.dtype.itemsize}")
    pool = pool.view(u)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    for starts, tshape, off in tiles:
        dst = region[off : off + math.prod(tshape) * u.itemsize].view(u)
        first = next((i for i, m in enumerate(tshape) if m > 1), len(shape))
        if all(m == s for m, s in zip(tshape[first + 1 :], shape[first + 1 :], strict=True)):
            _copy_pieces(dst, pool, offs, pool_elems, sum(s * st for s, st in zip(starts, strides, strict=True)))
        else:
            _copy_rows(dst.reshape(tshape), pool, offs, pool_elems, shape, starts)
        if pinner is not None:
            pinner.written(off, dst.nbytes)


def _copy_rows(dst: np.ndarray, pool: np.ndarray, offs: list, pool_elems: int, shape: tuple, starts) -> None:
    """``dst`` = the block of the tensor made of ``pool`` pieces that starts at ``starts``: the rows (index of
    the first dimension) inside one piece are a view of the pool, one strided copy per piece; a row that
    spans two pieces is made in a one-row temporary first."""
    row = math.prod(shape[1:])
    inner = (slice(None),) + tuple(slice(s, s + m) for s, m in zip(starts[1:], dst.shape[1:], strict=True))
    r0, r1 = starts[0], starts[0] + dst.shape[0]
    r = r0
    while r < r1:
        k = r * row // pool_elems
        rb = min(r1, (k + 1) * pool_elems // row)  # rows r..rb-1 lie in piece k
        if rb > r:
            o = offs[k] + r * row - k * pool_elems
            dst[r - r0 : rb - r0] = pool[o : o + (rb - r) * row].reshape((rb - r, *shape[1:]))[inner]
            r = rb
        else:
            tmp = np.empty(row, dtype=pool.dtype)
            _copy_pieces(tmp, pool, offs, pool_elems, r * row)
            dst[r - r0] = tmp.reshape(1, *shape[1:])[inner][0]
            r += 1


def st_dtype(code: str) -> np.dtype | None:
    """The numpy dtype of a safetensors dtype code (``F16``, ``BF16`` ...), or None if unsupported."""
    t = _ST_DTYPES.get(code)
    return None if t is None else np.dtype(t)


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None, dtype=None
) -> int:
    """Write numpy arrays as a ``.safetensors`` file (bfloat16 as BF16); ``metadata``: string pairs for the
    header's ``__metadata__`` (``transformers`` wants ``{"format": "pt"}``); ``dtype``: cast every tensor to
    it (one tensor at a time) on the way. Returns the bytes of tensor data written."""
    names = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
    header: dict = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}} if metadata else {}
    off = 0
    for k, v in tensors.items():
        dt = np.dtype(v.dtype if dtype is None else dtype)
        if dt not in names:
            raise ValueError(f"tensor {k!r}: dtype {dt} has no safetensors code")
        n = math.prod(v.shape) * dt.itemsize
        header[k] = {"dtype": names[dt], "shape": list(v.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for v in tensors.values():
            x = np.ascontiguousarray(v, dtype=dtype).reshape(-1)
            f.write(memoryview(x.view(np.uint8)))
            del x
        f.flush()
        os.fsync(f.fileno())
    return off


_HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_HF_TOP = {"tok_embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_name(ours: str) -> str:
    """Our logical name -> the Hugging Face LLaMA parameter name (``KeyError`` for ``x0``, which is
    gathered from rows of ``model.embed_tokens.weight``, and for names that are not LLaMA weights)."""
    if ours in _HF_TOP:
        return _HF_TOP[ours]
    layer, _, what = ours.partition(".")
    if layer[:1] != "L" or not layer[1:].isdigit() or what not in _HF_LAYER:
        raise KeyError(f"{ours!r} is not a LLaMA weight with a Hugging Face name")
    return f"model.layers.{int(layer[1:])}.{_HF_LAYER[what]}"


def hf_shape(ours: str, shape) -> tuple:
    """The shape of the Hugging Face tensor behind logical input ``ours`` of taskgraph shape ``shape``."""
    what = ours.rsplit(".", 1)[-1]
    shape = tuple(int(s) for s in shape)
    if what in ("wq", "wk", "wv"):
        return (math.prod(shape[:-1]), shape[-1])
    if what == "wo":
        return (shape[0], math.prod(shape[1:]))
    return shape


def from_hf(ours: str, w, shape):
    """One Hugging Face tensor (numpy or torch) in our layout for logical input ``ours`` of taskgraph shape
    ``shape``: a reshape (a view where the tensor is contiguous), after checking its Hugging Face shape."""
    want = hf_shape(ours, shape)
    if tuple(w.shape) != want:
        raise ValueError(f"{hf_name(ours)} (for {ours}): shape {tuple(w.shape)}, the model expects {want}")
    return w.reshape(tuple(shape))
