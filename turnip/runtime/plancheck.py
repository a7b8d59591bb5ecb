"""The checks a plan passes before any backend loads it: a plan file is untrusted input, and nothing in it
may crash the runtime or make it write outside the memory it allocated.

``check_plan(mg, tg=None)`` returns, or raises ``PlanError`` naming the first offending vertex and field.
It is the cheap structural subset of what the backends rely on (``cpu.py``, ``cuda.py``'s constructor,
``layout.py``, the scheduler), in time linear in the plan: numpy over the per-vertex arrays and one Python
pass over the per-vertex lists (op, params, shape, dtype).

  header     n_gpus, budgets, host region sizes, the workspace, array types and lengths
  vertices   kind known; gpu and src_gpu in range; a kernel's op known, every parameter the kernels read of
             the type they read; shape and dtype give out_nbytes
  memory     every GPU write inside its arena and below the workspace reserved at its top; every host copy
             inside its host region (the regions of ``layout.plan_layout``)
  reads      CSR in range; each names a vertex that creates a buffer on the GPU the reader reads from; copies
             move a buffer of their shape and dtype (an offload, of its own tensor); a kernel's operands give
             its shape (``ops.check_shapes``)
  deps       CSR in range, acyclic (Kahn's algorithm when an edge points backwards)
  locks      a vertex is in a lock group iff it is a sum-into, and the group is its accumulator tensor
  outputs    in range, once each, each a buffer or a host copy
  taskgraph  (when given) arrays and CSR in range, index order topological, shapes and dtypes giving nbytes (the
             rest of ``TaskGraph.validate``, which costs 30 times more, follows for the vertices in the memgraph
             from the checks above and below); each vertex the shape and dtype of its tensor and the op and params
             of its taskgraph vertex; inputs the taskgraph's inputs, outputs its outputs
Races, dataflow order and lost dependencies are the verifier's (``turnip.memgraph.verify``).
"""

from __future__ import annotations

import math

import numpy as np

from turnip import ops
from turnip.memgraph.plan import (
    DTYPE_NBYTES,
    KIND_INPUT,
    KIND_KERNEL,
    KIND_NAMES,
    KIND_OFFLOAD,
    KIND_RELOAD,
    KIND_TRANSFER,
    MemGraph,
)
from turnip.runtime.errors import PlanError

MAX_GPUS = 64
MAX_NBYTES = 1 << 56  # any arena, region or buffer; keeps every sum of two in int64
MAX_RANK = 8
PER_VERTEX = ("kind", "gpu", "src_gpu", "tensor", "tg_vertex", "out_offset", "out_nbytes", "host_offset",
              "lock_group", "flops")  # fmt: skip
# the parameters the kernels read (turnip.reference, cuda_kernels) and what each must be
_REAL = frozenset({"scale", "eps", "theta", "alpha", "b1", "b2", "lr", "rope_factor", "rope_low", "rope_high",
                   "rope_orig"})  # fmt: skip
_UNIT = frozenset({"b1", "b2"})  # and in [0, 1)
_POSITIVE = frozenset({"tk", "tq", "h", "dh", "r", "n_out", "itemsize"})
_COUNT = frozenset({"q_off", "k_off", "pos_off", "start", "stop"})
_FLAG = frozenset({"causal", "partial", "inverse", "resident"})
_TEXT = frozenset({"subscripts", "src"})


def check_plan(mg: MemGraph, tg=None) -> None:
    """Raise ``PlanError`` at the first thing in ``mg`` (and ``tg``, its taskgraph, if given) that the runtime
    cannot load safely."""
    _header(mg)
    expect = _vertices(mg)
    _memory(mg, expect)
    _reads(mg)
    _deps(mg)
    _locks_outputs(mg)
    if tg is not None:
        _taskgraph(mg, tg)


def _fail(mg, v: int, field: str, why: str):
    raise PlanError(v, _label(mg, v), field, why)


def _label(mg, v: int) -> str:
    if v < 0:
        return "plan"
    try:
        k = int(mg.kind[v])
        name = KIND_NAMES[k] if 0 <= k < len(KIND_NAMES) else f"kind {k}"
        return f"{name}#{v}({str(mg.op[v])[:40]}, tensor {int(mg.tensor[v])}, gpu {int(mg.gpu[v])})"
    except (IndexError, TypeError, ValueError):
        return f"vertex #{v}"


