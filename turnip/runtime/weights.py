"""Model inputs: logical tensors (``ids``, ``tok_embed``, ``L0.wq`` ...) to the taskgraph's input tiles.

- ``random_inputs_for(tg, seed)``: random token ids and weights, quickly even for 7B shapes: values are cut
  from one seeded pool of normal numbers at random offsets (weights scaled by 0.02, norm weights near 1);
  ``iter_random_inputs`` yields them one tensor at a time and ``write_streaming`` writes such a stream
  into a loaded backend (peak host memory: the pinned input region plus one tensor).
- ``read_safetensors(path)``: a numpy-only reader of the safetensors format (8-byte little-endian header
  length, JSON header of ``dtype``/``shape``/``data_offsets``, raw little-endian data), memory-mapped.
- ``from_hf_names(tensors, n_layers)``: Hugging Face LLaMA names and layouts to ours (below).
- ``tile_inputs(tg, logical)``: {taskgraph input tensor: tile} as views, ready for ``write_inputs``.

Tensor names a safetensors file may use (either set; shapes for d model width, H heads of e = d / H,
f FFN width, V vocabulary):

| ours | shape | Hugging Face | conversion |
|---|---|---|---|
| ``tok_embed`` | (V, d) | ``model.embed_tokens.weight`` | as is |
| ``L{i}.attn_norm`` | (d,) | ``model.layers.{i}.input_layernorm.weight`` | as is |
| ``L{i}.wq`` / ``wk`` / ``wv`` | (d, H, e) | ``...self_attn.q_proj.weight`` (H*e, d) ... | ``W.T.reshape(d, H, e)`` |
| ``L{i}.wo`` | (H, e, d) | ``...self_attn.o_proj.weight`` (d, H*e) | ``W.T.reshape(H, e, d)`` |
| ``L{i}.ffn_norm`` | (d,) | ``...post_attention_layernorm.weight`` | as is |
| ``L{i}.w_gate`` / ``w_up`` | (d, f) | ``...mlp.gate_proj.weight`` / ``up_proj`` (f, d) | ``W.T`` |
| ``L{i}.w_down`` | (f, d) | ``...mlp.down_proj.weight`` (d, f) | ``W.T`` |
| ``final_norm`` | (d,) | ``model.norm.weight`` | as is |

``ids`` (token ids, int32) is not a weight: it is drawn at random unless given.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_ST_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BF16": np.uint16, "BOOL": np.bool_}  # fmt: skip
NP_OF = {"fp16": np.float16, "fp32": np.float32, "int32": np.int32}


def logical_inputs(tg) -> dict[str, tuple]:
    """Logical input name -> (shape, [(block starts, taskgraph input vertex), ...])."""
    return tg.meta.get("input_blocks", {})


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


def random_inputs_for(tg, seed: int = 0, pool_elems: int = 1 << 22) -> dict[str, np.ndarray]:
    """Random logical inputs for a taskgraph: ids below the vocabulary, weights ~0.02 * N(0, 1), norm
    weights 1 + 0.1 * N(0, 1). Each tensor is a slice of a seeded normal pool at a random offset."""
    return dict(iter_random_inputs(tg, seed, pool_elems))


def iter_random_inputs(tg, seed: int = 0, pool_elems: int = 1 << 22):
    """``random_inputs_for`` one logical tensor at a time: (name, array) pairs, each made when asked for."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(pool_elems).astype(np.float32)
    z = np.concatenate([z, z])  # any offset below pool_elems has pool_elems values after it
    pools: dict = {}
    lg = logical_inputs(tg)
    vocab = lg["tok_embed"][0][0] if "tok_embed" in lg else 1
    for name, (shape, blocks) in lg.items():
        dt = NP_OF[tg.dtype[blocks[0][1]]]
        if dt == np.int32:
            yield name, rng.integers(0, vocab, size=shape, dtype=np.int32)
            continue
        norm = name.endswith("norm")
        pool = pools.get((dt, norm))
        if pool is None:
            pool = pools[(dt, norm)] = (1.0 + 0.1 * z if norm else 0.02 * z).astype(dt)
        size = int(np.prod(shape))
        x = np.empty(size, dtype=dt)
        for i in range(0, size, pool_elems):
            m = min(pool_elems, size - i)
            o = int(rng.integers(pool_elems))
            x[i : i + m] = pool[o : o + m]
        yield name, x.reshape(shape)


