"""Launchers for every op of the specification (``turnip.reference``): ``prepare`` once, then launch many times.

``prepare(op, in_shapes, out_shape, dtype, params)`` validates shapes, picks the implementation, compiles
it (JIT warm-up happens here), computes the launch geometry and returns a ``Launcher``. Two ways to run it:

- ``launcher(stream, out, ins)`` enqueues work on a numba stream (the portable path, and the only one
  under the CUDA simulator): no allocation, no compilation; ``out``/``ins`` are C-contiguous device
  arrays already shaped as declared; for ``sum_into`` ``ins[0]`` is the accumulator and is ``out``.
- ``launcher.bind(out, ins)`` fixes the arrays once (at plan load) and returns a ``RawLaunch`` (one
  ``cuLaunchKernel``) or a ``LibCall`` (cuBLASLt, cuDNN, copies) for the runtime (``cuda_kernels.launch``).

Implementations (``launcher.path``): ``cublas`` / ``cublaslt`` GEMMs, ``cudnn`` fused attention (fp16,
bf16; grouped-query too), ``nvrtc`` hand-written CUDA C++ memory-bound kernels (``cuda_kernels.fast``;
opt-in with ``fast=True``), ``memcpy`` concatenation and row slices, and generated numba kernels
(``kernel``, ``numba-gemm``) for everything else and as the fallback of every other path.

Dtypes: fp16, fp32 and, when ``ml_dtypes`` is installed, bf16 (``ml_dtypes.bfloat16`` arrays). numba has
no bfloat16: its kernels get bf16 arrays as uint16 views of their bits and convert in the kernel
(``codegen.bf16_functions``). ``dtype`` is the vertex's (the output's): ops whose inputs have another name
it in ``params["src"]`` (``cast``, ``xent``); targets are int32; Adam and ``xent``'s output are float32 only.
Importing this module needs numpy only; numba is imported by ``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels import gemm as gm
from cuda_kernels._build import (  # noqa: F401 - DTYPES, _BF16, _bits: also this module's interface
    _BF16,
    DTYPES,
    _arr,
    _bits,
    _ew,
    _kern,
    _need,
    _noop,
    _noop_bind,
    _ptr,
    _simple,
)
from cuda_kernels._numba import Compiled, scalar_type
from cuda_kernels.fast import rope_params
from cuda_kernels.import_ops import BUILDERS as _IMPORT_BUILDERS
from cuda_kernels.launch import LibCall, launch_raw
from cuda_kernels.standalone import standalone_context  # also this module's interface
from cuda_kernels.train_ops import _adam_scalars, _cast, _cols, _rmsnorm_bwd, _xent

GEMM_MODES = ("auto", "cublas", "cublaslt", "numba")
DEFAULT_WS_NBYTES = 1 << 20  # workspace per stream slot a launch may use (a plan's, at run time)


class KernelPrepareError(ValueError):
    """An op cannot be prepared for the given shapes/params; the message names op, shapes and reason."""


class Launcher:
    """A prepared op. ``path`` names the implementation; ``flops`` counts GEMM work."""

    __slots__ = ("op", "in_shapes", "out_shape", "dtype", "params", "path", "flops", "_run", "_bind")

    def __init__(self, op, in_shapes, out_shape, dtype, params, path, run, flops=0, bind=None):
        self.op, self.in_shapes, self.out_shape = op, in_shapes, out_shape
        self.dtype, self.params, self.path, self._run, self.flops = dtype, params, path, run, flops
        self._bind = bind

    def __call__(self, stream, out, ins: Sequence) -> None:
        self._run(stream, out, ins)

    def bind(self, out, ins: Sequence):
        """``RawLaunch`` or ``LibCall`` over these arrays (device only; built once per vertex)."""
        if self._bind is None:
            raise RuntimeError(f"{self!r} cannot be bound")
        return self._bind(out, list(ins))

    def __repr__(self) -> str:
        return f"Launcher({self.op}, {self.in_shapes} -> {self.out_shape}, {self.dtype}, {self.path})"


def prepare(op: str, in_shapes: Sequence[tuple], out_shape: tuple, dtype: str, params: dict | None = None,
            gemm: str = "auto", fast: bool = False, ws_nbytes: int = DEFAULT_WS_NBYTES) -> Launcher:
    """Build (and compile) the launcher of one op instance. Raises ``KernelPrepareError``.

    ``fast`` uses the CUDA C++ memory-bound kernels where they cover the op (needs CuPy and a device);
    ``ws_nbytes`` is the workspace a launch may ask of its stream slot (GEMMs use none)."""
    params = dict(params or {})
    in_shapes = [tuple(int(e) for e in s) for s in in_shapes]
    out_shape = tuple(int(e) for e in out_shape)
    if op not in _BUILDERS:
        raise KernelPrepareError(f"unknown op {op!r}; known: {sorted(_BUILDERS)}")
    if dtype not in DTYPES:
        raise KernelPrepareError(f"{op}: dtype {dtype!r} not in {sorted(DTYPES)} (bf16 needs ml_dtypes)")
    if gemm not in GEMM_MODES:
        raise KernelPrepareError(f"{op}: gemm={gemm!r} not in {GEMM_MODES}")
    seq = int(params.get("seq", 0)) if op in PACKED_OPS else 0
    if seq and out_shape and out_shape[0] > seq:
        return _packed(op, in_shapes, out_shape, dtype, params, seq, gemm=gemm, fast=fast, ws_nbytes=ws_nbytes)
    try:
        built = _fast(op, in_shapes, out_shape, dtype, params) if fast else None
        if built is None:
            built = _BUILDERS[op](in_shapes, out_shape, dtype, params, {"gemm": gemm, "ws_nbytes": ws_nbytes})
    except (ValueError, KeyError, IndexError) as e:
        raise KernelPrepareError(f"{op} {in_shapes} -> {out_shape} {dtype} {params}: {e}") from e
    path, run, flops, bind = built
    return Launcher(op, in_shapes, out_shape, dtype, params, path, run, flops, bind)


PACKED_OPS = ("sdpa", "sdpa_bwd", "rotary")  # ops whose token tiles may hold whole sequences (``seq`` param)


def _packed(op: str, in_shapes, out_shape, dtype: str, params: dict, seq: int, **kw) -> Launcher:
    """A tile of whole sequences of ``seq`` rows (``turnip.reference.packed``): the one-sequence launcher
    over each sequence's rows of every operand and the output, in turn on the same stream; bound, one
    ``LibCall`` of them all (capturable where each part is)."""
    n = out_shape[0]
    if n % seq or any(s[0] != n for s in in_shapes):
        raise KernelPrepareError(f"{op} {in_shapes} -> {out_shape}: packed sequences of {seq} rows need whole "
                                 "sequences in every operand")  # fmt: skip
    one = {k: v for k, v in params.items() if k != "seq"} | ({"tk": seq} if op == "sdpa" else {})
    inner = prepare(op, [(seq, *s[1:]) for s in in_shapes], (seq, *out_shape[1:]), dtype, one, **kw)
    cuts = [slice(i, i + seq) for i in range(0, n, seq)]

    def run(stream, out, ins):
        for c in cuts:
            inner(stream, out[c], [x[c] for x in ins])

    def bind(out, ins):
        return chain([inner.bind(out[c], [x[c] for x in ins]) for c in cuts], f"{op} x{len(cuts)}")

    return Launcher(op, in_shapes, out_shape, dtype, params, inner.path, run, inner.flops * len(cuts), bind)


def chain(parts: list, what: str) -> LibCall:
    """Bound launches (``RawLaunch`` / ``LibCall``) as one ``LibCall`` issuing them in order on the slot's
    stream; capturable where every part is; at most one library's handle among them."""
    libs = {b.lib for b in parts if isinstance(b, LibCall) and b.lib}
    if len(libs) > 1:
        raise KernelPrepareError(f"{what}: parts use several libraries' handles ({sorted(libs)})")

    def call(ctx) -> None:
        for b in parts:
            if isinstance(b, LibCall):
                b(ctx)
            else:
                r = launch_raw(b, ctx.stream)
                if r:
                    raise RuntimeError(f"cuLaunchKernel ({what}): CUDA error {r}")

    ws = max((b.ws_nbytes for b in parts if isinstance(b, LibCall)), default=0)
    ok = all(b.capturable for b in parts if isinstance(b, LibCall))
    return LibCall(call, ws, what, capturable=ok, lib=next(iter(libs), None))


