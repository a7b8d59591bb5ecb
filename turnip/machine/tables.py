"""Measured cost tables of a machine profile, and the model that reads them (``docs/profile.md``).

A table is a list of measured points: kernel time over work per (op, match, dtype), copy time over bytes
per (kind, contended). Each point has the mean, the standard deviation and the count of its samples.
``Curve`` interpolates one key's points:

- between measured points, log(mean ns) is piecewise linear in log(x): exact at every point and monotone
  between two neighbours;
- above the largest point the time grows in proportion to x (the last point's throughput);
- below the smallest, in proportion too, but never below half the smallest point's mean;
- the coefficient of variation (sd / mean) is linear in log(x) between points and constant beyond them.

Rows are checked on load: one-line ``ValueError`` naming the source, the list, the row and the field.
Everything here is immutable once built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

COPY_KINDS = ("h2d", "d2h", "p2p")
DTYPES = ("fp16", "bf16", "fp32")
BELOW_SMALLEST = 0.5  # below the smallest measured point: never faster than this fraction of its mean


@dataclass(frozen=True, slots=True)
class KernelPoint:
    op: str
    match: str  # an einsum's subscripts, or "*" for any vertex of the op
    dtype: str
    work: float  # flops (einsum, sdpa, sdpa_bwd) or bytes read plus written (other ops): turnip.machine.costs.work_of
    ns_mean: float
    ns_sd: float
    n: int
    shape: str = ""  # informational


@dataclass(frozen=True, slots=True)
class CopyPoint:
    kind: str  # h2d, d2h or p2p
    contended: bool  # measured while the opposite direction also copied
    nbytes: int
    ns_mean: float
    ns_sd: float
    n: int


class Curve:
    """One key's measured points, sorted by x, with the interpolation described in the module docstring."""

    __slots__ = ("x", "mean", "cv", "_lx", "_ly")

    def __init__(self, x, mean_ns, sd_ns):
        order = np.argsort(np.asarray(x, dtype=np.float64))
        self.x = np.asarray(x, dtype=np.float64)[order]
        self.mean = np.asarray(mean_ns, dtype=np.float64)[order]
        self.cv = np.asarray(sd_ns, dtype=np.float64)[order] / self.mean
        self._lx, self._ly = np.log(self.x), np.log(self.mean)

    def mean_ns(self, x) -> np.ndarray:
        """Interpolated mean time (ns) at each x."""
        x = np.atleast_1d(np.asarray(x, dtype=np.float64))
        lo, hi = self.x[0], self.x[-1]
        out = np.empty(len(x))
        inside = (x >= lo) & (x <= hi)
        out[inside] = np.exp(np.interp(np.log(x[inside]), self._lx, self._ly))
        j = np.minimum(np.searchsorted(self.x, x), len(self.x) - 1)
        hit = self.x[j] == x
        out[hit] = self.mean[j[hit]]  # exactly the measured mean at a measured point
        above = x > hi
        out[above] = self.mean[-1] * x[above] / hi
        below = ~inside & ~above  # includes x <= 0 and NaN
        prop = self.mean[0] * np.where(x[below] > 0, x[below], 0.0) / lo
        out[below] = np.maximum(prop, BELOW_SMALLEST * self.mean[0])
        return out

    def cv_at(self, x) -> np.ndarray:
        """Interpolated coefficient of variation (sd / mean) at each x; the end values beyond the points."""
        x = np.atleast_1d(np.asarray(x, dtype=np.float64))
        lx = np.log(np.clip(x, self.x[0], self.x[-1]))
        return np.interp(lx, self._lx, self.cv)


@dataclass(frozen=True, slots=True)
class LaunchPoint:
    op: str
    ns: int  # median host issue time of the op's kernels
    n: int  # samples