def _is_int(x) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def _int_array(mg, name: str, a, length: int | None, floats: bool = False) -> None:
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in ("iuf" if floats else "iu"):
        what = f"{a.dtype} {a.ndim}-d array" if isinstance(a, np.ndarray) else type(a).__name__
        _fail(mg, -1, name, f"must be a 1-d {'numeric' if floats else 'integer'} array, not a {what}")
    if length is not None and len(a) != length:
        _fail(mg, -1, name, f"has {len(a)} entries, the plan {length}")


def _header(mg) -> None:
    if not _is_int(mg.n_gpus) or not 1 <= mg.n_gpus <= MAX_GPUS:
        _fail(mg, -1, "n_gpus", f"{mg.n_gpus!r} is not a GPU count in 1..{MAX_GPUS}")
    _int_array(mg, "kind", mg.kind, None)
    n = len(mg.kind)
    for name in PER_VERTEX:
        _int_array(mg, name, getattr(mg, name), n, floats=name == "flops")
    for name in ("in_ptr", "dep_ptr"):
        _int_array(mg, name, getattr(mg, name), n + 1)
    _int_array(mg, "in_idx", mg.in_idx, None)
    _int_array(mg, "dep_src", mg.dep_src, None)
    _int_array(mg, "dep_kind", mg.dep_kind, len(mg.dep_src))
    _int_array(mg, "outputs", mg.outputs, None)
    _int_array(mg, "budget_nbytes", mg.budget_nbytes, mg.n_gpus)
    for name in ("op", "params", "shape", "dtype"):
        x = getattr(mg, name)
        if not isinstance(x, list | tuple) or len(x) != n:
            _fail(mg, -1, name, f"must be a list of {n} entries, one per vertex")
    if not isinstance(mg.stats, dict):
        _fail(mg, -1, "stats", "must be a dict")
    sizes = {"host_nbytes": mg.host_nbytes} | {k: mg.stats.get(k, 0) for k in (
        "host_input_nbytes", "workspace_slot_nbytes", "workspace_slots", "resident_input_nbytes")}  # fmt: skip
    for k, x in sizes.items():
        if not _is_int(x) or not 0 <= x <= MAX_NBYTES:
            _fail(mg, -1, k, f"{x!r} is not a byte count in 0..{MAX_NBYTES}")
    ws = sizes["workspace_slot_nbytes"] * sizes["workspace_slots"]
    b = mg.budget_nbytes
    bad = (b <= ws) | (b > MAX_NBYTES)
    if bad.any():
        g = _first(bad)
        _fail(mg, -1, "budget_nbytes", f"of gpu {g} is {int(b[g])} bytes, not above the {ws}-byte workspace "
              f"reserved at its top (and at most {MAX_NBYTES})")  # fmt: skip


