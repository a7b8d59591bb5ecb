"""Timing model: per-vertex floor durations (roofline x efficiency) and seeded jitter draws.

A sampled duration is ``floor * (1 + e)`` with ``e >= 0`` (lognormal with the profile's mean and standard
deviation for the vertex kind, "contended" variants when copies overlap), so no draw is below the floor and
the lower bound built from floors holds for every run. Copies also draw rare Pareto stalls. All draws for a
run are taken up front, per vertex, from one ``np.random.Generator``: runs of different policies with the
same seed see the same draws (common random numbers), which makes their comparison paired.
``mean_only`` replaces each draw by its expectation: no variance at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.profile import MachineProfile
from turnip.memgraph.plan import KIND_KERNEL, KIND_OFFLOAD, KIND_TRANSFER, MemGraph

# engine classes of a vertex
ENG_KERNEL, ENG_H2D, ENG_D2H, ENG_P2P = 0, 1, 2, 3


def engine_class(mg: MemGraph) -> np.ndarray:
    k = mg.kind
    e = np.full(mg.n, ENG_H2D, dtype=np.int8)
    e[k == KIND_KERNEL] = ENG_KERNEL
    e[k == KIND_OFFLOAD] = ENG_D2H
    e[k == KIND_TRANSFER] = ENG_P2P
    return e


def kernel_floor_ns(mg: MemGraph, prof: MachineProfile) -> np.ndarray:
    """Roofline: max(flops / peak, bytes touched / HBM bandwidth) / efficiency, at least kernel_min_ns."""
    peak = np.array([prof.fp32_flops_per_s if d == "fp32" else prof.fp16_flops_per_s for d in mg.dtype])
    t = np.maximum(mg.flops / peak, mg.io_nbytes() / prof.hbm_bytes_per_s) / kernel_efficiency(mg, prof)
    return np.maximum(np.rint(t * 1e9), prof.kernel_min_ns).astype(np.int64)


def load_calibration(name: str) -> dict[tuple[str, str, str], float]:
    """(op, match, dtype) -> efficiency from a CSV in ``sim/profiles/`` (or a path). ``match`` is an einsum's
    subscripts, or ``*`` for any vertex of that op."""
    import csv

    p = Path(name)
    if not p.exists():
        p = Path(__file__).parent / "profiles" / name
    with open(p, newline="") as f:
        return {(r["op"], r["match"], r["dtype"]): float(r["efficiency"]) for r in csv.DictReader(f)}


def kernel_efficiency(mg: MemGraph, prof: MachineProfile) -> np.ndarray:
    """Per-vertex efficiency: the calibration's entry for (op, subscripts) or (op, *), else the profile's."""
    if not prof.kernel_calibration:
        return np.full(mg.n, prof.kernel_efficiency)
    cal = load_calibration(prof.kernel_calibration)
    out = np.empty(mg.n)
    for v, (op, dt, par) in enumerate(zip(mg.op, mg.dtype, mg.params, strict=True)):
        e = cal.get((op, par.get("subscripts", "*"), dt)) or cal.get((op, "*", dt))
        out[v] = e if e else prof.kernel_efficiency
    return out


@dataclass(slots=True)
class Draws:
    """One run's random factors per vertex: (1 + e) alone / contended, and extra stall ns for copies."""

    factor: np.ndarray
    factor_contended: np.ndarray
    stall_ns: np.ndarray


