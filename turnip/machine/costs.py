"""Per-vertex costs of a plan on a machine: engine class, floor durations and host launch costs.

A floor is a vertex's duration with no noise and no contention: every run takes at least that long, so the
lower bound (``turnip.machine.bound``) is built from floors and the simulator's draws never go below them
(``sim.timing``). Two models give a kernel's floor:

- **measured tables** (``MachineProfile.tables``, ``docs/profile.md``): the table of (op, einsum
  subscripts, dtype), else (op, ``*``, dtype), interpolated at the vertex's work (``vertex_work``) gives the
  mean time m and the spread cv; the floor is m / (1 + kernel_excess_mean), so the mean of the draws is m.
  Host<->device and GPU<->GPU copies the same way over bytes, per (kind, contended);
- otherwise **roofline x efficiency**: max(flops / peak, bytes touched / HBM bandwidth) / efficiency, the
  efficiency per op from ``kernel_calibration`` (CSV) or the profile's constant; copies: latency + bytes /
  bandwidth.

An op measured by neither (a training op on a profile calibrated on prefills, an einsum of other subscripts)
borrows from the measured ops of its **cost class** (``cost_class``: ``gemm``, ``attention`` or ``memory``)
and dtype: the median of their tables at its own work (never below the roofline at full efficiency), else the
median of their calibration efficiencies, else the profile's ``kernel_efficiency``. The class also picks the
host launch cost (``gemm_launch_ns``, ``attn_launch_ns``, ``kernel_launch_ns``).

``VertexCosts`` holds the arrays for one plan and one profile; it owns nothing else and never changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from turnip.machine.profile import MachineProfile
from turnip.memgraph.plan import KIND_KERNEL, KIND_OFFLOAD, KIND_TRANSFER, MemGraph

# engine classes of a vertex
ENG_KERNEL, ENG_H2D, ENG_D2H, ENG_P2P = 0, 1, 2, 3
COPY_KIND = {ENG_H2D: "h2d", ENG_D2H: "d2h", ENG_P2P: "p2p"}
# GEMMs and attention (forward and backward) are flop-bound; every other op is memory-bound
COST_CLASS = {"einsum": "gemm", "sdpa": "attention", "sdpa_bwd": "attention"}
WORK_FLOPS = tuple(COST_CLASS)  # ops whose work is flops; the others: bytes read plus written


def clock_slowdowns(prof: MachineProfile) -> dict[str, float]:
    """Per cost class (``cost_class``), how many times slower its kernels run at the clock the power limit
    sustains (throttle 1 of the shared-clock model: ``power_slow_gemm``, ``power_slow_attn``,
    ``power_slow_memory``); 1.0 each where the profile models no clock."""
    if prof.power_slow_gemm <= 0.0:
        return {"gemm": 1.0, "attention": 1.0, "memory": 1.0}
    return {"gemm": prof.power_slow_gemm, "attention": prof.power_slow_attn, "memory": prof.power_slow_memory}


def cost_class(op: str) -> str:
    """``gemm`` (einsum), ``attention`` (sdpa, sdpa_bwd) or ``memory`` (every other op): whose measurements
    an op without its own borrows, and which host launch cost it pays."""
    return COST_CLASS.get(op, "memory")


def work_of(op: str) -> str:
    """What a kernel table's ``work`` measures for ``op``: ``"flops"`` (``mg.flops[v]``) for einsum, sdpa
    and sdpa_bwd, ``"io_nbytes"`` (``mg.io_nbytes()[v]``: bytes read plus written) for every other op."""
    return "flops" if op in WORK_FLOPS else "io_nbytes"


def vertex_work(mg: MemGraph) -> np.ndarray:
    """Every vertex's work in the sense of ``work_of`` (float64); what calibration records and tables read."""
    flops = np.asarray(mg.flops, dtype=np.float64)
    io = mg.io_nbytes().astype(np.float64)
    return np.where([work_of(op) == "flops" for op in mg.op], flops, io)