def _fast(op, in_shapes, out_shape, dtype, params):
    """The CUDA C++ kernel of ``cuda_kernels.fast`` for this op, or None (not covered, no CuPy)."""
    try:
        from cuda_kernels.fast import fast_kernel
    except ImportError:
        return None
    fk = fast_kernel(op, in_shapes, out_shape, dtype, params)
    if fk is None:
        return None

    def bind(out, ins):
        return fk.bind(_ptr(out), [_ptr(x) for x in ins])

    def run(stream, out, ins):
        r = launch_raw(bind(out, ins), int(stream.handle))
        if r:
            raise RuntimeError(f"cuLaunchKernel of {op}: CUDA error {r}")

    return "nvrtc", run, 0, bind


# ---------------------------------------------------------------- contractions


def _gemm(plan: gm.EinsumPlan, in_shapes, out_shape, dtype, alpha: float, opts: dict):
    """(path, run, bind) of one einsum as a GEMM; a cuBLASLt ``bind`` given a third input adds it (its C
    operand with beta 1)."""
    gemm = opts["gemm"]
    if gemm != "numba" and gm.cupy_usable():
        layout = gm.cublas_layout(plan)
        if layout is not None:
            g = gm.CublasGemm(layout, dtype, alpha)
            lt = _lt(layout, dtype, alpha, opts) if gemm in ("auto", "cublaslt") else None

            def run(stream, out, ins):
                g(stream, out, ins[0], ins[1])

            def bind(out, ins):
                if lt is not None:
                    return lt.bind(_ptr(out), _ptr(ins[0]), _ptr(ins[1]), _ptr(ins[2]) if len(ins) == 3 else None)
                a, b = ins[:2]
                return LibCall(lambda ctx: g(ctx.numba_stream, out, a, b), 0, "cublas")

            return ("cublaslt" if lt is not None else "cublas"), run, bind
        if gemm in ("cublas", "cublaslt"):
            raise ValueError(f"einsum {plan.subscripts!r} is not a single strided cuBLAS GEMM")
    elif gemm in ("cublas", "cublaslt"):
        raise ValueError("gemm='cublas' but CuPy/cuBLAS is not usable here")
    grid, block = gm.numba_gemm_geometry(plan)
    sizes = tuple(plan.size[c] for c in gm.gemm_letters(plan))
    types = [_arr(dtype, in_shapes[0]), _arr(dtype, in_shapes[1]), _arr(dtype, out_shape),
             scalar_type("f4"), *[scalar_type("i8")] * len(sizes)]
    bf = dtype == "bf16"
    k = Compiled(cg.jit(gm.numba_gemm_source(plan, bf)), types, grid, block)
    a32 = np.float32(alpha)
    return ("numba-gemm", *_kern(k, lambda out, ins: (ins[0], ins[1], out, a32, *sizes), bf))