def _vertices(mg) -> np.ndarray:
    """Kinds, GPUs, ops, params, shapes and dtypes; returns the bytes each vertex's shape and dtype make."""
    n, kind = mg.n, mg.kind
    bad = (kind < 0) | (kind >= len(KIND_NAMES))
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "kind", f"{int(kind[v])} is not one of {KIND_NAMES}")
    for name in ("gpu", "src_gpu"):
        g = getattr(mg, name)
        bad = (g < 0) | (g >= mg.n_gpus)
        if bad.any():
            v = _first(bad)
            _fail(mg, v, name, f"{int(g[v])} is outside 0..{mg.n_gpus - 1}")
    bad = (kind != KIND_TRANSFER) & (mg.src_gpu != mg.gpu)
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "src_gpu", f"{int(mg.src_gpu[v])} is not gpu {int(mg.gpu[v])} on a vertex that is no transfer")
    expect = np.zeros(n, dtype=np.int64)
    kinds, shapes, dtypes = kind.tolist(), mg.shape, mg.dtype
    seen: dict = {}  # shape -> element count, for the many vertices sharing a tile shape
    for v in range(n):
        op, p = mg.op[v], mg.params[v]
        if not isinstance(op, str) or (kinds[v] == KIND_KERNEL and op not in ops.OPS):
            _fail(mg, v, "op", f"{op!r} is not a known kernel op" if kinds[v] == KIND_KERNEL else f"{op!r} is no name")
        if not isinstance(p, dict):
            _fail(mg, v, "params", f"must be a dict, not {type(p).__name__}")
        if p:
            why = _param_problem(p)
            if why:
                _fail(mg, v, "params", why)
        dt = dtypes[v]
        if not isinstance(dt, str) or dt not in DTYPE_NBYTES:
            _fail(mg, v, "dtype", f"{dt!r} is not one of {sorted(DTYPE_NBYTES)}")
        s = shapes[v]
        try:
            count = seen[s]
        except (KeyError, TypeError):
            count = _elements(mg, v, s)
            if isinstance(s, tuple):
                seen[s] = count
        expect[v] = count * DTYPE_NBYTES[dt]
    bad = mg.out_nbytes != expect
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "out_nbytes", f"is {int(mg.out_nbytes[v])}, but shape {tuple(shapes[v])} {dtypes[v]} is "
              f"{int(expect[v])} bytes")  # fmt: skip
    bad = ~np.isfinite(mg.flops) | (mg.flops < 0)
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "flops", f"{mg.flops[v]!r} is not a finite count >= 0")
    return expect


def _elements(mg, v: int, s) -> int:
    if not isinstance(s, tuple | list) or len(s) > MAX_RANK or not all(_is_int(x) and x >= 1 for x in s):
        _fail(mg, v, "shape", f"{s!r} is not a tuple of at most {MAX_RANK} positive extents")
    count = math.prod(s)
    if count > MAX_NBYTES:
        _fail(mg, v, "shape", f"{tuple(s)} has {count} elements")
    return count


def _param_problem(p: dict) -> str | None:
    """What is wrong with the parameters the kernels read (None: nothing)."""
    for k, x in p.items():
        if k in _REAL:
            ok = (k == "rope_factor" and x is None) or (
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x))  # fmt: skip
            want = "a finite number"
            if ok and k in _UNIT and not 0 <= x < 1:  # Adam's decay rates: 1 - b^step is a divisor, sqrt'ed for b2
                ok, want = False, "in [0, 1)"
            elif ok and k == "eps" and x < 0:
                ok, want = False, "a number >= 0"
        elif k in _POSITIVE or k in _COUNT:
            ok = _is_int(x) and x >= (1 if k in _POSITIVE else 0) and x <= MAX_NBYTES
            want = "an integer >= 1" if k in _POSITIVE else "an integer >= 0"
        elif k in _FLAG:
            ok, want = isinstance(x, bool), "true or false"
        elif k in _TEXT:
            ok, want = isinstance(x, str) and len(x) < 256, "a short string"
        elif k == "dtype":
            ok, want = isinstance(x, str) and x in DTYPE_NBYTES, f"one of {sorted(DTYPE_NBYTES)}"
        elif k == "tail":
            ok = isinstance(x, list | tuple) and len(x) <= MAX_RANK and all(_is_int(y) and y >= 1 for y in x)
            want = "a list of positive extents"
        else:
            continue
        if not ok:
            return f"{k}={x!r} must be {want}"
    return None


def _memory(mg, nb: np.ndarray) -> None:
    """GPU writes inside the arena, below the workspace; host copies inside their region."""
    kind = mg.kind
    ws = int(mg.stats.get("workspace_slot_nbytes", 0)) * int(mg.stats.get("workspace_slots", 0))
    limit = mg.budget_nbytes.astype(np.int64)[mg.gpu] - ws
    off = mg.out_offset.astype(np.int64)
    bad = (kind != KIND_OFFLOAD) & ((off < 0) | (nb > limit) | (off > limit - nb))
    if bad.any():
        v = _first(bad)
        b = int(mg.budget_nbytes[mg.gpu[v]])
        top = f" (the {ws} bytes at its top are the kernels' workspace)" if ws else ""
        _fail(mg, v, "out_offset", f"writes [{int(off[v])}, {int(off[v]) + int(nb[v])}), outside [0, {b - ws}) of "
              f"gpu {int(mg.gpu[v])}'s {b}-byte arena{top}")  # fmt: skip
    host = (kind == KIND_INPUT) | (kind == KIND_OFFLOAD) | (kind == KIND_RELOAD)
    is_input = np.isin(mg.tensor, mg.tensor[kind == KIND_INPUT])  # where layout.plan_layout puts the copy
    size = np.where(is_input, int(mg.stats.get("host_input_nbytes", 0)), int(mg.host_nbytes))
    hoff = mg.host_offset.astype(np.int64)
    bad = host & ((hoff < 0) | (nb > size) | (hoff > size - nb))
    if bad.any():
        v = _first(bad)
        region = "input region" if is_input[v] else "offload region"
        _fail(mg, v, "host_offset", f"copies [{int(hoff[v])}, {int(hoff[v]) + int(nb[v])}) outside the "
              f"{int(size[v])}-byte host {region}")  # fmt: skip