@dataclass(frozen=True)
class CostTables:
    """The measured points of one profile, and their curves by key; ``launch``: the host's issue time per
    kernel op (median ns), where measured."""

    kernels: tuple[KernelPoint, ...] = ()
    copies: tuple[CopyPoint, ...] = ()
    launch: tuple[LaunchPoint, ...] = ()
    _kernel_curves: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    _copy_curves: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        groups: dict = {}
        for k in self.kernels:
            groups.setdefault((k.op, k.match, k.dtype), []).append((k.work, k.ns_mean, k.ns_sd))
        self._kernel_curves.update({key: Curve(*zip(*pts, strict=True)) for key, pts in groups.items()})
        groups = {}
        for c in self.copies:
            groups.setdefault((c.kind, c.contended), []).append((c.nbytes, c.ns_mean, c.ns_sd))
        self._copy_curves.update({key: Curve(*zip(*pts, strict=True)) for key, pts in groups.items()})

    def kernel_curve(self, op: str, match: str, dtype: str) -> Curve | None:
        """The table for (op, match, dtype), else (op, "*", dtype), else None."""
        c = self._kernel_curves.get((op, match, dtype))
        return c if c is not None else self._kernel_curves.get((op, "*", dtype))

    def kernel_curves(self, dtype: str, keep) -> list[Curve]:
        """Every kernel curve of ``dtype`` whose op passes ``keep(op)`` (any match), in key order."""
        return [c for (op, _, dt), c in sorted(self._kernel_curves.items(), key=lambda kv: kv[0])
                if dt == dtype and keep(op)]  # fmt: skip

    def copy_curve(self, kind: str, contended: bool) -> Curve | None:
        return self._copy_curves.get((kind, bool(contended)))

    def launch_ns(self, op: str) -> int | None:
        """The measured host issue time of ``op``'s kernels, or None."""
        return next((x.ns for x in self.launch if x.op == op), None)

    def to_rows(self) -> tuple[list[dict], list[dict], list[dict]]:
        """The ``kernels``, ``copies`` and ``launch`` lists of a profile document."""
        kern = [{f.name: getattr(k, f.name) for f in fields(KernelPoint)} for k in self.kernels]
        for r in kern:
            if not r["shape"]:
                del r["shape"]
        return (kern, [{f.name: getattr(c, f.name) for f in fields(CopyPoint)} for c in self.copies],
                [{f.name: getattr(x, f.name) for f in fields(LaunchPoint)} for x in self.launch])


# ---------------------------------------------------------------------------------------------- validation
_REQUIRED = {"kernels": ("op", "match", "dtype", "work", "ns_mean", "ns_sd", "n"),
             "copies": ("kind", "contended", "nbytes", "ns_mean", "ns_sd", "n"),
             "launch": ("op", "ns", "n")}  # fmt: skip
_OPTIONAL = {"kernels": ("shape",), "copies": (), "launch": ()}


def parse_tables(source: str, kernels, copies, launch=None) -> CostTables | None:
    """Checked ``CostTables`` from a profile document's ``kernels``, ``copies`` and ``launch`` lists (None when
    all are empty). A bad row raises a one-line ``ValueError``: ``<source>: kernels[3]: <the problem>``."""
    from turnip.ops import OPS

    kern = tuple(_kernel_point(source, i, r) for i, r in enumerate(_rows(source, "kernels", kernels)))
    cop = tuple(_copy_point(source, i, r) for i, r in enumerate(_rows(source, "copies", copies)))
    lau = tuple(LaunchPoint(_string(f"{source}: launch[{i}]", r, "op", OPS),
                            int(_number(f"{source}: launch[{i}]", r, "ns", 0, whole=True)),
                            int(_number(f"{source}: launch[{i}]", r, "n", 1, whole=True)))
                for i, r in enumerate(_rows(source, "launch", launch)))  # fmt: skip
    _no_duplicates(source, "kernels", [(k.op, k.match, k.dtype, k.work) for k in kern],
                   "op {}, match {!r}, dtype {}, work {:g}")  # fmt: skip
    _no_duplicates(source, "copies", [(c.kind, c.contended, c.nbytes) for c in cop],
                   "kind {}, contended {}, nbytes {}")  # fmt: skip
    _no_duplicates(source, "launch", [(x.op,) for x in lau], "op {}")
    return CostTables(kern, cop, lau) if kern or cop or lau else None