def write_streaming(backend, tg, tensors) -> int:
    """Write logical inputs into a loaded backend one at a time: each (name, array) of ``tensors`` is cut
    into its tiles, copied into the backend's host input region (pinned memory on a GPU) and dropped, so
    the host holds the region plus one tensor, never a second copy of the model. Returns bytes written."""
    n = 0
    for name, x in tensors:
        tiles = tile_inputs(tg, {name: x})
        backend.write_inputs(tiles)
        n += sum(int(t.nbytes) for t in tiles.values())
        del tiles, x
    return n


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a ``.safetensors`` file as read-only memory-mapped numpy arrays (bf16 -> float32)."""
    path = Path(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        x = mm[8 + n + a : 8 + n + b].view(np.dtype(_ST_DTYPES[info["dtype"]]).newbyteorder("<"))
        if info["dtype"] == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        out[name] = x.reshape(info["shape"])
    return out


def iter_safetensors(path: str | Path, names=None):
    """(name, array) of the tensors of a ``.safetensors`` file (those in ``names`` if given, in file
    order), each read from disk into its own array when asked for: unlike ``read_safetensors`` nothing
    stays mapped, so a loader holds one tensor at a time. bf16 is widened to float32."""
    path = Path(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        items = [(k, v) for k, v in header.items() if k != "__metadata__"]
        items.sort(key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in items:
            if names is not None and name not in names:
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
            a, b = info["data_offsets"]
            x = np.empty((b - a) // np.dtype(_ST_DTYPES[info["dtype"]]).itemsize, _ST_DTYPES[info["dtype"]])
            f.seek(8 + n + a)
            if f.readinto(memoryview(x).cast("B")) != b - a:
                raise ValueError(f"{path}: tensor {name!r} is cut short (file truncated?)")
            if info["dtype"] == "BF16":
                x = (x.astype(np.uint32) << 16).view(np.float32)
            yield name, x.reshape(info["shape"])


def iter_weights(tg, path: str | Path, n_heads: int):
    """The logical weights of ``tg`` from a safetensors file with our names or Hugging Face LLaMA names,
    one tensor at a time (converted to our layout), for ``write_streaming``."""
    names = [k for k in logical_inputs(tg) if k != "ids"]
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    if all(k in header for k in names):
        yield from iter_safetensors(path, set(names))
        return
    ours = {hf_name(k): k for k in names}
    missing = [k for k in ours if k not in header]
    if missing:
        raise KeyError(f"no tensor {missing[0]!r} (for {ours[missing[0]]!r}) in {path}")
    for hf, x in iter_safetensors(path, set(ours)):
        yield ours[hf], np.ascontiguousarray(from_hf(ours[hf], x, n_heads))


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Write numpy arrays as a ``.safetensors`` file (for tests and for exporting random weights)."""
    names = {np.dtype(v): k for k, v in _ST_DTYPES.items() if k != "BF16"}
    header, off = {}, 0
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    for k, v in arrays.items():
        header[k] = {"dtype": names[v.dtype], "shape": list(v.shape), "data_offsets": [off, off + v.nbytes]}
        off += v.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for v in arrays.values():
            f.write(v.tobytes())


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


def hf_name(ours: str) -> str:
    """Our logical name -> the Hugging Face LLaMA parameter name."""
    if ours == "tok_embed":
        return "model.embed_tokens.weight"
    if ours == "final_norm":
        return "model.norm.weight"
    layer, what = ours.split(".", 1)
    return f"model.layers.{int(layer[1:])}.{_HF_LAYER[what]}"


def from_hf(ours: str, w, n_heads: int):
    """Convert one Hugging Face tensor (numpy or torch) to our layout for logical name ``ours``."""
    what = ours.split(".", 1)[-1]
    if what in ("wq", "wk", "wv"):
        d = w.shape[1]
        return w.T.reshape(d, n_heads, d // n_heads)
    if what == "wo":
        d = w.shape[0]
        return w.T.reshape(n_heads, d // n_heads, d)
    if what in ("w_gate", "w_up", "w_down"):
        return w.T
    return w


def from_hf_names(tensors: dict, names: list[str], n_heads: int) -> dict:
    """Our logical tensors from a Hugging Face LLaMA state dict (only the names asked for)."""
    out = {}
    for ours in names:
        k = hf_name(ours)
        if k not in tensors:
            raise KeyError(f"no tensor {k!r} (for {ours!r}) in the weights")
        out[ours] = from_hf(ours, tensors[k], n_heads)
    return out


def load_weights(tg, path: str | Path, n_heads: int) -> dict[str, np.ndarray]:
    """Logical weights from a safetensors file with our names or Hugging Face LLaMA names."""
    st = read_safetensors(path)
    names = [k for k in logical_inputs(tg) if k != "ids"]
    if all(k in st for k in names):
        return {k: st[k] for k in names}
    return from_hf_names(st, names, n_heads)