def _csr(mg, ptr_name: str, idx_name: str) -> np.ndarray:
    """Check CSR ``ptr``/``idx`` over the vertices; returns each entry's owning vertex."""
    ptr, idx, n = getattr(mg, ptr_name), getattr(mg, idx_name), mg.n
    if ptr[0] != 0 or ptr[-1] != len(idx):
        _fail(mg, -1, ptr_name, f"must run from 0 to {len(idx)} (the length of {idx_name}), not {int(ptr[0])} to "
              f"{int(ptr[-1])}")  # fmt: skip
    d = np.diff(ptr)
    if (d < 0).any():
        v = _first(d < 0)
        _fail(mg, v, ptr_name, f"decreases ({int(ptr[v])} then {int(ptr[v + 1])})")
    owner = np.repeat(np.arange(n), d)
    bad = (idx < 0) | (idx >= n)
    if bad.any():
        i = _first(bad)
        _fail(mg, int(owner[i]), idx_name, f"names vertex {int(idx[i])}, outside 0..{n - 1}")
    return owner


def _reads(mg) -> None:
    kind = mg.kind
    owner = _csr(mg, "in_ptr", "in_idx")
    nread = np.diff(mg.in_ptr)
    into = np.array([op == "sum_into" for op in mg.op], dtype=bool) & (kind == KIND_KERNEL)
    want = np.where((kind == KIND_OFFLOAD) | (kind == KIND_TRANSFER), 1, 0)
    bad = (kind != KIND_KERNEL) & (nread != want)
    bad |= (kind == KIND_KERNEL) & (nread == 0)
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "in_ptr", f"gives it {int(nread[v])} operands; a {KIND_NAMES[kind[v]]} takes "
              f"{int(want[v]) if kind[v] != KIND_KERNEL else 'one or more'}")  # fmt: skip
    rd = mg.in_idx
    creates = (kind != KIND_OFFLOAD) & ~into
    bad = ~creates[rd]
    if bad.any():
        i = _first(bad)
        _fail(mg, int(owner[i]), "in_idx", f"reads vertex {int(rd[i])}, which creates no buffer")
    reader_gpu = np.where(kind == KIND_TRANSFER, mg.src_gpu, mg.gpu)
    bad = mg.gpu[rd] != reader_gpu[owner]
    if bad.any():
        i = _first(bad)
        _fail(mg, int(owner[i]), "in_idx", f"reads buffer {int(rd[i])} on gpu {int(mg.gpu[rd[i]])}, not on gpu "
              f"{int(reader_gpu[owner[i]])}")  # fmt: skip
    ip, ii = mg.in_ptr.tolist(), rd.tolist()
    cache: dict = {}
    for v in np.flatnonzero(kind != KIND_INPUT).tolist():
        k, r = int(kind[v]), ii[ip[v] : ip[v + 1]]
        if k in (KIND_OFFLOAD, KIND_TRANSFER):
            b = r[0]
            if k == KIND_OFFLOAD and mg.tensor[b] != mg.tensor[v]:
                _fail(mg, v, "in_idx", f"offloads buffer {b} of tensor {int(mg.tensor[b])}, not its own tensor")
            if tuple(mg.shape[b]) != tuple(mg.shape[v]) or mg.dtype[b] != mg.dtype[v]:
                _fail(mg, v, "shape", f"{tuple(mg.shape[v])} {mg.dtype[v]} copies buffer {b} of "
                      f"{tuple(mg.shape[b])} {mg.dtype[b]}")  # fmt: skip
        elif k == KIND_KERNEL:
            _kernel_shapes(mg, v, r, cache)
            if into[v] and mg.dtype[r[0]] != mg.dtype[v]:
                _fail(mg, v, "dtype", f"{mg.dtype[v]} adds into accumulator {r[0]} of {mg.dtype[r[0]]}")