def _then_add(built, out_shape, dtype: str, opts: dict):
    """(path, run, bind) of a GEMM ``built`` followed by out += addend (the third input), on the same stream."""
    path, run, bind = built
    _, add_run, _, add_bind = _simple(2, "v0 + v1")([out_shape, out_shape], out_shape, dtype, {}, opts)

    def run2(stream, out, ins):
        run(stream, out, ins[:2])
        add_run(stream, out, [out, ins[2]])

    def bind2(out, ins):
        calls = [bind(out, ins[:2]), add_bind(out, [out, ins[2]])]

        def call(ctx):
            for c in calls:
                if isinstance(c, LibCall):
                    c(ctx)
                else:
                    r = launch_raw(c, int(ctx.stream))
                    if r:
                        raise RuntimeError(f"cuLaunchKernel of einsum's addend: CUDA error {r}")

        libs = {c.lib for c in calls if isinstance(c, LibCall) and c.lib}
        ok = all(c.capturable for c in calls if isinstance(c, LibCall))
        ws = max((c.ws_nbytes for c in calls if isinstance(c, LibCall)), default=0)
        return LibCall(call, ws, f"einsum {path} + addend", capturable=ok, lib=next(iter(libs), None))

    return path + "+add", run2, bind2


def _lt(layout, dtype: str, alpha: float, opts: dict):
    """A cuBLASLt GEMM with its algorithm chosen now, or None where cuBLASLt cannot be loaded."""
    try:
        from cuda_kernels.cublaslt import LtGemm
    except ImportError:
        return None
    try:
        return LtGemm(layout, dtype, alpha, 0)  # no workspace: its launch can be captured once for any stream
    except (OSError, RuntimeError):
        if opts["gemm"] == "cublaslt":
            raise
        return None


