"""What every kernel builder shares: the dtypes kernels take, argument checks, and the ways a compiled numba
kernel becomes a launcher's ``run`` (enqueue on a numba stream) and ``bind`` (a ``RawLaunch`` over fixed
arrays), elementwise kernels included. ``cuda_kernels.kernels`` and ``cuda_kernels.train_ops`` build on it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels._numba import Compiled, array_type, scalar_type
from cuda_kernels.launch import LibCall


def _bf16_type():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.bfloat16


DTYPES = {"fp16": np.float16, "fp32": np.float32}
_BF16 = _bf16_type()
if _BF16 is not None:
    DTYPES["bf16"] = _BF16
def _arr(dtype, shape_or_ndim):
    nd = shape_or_ndim if isinstance(shape_or_ndim, int) else len(shape_or_ndim)
    return array_type(DTYPES.get(dtype, dtype), nd)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _ptr(a) -> int:
    return a.device_ctypes_pointer.value or 0


def _noop(*_args) -> None:
    return None


def _noop_bind(out, ins) -> LibCall:
    return LibCall(_noop, 0, "empty")


def _bits(a):
    """A bf16 device array as the uint16 array of its bits (how numba kernels take bf16); others as they are."""
    return a.view(np.uint16) if _BF16 is not None and getattr(a, "dtype", None) == _BF16 else a


def _kern(k: Compiled, args_of: Callable, bits: bool = False) -> tuple[Callable, Callable]:
    """(run, bind) of one numba kernel whose arguments are ``args_of(out, ins)`` (``bits``: bf16 arrays
    among them are passed as their uint16 bits)."""
    if bits:
        typed = args_of

        def args_of(out, ins):
            return tuple(_bits(a) for a in typed(out, ins))

    return (lambda stream, out, ins: k.launch(stream, args_of(out, ins))), (lambda out, ins: k.bind(args_of(out, ins)))


def _ew(src: str, out_shape, argtypes, scalars=(), bits: bool = False, view=None) -> tuple[Callable, Callable]:
    """(run, bind) of an elementwise kernel over ``out_shape``; ``view(out, ins)`` reshapes the arrays first."""
    if any(e == 0 for e in out_shape):
        return _noop, _noop_bind
    grid, block = cg.elementwise_geometry(out_shape, per_thread=cg.unroll())
    k = Compiled(cg.jit(src), argtypes, grid, block)
    sc = tuple(scalars)
    if view is None:
        return _kern(k, lambda out, ins: (out, *ins, *sc), bits)

    def args_of(out, ins):
        o, xs = view(out, ins)
        return (o, *xs, *sc)

    return _kern(k, args_of, bits)


def _as_1(x):
    """A 0-d device array as shape (1,) (numba kernels take arrays of rank >= 1)."""
    return x.reshape(1) if x.ndim == 0 else x


def _merged(in_shapes: list, out_shape: tuple) -> tuple[list, tuple]:
    """Shapes of the same arrays with dims merged between the places where an input's trailing part begins
    (inputs: trailing parts of ``out_shape`` or ``()``): (t, h, r, e) with a bias (h, r, e) is (t, h*r*e)
    and (h*r*e,); with (e,) as well, (t, h*r, e), (h*r, e) and (e,)."""
    n = len(out_shape)
    cuts = sorted({0, n} | {n - len(s) for s in in_shapes if s})
    merged = [int(np.prod(out_shape[a:b], dtype=np.int64)) for a, b in zip(cuts, cuts[1:], strict=False)]
    return [tuple(merged[cuts.index(n - len(s)) :]) if s else () for s in in_shapes], tuple(merged)


def _simple(n_in: int, expr: str, scalars: Callable | None = None, pre: tuple = (), fp32: bool = False):
    """Elementwise op on same-shaped (or broadcastable, 0-d included) inputs; ``scalars(params)`` gives the
    float32 scalars ``s0, s1, ..``; ``pre`` are statements run before ``expr``; ``fp32``: float32 only."""

    def build(in_shapes, out_shape, dtype, params, opts):
        _need(len(in_shapes) == n_in if n_in else len(in_shapes) >= 1, f"expects {n_in or '>=1'} inputs")
        _need(not fp32 or dtype == "fp32", f"computes float32 only, not {dtype}")
        bf = dtype == "bf16"
        view = (lambda out, ins: (out, [_as_1(x) for x in ins])) if () in in_shapes else None
        if len(out_shape) > 1 and all(s in (out_shape, ()) for s in in_shapes):  # no broadcasting: run flat
            n = int(np.prod(out_shape, dtype=np.int64))
            in_shapes, out_shape = [(n,) if s else () for s in in_shapes], (n,)

            def view(out, ins, n=n):
                return out.reshape(n), [x.reshape(n) if x.ndim else x.reshape(1) for x in ins]

        elif len(out_shape) > 3 and all(s == out_shape[len(out_shape) - len(s) :] for s in in_shapes if s):
            in_shapes, out_shape = _merged(in_shapes, out_shape)  # inputs are trailing parts (a bias)

            def view(out, ins, o=out_shape, ss=tuple(in_shapes)):
                xs = [x.reshape(sh) if x.ndim else x.reshape(1) for x, sh in zip(ins, ss, strict=True)]
                return out.reshape(o), xs

        nd = len(out_shape)
        shapes = [s or (1,) for s in in_shapes]
        loads = [cg.load(k, cg.broadcast_index(s, out_shape), bf) for k, s in enumerate(shapes)]
        ex = expr(len(in_shapes)) if callable(expr) else expr
        scal = [np.float32(v) for v in scalars(params)] if scalars else []
        src = cg.elementwise_source(len(shapes), nd, loads, ex, len(scal), pre, bf16=bf)
        types = [_arr(dtype, nd), *(_arr(dtype, s) for s in shapes), *[scalar_type("f4")] * len(scal)]
        run, bind = _ew(src, out_shape, types, scal, bf, view)
        return "kernel", run, 0, bind

    return build
