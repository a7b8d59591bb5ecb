"""Weight files read by a thread pool straight into the tiles they fill: the checkpoint path of
``write_streaming`` at the disk's (or the page cache's) speed.

A load is a list of ``Source`` (one logical tensor: a byte range of a file holding its elements in C order,
in a stored dtype) each with its destinations: tiles (start index, typed C-contiguous array of the tile's
shape, usually a view of the backend's pinned host input region). ``plan_copies`` cuts them into ``Copy``
tasks of at most ``PIECE_NBYTES`` of file, in file order:

- a tile that is one contiguous range of its tensor (every dimension after its first longer than 1 whole)
  is read piece by piece with ``os.preadv`` into the tile itself when the dtypes agree, else into the
  thread's scratch buffer and converted from there into the tile;
- the other tiles of a tensor (split along a later dimension: ``wo``, ``w_down``) are served by row blocks
  of the tensor's first dimension: each block is read once into scratch and its part of every such tile is
  copied (or converted) out of it.

``load(loads)`` runs them on ``threads`` workers (file reads and numpy casts release the GIL); nothing is
ever written twice or read back from a destination (pinned host memory is write-combined on a GPU). The
state of a load is its workers' file descriptors (each opens the files it reads: its own read-ahead) and
buffers (a piece of file bytes, cache-sized conversion chunks), all dropped at the end. Conversions give
the bytes numpy's and ml_dtypes' casts give (bf16 -> fp16 in integer steps, others through float32
chunks), refusing values beyond fp16's range when narrowing to fp16. Every problem is ``error`` (a
``ValueError`` subclass given by the caller) with a one-line message naming the file and the tensor.

``CheckpointInputs`` (made by ``turnip.checkpoint.Checkpoint.inputs``) is such a load as the stream that
``write_streaming`` takes: iterating it yields (name, array) pairs the old way; ``write_into`` fills the
backend's host input region from threads and then loads the resident inputs; ``arrays`` reads every input
into its own array from threads. ``HostRegion`` is a host input
region without a plan, laid out tile after tile, for benchmarks and tests.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

PIECE_NBYTES = 8 << 20  # file bytes per task (and per worker's scratch buffer)
CONVERT_NBYTES = 1 << 20  # file bytes read into scratch and converted at once (stays in cache)
CHUNK_ELEMS = 1 << 18  # elements converted at once through a float32 chunk
THREADS = min(16, os.cpu_count() or 1)
READ_AHEAD_PIECES = 64  # how far the read-ahead stream runs ahead of the workers
_BF16, _F16, _F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
_FP16_MAX = float(np.finfo(np.float16).max)
_FP16_OK_BITS = {_BF16: 0x477F, _F32: 0x477FE000}  # largest |x| (as bits without the sign) that fits fp16
_SMALL_BF16_FP16 = np.arange(0x3880, dtype=np.uint16).view(_BF16).astype(np.float16).view(np.uint16)


@dataclass(frozen=True, slots=True)
class Source:
    """One logical tensor in a file: ``shape`` elements of ``dtype`` in C order from byte ``offset``."""

    file: Path
    offset: int
    dtype: np.dtype
    shape: tuple
    tensor: str  # the file's name for it (messages)
    label: str  # the logical input (messages)

    @property
    def row_nbytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass(slots=True)
class Copy:
    """One task: elements ``[first, first + count)`` of ``src`` into ``dst`` (1-D) when ``rows`` is None;
    else rows ``[first, first + count)`` of its first dimension into their part of every tile of ``rows``
    ((starts, array) pairs)."""

    src: Source
    first: int
    count: int
    dst: np.ndarray | None = None
    rows: list = field(default_factory=list)

    @property
    def file_offset(self) -> int:
        unit = self.src.dtype.itemsize if self.dst is not None else self.src.row_nbytes
        return self.src.offset + self.first * unit

    @property
    def nbytes(self) -> int:
        return self.count * (self.src.dtype.itemsize if self.dst is not None else self.src.row_nbytes)


def _contiguous(shape: tuple, starts: tuple, tshape: tuple) -> bool:
    """Whether the block ``starts``/``tshape`` of a C-order tensor of ``shape`` is one range of it."""
    k = next((i for i, m in enumerate(tshape) if m > 1), len(shape))
    return tuple(tshape[k + 1 :]) == tuple(shape[k + 1 :])


def plan_copies(loads: list, piece_nbytes: int | None = None) -> list[Copy]:
    """``loads``: (Source, [(starts, tile array), ...]) pairs -> the ``Copy`` tasks of at most ``piece_nbytes``
    (default ``PIECE_NBYTES``) of file each, in file order."""
    piece_nbytes = piece_nbytes or PIECE_NBYTES
    out = []
    for src, tiles in loads:
        isz, shape = src.dtype.itemsize, tuple(src.shape)
        strided = []
        for starts, dst in tiles:
            if not _contiguous(shape, tuple(starts), dst.shape):
                strided.append((tuple(starts), dst))
                continue
            first = sum(s * math.prod(shape[i + 1 :]) for i, s in enumerate(starts))
            flat, step = dst.reshape(-1), max(1, piece_nbytes // isz)
            for a in range(0, flat.size, step):
                out.append(Copy(src, first + a, min(step, flat.size - a), flat[a : a + step]))
        if strided:
            step = max(1, piece_nbytes // max(1, src.row_nbytes))
            lo, hi = min(s[0] for s, _ in strided), max(s[0] + d.shape[0] for s, d in strided)
            for r in range(lo, hi, step):
                m = min(step, hi - r)
                mine = [(s, d) for s, d in strided if s[0] < r + m and r < s[0] + d.shape[0]]
                if mine:
                    out.append(Copy(src, r, m, None, mine))
    out.sort(key=lambda c: (str(c.src.file), c.file_offset))
    return out


class _Worker(threading.local):
    """A worker thread's descriptors and buffers: file bytes (a piece), a float32 chunk, two uint16 chunks."""

    def __init__(self):
        self.fds: dict[Path, int] = {}  # file -> this thread's descriptor
        self.buf = np.empty(0, dtype=np.uint8)
        self.f32 = np.empty(CHUNK_ELEMS, dtype=np.float32)
        self._u16 = [np.empty(CHUNK_ELEMS, dtype=np.uint16) for _ in range(2)]

    def u16(self, k: int, shape: tuple) -> np.ndarray:
        n = math.prod(shape)
        if self._u16[k].size < n:
            self._u16[k] = np.empty(n, dtype=np.uint16)
        return self._u16[k][:n].reshape(shape)

    def scratch(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(max(nbytes, PIECE_NBYTES), dtype=np.uint8)
        return self.buf[:nbytes]


def load(loads: list, threads: int | None = None, error: type[Exception] = ValueError,
         piece_nbytes: int | None = None) -> int:  # fmt: skip
    """Fill every tile of ``loads`` ((Source, [(starts, tile array), ...]) pairs) from its file, on
    ``threads`` workers (default ``THREADS``). Returns the file bytes read. Each worker opens the files it
    reads itself (its own read-ahead state); all are closed at the end."""
    copies = plan_copies(loads, piece_nbytes)
    for f in {c.src.file: c.src for c in copies}.values():
        os.close(_open(f, error))  # an unreadable file fails here, before any thread starts
    local, opened = _Worker(), []
    n = max(1, min(threads or THREADS, len(copies)))
    ahead = _ReadAhead(copies, READ_AHEAD_PIECES)
    ahead.start()
    try:
        if n == 1:
            for c in copies:
                _run(c, local, opened, error, ahead)
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="turnip-load") as ex:
                futures = [ex.submit(_run, c, local, opened, error, ahead) for c in copies]
                try:
                    for f in futures:
                        f.result()
                finally:
                    for f in futures:
                        f.cancel()
    finally:
        ahead.finish()
        for fd in opened:
            os.close(fd)
    return sum(c.nbytes for c in copies)