def _einsum(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) in (2, 3), "einsum takes two operands and an optional addend")
    _need(len(in_shapes) == 2 or in_shapes[2] == out_shape, f"einsum's addend {in_shapes[-1]} is not {out_shape}")
    plan = gm.plan_einsum(params["subscripts"], in_shapes[0], in_shapes[1], out_shape)
    path, run, bind = _gemm(plan, in_shapes[:2], out_shape, dtype, float(params.get("scale", 1.0)), opts)
    if len(in_shapes) == 3:  # the addend: cuBLASLt's bound call adds it itself; direct runs and other paths add after
        added = _then_add((path, run, bind), out_shape, dtype, opts)
        path, run, bind = (path, added[1], bind) if path == "cublaslt" else added
    return path, run, plan.flops(), bind


# ---------------------------------------------------------------- attention


def _sdpa(in_shapes, out_shape, dtype, params, opts):
    from cuda_kernels import cudnn_sdpa

    _need(len(in_shapes) == 3 and len(in_shapes[0]) in (3, 4) and len(in_shapes[1]) == len(in_shapes[2]) == 3,
          "sdpa takes q (tq, h, dh) or (tq, hk, r, dh), k and v (tk, hk, dh)")
    qs, (tk_all, hk, dk) = in_shapes[0], in_shapes[1]
    tq, h, dh = qs[0], int(np.prod(qs[1:-1], dtype=np.int64)), qs[-1]
    _need(dk == dh and in_shapes[2] == in_shapes[1] and 0 < hk and h % hk == 0 and (len(qs) == 3 or qs[1] == hk),
          f"q {qs}, k and v {in_shapes[1:]}: head dims differ or query heads are not key/value heads * r")
    tk = int(params.get("tk", tk_all))
    partial = bool(params.get("partial", False))
    n_o = tq * h * dh
    _need(out_shape == ((n_o + h * tq * 4 // np.dtype(DTYPES[dtype]).itemsize,) if partial else qs),
          f"output {out_shape} does not match q {in_shapes[0]} (partial={partial})")
    lse_off = n_o * np.dtype(DTYPES[dtype]).itemsize
    scale = float(params["scale"])
    window, cap = int(params.get("window", 0)), float(params.get("softcap", 0.0))
    _need(window >= 0 and cap >= 0 and (not window or params.get("causal", True)),
          f"window {window} and softcap {cap} must be >= 0, a window only on causal attention")
    g = None
    if not cap and cudnn_sdpa.supports(tq, tk, h, dh, dtype, params, hk):  # no score cap in cuDNN's graph
        mode = cudnn_sdpa.mask_mode(tq, tk, params)
        try:
            g = cudnn_sdpa.CudnnSdpa(tq, tk, tk_all, h, dh, dtype, scale, mode, partial, hk,
                                     window if mode == "band" else 0)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a graph cuDNN will not build: the portable kernel, said loudly
            import warnings

            warnings.warn(f"sdpa q {qs} k {in_shapes[1]} {dtype}: cuDNN graph failed ({e!r}); using the portable "
                          "kernel (slow)", stacklevel=2)
        if g is not None and g.ws_nbytes > opts["ws_nbytes"]:  # too little scratch in the plan: portable kernel
            g = None
    if g is not None:

        def bind(out, ins):
            o = _ptr(out)
            return g.bind(o, o + lse_off, _ptr(ins[0]), _ptr(ins[1]), _ptr(ins[2]))

        def run(stream, out, ins):
            bind(out, ins)(standalone_context(stream, g.ws_nbytes, "cudnn"))

        return "cudnn", run, 0, bind
    diag = int(params["q_off"]) - int(params["k_off"]) if params.get("causal", True) else tk
    block = cg.block_for(tq, 128)
    types = [_arr(dtype, 3), _arr("fp32", 2), _arr(dtype, 3), _arr(dtype, 3), _arr(dtype, 3),
             scalar_type("f4"), scalar_type("i8"), scalar_type("i8"), scalar_type("i8"), scalar_type("f4")]
    bf = dtype == "bf16"
    src = cg.sdpa_source(dh, partial, h // hk, bf, softcap=cap > 0)
    k = Compiled(cg.jit(src), types, (-(-tq // block), h), (block,))
    s32, c32 = np.float32(scale), np.float32(cap or 1.0)
    wk = window or tq + tk + abs(diag) + 1  # no window: beyond every key the tile has
    flat = len(qs) == 4  # grouped-query tiles (tq, hk, r, dh): the kernel sees (tq, h, dh) views

    def args_of(out, ins):
        q = ins[0].reshape(tq, h, dh) if flat else ins[0]
        if partial:
            o, lse = _split_partial(out, tq, h, dh)
        else:
            o, lse = (out.reshape(tq, h, dh) if flat else out), _dummy_lse(out)
        return (o, lse, q, ins[1], ins[2], s32, diag, tk, wk, c32)

    run, bind = _kern(k, args_of, bf)
    return "kernel", run, 0, bind


def _split_partial(x, tq: int, h: int, dh: int):
    """Device views (O (tq, h, dh), L (h, tq) float32) of a flat partial buffer."""
    n = tq * h * dh
    return x[:n].reshape(tq, h, dh), x[n:].view(np.float32).reshape(h, tq)


def _dummy_lse(out):
    """A (1, 1) float32 view, never written (the non-partial kernel stores no log-sum-exp)."""
    return out.reshape(-1)[: 4 // out.dtype.itemsize].view(np.float32).reshape(1, 1)


def _sdpa_bwd(in_shapes, out_shape, dtype, params, opts):
    """Gradients of causal attention: cuDNN where it fits the plan's workspace, else portable numba kernels
    (``cuda_kernels.attn_bwd``)."""
    from cuda_kernels import attn_bwd

    return attn_bwd.build(in_shapes, out_shape, dtype, params, opts)


def _attn_combine(in_shapes, out_shape, dtype, params, opts):
    tq, h, dh = int(params["tq"]), int(params["h"]), int(params["dh"])
    r = int(params.get("r", 1))  # grouped-query: output (tq, h / r, r, dh), the same memory as (tq, h, dh)
    _need(r >= 1 and h % r == 0 and out_shape == ((tq, h, dh) if r == 1 else (tq, h // r, r, dh))
          and len(in_shapes) >= 1, "attn_combine: output (tq, h, dh) (r > 1: (tq, h / r, r, dh)) of >= 1 partials")
    n, bf = len(in_shapes), dtype == "bf16"
    grid, block = cg.elementwise_geometry((tq, h, dh))
    types = [_arr(dtype, 3)] + [_arr(dtype, 3), _arr("fp32", 2)] * n
    k = Compiled(cg.jit(cg.combine_source(n, bf)), types, grid, block)

    def args_of(out, ins):
        o = out if r == 1 else out.reshape(tq, h, dh)
        return (o, *(v for x in ins for v in _split_partial(x, tq, h, dh)))

    run, bind = _kern(k, args_of, bf)
    return "kernel", run, 0, bind


def _concat(in_shapes, out_shape, dtype, params, opts):
    rest = in_shapes[0][1:]
    _need(all(s[1:] == rest for s in in_shapes) and out_shape == (sum(s[0] for s in in_shapes), *rest),
          "concat: inputs (t_i, ...) of equal trailing dims -> (sum t_i, ...)")
    rows = np.cumsum([0] + [s[0] for s in in_shapes]).tolist()
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    row_nbytes = int(np.prod(rest, dtype=np.int64)) * itemsize

    def run(stream, out, ins):
        for x, r0, r1 in zip(ins, rows, rows[1:], strict=False):
            if r1 > r0:  # bf16 as uint16 bits: the simulator's copy cannot cast bfloat16
                _bits(out[r0:r1]).copy_to_device(_bits(x), stream=stream)

    def bind(out, ins):
        base = _ptr(out)
        return _memcpy([(base + r0 * row_nbytes, _ptr(x), (r1 - r0) * row_nbytes)
                        for x, r0, r1 in zip(ins, rows, rows[1:], strict=False) if r1 > r0])  # fmt: skip

    return "memcpy", run, 0, bind


def _memcpy(chunks: list[tuple[int, int, int]]) -> LibCall:
    """A capturable ``LibCall`` of device-to-device copies ``(dst, src, nbytes)`` on the slot's stream."""
    from cuda_kernels.launch import driver

    f = driver().cuMemcpyDtoDAsync_v2

    def copy(ctx) -> None:
        for d, s, nb in chunks:
            r = f(d, s, nb, ctx.stream)
            if r:
                raise RuntimeError(f"cuMemcpyDtoDAsync: CUDA error {r}")

    return LibCall(copy, 0, "memcpy", capturable=True)


def _rows(in_shapes, out_shape, dtype, params, opts):
    a, b = int(params["start"]), int(params["stop"])
    _need(len(in_shapes) == 1 and len(in_shapes[0]) >= 1 and 0 <= a < b <= in_shapes[0][0]
          and out_shape == (b - a, *in_shapes[0][1:]),
          "rows takes x (t, ...) and 0 <= start < stop <= t -> (stop - start, ...)")
    row_nbytes = int(np.prod(out_shape[1:], dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
    nbytes = (b - a) * row_nbytes

    def run(stream, out, ins):
        if nbytes:
            _bits(out).copy_to_device(_bits(ins[0][a:b]), stream=stream)

    def bind(out, ins):
        return _memcpy([(_ptr(out), _ptr(ins[0]) + a * row_nbytes, nbytes)]) if nbytes else _noop_bind(out, ins)

    return "memcpy", run, 0, bind


# ---------------------------------------------------------------- norms, rotary, gather


def _rmsnorm(in_shapes, out_shape, dtype, params, opts):
    """Rows of the last axis (any rank: the kernel sees (rows, d) views); ``offset``: weights ``w + offset``."""
    _need(len(in_shapes) == 2 and len(out_shape) >= 1 and in_shapes[1] == in_shapes[0][-1:]
          and out_shape == in_shapes[0], "rmsnorm takes x (..., d) and w (d,)")  # fmt: skip
    blk, n = cg.row_block(), out_shape[-1]
    rows = int(np.prod(out_shape[:-1], dtype=np.int64))
    off = float(params.get("offset", 0.0))
    types = [_arr(dtype, 2), _arr(dtype, 2), _arr(dtype, 1), scalar_type("f4"), *[scalar_type("f4")] * bool(off)]
    bf = dtype == "bf16"
    k = Compiled(cg.jit(cg.rmsnorm_source(2, blk, bf, offset=bool(off))), types, (rows,), (blk,))
    sc = (np.float32(params.get("eps", 1e-5)), *([np.float32(off)] if off else []))
    run, bind = _kern(k, lambda out, ins: (out.reshape(rows, n), ins[0].reshape(rows, n), ins[1], *sc), bf)
    return "kernel", run, 0, bind


def _rotary(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 1 and len(out_shape) >= 3 and in_shapes[0] == out_shape and out_shape[-1] % 2 == 0,
          "rotary takes x (t, h, dh) or (t, ..., dh) with even dh")
    t, h, dh = out_shape[0], int(np.prod(out_shape[1:-1], dtype=np.int64)), out_shape[-1]
    (gx,), block = cg.elementwise_geometry((dh // 2,))
    grid = (gx, t, -(-h // cg.ROTARY_HEADS_PER_THREAD))
    _need(t <= 65535, f"rotary tile of {t} tokens exceeds the grid limit 65535")
    rope = rope_params(params)
    scaled, bf = rope[0] != 0.0, dtype == "bf16"
    types = [_arr(dtype, 3), _arr(dtype, 3), scalar_type("i8"), scalar_type("f8"), *[scalar_type("f8")] * (4 * scaled)]
    src = cg.rotary_source(scaled=scaled, bf16=bf, inverse=bool(params.get("inverse", False)))
    k = Compiled(cg.jit(src), types, grid, block)
    sc = (int(params["pos_off"]), float(params.get("theta", 10000.0)), *(rope if scaled else ()))
    if len(out_shape) == 3:
        run, bind = _kern(k, lambda out, ins: (out, ins[0], *sc), bf)
    else:  # middle axes flattened into heads: (t, h, dh) views
        run, bind = _kern(k, lambda out, ins: (out.reshape(t, h, dh), ins[0].reshape(t, h, dh), *sc), bf)
    return "kernel", run, 0, bind


def _embed(in_shapes, out_shape, dtype, params, opts):
    (t,), (_, d) = in_shapes
    _need(out_shape == (t, d), "embed takes ids (t,) and table (V, d) -> (t, d)")
    src = cg.elementwise_source(2, 2, [], "x1[x0[b], c]")  # a copy: bf16 rows move as their uint16 bits
    by_itemsize = {}
    for ids in ("int32", "int64"):
        types = [_arr(dtype, 2), _arr(ids, 1), _arr(dtype, 2)]
        by_itemsize[np.dtype(ids).itemsize] = _ew(src, out_shape, types, bits=dtype == "bf16")
    (r4, b4), (r8, b8) = by_itemsize[4], by_itemsize[8]

    def run(stream, out, ins):
        (r4 if ins[0].dtype.itemsize == 4 else r8)(stream, out, ins)

    def bind(out, ins):
        return (b4 if ins[0].dtype.itemsize == 4 else b8)(out, ins)

    return "kernel", run, 0, bind


def _sum_into(in_shapes, out_shape, dtype, params, opts):
    _need(len(in_shapes) == 2 and in_shapes[0] == out_shape, "sum_into takes (acc, x) with acc shaped as out")
    return _simple(2, "v0 + v1")(in_shapes, out_shape, dtype, params, opts)


def _mix(in_shapes, out_shape, dtype, params, opts):
    n = int(params["n_out"])
    _need(out_shape == (n,), f"mix output must be ({n},)")
    loads, terms = [], ["ONE"]
    for k, s in enumerate(in_shapes):
        if int(np.prod(s, dtype=np.int64)) == 0:
            loads.append("ZERO")
            continue
        loads.append(cg.load(k, cg.flat_index(f"c % x{k}.size", len(s), f"x{k}"), dtype == "bf16"))
        terms.append(f"np.float32({k + 1}.0) * v{k}")
    src = cg.elementwise_source(len(in_shapes), 1, loads, f"HALF * math.tanh({' + '.join(terms)})")
    types = [_arr("fp32", 1), *(_arr(dtype, s) for s in in_shapes)]
    run, bind = _ew(src, out_shape, types, bits=dtype == "bf16")
    return "kernel", run, 0, bind


_BUILDERS: dict[str, Callable] = {
    "einsum": _einsum,
    "sdpa": _sdpa,
    "attn_combine": _attn_combine,
    "sdpa_bwd": _sdpa_bwd,
    "concat": _concat,
    "rows": _rows,
    "add_n": _simple(0, lambda n: " + ".join(f"v{k}" for k in range(n))),
    "mul": _simple(2, "v0 * v1"),
    "scale": _simple(1, "v0 * s0", lambda p: (p["alpha"],)),
    "silu": _simple(1, "v0 / (ONE + math.exp(-v0))"),
    "silu_mul": _simple(2, "v0 / (ONE + math.exp(-v0)) * v1"),
    "gelu_tanh_mul": _simple(2, "HALF * v0 * (ONE + math.tanh(s0 * (v0 + s1 * v0 * v0 * v0))) * v1",
                             lambda p: (0.7978845608028654, 0.044715)),
    "softcap": _simple(1, "s0 * math.tanh(v0 / s0)", lambda p: (p["cap"],)),
    "silu_mul_dg": _simple(3, "v2 * v1 * mm * (ONE + v0 * (ONE - mm))", pre=("mm = ONE / (ONE + math.exp(-v0))",)),
    "rmsnorm": _rmsnorm,
    "rmsnorm_bwd": _rmsnorm_bwd,
    "rotary": _rotary,
    "embed": _embed,
    "sum_into": _sum_into,
    "mix": _mix,
    "cols": _cols,
    "xent": _xent,
    "xent_bwd": lambda *a: _xent(*a, backward=True),
    "cast": _cast,
    "adam_m": _simple(2, "s0 * v0 + (ONE - s0) * v1", lambda p: (p["b1"],), fp32=True),
    "adam_v": _simple(2, "s0 * v0 + (ONE - s0) * v1 * v1", lambda p: (p["b2"],), fp32=True),
    "adam_p": _simple(4, "v0 - s0 / q1 * v1 / (math.sqrt(v2) / math.sqrt(q2) + s3)", _adam_scalars,
                      pre=("q1 = -math.expm1(v3 * s1)", "q2 = -math.expm1(v3 * s2)"), fp32=True),
    **_IMPORT_BUILDERS,  # the ops of imported graphs (``turnip.torchimport.kernels``)
}
OPS = frozenset(_BUILDERS)  # every op of the specification (``turnip.reference``); a test checks they agree