def _rows(source: str, name: str, rows) -> list[dict]:
    if rows is None:
        return []
    if not isinstance(rows, list):
        raise ValueError(f"{source}: {name} must be a list of rows, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        where = f"{source}: {name}[{i}]"
        if not isinstance(r, dict):
            raise ValueError(f"{where}: a row is an object with fields {', '.join(_REQUIRED[name])}; "
                             f"got {type(r).__name__}")  # fmt: skip
        for f in _REQUIRED[name]:
            if f not in r:
                raise ValueError(f"{where}: missing field {f!r}")
        extra = sorted(set(r) - set(_REQUIRED[name]) - set(_OPTIONAL[name]))
        if extra:
            raise ValueError(f"{where}: unknown field {extra[0]!r} (fields: "
                             f"{', '.join(_REQUIRED[name] + _OPTIONAL[name])})")  # fmt: skip
    return rows


def _number(where: str, r: dict, f: str, least_ok: float | None = None, whole: bool = False) -> float:
    """A finite number > 0 (or >= ``least_ok`` when given); ``whole``: an integer value."""
    v = r[f]
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > 0 if least_ok is None else v >= least_ok)
    ok = ok and (not whole or float(v).is_integer())
    if not ok:
        need = "a whole number" if whole else "a finite number"
        need += " > 0" if least_ok is None else f" >= {least_ok:g}"
        raise ValueError(f"{where}: field {f!r} is {v!r}; it must be {need}")
    return v


def _string(where: str, r: dict, f: str, choices=None) -> str:
    v = r[f]
    if not isinstance(v, str) or not v:
        raise ValueError(f"{where}: field {f!r} is {v!r}; it must be a non-empty string")
    if choices is not None and v not in choices:
        raise ValueError(f"{where}: field {f!r} is {v!r}: unknown {f}; known: {', '.join(sorted(choices))}")
    return v


def _kernel_point(source: str, i: int, r: dict) -> KernelPoint:
    from turnip.ops import OPS

    where = f"{source}: kernels[{i}]"
    op = _string(where, r, "op", OPS)
    match = _string(where, r, "match")
    if match != "*" and op != "einsum":
        raise ValueError(f"{where}: field 'match' is {match!r}; only einsum rows name subscripts, use '*'")
    if match != "*" and "->" not in match:
        raise ValueError(f"{where}: field 'match' is {match!r}; it must be einsum subscripts (a,b->c) or '*'")
    shape = r.get("shape", "")
    if not isinstance(shape, str):
        raise ValueError(f"{where}: field 'shape' is {shape!r}; it must be a string (informational)")
    return KernelPoint(op, match, _string(where, r, "dtype", DTYPES), float(_number(where, r, "work")),
                       float(_number(where, r, "ns_mean")), float(_number(where, r, "ns_sd", 0.0)),
                       int(_number(where, r, "n", 1, whole=True)), shape)  # fmt: skip


def _copy_point(source: str, i: int, r: dict) -> CopyPoint:
    where = f"{source}: copies[{i}]"
    kind = _string(where, r, "kind", COPY_KINDS)
    if not isinstance(r["contended"], bool):
        raise ValueError(f"{where}: field 'contended' is {r['contended']!r}; it must be true or false")
    return CopyPoint(kind, r["contended"], int(_number(where, r, "nbytes", whole=True)),
                     float(_number(where, r, "ns_mean")), float(_number(where, r, "ns_sd", 0.0)),
                     int(_number(where, r, "n", 1, whole=True)))  # fmt: skip


def _no_duplicates(source: str, name: str, keys: list[tuple], fmt: str) -> None:
    seen: dict = {}
    for i, k in enumerate(keys):
        if k in seen:
            raise ValueError(f"{source}: {name}[{i}]: duplicate of {name}[{seen[k]}] ({fmt.format(*k)})")
        seen[k] = i
