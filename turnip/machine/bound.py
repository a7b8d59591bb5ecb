"""A plan's lower bound, and the floor estimate its simulator starts from.

``lower_bound``: a makespan no run beats, simulated or real: max(critical path, busiest GPU's kernel time, busiest
link). Each kernel counts the least of its model floor (``turnip.machine.costs``: a measured table or roofline /
efficiency, as the simulator draws it) and the datasheet roofline (flops at the dtype's peak, bytes touched at the
peak HBM rate: ``MachineProfile.peak_*``), so neither a kernel faster than its table nor one above the assumed
efficiency breaks it. Copies count their bytes at the links' peak rates (a host copy the fewer of its bytes and
``link_nbytes``, the bytes its measured floor moves at the link's rate), and the host behind the links
(``MachineProfile.host_*_total_bytes_per_s``) bounds the plan's host copies as a whole; with
``p2p_ports_serial`` each GPU's GPU<->GPU copies out, and in, add up. The critical path is of
those floors alone: no latencies, no host costs. ``host_ns`` (issuing and handling every command at the
profile's median costs) is reported beside it and not in the max: a faster host beats the medians.

``sustained_kernel_ns``: the busiest GPU's kernels at the clock its power limit sustains, an estimate reported
beside the bound: kernel-bound runs come within 0.85-0.89 of it on four H100s where they reach 0.6 of the bound.

``floor_estimate``: the estimate the simulator's power model starts a run from (``sim.engine._steady_guess``):
max(critical path of model floors + launch + completion + handling, per-GPU kernel floors, per-GPU link,
host busy time), each GPU's host link independent. An estimate, not a bound: runs beat it by a few percent.
"""

from __future__ import annotations

import numpy as np

from turnip.machine.costs import (
    ENG_D2H,
    ENG_H2D,
    ENG_KERNEL,
    ENG_P2P,
    VertexCosts,
    clock_slowdowns,
    cost_class,
    host_busy_ns,
    host_costs,
)
from turnip.machine.profile import MachineProfile, host_total_bytes_per_s
from turnip.sched.priority import critical_path_ns


def lower_bound(costs: VertexCosts, host: float = 1.0, link: float = 1.0) -> dict[str, int]:
    """The bound and its parts (all ns): ``critical_path_ns``, ``kernel_ns`` (busiest GPU), ``link_ns``
    (busiest host link, the host's links together, or busiest GPU<->GPU link), ``host_ns`` (issuing and
    handling all commands at the profile's host costs: reported, not in ``lower_bound_ns``). ``costs`` is a
    ``VertexCosts`` (the simulator's ``TimingModel`` is one); ``host``: a run's host speed factor, which scales
    ``host_ns``; ``link``: its host link time factor (host<->GPU copies push their bytes ``link`` times
    slower). What no factor changes is worked out once per ``costs`` (``_fixed``)."""
    f = _fixed(costs)
    parts = {
        "critical_path_ns": int(critical_path_ns(costs.mg, bound_floor_ns(costs, link)).max(initial=0)),
        "kernel_ns": f.kernel_ns,
        "link_ns": int(max(f.host_link_s * 1e9 * link, f.p2p_ns)),
        "host_ns": host_ns(costs, host),
    }
    parts["lower_bound_ns"] = max(parts["critical_path_ns"], parts["kernel_ns"], parts["link_ns"])
    return parts