def vertex_match(mg: MemGraph) -> list[str]:
    """Every vertex's table ``match``: an einsum's subscripts, ``*`` for any other vertex."""
    return [p.get("subscripts", "*") if op == "einsum" else "*" for op, p in zip(mg.op, mg.params, strict=True)]


def engine_class(mg: MemGraph) -> np.ndarray:
    k = mg.kind
    e = np.full(mg.n, ENG_H2D, dtype=np.int8)
    e[k == KIND_KERNEL] = ENG_KERNEL
    e[k == KIND_OFFLOAD] = ENG_D2H
    e[k == KIND_TRANSFER] = ENG_P2P
    return e


def roofline_ns(mg: MemGraph, prof: MachineProfile) -> np.ndarray:
    """max(flops / peak, bytes touched / HBM bandwidth) in float ns: every vertex at full efficiency."""
    peak = np.array([prof.fp32_flops_per_s if d == "fp32" else prof.fp16_flops_per_s for d in mg.dtype])
    return np.maximum(mg.flops / peak, mg.io_nbytes() / prof.hbm_bytes_per_s) * 1e9


def kernel_floor_ns(mg: MemGraph, prof: MachineProfile) -> np.ndarray:
    """Roofline: max(flops / peak, bytes touched / HBM bandwidth) / efficiency, at least kernel_min_ns."""
    t = roofline_ns(mg, prof) / kernel_efficiency(mg, prof)
    return np.maximum(np.rint(t), prof.kernel_min_ns).astype(np.int64)


def load_calibration(name: str) -> dict[tuple[str, str, str], float]:
    """(op, match, dtype) -> efficiency from a CSV in ``turnip/machine/profiles/`` (or a path). ``match`` is
    an einsum's subscripts, or ``*`` for any vertex of that op."""
    import csv

    p = Path(name)
    if not p.exists():
        p = Path(__file__).parent / "profiles" / name
    with open(p, newline="") as f:
        return {(r["op"], r["match"], r["dtype"]): float(r["efficiency"]) for r in csv.DictReader(f)}


def kernel_efficiency(mg: MemGraph, prof: MachineProfile) -> np.ndarray:
    """Per-vertex efficiency: the calibration's entry for (op, subscripts) or (op, *), else the median of
    its entries of the vertex's cost class and dtype, else the profile's ``kernel_efficiency``."""
    return _calibrated(mg, prof)[0]


def _calibrated(mg: MemGraph, prof: MachineProfile) -> tuple[np.ndarray, np.ndarray]:
    """``kernel_efficiency`` and, per vertex, whether the calibration has an entry for its own op."""
    out, own = np.full(mg.n, prof.kernel_efficiency), np.zeros(mg.n, dtype=bool)
    if not prof.kernel_calibration:
        return out, own
    cal = load_calibration(prof.kernel_calibration)
    pooled: dict[tuple[str, str], list[float]] = {}
    for (op, _, dt), e in cal.items():
        if e:
            pooled.setdefault((cost_class(op), dt), []).append(e)
    median = {k: float(np.median(v)) for k, v in pooled.items()}
    for v, (op, dt, par) in enumerate(zip(mg.op, mg.dtype, mg.params, strict=True)):
        e = cal.get((op, par.get("subscripts", "*"), dt)) or cal.get((op, "*", dt))
        own[v] = bool(e)
        out[v] = e if e else median.get((cost_class(op), dt), prof.kernel_efficiency)
    return out, own