class TimingModel:
    """Floors and jitter for one memgraph on one machine profile."""

    def __init__(self, mg: MemGraph, prof: MachineProfile):
        self.mg, self.prof = mg, prof
        self.eng = engine_class(mg)
        self.preloaded = mg.preloaded()
        self.nbytes = np.where(self.preloaded, 0, mg.out_nbytes).astype(np.int64)  # resident: moved at load
        self.kernel_ns = kernel_floor_ns(mg, prof)
        gemm = np.array([op == "einsum" for op in mg.op], dtype=bool)
        attn = np.array([op == "sdpa" for op in mg.op], dtype=bool)
        gemm_ns = prof.kernel_launch_ns if prof.gemm_launch_ns is None else prof.gemm_launch_ns
        attn_ns = prof.kernel_launch_ns if prof.attn_launch_ns is None else prof.attn_launch_ns
        kernel_launch = np.where(gemm, gemm_ns, np.where(attn, attn_ns, prof.kernel_launch_ns))
        launch = np.where(self.eng == ENG_KERNEL, kernel_launch, prof.copy_launch_ns)
        self.launch_ns = np.where(self.preloaded, 0, launch).astype(np.int64)  # host time to issue each vertex
        p = prof
        self._params = {
            ENG_KERNEL: ((p.kernel_excess_mean, p.kernel_excess_sd),
                         (p.kernel_contended_excess_mean, p.kernel_contended_excess_sd)),
            ENG_H2D: ((p.h2d_excess_mean, p.h2d_excess_sd),
                      (p.h2d_contended_excess_mean, p.h2d_contended_excess_sd)),
            ENG_D2H: ((p.d2h_excess_mean, p.d2h_excess_sd),
                      (p.d2h_contended_excess_mean, p.d2h_contended_excess_sd)),
            ENG_P2P: ((p.p2p_excess_mean, p.p2p_excess_sd), (p.p2p_excess_mean, p.p2p_excess_sd)),
        }  # fmt: skip

    def floor_ns(self) -> np.ndarray:
        """No-noise, no-contention duration of every vertex on its engine (copies include latency)."""
        p, e, nb = self.prof, self.eng, self.nbytes
        out = self.kernel_ns.copy()
        out[e == ENG_H2D] = p.copy_latency_ns + nb[e == ENG_H2D] * 1e9 / p.h2d_bytes_per_s
        out[e == ENG_D2H] = p.copy_latency_ns + nb[e == ENG_D2H] * 1e9 / p.d2h_bytes_per_s
        out[e == ENG_P2P] = p.p2p_latency_ns + nb[e == ENG_P2P] * 1e9 / p.p2p_bytes_per_s
        out[self.preloaded] = 0
        return out

    def mean_ns(self) -> np.ndarray:
        """Expected uncontended duration (floor x mean factor + mean stall): priorities and reports."""
        d = self.draws(None)
        copy = self.eng != ENG_KERNEL
        return np.rint(self.floor_ns() * d.factor + np.where(copy, d.stall_ns, 0)).astype(np.int64)

    def draws(self, rng: np.random.Generator | None) -> Draws:
        """Per-vertex factors for one run; ``rng=None`` gives the means (the ``--mean-only`` mode)."""
        n, e = self.mg.n, self.eng
        f, fc = np.ones(n), np.ones(n)
        z = rng.standard_normal((2, n)) if rng is not None else None
        for cls, ((m, s), (mc, sc)) in self._params.items():
            sel = e == cls
            f[sel] = 1 + _excess(m, s, None if z is None else z[0, sel])
            fc[sel] = 1 + _excess(mc, sc, None if z is None else z[1, sel])
        p = self.prof
        copy = e != ENG_KERNEL
        if rng is None:
            stall_mean = p.stall_scale_ns * p.stall_alpha / (p.stall_alpha - 1) if p.stall_alpha > 1 else 0
            stall = np.where(copy, p.stall_prob * stall_mean, 0.0)
        else:
            hit = copy & (rng.random(n) < p.stall_prob)
            stall = np.where(hit, p.stall_scale_ns * (1 + rng.pareto(p.stall_alpha, n)), 0.0)
        return Draws(f, fc, np.rint(stall).astype(np.int64))


def _excess(mean: float, sd: float, z: np.ndarray | None) -> np.ndarray | float:
    """Lognormal with the given mean and sd at standard-normal draws ``z`` (None: the mean)."""
    if mean <= 0:
        return 0.0 if z is None else np.zeros(len(z))
    if z is None or sd <= 0:
        return mean if z is None else np.full(len(z), mean)
    s2 = np.log1p((sd / mean) ** 2)
    return np.exp(np.log(mean) - s2 / 2 + np.sqrt(s2) * z)