class _ReadAhead(threading.Thread):
    """Asks the kernel for the file ranges of ``copies`` in their order (``POSIX_FADV_WILLNEED``), at most
    ``window`` pieces ahead of the workers: one sequential stream from a cold disk however many workers
    copy, and a page cache that is read ahead of them. Advice only: an error stops it, nothing else."""

    def __init__(self, copies: list, window: int):
        super().__init__(name="turnip-readahead", daemon=True)
        self.copies, self.window, self.started, self.done = copies, window, 0, False
        self.cond = threading.Condition()

    def run(self) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        fds: dict[Path, int] = {}
        try:
            for i, c in enumerate(self.copies):
                with self.cond:
                    while i - self.started >= self.window and not self.done:
                        self.cond.wait()
                    if self.done:
                        return
                if c.src.file not in fds:
                    fds[c.src.file] = os.open(c.src.file, os.O_RDONLY)
                os.posix_fadvise(fds[c.src.file], c.file_offset, c.nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:
            return
        finally:
            for fd in fds.values():
                os.close(fd)

    def began(self) -> None:
        """A worker took its next piece."""
        with self.cond:
            self.started += 1
            self.cond.notify()

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify()
        self.join()


def _open(src: Source, error) -> int:
    try:
        return os.open(src.file, os.O_RDONLY)
    except OSError as e:
        raise error(f"{src.file}: cannot read: {e.strerror or e}") from None


def _fd(src: Source, local: _Worker, opened: list, error) -> int:
    """This worker's descriptor of ``src``'s file (opened on first use, listed in ``opened``)."""
    fd = local.fds.get(src.file)
    if fd is None:
        fd = local.fds[src.file] = _open(src, error)
        opened.append(fd)  # list.append is atomic
    return fd


def _run(c: Copy, local: _Worker, opened: list, error, ahead: _ReadAhead) -> None:
    ahead.began()
    src = c.src
    fd = _fd(src, local, opened, error)
    if c.dst is not None and c.dst.dtype == src.dtype:
        _pread(fd, c.dst.view(np.uint8), c.file_offset, src, error)  # straight into the tile
        return
    if c.dst is not None:  # converted from scratch a cache-sized part at a time
        isz, step = src.dtype.itemsize, max(1, CONVERT_NBYTES // src.dtype.itemsize)
        for a in range(0, c.count, step):
            m = min(step, c.count - a)
            raw = local.scratch(m * isz)
            _pread(fd, raw, c.file_offset + a * isz, src, error)
            _put(c.dst[a : a + m], raw.view(src.dtype), local, src, error)
        return
    raw = local.scratch(c.nbytes)
    _pread(fd, raw, c.file_offset, src, error)
    x = raw.view(src.dtype).reshape((c.count, *src.shape[1:]))
    for starts, dst in c.rows:
        a, b = max(c.first, starts[0]), min(c.first + c.count, starts[0] + dst.shape[0])
        inner = tuple(slice(s, s + m) for s, m in zip(starts[1:], dst.shape[1:], strict=True))
        _put(dst[a - starts[0] : b - starts[0]], x[(slice(a - c.first, b - c.first), *inner)], local, src, error)


def _pread(fd: int, buf: np.ndarray, offset: int, src: Source, error) -> None:
    """Fill ``buf`` (bytes) from byte ``offset`` of the file, however many reads it takes."""
    mv, done = memoryview(buf).cast("B"), 0
    while done < len(mv):
        try:
            got = os.preadv(fd, [mv[done:]], offset + done)
        except OSError as e:
            raise error(f"{src.file}: cannot read tensor {src.tensor!r}: {e.strerror or e}") from None
        if got == 0:
            size = os.fstat(fd).st_size
            raise error(f"{src.file}: tensor {src.tensor!r} (for {src.label}) is cut short: the file ends at byte "
                        f"{size}, before byte {offset + len(mv)} (truncated?)")  # fmt: skip
        done += got


def _put(dst: np.ndarray, x: np.ndarray, local: _Worker, src: Source, error) -> None:
    """``dst[...] = x`` (same shape, either possibly strided) in ``dst``'s dtype, writing ``dst`` once."""
    if dst.dtype == x.dtype:
        u = np.dtype(f"u{x.dtype.itemsize}")
        np.copyto(dst.view(u), x.view(u))  # no dtype-specific copy loop that might hold the GIL
        return
    if dst.dtype == _F32:
        np.copyto(dst, x, casting="unsafe")  # exact widening
        return
    convert = _bf16_fp16 if x.dtype == _BF16 and dst.dtype == _F16 else _via_f32
    step = max(1, CHUNK_ELEMS // max(1, math.prod(x.shape[1:])))
    for i in range(0, x.shape[0], step):
        convert(dst[i : i + step], x[i : i + step], local, src, error)


@functools.cache
def _bf16_kernel():
    """A compiled one-pass bf16 -> fp16 conversion over contiguous uint16 bits (numba, without the GIL), or
    None where numba is missing or ``TURNIP_CONVERT=numpy``: returns 1 (having written the values before it) at
    the first value beyond fp16."""
    if os.environ.get("TURNIP_CONVERT") == "numpy":
        return None
    try:
        import numba
    except ImportError:  # turnip imports with numpy alone; the numpy steps below then convert
        return None

    @numba.njit(nogil=True, cache=True)
    def convert(u, out, table, ok):
        for i in range(u.size):
            x = np.int64(u[i])
            m = x & 0x7FFF
            if m > ok:
                return 1
            h = np.int64(table[m]) if m < 0x3880 else ((m << 3) - 0xC000) & 0xFFFF
            out[i] = np.uint16(h | (x & 0x8000))
        return 0

    return convert


_WARMING: list[threading.Thread] = []


def warm_conversion() -> threading.Thread | None:
    """Get the compiled bf16 -> fp16 conversion ready on a background thread (once per process): a process's
    first compiled call costs about a second (numba starting and loading it from its cache, or compiling it),
    which the load's first conversions would otherwise wait for; started when a checkpoint with bf16 tensors is
    opened, it runs while the plan is built. None where the conversion is not compiled (``_bf16_kernel``)."""
    if _WARMING:
        return _WARMING[0]
    k = _bf16_kernel()
    if k is None:
        return None

    def run() -> None:
        u = np.zeros(1, dtype=np.uint16)
        k(u, np.empty_like(u), _SMALL_BF16_FP16, _FP16_OK_BITS[_BF16])

    # not a daemon: an exit waits for it (about a second at most) instead of tearing numba down under it
    t = threading.Thread(target=run, name="turnip-warm-bf16")
    _WARMING.append(t)
    t.start()
    return t


def _bf16_fp16(dst: np.ndarray, x: np.ndarray, local: _Worker, src: Source, error) -> None:
    """bf16 -> fp16 in integer steps: a magnitude that is a normal fp16 keeps its 7 mantissa bits (exact:
    rebias the exponent), the few below fp16's normal range come from a table of ml_dtypes' casts; the same
    bits as ``x.astype(np.float16)``. Compiled in one pass where numba is present and both arrays are
    contiguous (16 threads at memory speed), else in numpy steps on cache-sized scratch."""
    u = x.view(np.uint16)
    k = _bf16_kernel() if u.flags.c_contiguous and dst.flags.c_contiguous else None
    if k is not None and not k(u.reshape(-1), dst.view(np.uint16).reshape(-1), _SMALL_BF16_FP16,
                               _FP16_OK_BITS[_BF16]):  # fmt: skip
        return
    _bf16_fp16_numpy(dst, x, local, src, error)


def _bf16_fp16_numpy(dst: np.ndarray, x: np.ndarray, local: _Worker, src: Source, error) -> None:
    u = x.view(np.uint16)
    m, h = local.u16(0, u.shape), local.u16(1, u.shape)
    np.bitwise_and(u, 0x7FFF, out=m)
    if int(m.max(initial=0)) > _FP16_OK_BITS[_BF16]:  # beyond fp16 (refused), or NaN
        _check_fp16(x, src, error)
        np.copyto(dst, x, casting="unsafe")
        return
    np.left_shift(u, 3, out=h)  # the sign bit falls off
    np.subtract(h, 0xC000, out=h)  # (exponent - 127 + 15) << 10 | mantissa << 3, modulo 2**16
    mf, hf = m.reshape(-1), h.reshape(-1)
    small = np.flatnonzero(mf < 0x3880)  # below 2**-14: fp16 subnormals, zero
    if small.size:
        hf[small] = _SMALL_BF16_FP16[mf[small]]
    np.bitwise_and(u, 0x8000, out=m)
    np.bitwise_or(h, m, out=dst.view(np.uint16))  # the sign back, straight into the tile


def _via_f32(dst: np.ndarray, x: np.ndarray, local: _Worker, src: Source, error) -> None:
    if dst.dtype == _F16:
        _check_fp16(x, src, error)
    if x.dtype == _F32:
        np.copyto(dst, x, casting="unsafe")
        return
    t = local.f32[: x.size].reshape(x.shape) if x.size <= CHUNK_ELEMS else np.empty(x.shape, np.float32)
    np.copyto(t, x, casting="unsafe")
    np.copyto(dst, t, casting="unsafe")


def _check_fp16(x: np.ndarray, src: Source, error) -> None:
    """Refuse values of ``x`` beyond fp16's range (as bits where the dtype allows: no float temporary)."""
    ok = _FP16_OK_BITS.get(x.dtype)
    if ok is not None:
        bits = x.view(f"u{x.dtype.itemsize}")
        if int(np.bitwise_and(bits, (1 << (8 * x.dtype.itemsize - 1)) - 1).max(initial=0)) <= ok:
            return
    top = float(np.nanmax(np.abs(x.astype(np.float32)), initial=0.0))
    if top > _FP16_MAX:
        raise error(f"{src.file}: tensor {src.tensor!r} (for {src.label}) has values up to {top:.3g}, beyond fp16's "
                    f"{_FP16_MAX:.0f}; compute in bf16 or fp32")  # fmt: skip


def input_offsets(backend) -> dict[int, int]:
    """Taskgraph input tensor -> byte offset of its tile in ``backend.host_in``."""
    offs = getattr(backend, "input_offsets", None)
    if offs is not None:
        return offs
    from turnip.runtime.layout import input_vertices

    lay = backend.lay
    return {t: int(lay.host_offset[vs[0]]) for t, vs in input_vertices(backend.mg).items()}


def _is_range(rows) -> bool:
    return rows is None or rows.size > 0 and bool(np.all(np.diff(rows) == 1))


class CheckpointInputs:
    """The logical inputs of ``tg`` from checkpoint ``ck`` (``Checkpoint.inputs``). Iterating yields
    ``ck.iter_inputs``' pairs; ``write_into(backend, tg)`` (what ``write_streaming`` does with it) reads the
    files from ``threads`` workers straight into the backend's host input region. ``entries``: the checked
    (logical name, header, rows or None) in file order (``ck.input_plan``, made when first asked for).
    After a write: ``nbytes_read``, ``seconds``."""

    def __init__(self, ck, tg, ids=None, seed: int = 0, only=None, error=ValueError, threads=None):
        self.ck, self.tg, self.ids, self.seed, self.only = ck, tg, ids, seed, only
        self.error, self.threads = error, threads or THREADS
        self.nbytes_read, self.seconds, self._entries = 0, 0.0, None

    @property
    def entries(self) -> list:
        if self._entries is None:
            self._entries = self.ck.input_plan(self.tg, self.ids, self.seed, self.only)
        return self._entries

    def __iter__(self):
        return self.ck.iter_inputs(self.tg, self.ids, self.seed, self.only)

    def write_into(self, backend, tg=None) -> int:
        """Fill ``backend``'s host input region (``host_in``; a backend without one gets the tensors one at a
        time through ``write_inputs``), then load the resident inputs. Returns the bytes of tiles written."""
        from turnip.runtime.weights import compute_dtype, logical_inputs, tile_inputs

        tg = tg or self.tg
        t0 = time.perf_counter()
        region = getattr(backend, "host_in", None)
        lg, loads, gathers, written = logical_inputs(tg), [], [], []
        offs = input_offsets(backend) if region is not None else {}
        for name, h, rows in self.entries:
            blocks = [(tuple(s), int(t)) for s, t in lg[name][1]]
            written += [t for _, t in blocks]
            if region is None or not _is_range(rows):
                gathers.append(name)
                continue
            dt = compute_dtype(tg, name)
            tiles = [(s, _tile(region, offs[t], tg.shape[t], dt)) for s, t in blocks if t in offs]
            loads.append((_source(name, h, rows, lg[name][0]), tiles))
        self.nbytes_read = load(loads, self.threads, self.error)
        if gathers:
            for name, x in self.ck.iter_inputs(tg, self.ids, self.seed, set(gathers)):
                self.nbytes_read += x.nbytes
                backend.write_inputs(tile_inputs(tg, {name: x}), load_resident=False)
        backend.load_resident(written)
        self.seconds = time.perf_counter() - t0
        return sum(int(tg.nbytes[t]) for t in written)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every logical input in its own array (compute dtype, logical shape; file order), read on the
        workers: the values ``dict(iter(self))`` gives, for a host copy of the weights."""
        from turnip.runtime.weights import compute_dtype, logical_inputs

        t0 = time.perf_counter()
        lg, out, loads, gathers = logical_inputs(self.tg), {}, [], []
        for name, h, rows in self.entries:
            if not _is_range(rows):
                gathers.append(name)
                continue
            x = out[name] = np.empty(lg[name][0], dtype=compute_dtype(self.tg, name))
            loads.append((_source(name, h, rows, x.shape), [((0,) * x.ndim, x)]))
        self.nbytes_read = load(loads, self.threads, self.error)
        if gathers:
            out |= dict(self.ck.iter_inputs(self.tg, self.ids, self.seed, set(gathers)))
        self.seconds = time.perf_counter() - t0
        return {name: out[name] for name, _, _ in self.entries}

    def summary(self) -> str:
        """One line: bytes read, from how many files, time and rate."""
        files = len({h.file for _, h, _ in self.entries})
        gb = self.nbytes_read / 1e9
        rate = gb / max(self.seconds, 1e-9)
        took = f"{self.seconds:.2f} s ({rate:.3g} GB/s, {self.threads} threads)"
        return f"weights   {gb:.3g} GB from {files} file(s) in {took}"


def _source(name: str, h, rows, shape) -> Source:
    """The ``Source`` of logical input ``name`` (of ``shape``): rows ``rows`` (a range, or None: all) of the
    tensor of header ``h``."""
    from turnip.runtime.weights import st_dtype

    dt = st_dtype(h.dtype)
    row0 = 0 if rows is None else int(rows[0]) * math.prod(h.shape[1:]) * dt.itemsize
    return Source(h.file, h.offset + row0, dt, tuple(int(s) for s in shape), h.name, name)


def _tile(region: np.ndarray, off: int, shape, dtype: np.dtype) -> np.ndarray:
    n = math.prod(int(s) for s in shape) * dtype.itemsize
    return region[off : off + n].view(dtype).reshape(tuple(int(s) for s in shape))


class HostRegion:
    """A host input region for ``tg``'s inputs without a plan (benchmarks, tests): every input tile in turn
    (``tensors``: these input tensors instead), 256-byte aligned, in one byte array (``host_in``); ``tiles()``
    gives them as typed arrays."""

    def __init__(self, tg, zero: bool = True, tensors=None):
        from turnip.runtime.weights import NP_OF

        if tensors is None:  # every tile of the logical inputs
            tensors = [t for _, (_, blocks) in tg.meta.get("input_blocks", {}).items() for _, t in blocks]
        self.tg, self.input_offsets, n = tg, {}, 0
        for t in tensors:
            self.input_offsets[int(t)] = n
            n += -int(tg.nbytes[t]) % 256 + int(tg.nbytes[t])
        self.host_in = (np.zeros if zero else np.empty)(n, dtype=np.uint8)
        self._dt = {t: np.dtype(NP_OF[tg.dtype[t]]) for t in self.input_offsets}

    def tiles(self) -> dict[int, np.ndarray]:
        return {t: _tile(self.host_in, o, self.tg.shape[t], self._dt[t]) for t, o in self.input_offsets.items()}

    def write_inputs(self, values: dict, load_resident: bool = True) -> None:
        tiles = self.tiles()
        for t, x in values.items():
            if t in tiles:
                tiles[t][...] = np.asarray(x).reshape(tiles[t].shape)

    def load_resident(self, tensors) -> None:
        pass


def write_tiles(backend, tg, values: dict, threads: int | None = None) -> int:
    """``backend.write_inputs(values)`` (taskgraph input tensor -> its value) with each value copied straight
    into the backend's host input region (``host_in``) by ``threads`` workers (default min(16, cores)), then
    the resident ones loaded. A value is any array of its tile's size and dtype (a strided view of a bigger
    array: one copy, no contiguous one first); others, and a backend without ``host_in``, go through
    ``write_inputs``. Returns bytes written."""
    from turnip.runtime.weights import NP_OF

    region = getattr(backend, "host_in", None)
    offs = input_offsets(backend) if region is not None else {}
    jobs, rest = [], {}
    for t, x in values.items():
        x, shape = np.asarray(x), tuple(int(s) for s in tg.shape[t])
        dt = np.dtype(NP_OF[tg.dtype[t]])
        if t in offs and x.dtype == dt and x.size == math.prod(shape):
            jobs.append((_tile(region, offs[t], shape, dt).reshape(x.shape), x))
        else:
            rest[t] = np.ascontiguousarray(x).reshape(shape)
    if rest:
        backend.write_inputs(rest, load_resident=False)
    _copy_all(jobs, threads)
    backend.load_resident(list(values))
    return sum(int(tg.nbytes[t]) for t in values)


def thread_map(fn, items: list, threads: int | None = None) -> list:
    """``fn`` over ``items`` on ``threads`` workers (default min(16, cores); numpy's copies release the GIL), results
    in order; one item runs here."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(min(threads or 16, os.cpu_count() or 1, len(items)), thread_name_prefix="turnip-map") as ex:
        return list(ex.map(fn, items))


def _copy_all(jobs: list, threads: int | None, pinner=None) -> None:
    """``np.copyto(dst, src)`` for every (dst, src) of ``jobs`` on ``threads`` workers (default min(16, cores));
    with a ``pinner`` (``turnip.runtime.hostmem.PiecePinner``) each job is (dst, src, byte offset in the region),
    announced to it once copied."""

    def copy(job):
        np.copyto(job[0], job[1])
        if pinner is not None:
            pinner.written(job[2], job[0].nbytes)

    thread_map(copy, jobs, threads)


def write_arrays(backend, tg, arrays: dict, threads: int | None = None) -> int:
    """``write_streaming(backend, tg, arrays.items())`` with every tile copied straight from its logical array
    into the backend's host input region (``host_in``) by ``threads`` workers (default min(16, cores)), then
    the resident inputs loaded; no tile array in between. A ``LazyWeights`` is made one array at a time, each
    copied before the next is made. Inputs without a host copy, and a backend without
    ``host_in``, go through ``write_inputs``. A backend that pins its region while it is filled
    (``pin_while_filling``: the CUDA backend's registered region) hears of every tile as it is written. Returns
    bytes written."""
    from turnip.runtime.weights import LazyWeights, compute_dtype, logical_inputs, pinned_while_filled, write_streaming

    region = getattr(backend, "host_in", None)
    if region is None:
        return write_streaming(backend, tg, arrays.items())
    offs, lg = input_offsets(backend), logical_inputs(tg)
    jobs, rest, written = [], {}, []
    writes = [(offs[int(t)], int(tg.nbytes[int(t)])) for name in arrays for _, t in lg[name][1] if int(t) in offs]
    lazy = isinstance(arrays, LazyWeights)  # one array made at a time: its tiles copied before the next is made
    with pinned_while_filled(backend, writes) as pinner:
        for name in arrays:
            if lazy:
                _copy_all(jobs, threads, pinner)
                jobs = []
            x = np.asarray(arrays[name])
            direct = x.dtype == compute_dtype(tg, name)
            for starts, t in lg[name][1]:
                t = int(t)
                written.append(t)
                shape = tuple(tg.shape[t])
                src = x[tuple(slice(a, a + n) for a, n in zip(starts, shape, strict=True))]
                if t in offs and direct:
                    jobs.append((_tile(region, offs[t], shape, src.dtype), src, offs[t]))
                else:
                    rest[t] = np.ascontiguousarray(src)
        if rest:
            backend.write_inputs(rest, load_resident=False)
            if pinner is not None:
                for t in rest:
                    if t in offs:
                        pinner.written(offs[t], int(tg.nbytes[t]))
        _copy_all(jobs, threads, pinner)
    backend.load_resident(written)
    return sum(int(tg.nbytes[t]) for t in written)