def launch_ns(mg: MemGraph, prof: MachineProfile, eng: np.ndarray | None = None) -> np.ndarray:
    """Host time to issue each vertex: a kernel its op's measured launch time (the profile's ``launch``
    table), else its class's (GEMM, attention, other kernel: ``cost_class``); a copy ``copy_launch_ns``;
    0 for resident inputs."""
    eng = engine_class(mg) if eng is None else eng
    cls = [cost_class(op) for op in mg.op]
    gemm = np.array([c == "gemm" for c in cls], dtype=bool)
    attn = np.array([c == "attention" for c in cls], dtype=bool)
    gemm_ns = prof.kernel_launch_ns if prof.gemm_launch_ns is None else prof.gemm_launch_ns
    attn_ns = prof.kernel_launch_ns if prof.attn_launch_ns is None else prof.attn_launch_ns
    kernel_launch = np.where(gemm, gemm_ns, np.where(attn, attn_ns, prof.kernel_launch_ns))
    if prof.tables is not None and prof.tables.launch:  # measured per op
        own = {op: prof.tables.launch_ns(op) for op in set(mg.op)}
        kernel_launch = np.array([own[op] if own[op] is not None else x for op, x in zip(mg.op, kernel_launch,
                                                                                          strict=True)])  # fmt: skip
    launch = np.where(eng == ENG_KERNEL, kernel_launch, prof.copy_launch_ns)
    return np.where(mg.preloaded(), 0, launch).astype(np.int64)


class HostCosts(NamedTuple):
    """One run's host costs (ns): ``launch`` issue time per vertex; per completion ``handle`` plus
    ``handle_per_cmd`` per command it hands back to issue; ``completion`` the delay until an idle host loop
    sees a completion and ``poll`` more per vertex then in flight."""

    launch: np.ndarray
    handle: int
    handle_per_cmd: int
    completion: int
    poll: int


def host_costs(costs: VertexCosts, host: float = 1.0) -> HostCosts:
    """One run's host costs at host speed factor ``host`` (``MachineProfile.host_excess_sd``), each scaled and
    truncated to whole ns; the simulator charges them, the lower bound counts them."""
    p = costs.prof
    fields = (p.handle_ns, p.handle_per_cmd_ns, p.completion_ns, p.completion_per_inflight_ns)
    if host == 1.0:
        return HostCosts(costs.launch_ns, *fields)
    return HostCosts((costs.launch_ns * host).astype(np.int64), *(int(x * host) for x in fields))


def handed_over(costs: VertexCosts) -> int:
    """Commands a run issues in answer to a completion, at least: every command that waits for another command
    (a resident input is no command: it completes nothing in a run), and every command but those issued at the
    run's start, which hold a stream slot each (``streams_per_gpu`` per GPU) until they are done."""
    mg, sent = costs.mg, ~costs.preloaded
    owner = np.repeat(np.arange(mg.n), np.diff(mg.dep_ptr))
    waits = np.bincount(owner[sent[mg.dep_src]], minlength=mg.n) > 0
    return max(int((sent & waits).sum()), int(sent.sum()) - costs.prof.streams_per_gpu * max(mg.n_gpus, 1))


def host_busy_ns(costs: VertexCosts, host: float = 1.0) -> int:
    """The host thread's busy time in one run at host speed factor ``host``: every vertex's issue cost plus the
    handling of its completion (resident inputs: neither), as the simulator charges them (per-command handling
    counted for ``handed_over`` commands: at most ``streams_per_gpu`` per GPU short of a run's); on
    hardware ``turnip.runtime.RunResult.host_cost_ns`` sums the same two (polling is in neither)."""
    h = host_costs(costs, host)
    return int(h.launch.sum()) + int((~costs.preloaded).sum()) * h.handle + handed_over(costs) * h.handle_per_cmd


def host_factor_for(costs: VertexCosts, host_ms: float) -> float:
    """The host speed factor at which the host thread is busy ``host_ms`` per run (``host_busy_ns`` is linear in
    it): a measured run's own host time, for the simulator's ``host``; at least 1e-3."""
    return max(host_ms * 1e6 / host_busy_ns(costs, 1.0), 1e-3)


OVERLAP_SHORT_NS, OVERLAP_LONG_NS = 10_000, 1_000_000  # knots of the concurrency factor (profile fields)


