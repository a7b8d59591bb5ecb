"""Hugging Face model directories read with numpy alone, one tensor at a time, and a writer for tests.

``Checkpoint(path)``: a directory with ``config.json`` and ``model.safetensors`` (or
``model.safetensors.index.json`` and its shards), or one ``.safetensors`` file. It owns the parsed
``config.json`` and every tensor's ``TensorHeader`` (dtype code, shape, file, byte range), in file order;
no file stays open or mapped between calls. ``read`` gives one tensor in its own array, ``read_rows`` the
rows of a 2-D tensor picked by token ids (reading only those rows), ``iter_inputs(tg, ids)`` the
taskgraph's logical inputs (``turnip.runtime.weights``: Hugging Face tensors reshaped, ``x0`` gathered
from the embedding table) in file order, converted to the compute dtype, holding at most one tensor, its
converted copy and a float32 chunk at a time; ``inputs(tg, ids)`` the same stream as an object that
``write_streaming`` reads on threads straight into the backend's host input region
(``turnip.runtime.loader``: the same bytes at the disk's speed). ``iter_weights(tg, path)`` and
``load_weights`` are its fronts by path. This module owns reading weights into a plan's inputs; it uses
``turnip.runtime.weights``' names, layouts and dtypes, which never imports it back.

Invariants checked when opening: every tensor the index names lies in a shard whose header lists it; every
header entry's byte range matches its dtype and shape and lies inside its file. Every problem is a
``CheckpointError`` (a ``ValueError``; a missing tensor also a ``KeyError``) with a one-line message naming
the file and tensor involved.

``write_checkpoint(dir, config, tensors)`` writes the Hugging Face format (``config.json``, one
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``)
into a temporary directory renamed into place when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from turnip.fileio import _UMASK
from turnip.hfconfig import hf_source
from turnip.runtime.weights import (
    NP_OF,
    check_ids,
    compute_dtype,
    logical_inputs,
    st_dtype,
    write_safetensors,
)

INDEX, SINGLE, CONFIG = "model.safetensors.index.json", "model.safetensors", "config.json"
FLOAT_CODES = ("F16", "BF16", "F32", "F64")  # what weights may be stored as
CHUNK_ELEMS = 1 << 18  # conversions between dtypes go through float32 chunks of this many elements
CONVERT_THREADS = min(16, os.cpu_count() or 1)  # chunks converted at once (one float32 chunk each)
_FP16_MAX = float(np.finfo(np.float16).max)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked; the message is one line naming file and tensor."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors code: F16, BF16, F32 ...
    shape: tuple
    file: Path
    offset: int  # absolute byte offset of the data in ``file``
    nbytes: int


class Checkpoint:
    def __init__(self, path: str | os.PathLike):
        self.path = p = Path(path)
        self.config: dict | None = None
        self.index: Path | None = None
        if p.is_dir():
            self.config = _read_config(p / CONFIG) if (p / CONFIG).is_file() else None
            self.files = self._find_files(p)
        elif p.is_file():
            self.files = [p]
        else:
            raise CheckpointError(f"{p}: no such file or directory (a Hugging Face model directory or a .safetensors "
                                  "file is needed)")  # fmt: skip
        wm = self._weight_map if self.index is not None else None
        self._headers: dict[str, TensorHeader] = {}
        for f in self.files:
            for h in sorted(_parse_header(f), key=lambda h: h.offset):
                if wm is None or wm.get(h.name) == f.name:  # the index decides which shard holds a name
                    self._headers.setdefault(h.name, h)
        missing = [k for k in wm or () if k not in self._headers]
        if missing:
            raise CheckpointError(f"{self.index}: maps {missing[0]!r} to {wm[missing[0]]}, whose header has no such "
                                  "tensor")  # fmt: skip
        if any(h.dtype == "BF16" for h in self._headers.values()):  # likely converted to fp16 when read:
            from turnip.runtime.loader import warm_conversion  # ready the compiled conversion meanwhile

            warm_conversion()

    def _find_files(self, d: Path) -> list[Path]:
        if (d / SINGLE).is_file():  # preferred over an index, as transformers does
            return [d / SINGLE]
        if (d / INDEX).is_file():
            self.index = d / INDEX
            return self._shards()
        bins = sorted(f.name for f in d.glob("pytorch_model*.bin*"))
        if bins:
            raise CheckpointError(f"{d}: only PyTorch pickles ({', '.join(bins[:2])}), no model.safetensors; convert "
                                  "to safetensors: python -c \"import transformers as t; t.AutoModelForCausalLM"
                                  f".from_pretrained('{d}').save_pretrained('{d}-st')\" and pass {d}-st")  # fmt: skip
        other = sorted(f.name for f in d.glob("*.safetensors"))
        found = f" (found {', '.join(other[:3])})" if other else ""
        raise CheckpointError(f"{d}: no {SINGLE} or {INDEX}{found}; a Hugging Face model directory is needed")

    def _shards(self) -> list[Path]:
        try:
            wm = json.loads(self.index.read_text()).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{self.index}: cannot read the index: {_why(e)}") from None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{self.index}: no weight_map of tensor name -> shard file")
        self._weight_map = wm
        names = sorted(set(wm.values()))
        for n in names:
            if not (self.path / n).is_file():
                need = [k for k, v in wm.items() if v == n]
                raise CheckpointError(f"{self.index}: shard {n} is missing from {self.path} (it holds {need[0]!r} "
                                      f"and {len(need) - 1} more tensors; incomplete download?)")  # fmt: skip
        return [self.path / n for n in names]

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}: {len(self._headers)} tensors in {len(self.files)} file(s))"

    @property
    def tensor_names(self) -> list[str]:
        """Every tensor name, in file order (shards in name order, then by offset)."""
        return list(self._headers)

    def header(self, name: str) -> TensorHeader:
        h = self._headers.get(name)
        if h is None:
            raise MissingTensorError(f"{self._where()}: no tensor {name!r}")
        return h

    def read(self, name: str) -> np.ndarray:
        """One tensor as stored (BF16 as ``ml_dtypes.bfloat16``), read from disk into its own array."""
        h, dt = self._typed(name)
        buf = np.empty(h.nbytes, dtype=np.uint8)
        with _open(h.file) as f:
            f.seek(h.offset)
            _read_into(f, buf, h)
        return buf.view(dt).reshape(h.shape)

    def read_rows(self, name: str, ids) -> np.ndarray:
        """Rows ``ids`` of 2-D tensor ``name`` (shape ``ids.shape + (columns,)``, as stored), reading only
        those rows (runs of consecutive ids in one read)."""
        h, dt = self._typed(name)
        if len(h.shape) != 2:
            raise CheckpointError(f"{h.file}: tensor {name!r} has shape {h.shape}; rows need a 2-D tensor")
        ids = check_ids(ids, h.shape[0], f"rows of {name!r}", CheckpointError)
        row_nbytes = h.shape[1] * dt.itemsize
        uniq, inv = np.unique(ids.reshape(-1), return_inverse=True)
        buf = np.empty((len(uniq), row_nbytes), dtype=np.uint8)
        starts = np.concatenate([[0], np.flatnonzero(np.diff(uniq) != 1) + 1, [len(uniq)]]).tolist()
        with _open(h.file) as f:
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                f.seek(h.offset + int(uniq[a]) * row_nbytes)
                _read_into(f, buf[a:b], h)
        return buf.view(dt)[inv].reshape(*ids.shape, h.shape[1])

    def iter_inputs(self, tg, ids=None, seed: int = 0, only=None):
        """(logical name, array in the taskgraph's compute dtype and shape) for every logical input of
        ``tg`` (or those in ``only``), one at a time in file order, for ``write_streaming``. ``x0``
        (``tg.meta["embed"]``) is the embedding table's rows of ``ids`` (length seq; random ids of ``seed``
        when None, or the file's own ``x0`` if it has one). Everything is checked before the first tensor
        is read."""
        lg = logical_inputs(tg)
        for name, h, rows in self.input_plan(tg, ids, seed, only):
            raw = self.read(h.name) if rows is None else self.read_rows(h.name, rows)
            x = _convert(raw, compute_dtype(tg, name), h, name)
            del raw
            yield name, x.reshape(lg[name][0])
            del x

    def inputs(self, tg, ids=None, seed: int = 0, only=None, threads: int | None = None):
        """``iter_inputs`` as an object (``turnip.runtime.loader.CheckpointInputs``; checked when first used,
        as ``iter_inputs`` is): iterating it yields the same pairs, and ``write_streaming`` of it reads the files
        on ``threads`` workers straight into the backend's host input region (the same bytes, at the disk's
        speed); its ``arrays()`` reads them into arrays of their own the same way."""
        from turnip.runtime.loader import CheckpointInputs

        return CheckpointInputs(self, tg, ids, seed, only, CheckpointError, threads)

    def input_plan(self, tg, ids=None, seed: int = 0, only=None) -> list[tuple[str, TensorHeader, np.ndarray | None]]:
        """(logical name, header of the tensor it comes from, its rows or None: all) per logical input of
        ``tg`` (those in ``only``), in file order, every one checked (``iter_inputs``)."""
        lg = logical_inputs(tg)
        if only is not None:
            unknown = sorted(set(only) - set(lg))
            if unknown:
                raise CheckpointError(f"{unknown[0]!r} is not a logical input of this taskgraph (only={only!r})")
            lg = {k: v for k, v in lg.items() if k in set(only)}
        embed = tg.meta.get("embed") or {}
        x0 = embed.get("input")
        if ids is not None and x0 not in lg:
            raise CheckpointError("token ids were given but the taskgraph has no embedded input (tg.meta['embed'])")
        plan = []  # (file position, name, header, rows to gather or None)
        arch = tg.meta.get("arch") or (self.config or {}).get("model_type") or "llama"
        shapes = {k: v[0] for k, v in logical_inputs(tg).items()}
        for name, (shape, _) in lg.items():
            if name == x0 and (ids is not None or name not in self._headers):
                h = self._table(embed["table"], shape)
                rows = check_ids(np.random.default_rng(seed).integers(0, h.shape[0], shape[0]) if ids is None else ids,
                                 h.shape[0], f"token ids for {name!r} from {h.name!r}", CheckpointError)  # fmt: skip
                if rows.shape != (shape[0],):
                    raise CheckpointError(f"{rows.size} token ids (shape {rows.shape}); {name!r} takes {shape[0]} "
                                          f"(the taskgraph's sequence length)")  # fmt: skip
            else:
                h, rows = self._source(name, shape, arch, shapes)
            plan.append(((self.files.index(h.file), h.offset), name, h, rows))
        plan.sort(key=lambda t: t[0])
        return [(name, h, rows) for _, name, h, rows in plan]

    def _typed(self, name: str) -> tuple[TensorHeader, np.dtype]:
        h = self.header(name)
        dt = st_dtype(h.dtype)
        if dt is None:
            raise CheckpointError(f"{h.file}: tensor {name!r} has dtype {h.dtype}, which turnip cannot read")
        return h, dt

    def _source(self, ours: str, shape, arch: str = "llama", shapes=None) -> tuple[TensorHeader, np.ndarray | None]:
        """The header of the tensor behind logical input ``ours`` (of a model of family ``arch`` whose
        logical inputs have ``shapes``): its Hugging Face name, else our name; checked against the shape and
        dtype the model needs. With it, the rows of it to read (a fused tensor's part) or None (all)."""
        shape = tuple(int(s) for s in shape)
        try:
            hf, hf_sh, part = hf_source(arch, ours, shapes or {ours: shape})
        except KeyError:
            hf, hf_sh, part = None, None, None
        if hf == "lm_head.weight" and hf not in self._headers and (self.config or {}).get("tie_word_embeddings"):
            hf = "model.embed_tokens.weight"  # tied: the embedding table is the head
        for name, want in ((hf, hf_sh), (ours, shape)):
            if name in self._headers:
                rows = np.arange(*part) if part is not None and name == hf else None
                return self._checked(self._headers[name], ours, want), rows
        what = f"{hf!r} (turnip's {ours!r}, shape {hf_sh} for" if hf else f"{ours!r} (shape"
        raise MissingTensorError(f"{self._where()}: no tensor {what} the model's {shape}); searched "
                                 f"{self._searched()}")  # fmt: skip

    def _table(self, table: str, x0_shape) -> TensorHeader:
        name = table if table in self._headers else "tok_embed" if "tok_embed" in self._headers else None
        if name is None:
            raise MissingTensorError(f"{self._where()}: no embedding table {table!r} (turnip's 'tok_embed') to "
                                     f"gather x0 {tuple(x0_shape)} from; searched {self._searched()}")  # fmt: skip
        h = self._headers[name]
        return self._checked(h, "x0", (h.shape[0] if h.shape else 0, int(x0_shape[1])))

    def _checked(self, h: TensorHeader, ours: str, want: tuple) -> TensorHeader:
        if h.shape != tuple(want):
            n, m = math.prod(h.shape), math.prod(want)
            hint = ""
            if n == m and h.name == ours:
                hint = "; the same elements in another layout (turnip's old transposed one?): use Hugging Face names"
            elif n != m:
                hint = "; does config.json describe this checkpoint?"
            raise CheckpointError(f"{h.file}: tensor {h.name!r} (for {ours}) has shape {h.shape} ({n} elements); "
                                  f"turnip expects {tuple(want)} ({m} elements){hint}")  # fmt: skip
        if h.dtype not in FLOAT_CODES:
            raise CheckpointError(f"{h.file}: tensor {h.name!r} (for {ours}) has dtype {h.dtype}; turnip reads "
                                  f"{', '.join(FLOAT_CODES)} weights")  # fmt: skip
        return h

    def _where(self) -> str:
        return str(self.index or self.files[0])

    def _searched(self) -> str:
        if self.index is not None:
            return f"{self.index.name} and its {len(self.files)} shard(s) {', '.join(f.name for f in self.files[:3])}"
        return f"{self.files[0].name}, Hugging Face and turnip names"


def _convert(raw: np.ndarray, dt: np.dtype, h: TensorHeader, ours: str) -> np.ndarray:
    """``raw`` in dtype ``dt``: as is when it already is; a direct cast to float32 or from float32 to bf16;
    else through float32 chunks (bf16 -> fp16 too), refusing values beyond fp16's range. Holds raw, the
    result and one chunk."""
    if raw.dtype == dt:
        return raw
    out = np.empty(raw.shape, dtype=dt)
    if dt == np.float32 or raw.dtype == np.float32 and dt != np.float16:
        out[...] = raw  # exact widening, or one rounding of float32 to bf16
        return out
    src, dst = raw.reshape(-1), out.reshape(-1)
    narrow = dt == np.float16 and raw.dtype != np.float16

    def chunk(i: int) -> float:  # numpy's casts release the GIL: chunks convert in parallel
        c = src[i : i + CHUNK_ELEMS].astype(np.float32)
        top = max(float(c.max()), -float(c.min())) if narrow and c.size else 0.0  # no |c| temporary
        if top <= _FP16_MAX:
            dst[i : i + CHUNK_ELEMS] = c
        return top

    starts = range(0, src.size, CHUNK_ELEMS)
    if len(starts) > 1:
        with ThreadPoolExecutor(CONVERT_THREADS) as ex:
            top = max(ex.map(chunk, starts))
    else:
        top = max(map(chunk, starts), default=0.0)
    if top > _FP16_MAX:
        raise CheckpointError(f"{h.file}: tensor {h.name!r} (for {ours}) has values up to {top:.3g}, beyond "
                              f"fp16's {_FP16_MAX:.0f}; compute in bf16 or fp32")  # fmt: skip
    return out


def has_weights(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``.safetensors`` file or a directory holding model weights in any format
    (safetensors, an index, PyTorch pickles: ``Checkpoint`` says how to convert those)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors"
    return p.is_dir() and any(any(p.glob(g)) for g in ("*.safetensors", INDEX, "pytorch_model*.bin*"))


def _why(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__


def _open(file: Path):
    try:
        return open(file, "rb")
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {_why(e)}") from None


def _read_into(f, buf: np.ndarray, h: TensorHeader) -> None:
    try:
        got = f.readinto(memoryview(buf).cast("B"))
    except OSError as e:
        raise CheckpointError(f"{h.file}: cannot read tensor {h.name!r}: {_why(e)}") from None
    if got != buf.nbytes:
        raise CheckpointError(f"{h.file}: tensor {h.name!r} is cut short ({got} of {buf.nbytes} bytes; truncated?)")


def _read_config(f: Path) -> dict:
    from turnip.models import read_config_json

    try:
        return read_config_json(f)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _parse_header(file: Path) -> list[TensorHeader]:
    """Every tensor entry of a safetensors file's header, checked against the file's size."""
    with _open(file) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise CheckpointError(f"{file}: not a safetensors file or truncated ({size} bytes, header length "
                                      f"{n if size >= 8 else 'missing'})")  # fmt: skip
            header = json.loads(f.read(n))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{file}: not a safetensors file (header unreadable: {_why(e)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (the header is not a JSON object)")
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (a, b) = str(info["dtype"]), tuple(int(s) for s in info["shape"]), info["data_offsets"]
            a, b = int(a), int(b)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: malformed header entry for tensor {name!r}: {info!r}"[:300]) from None
        dt = st_dtype(code)
        need = math.prod(shape) * dt.itemsize if dt is not None else b - a
        if not 0 <= a <= b or b - a != need or min(shape, default=0) < 0:
            raise CheckpointError(f"{file}: tensor {name!r} has data_offsets [{a}, {b}] ({b - a} bytes) but dtype "
                                  f"{code} shape {shape} needs {need}")  # fmt: skip
        if 8 + n + b > size:
            raise CheckpointError(f"{file}: truncated: tensor {name!r} ends at byte {8 + n + b} but the file has "
                                  f"{size} bytes (incomplete download?)")  # fmt: skip
        out.append(TensorHeader(name, code, shape, file, 8 + n + a, b - a))
    return out


def iter_weights(tg, path: str | Path, ids=None, seed: int = 0, only=None):
    """The logical inputs of ``tg`` from one ``.safetensors`` file (our names or Hugging Face LLaMA names) or
    a Hugging Face model directory, one tensor at a time in the compute dtype, for ``write_streaming``
    (``turnip.runtime.weights``; ``Checkpoint.iter_inputs``). ``x0`` is the embedding table's rows of ``ids``
    (random ids of ``seed`` when None), or the file's own ``x0`` when it has one and no ids are given.
    ``n_heads`` is not needed any more (shapes come from ``tg``); ``only``: just these logical names."""
    yield from Checkpoint(path).iter_inputs(tg, ids, seed, only)


def load_weights(tg, path: str | Path, ids=None, seed: int = 0) -> dict[str, np.ndarray]:
    """``iter_weights`` as a dict (every tensor in memory at once: for tests and ``--check``)."""
    return dict(iter_weights(tg, path, ids, seed))


def write_checkpoint(
    path: str | os.PathLike,
    config: dict,
    tensors: dict[str, np.ndarray],
    shard_nbytes: int | None = None,
    dtype=None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory: ``config.json`` and ``tensors`` (Hugging Face names) in one
    ``model.safetensors`` or, when ``shard_nbytes`` splits them (greedily, in order), in shards
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``. ``dtype`` ("fp16", "bf16",
    "fp32" or a numpy dtype) casts every tensor. Written into a temporary directory beside ``path`` and
    renamed into place when complete; an existing non-empty ``path`` is replaced only with ``overwrite``."""
    path = Path(path)
    dt = None if dtype is None else np.dtype(NP_OF.get(dtype, dtype) if isinstance(dtype, str) else dtype)
    if path.exists() and (not path.is_dir() or any(path.iterdir()) and not overwrite):
        raise CheckpointError(f"{path} exists and is not an empty directory; pass overwrite=True to replace it")
    sizes = [math.prod(np.shape(v)) * (dt or np.asarray(v).dtype).itemsize for v in tensors.values()]
    shards: list[list[str]] = [[]]
    used = 0
    for name, n in zip(tensors, sizes, strict=True):
        if shard_nbytes is not None and shards[-1] and used + n > shard_nbytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        meta = {"format": "pt"}  # transformers refuses safetensors files without it
        if len(shards) == 1:
            write_safetensors(tmp / SINGLE, tensors, meta, dt)
        else:
            k, wm = len(shards), {}
            for i, names in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{k:05d}.safetensors"
                write_safetensors(tmp / file, {n: tensors[n] for n in names}, meta, dt)
                wm |= dict.fromkeys(names, file)
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": wm}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp's is 0o700
        _swap_into(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _swap_into(tmp: Path, path: Path) -> None:
    """Rename directory ``tmp`` to ``path``; an existing ``path`` is moved aside first and then removed."""
    if path.exists() and any(path.iterdir()):
        old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
        os.replace(path, old / "x")
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)  # an empty directory is replaced