def _kernel_shapes(mg, v: int, reads: list[int], cache: dict) -> None:
    op, p = mg.op[v], mg.params[v]
    ins = tuple(tuple(mg.shape[b]) for b in reads)
    out = tuple(mg.shape[v])
    try:
        key = (op, ins, out, tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in p.items())))
        hash(key)
    except TypeError:
        key = None
    why = cache.get(key, 0) if key is not None else 0
    if why == 0:
        try:
            why = ops.check_shapes(op, list(ins), out, p)
        except (ArithmeticError, TypeError, ValueError, KeyError, IndexError) as e:
            why = f"{op} of {list(ins)}: {type(e).__name__}: {e}"
        if key is not None:
            cache[key] = why
    if why:
        _fail(mg, v, "shape", why)


def _deps(mg) -> None:
    owner = _csr(mg, "dep_ptr", "dep_src")
    bad = (mg.dep_kind < 0) | (mg.dep_kind > 1)
    if bad.any():
        i = _first(bad)
        _fail(mg, int(owner[i]), "dep_kind", f"{int(mg.dep_kind[i])} is neither data (0) nor memory (1)")
    src = mg.dep_src
    if (src < owner).all():  # every edge points forward, as emitted: vertex order is topological
        return
    n = mg.n
    indeg = np.bincount(owner, minlength=n).astype(np.int64)
    order = np.argsort(src, kind="stable")
    sp = np.zeros(n + 1, dtype=np.int64)
    sp[1:] = np.cumsum(np.bincount(src, minlength=n))
    succ, sp = owner[order].tolist(), sp.tolist()
    deg = indeg.tolist()
    stack = [v for v in range(n) if deg[v] == 0]
    done = 0
    while stack:
        u = stack.pop()
        done += 1
        for w in succ[sp[u] : sp[u + 1]]:
            deg[w] -= 1
            if deg[w] == 0:
                stack.append(w)
    if done < n:
        v = next(v for v in range(n) if deg[v] > 0)
        _fail(mg, v, "dep_src", f"closes a dependency cycle ({n - done} vertices on or after cycles)")


def _locks_outputs(mg) -> None:
    kind, lock = mg.kind, mg.lock_group
    into = np.array([op == "sum_into" for op in mg.op], dtype=bool) & (kind == KIND_KERNEL)
    acc = np.full(mg.n, -1, dtype=np.int64)
    acc[into] = mg.in_idx[mg.in_ptr[:-1][into]]
    bad = np.where(into, (lock != mg.tensor) | (mg.tensor[np.maximum(acc, 0)] != mg.tensor), lock != -1)
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "lock_group", f"is {int(lock[v])}; a sum-into's is its accumulator tensor, any other "
              "vertex's -1")  # fmt: skip
    out = mg.outputs
    bad = (out < 0) | (out >= mg.n)
    if bad.any():
        _fail(mg, -1, "outputs", f"names vertex {int(out[_first(bad)])}, outside 0..{mg.n - 1}")
    if len(np.unique(out)) != len(out):
        _fail(mg, -1, "outputs", "names a vertex twice")
    bad = into[out]
    if bad.any():
        _fail(mg, int(out[_first(bad)]), "outputs", "names a sum-into, which creates no buffer")