class _Fixed:
    """The parts of a plan's bound that no run's factors change (``_fixed``): ``floor`` each vertex's bound floor
    (float ns) but a host copy's; the host copies (``copies``, not resident inputs), their bytes (``copy_nbytes``:
    ``link_nbytes`` where fewer) and their direction's rate (``copy_rate``); ``kernel_ns`` the busiest GPU's
    kernel floors; ``host_link_s`` the busiest host link, or the host's links together, at the links' peak
    rates (s, times ``link``); ``p2p_ns`` the busiest GPU<->GPU link (or port)."""

    __slots__ = ("floor", "copies", "copy_nbytes", "copy_rate", "kernel_ns", "host_link_s", "p2p_ns")

    def __init__(self, costs: VertexCosts):
        mg, p, e = costs.mg, costs.prof, costs.eng
        g, gpus = mg.gpu.astype(np.int64), max(mg.n_gpus, 1)
        peak = np.array([p.peak_fp32_flops_per_s if d == "fp32" else p.peak_fp16_flops_per_s for d in mg.dtype])
        roof = np.maximum(np.asarray(mg.flops, dtype=np.float64) / peak, mg.io_nbytes() / p.peak_hbm_bytes_per_s)
        out = np.minimum(costs.alone_ns() * np.minimum(costs.overlap, 1.0), roof * 1e9)
        p2p = np.minimum(costs.nbytes * 1e9 / p.p2p_bytes_per_s, costs.copy_floor_ns)
        out = np.where(e == ENG_P2P, p2p, out)
        nb = np.minimum(np.asarray(costs.link_nbytes, dtype=np.float64), costs.nbytes)
        host_copy = (e == ENG_H2D) | (e == ENG_D2H)
        out[host_copy | costs.preloaded] = 0.0
        self.floor, self.copies = out, np.flatnonzero(host_copy & ~costs.preloaded)
        self.copy_nbytes = nb[self.copies]
        self.copy_rate = np.where(e[self.copies] == ENG_H2D, p.h2d_bytes_per_s, p.d2h_bytes_per_s)
        kern = e == ENG_KERNEL
        self.kernel_ns = int(np.bincount(g[kern], np.floor(np.maximum(out[kern], 0.0)).astype(np.int64),
                                         minlength=gpus).max(initial=0))  # fmt: skip
        h2d = np.bincount(g[e == ENG_H2D], nb[e == ENG_H2D], minlength=gpus)
        d2h = np.bincount(g[e == ENG_D2H], nb[e == ENG_D2H], minlength=gpus)
        r_h, r_d, r_all = host_rates(p, 1)
        per_gpu = np.maximum.reduce([h2d / r_h, d2h / r_d, (h2d + d2h) / r_all])
        r_h, r_d, r_all = host_rates(p, gpus)
        host_wide = max(h2d.sum() / r_h, d2h.sum() / r_d, (h2d.sum() + d2h.sum()) / r_all)
        self.host_link_s = max(per_gpu.max(initial=0), host_wide)
        alone = costs.alone_ns()  # GPU<->GPU: each pair's copies one after another, at their floors as today
        sel = e == ENG_P2P
        pair = mg.src_gpu.astype(np.int64) * gpus + g
        links = np.bincount(pair[sel], alone[sel].astype(np.float64), minlength=gpus * gpus)
        if p.p2p_ports_serial:  # a GPU sends one copy at a time and takes one at a time
            ports = (np.bincount(mg.src_gpu[sel].astype(np.int64), alone[sel], minlength=gpus),
                     np.bincount(g[sel], alone[sel], minlength=gpus))  # fmt: skip
            links = np.concatenate([links, *ports])
        self.p2p_ns = links.max(initial=0)


def _fixed(costs: VertexCosts) -> _Fixed:
    """``costs``' ``_Fixed``, worked out on first use and kept on it."""
    f = getattr(costs, "_bound_fixed", None)
    if f is None:
        f = costs._bound_fixed = _Fixed(costs)
    return f


def bound_floor_ns(costs: VertexCosts, link: float = 1.0) -> np.ndarray:
    """Per vertex, the least time any run gives it (int64 ns, rounded down): a kernel the smaller of its model
    floor (``VertexCosts.floor_ns``) and its datasheet roofline; a host copy its bytes (``link_nbytes`` where
    fewer) at its direction's rate, ``link`` times slower; a GPU<->GPU copy its bytes at ``p2p_bytes_per_s``
    or its measured floor where less; a resident input 0. No latencies."""
    f = _fixed(costs)
    out = f.floor.copy()
    out[f.copies] = f.copy_nbytes * 1e9 * link / f.copy_rate
    return np.floor(np.maximum(out, 0.0)).astype(np.int64)


def host_rates(p: MachineProfile, gpus: int) -> tuple[float, float, float]:
    """The highest total host link rates (bytes per s: host to GPU, GPU to host, both ways together) that any
    number of GPUs up to ``gpus`` reaches: one GPU's link rates, or ``gpus`` links' up to the host's most
    (``MachineProfile.host_*_total_bytes_per_s``, entries 2 to ``gpus``)."""
    one = max(p.h2d_bytes_per_s, p.d2h_bytes_per_s, min(p.pcie_both_bytes_per_s, p.h2d_bytes_per_s + p.d2h_bytes_per_s))

    def most(table: tuple[float, ...], each: float) -> float:
        caps = [host_total_bytes_per_s(table, n) for n in range(2, gpus + 1)] if table else []
        return max(each, min(gpus * each, max(caps, default=float("inf"))))

    h, d = most(p.host_h2d_total_bytes_per_s, p.h2d_bytes_per_s), most(p.host_d2h_total_bytes_per_s, p.d2h_bytes_per_s)
    return h, d, max(h, d, min(most(p.host_both_total_bytes_per_s, one), h + d))


