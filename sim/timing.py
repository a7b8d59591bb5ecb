"""Timing model: seeded jitter around the per-vertex floors of ``turnip.machine.costs``.

A sampled duration is ``floor * (1 + e)`` with ``e >= 0`` (lognormal with the profile's mean and standard
deviation for the vertex kind, "contended" variants when copies overlap), so no draw is below the floor and
the lower bound built from floors holds for every run. Where a measured table covers a vertex
(``MachineProfile.tables``), the sd of ``e`` is the table's cv x (1 + mean), so the spread is the one
measured at that shape, and a host link copy that starts while the other direction is busy takes the
contended table's time (never less than the engine's shared-link rate gives). Copies also draw rare Pareto
stalls. All draws for a run are taken up front, per vertex, from one ``np.random.Generator``: runs of
different policies with the same seed see the same draws (common random numbers), which makes their
comparison paired. Two run-wide factors are drawn last: the host's speed (every host cost) and the host
link's (every host<->GPU copy's byte time), lognormal with median 1 and correlated as the profile says.
``mean_only`` replaces each draw by its expectation: no variance at all.

The engine (``sim.engine``) runs a copy's bytes x factor through its link at the solo or shared rate and
adds the latency; ``draws`` turns each duration factor into that byte factor, so the engine needs nothing
table-specific.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from turnip.machine.costs import ENG_D2H, ENG_H2D, ENG_KERNEL, ENG_P2P, VertexCosts, link_rates, roofline_ns
from turnip.machine.profile import MachineProfile
from turnip.memgraph.plan import MemGraph


@dataclass(slots=True)
class Draws:
    """One run's random factors per vertex as the engine applies them: alone / contended (kernels and
    P2P: duration / floor; host link copies: bytes to push / bytes), and extra stall ns for copies."""

    factor: np.ndarray
    factor_contended: np.ndarray
    stall_ns: np.ndarray
    host: float = 1.0  # the run's host speed factor: every host cost is this times the profile's
    link_z: float = 0.0  # the link's own standard-normal draw (``TimingModel.link_factor``)


class TimingModel(VertexCosts):
    """Floors and jitter for one memgraph on one machine profile."""

    def __init__(self, mg: MemGraph, prof: MachineProfile):
        super().__init__(mg, prof)
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

    def p2p_slowdowns(self, slowdown: float) -> list[float]:
        """Per vertex, a kernel's slowdown beside a GPU<->GPU copy: 1 + (``slowdown`` - 1) x the memory share of its
        roofline (bytes touched over HBM bandwidth, against that or its flops over peak, whichever is longer);
        built once per plan."""
        cached = getattr(self, "_p2p_slow", None)
        if cached is None or cached[0] != slowdown:
            mem, roof = self.mg.io_nbytes() * 1e9 / self.prof.hbm_bytes_per_s, roofline_ns(self.mg, self.prof)
            share = np.divide(mem, roof, out=np.ones(self.mg.n), where=roof > 0)
            cached = self._p2p_slow = (slowdown, (1.0 + (slowdown - 1.0) * share).tolist())
        return cached[1]

    def mean_ns(self) -> np.ndarray:
        """Expected uncontended duration (floor x mean factor + mean stall): priorities and reports."""
        x, _, stall = self._excess(None)
        copy = self.eng != ENG_KERNEL
        return np.rint(self.alone_ns() * x + np.where(copy, stall, 0)).astype(np.int64)

    def draws(self, rng: np.random.Generator | None) -> Draws:
        """Per-vertex factors for one run; ``rng=None`` gives the means (the ``--mean-only`` mode)."""
        x, xc, stall = self._excess(rng)
        f, fc = self._engine_factors(x, xc)
        p = self.prof  # the run-wide factors last, each only where its spread is > 0: a profile without link
        # spread draws what it drew before
        z = rng.standard_normal() if rng is not None and p.host_excess_sd > 0 else 0.0
        z2 = rng.standard_normal() if rng is not None and p.link_excess_sd > 0 else 0.0
        return Draws(f, fc, stall, float(np.exp(p.host_excess_sd * z)), float(z2))

    def link_factor(self, host: float, link_z: float) -> float:
        """The run's host link time factor exp(link_excess_sd x z') at host speed factor ``host``: z' = corr z +
        sqrt(1 - corr^2) ``link_z``, z the host's standard-normal value (log(host) / host_excess_sd; 0 without
        host spread) and corr ``host_link_corr``; so a given host factor moves the link as a drawn one would."""
        p = self.prof
        if p.link_excess_sd <= 0:
            return 1.0
        c, z = (p.host_link_corr, np.log(host) / p.host_excess_sd) if p.host_excess_sd > 0 else (0.0, 0.0)
        return float(np.exp(p.link_excess_sd * (c * z + np.sqrt(1.0 - c * c) * link_z)))

    def _classes(self) -> list[tuple]:
        """Per engine class with vertices: its parameters, its vertices, those a table covers and the sd of their
        excess, those a contended table covers and theirs (built once: every run draws over the same sets)."""
        if getattr(self, "_by_class", None) is None:
            e, has_c = self.eng, ~np.isnan(self.contended_cv)
            out = []
            for cls, ((m, s), (mc, sc)) in self._params.items():
                sel = e == cls
                if sel.any():
                    t, tc = np.flatnonzero(sel & self.covered), np.flatnonzero(sel & has_c)
                    sd_t, sd_tc = self.table_cv[t] * (1 + m), self.contended_cv[tc] * (1 + mc)
                    out.append((m, s, mc, sc, np.flatnonzero(sel), t, sd_t, tc, sd_tc))
            self._by_class = out
            self._kernels = np.flatnonzero(e == ENG_KERNEL)
        return self._by_class

    def _excess(self, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Duration / floor alone and contended (1 + e), and stall ns, per vertex."""
        n, e = self.mg.n, self.eng
        f, fc = np.ones(n), np.ones(n)
        z = rng.standard_normal((2, n)) if rng is not None else None
        for m, s, mc, sc, sel, t, sd_t, tc, sd_tc in self._classes():
            f[sel] = 1 + _excess(m, s, None if z is None else z[0, sel])
            fc[sel] = 1 + _excess(mc, sc, None if z is None else z[1, sel])
            if z is not None:  # measured spread where a table covers the vertex (the means stay the profile's)
                if len(t):
                    f[t] = 1 + _excess(m, sd_t, z[0, t])
                if len(tc):
                    fc[tc] = 1 + _excess(mc, sd_tc, z[1, tc])
        p = self.prof
        if p.run_excess_mean > 0:  # one run-wide factor on every kernel (drawn only when modelled)
            z = None if rng is None else rng.standard_normal(1)
            r = 1 + float(np.asarray(_excess(p.run_excess_mean, p.run_excess_sd, z)).reshape(-1)[0])
            f[self._kernels] *= r
            fc[self._kernels] *= r
        copy = e != ENG_KERNEL
        if rng is None:
            stall_mean = p.stall_scale_ns * p.stall_alpha / (p.stall_alpha - 1) if p.stall_alpha > 1 else 0
            stall = np.where(copy, p.stall_prob * stall_mean, 0.0)
        else:
            hit = copy & (rng.random(n) < p.stall_prob)
            stall = np.where(hit, p.stall_scale_ns * (1 + rng.pareto(p.stall_alpha, n)), 0.0)
        return f, fc, np.rint(stall).astype(np.int64)

    def _engine_factors(self, x: np.ndarray, xc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Duration factors as the engine applies them. Without a table they are the same numbers. With one:
        P2P scales the roofline duration to the table's; a host link copy pushes ``bytes x factor`` at the
        solo rate (shared rate when contended) and then waits the latency, so its factor is the bytes that
        take (floor x (1 + e) - latency) at that rate, over its bytes; contended, at least its
        ``link_nbytes`` (so a copy whose contention ends early still takes its floor)."""
        f, fc = x.copy(), xc.copy()
        e, p = self.eng, self.prof
        floor = self.copy_floor_ns
        t = self.covered & (e == ENG_P2P) & (self.roofline_copy_ns > 0)
        f[t] = floor[t] * x[t] / self.roofline_copy_ns[t]
        solo, shared = link_rates(p)
        for cls, d in ((ENG_H2D, 0), (ENG_D2H, 1)):
            has_c = ~np.isnan(self.contended_mean_ns)
            sel = np.flatnonzero((e == cls) & (self.nbytes > 0) & (self.covered | has_c))
            if not len(sel):
                continue
            nb, link, lat = self.nbytes[sel].astype(np.float64), self.link_nbytes[sel], p.copy_latency_ns
            f[sel] = np.where(self.covered[sel], (floor[sel] * x[sel] - lat) * solo[d] / nb, x[sel])
            mc = self._params[cls][1][0]
            floor_c = np.fmax(self.contended_mean_ns[sel] / (1 + mc), floor[sel])  # never faster than alone
            push_c = np.where(has_c[sel], (floor_c * xc[sel] - lat) * shared[d], link * xc[sel])
            fc[sel] = np.maximum(push_c, link) / nb
        return f, fc


def _excess(mean: float, sd, z: np.ndarray | None) -> np.ndarray | float:
    """Lognormal with the given mean and sd (a number, or one per draw) at standard-normal draws ``z``
    (None: the mean)."""
    if mean <= 0:
        return 0.0 if z is None else np.zeros(len(z))
    if z is None:
        return mean
    if np.ndim(sd) == 0:
        if sd <= 0:
            return np.full(len(z), mean)
        s2 = np.log1p((sd / mean) ** 2)
        return np.exp(np.log(mean) - s2 / 2 + np.sqrt(s2) * z)
    s2 = np.log1p((np.maximum(sd, 0.0) / mean) ** 2)
    return np.exp(np.log(mean) - s2 / 2 + np.sqrt(s2) * z)