def _taskgraph(mg, tg) -> None:
    def fail(field: str, why: str):
        raise PlanError(-1, "taskgraph", field, why)

    if not _is_int(tg.n_gpus) or tg.n_gpus != mg.n_gpus:
        fail("n_gpus", f"{tg.n_gpus!r} differs from the memgraph's {mg.n_gpus}")
    for name in ("kind", "gpu", "src_gpu", "nbytes", "flops", "acc", "is_output", "arg_ptr", "arg_idx"):
        a = getattr(tg, name)
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iufb":
            fail(name, "must be a 1-d numeric array")
    nt = len(tg.kind)
    if any(len(getattr(tg, k)) != nt for k in ("gpu", "src_gpu", "nbytes", "flops", "acc", "is_output")):
        fail("kind", "arrays of different lengths")
    if any(not isinstance(x, list | tuple) or len(x) != nt for x in (tg.op, tg.params, tg.shape, tg.dtype, tg.name)):
        fail("op", f"per-vertex lists must have {nt} entries")
    if not isinstance(tg.meta, dict):
        fail("meta", "must be a dict")
    p, a = tg.arg_ptr, tg.arg_idx
    if len(p) != nt + 1 or p[0] != 0 or p[-1] != len(a) or (np.diff(p) < 0).any() or ((a < 0) | (a >= nt)).any():
        fail("arg_ptr", "is not a CSR over the taskgraph's vertices")
    if ((tg.acc < -1) | (tg.acc >= nt)).any():
        fail("acc", "names a vertex out of range")
    owner = np.repeat(np.arange(nt), np.diff(p))
    if (a >= owner).any():  # a taskgraph's index order is topological: this is its acyclicity
        fail("arg_idx", f"vertex {int(owner[_first(a >= owner)])} reads a tensor made after it")
    if ((tg.kind < 0) | (tg.kind > KIND_TRANSFER)).any() or ((tg.gpu < 0) | (tg.gpu >= tg.n_gpus)).any():
        fail("kind", "or gpu out of range")
    for t in range(nt):
        op, s, dt = tg.op[t], tg.shape[t], tg.dtype[t]
        if (
            not isinstance(dt, str)
            or dt not in DTYPE_NBYTES
            or not isinstance(s, tuple | list)
            or not all(_is_int(x) and x >= 1 for x in s)
            or not isinstance(op, str)
            or not isinstance(tg.params[t], dict)
        ):
            fail(
                "vertices", f"vertex {t} ({str(tg.name[t])[:60]}): op {op!r}, shape {s!r} or dtype {dt!r} is malformed"
            )
        if tg.nbytes[t] != (0 if op == "sum_into" else math.prod(s) * DTYPE_NBYTES[dt]):
            fail("nbytes", f"of vertex {t} is {tg.nbytes[t]}, not what shape {tuple(s)} {dt} makes")
    for name, lo in (("tensor", 0), ("tg_vertex", -1)):
        x = getattr(mg, name)
        bad = (x < lo) | (x >= nt)
        if bad.any():
            v = _first(bad)
            _fail(mg, v, name, f"{int(x[v])} is not a taskgraph vertex (0..{nt - 1})")
    t, tv, kind = mg.tensor.tolist(), mg.tg_vertex.tolist(), mg.kind
    for v in range(mg.n):
        s = t[v]
        if tuple(mg.shape[v]) != tuple(tg.shape[s]) or mg.dtype[v] != tg.dtype[s]:
            _fail(mg, v, "shape", f"{tuple(mg.shape[v])} {mg.dtype[v]} differs from its tensor's "
                  f"{tuple(tg.shape[s])} {tg.dtype[s]}")  # fmt: skip
        u = tv[v]
        if u >= 0 and (
            kind[v] != tg.kind[u] or kind[v] == KIND_KERNEL and (mg.op[v] != tg.op[u] or mg.params[v] != tg.params[u])
        ):
            _fail(mg, v, "op", f"{mg.op[v]} {mg.params[v]} differs from taskgraph vertex {u}'s {tg.op[u]} "
                  f"{tg.params[u]}")  # fmt: skip
    bad = (kind == KIND_INPUT) & (tg.kind[mg.tensor] != KIND_INPUT)
    if bad.any():
        v = _first(bad)
        _fail(mg, v, "tensor", f"{t[v]} is not an input of the taskgraph")
    want = set(np.flatnonzero(tg.is_output).tolist())
    got = mg.tensor[mg.outputs].tolist()
    if set(got) != want or len(got) != len(want):
        fail("is_output", f"the memgraph's outputs are tensors {sorted(set(got))[:8]}..., the taskgraph's "
             f"{sorted(want)[:8]}...")  # fmt: skip