def host_ns(costs: VertexCosts, host: float = 1.0) -> int:
    """The host thread's time to issue every command and handle every completion but the last (that one is only
    seen) at the profile's costs, ``host`` times slower."""
    h = host_costs(costs, host)
    return host_busy_ns(costs, host) - (h.handle if (~costs.preloaded).any() else 0)


def floor_estimate(costs: VertexCosts, host: float = 1.0, link: float = 1.0) -> dict[str, int]:
    """An estimate of the plan's makespan and its parts (ns): ``critical_path_ns`` (model floors plus each
    vertex's launch, start latency, completion and handling), ``kernel_ns`` (busiest GPU's model floors),
    ``link_ns`` (busiest host link on its own, or GPU<->GPU link), ``host_ns``, and ``estimate_ns``, their max.
    Not a bound: kernels beat their model floors and hosts their median costs. ``host``, ``link``: as for
    ``lower_bound``."""
    mg, p = costs.mg, costs.prof
    floor = costs.floor_ns()
    e, g = costs.eng, mg.gpu.astype(np.int64)
    if link != 1.0:  # host link copies push their bytes ``link`` times slower; the latency stays
        hl = (e == ENG_H2D) | (e == ENG_D2H)
        push = np.maximum(floor[hl] - p.copy_latency_ns, 0)
        floor = floor.copy()
        floor[hl] = floor[hl] - push + np.floor(push * link).astype(np.int64)
    gpus = max(mg.n_gpus, 1)
    kern = np.bincount(g[e == ENG_KERNEL], floor[e == ENG_KERNEL], minlength=gpus)
    nb = np.asarray(costs.link_nbytes, dtype=np.float64)
    h2d = np.bincount(g[e == ENG_H2D], nb[e == ENG_H2D], minlength=gpus)
    d2h = np.bincount(g[e == ENG_D2H], nb[e == ENG_D2H], minlength=gpus)
    pcie = np.maximum.reduce([h2d / p.h2d_bytes_per_s, d2h / p.d2h_bytes_per_s, (h2d + d2h) / p.pcie_both_bytes_per_s])
    pair = mg.src_gpu.astype(np.int64) * gpus + g
    sel = e == ENG_P2P
    p2p = np.bincount(pair[sel], floor[sel].astype(np.float64), minlength=gpus * gpus)
    h = host_costs(costs, host)  # as the simulator charges them
    start = np.where(e == ENG_KERNEL, p.kernel_start_latency_ns, 0)
    # a chain waits for each hand-over: the completion that issues the next vertex hands back at least it
    handle = h.handle + h.handle_per_cmd
    per_vertex = floor + h.launch + h.completion + handle + start
    per_vertex[costs.preloaded] = 0  # a resident input is there before the run: nothing to wait for
    parts = {
        "critical_path_ns": int(max(0, critical_path_ns(mg, per_vertex).max(initial=0) - handle)),  # last: seen
        "kernel_ns": int(kern.max(initial=0)),
        "link_ns": int(max(pcie.max(initial=0) * 1e9 * link, p2p.max(initial=0))),
        "host_ns": host_ns(costs, host),
    }
    parts["estimate_ns"] = max(parts.values())
    return parts


def sustained_kernel_ns(costs: VertexCosts) -> int:
    """The busiest GPU's kernels at the clock its power limit sustains (ns): each kernel's model floor times its
    class's slowdown at that clock (``MachineProfile.power_slow_gemm``, ``power_slow_attn``,
    ``power_slow_memory``: the shared-clock model), or its model floor where the profile models no clock. An
    estimate of what a long run's kernels take, not a bound: a GPU runs at full clock while its power allows
    (``power_burst_s``), and kernels beat their model floors."""
    mg = costs.mg
    kern = np.flatnonzero(costs.eng == ENG_KERNEL)
    slow = clock_slowdowns(costs.prof)
    floor = costs.floor_ns()[kern] * np.array([slow[cost_class(mg.op[v])] for v in kern.tolist()])
    per_gpu = np.bincount(mg.gpu[kern].astype(np.int64), floor, minlength=max(mg.n_gpus, 1))
    return int(per_gpu.max(initial=0))


def plan_bound(mg, profile="h100") -> dict[str, int]:
    """``lower_bound`` of ``mg`` on a profile (a ``MachineProfile``, or a name or path for ``load_profile``)."""
    return lower_bound(_costs(mg, profile))


def plan_sustained_ns(mg, profile="h100") -> int:
    """``sustained_kernel_ns`` of ``mg`` on a profile (as ``plan_bound``)."""
    return sustained_kernel_ns(_costs(mg, profile))


def _costs(mg, profile) -> VertexCosts:
    from turnip.machine.profile import load_profile

    return VertexCosts(mg, profile if isinstance(profile, MachineProfile) else load_profile(profile))