def overlap_factor(floor_ns: np.ndarray, prof: MachineProfile) -> np.ndarray:
    """Duration factor of a kernel that starts behind another on its GPU: ``kernel_overlap_short`` at a floor
    of ``OVERLAP_SHORT_NS`` or less, ``kernel_overlap_long`` at ``OVERLAP_LONG_NS`` or more, linear in
    log(floor) between."""
    x = np.log(np.maximum(np.asarray(floor_ns, dtype=np.float64), 1.0) / OVERLAP_SHORT_NS)
    x = np.clip(x / np.log(OVERLAP_LONG_NS / OVERLAP_SHORT_NS), 0.0, 1.0)
    return prof.kernel_overlap_short + x * (prof.kernel_overlap_long - prof.kernel_overlap_short)


def link_rates(prof: MachineProfile) -> tuple[tuple[float, float], tuple[float, float]]:
    """Host link rates in bytes per ns, (h2d, d2h): alone, and each direction's share when both run."""
    both = prof.pcie_both_bytes_per_s / (prof.h2d_bytes_per_s + prof.d2h_bytes_per_s)
    solo = (prof.h2d_bytes_per_s / 1e9, prof.d2h_bytes_per_s / 1e9)
    return solo, (min(1.0, both) * solo[0], min(1.0, both) * solo[1])


def excess_mean(prof: MachineProfile, contended: bool = False) -> dict[int, float]:
    """The profile's mean excess (duration / floor - 1) per engine class."""
    p = prof
    if contended:
        return {ENG_KERNEL: p.kernel_contended_excess_mean, ENG_H2D: p.h2d_contended_excess_mean,
                ENG_D2H: p.d2h_contended_excess_mean, ENG_P2P: p.p2p_excess_mean}  # fmt: skip
    return {ENG_KERNEL: p.kernel_excess_mean, ENG_H2D: p.h2d_excess_mean, ENG_D2H: p.d2h_excess_mean,
            ENG_P2P: p.p2p_excess_mean}  # fmt: skip


class VertexCosts:
    """Floors, launch costs and measured spread of every vertex of one plan on one machine profile.

    Arrays (one entry per vertex): ``eng`` engine class; ``preloaded`` resident inputs (cost nothing in a
    run); ``nbytes`` bytes a copy moves (0 when preloaded); ``kernel_ns`` kernel floors; ``launch_ns`` host
    issue cost; ``link_nbytes`` a host<->device copy's occupancy of its link in bytes at the solo rate
    (its floor less ``copy_latency_ns``, times the rate: ``nbytes`` without a table); ``table_mean_ns`` /
    ``table_cv`` the measured mean and cv where a table covers the vertex (``covered``), else NaN;
    ``borrowed`` kernels covered by the tables of other ops of their cost class (nothing measured of their
    own); ``contended_mean_ns`` / ``contended_cv`` the same from the contended copy tables (host link copies);
    ``copy_floor_ns`` copies' floors in float ns; ``roofline_copy_ns`` latency + bytes / bandwidth;
    ``overlap`` the duration factor of a kernel that starts behind another on its GPU (``overlap_factor``;
    1 for copies)."""

    def __init__(self, mg: MemGraph, prof: MachineProfile):
        self.mg, self.prof = mg, prof
        self.eng = e = engine_class(mg)
        self.preloaded = mg.preloaded()
        self.nbytes = np.where(self.preloaded, 0, mg.out_nbytes).astype(np.int64)  # resident: moved at load
        self.launch_ns = launch_ns(mg, prof, e)
        n = mg.n
        self.table_mean_ns, self.table_cv = np.full(n, np.nan), np.full(n, np.nan)
        self.contended_mean_ns, self.contended_cv = np.full(n, np.nan), np.full(n, np.nan)
        self.borrowed = np.zeros(n, dtype=bool)
        if prof.tables is not None:
            self._read_tables()
        self.covered = ~np.isnan(self.table_mean_ns)
        mu = excess_mean(prof)
        mu_v = np.array([mu[c] for c in range(4)])[e]
        mu_v = np.where(e == ENG_KERNEL, (1 + mu_v) * (1 + prof.run_excess_mean) - 1, mu_v)  # the run's factor too
        roof = kernel_floor_ns(mg, prof)
        table_floor = self.table_mean_ns / (1 + mu_v)
        table_kernel = np.maximum(np.rint(table_floor), prof.kernel_min_ns)  # no floor below the smallest kernel
        self.kernel_ns = np.where(self.covered & (e == ENG_KERNEL), table_kernel, roof).astype(np.int64)
        self.overlap = np.where(e == ENG_KERNEL, overlap_factor(self.kernel_ns, prof), 1.0)
        # copies: floor (float ns) and link occupancy
        lat = np.where(e == ENG_P2P, prof.p2p_latency_ns, prof.copy_latency_ns).astype(np.float64)
        rate = np.select([e == ENG_H2D, e == ENG_D2H], [prof.h2d_bytes_per_s, prof.d2h_bytes_per_s],
                         prof.p2p_bytes_per_s)  # fmt: skip
        self.roofline_copy_ns = lat + self.nbytes * 1e9 / rate
        host_link = (e == ENG_H2D) | (e == ENG_D2H)
        tfloor = np.where(host_link, np.fmax(table_floor, lat), table_floor)  # the engine adds the latency
        self.copy_floor_ns = np.where(self.covered, tfloor, self.roofline_copy_ns)
        self.copy_floor_ns[self.preloaded | (e == ENG_KERNEL)] = 0.0
        self.link_nbytes = np.where(host_link & self.covered, (self.copy_floor_ns - lat) * rate / 1e9, self.nbytes)

    def _read_tables(self) -> None:
        mg, t, e = self.mg, self.prof.tables, self.eng
        work = vertex_work(mg)
        kern = np.flatnonzero(e == ENG_KERNEL)
        groups: dict = {}
        match = vertex_match(mg)
        for v in kern.tolist():
            groups.setdefault((mg.op[v], match[v], mg.dtype[v]), []).append(v)
        own_csv = _calibrated(mg, self.prof)[1]
        roof = roofline_ns(mg, self.prof)
        for (op, m, dt), vs in groups.items():
            vs = np.asarray(vs)
            c = t.kernel_curve(op, m, dt)
            if c is not None:
                self.table_mean_ns[vs] = np.maximum(c.mean_ns(work[vs]), self.prof.kernel_min_ns)
                self.table_cv[vs] = c.cv_at(work[vs])
                continue
            vs = vs[~own_csv[vs]]  # an op's own calibration entry beats other ops' tables
            cls = cost_class(op)
            same = t.kernel_curves(dt, lambda o, cls=cls: cost_class(o) == cls)
            if same and len(vs):  # the median of its class's tables at its work, never above full efficiency
                mean = np.median([s.mean_ns(work[vs]) for s in same], axis=0)
                self.table_mean_ns[vs] = np.maximum(np.maximum(mean, roof[vs]), self.prof.kernel_min_ns)
                self.table_cv[vs] = np.median([s.cv_at(work[vs]) for s in same], axis=0)
                self.borrowed[vs] = True
        for cls, kind in COPY_KIND.items():
            vs = np.flatnonzero((e == cls) & ~self.preloaded)
            for contended, mean, cv in ((False, self.table_mean_ns, self.table_cv),
                                        (True, self.contended_mean_ns, self.contended_cv)):  # fmt: skip
                c = t.copy_curve(kind, contended)
                if c is not None and len(vs) and not (contended and cls == ENG_P2P):
                    mean[vs], cv[vs] = c.mean_ns(self.nbytes[vs]), c.cv_at(self.nbytes[vs])

    def alone_ns(self) -> np.ndarray:
        """No-noise, no-contention duration of every vertex alone on its engine (copies include latency)."""
        e = self.eng
        out = self.kernel_ns.copy()
        copy = e != ENG_KERNEL
        out[copy] = self.copy_floor_ns[copy]  # truncated: never above what the simulator's copies take
        out[self.preloaded] = 0
        return out

    def floor_ns(self) -> np.ndarray:
        """The least any run takes for every vertex: ``alone_ns``, for a kernel that may overlap another
        (``overlap`` < 1) at that factor."""
        return np.rint(self.alone_ns() * np.minimum(self.overlap, 1.0)).astype(np.int64)
