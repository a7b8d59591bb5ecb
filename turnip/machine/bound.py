"""Lower bound on a plan's makespan: max(critical path, per-GPU kernel time, per-link transfer time).

Built from floor durations (no noise, no contention: ``turnip.machine.costs``), so it holds for every
simulated run, and for real runs as far as the profile's floors hold on the hardware. The critical path
counts each vertex's host launch, completion latency and handling; ``host_ns`` is the launch and handling
cost of all commands (one host thread issues and handles them one after another). A host link carries each
copy's ``link_nbytes`` (its bytes, or with a measured copy table the bytes its floor moves at the link's
rate).
"""

from __future__ import annotations

import numpy as np

from turnip.machine.costs import ENG_D2H, ENG_H2D, ENG_KERNEL, ENG_P2P, VertexCosts, host_busy_ns, host_costs
from turnip.sched.priority import critical_path_ns


def lower_bound(costs: VertexCosts, host: float = 1.0, link: float = 1.0) -> dict[str, int]:
    """The bound and its parts (all ns): ``critical_path_ns``, ``kernel_ns`` (busiest GPU),
    ``link_ns`` (busiest host link or GPU<->GPU link), ``host_ns`` (issuing and handling all commands).
    ``costs`` is a ``VertexCosts`` (the simulator's ``TimingModel`` is one); ``host``: a run's host speed
    factor (``MachineProfile.host_excess_sd``), which scales every host cost of that run; ``link``: its host
    link time factor (a host<->GPU copy's time less its latency, times it)."""
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
    host_ns = host_busy_ns(costs, host) - (h.handle if (~costs.preloaded).any() else 0)  # the last is only seen
    start = np.where(e == ENG_KERNEL, p.kernel_start_latency_ns, 0)
    # a chain waits for each hand-over: the completion that issues the next vertex hands back at least it
    handle = h.handle + h.handle_per_cmd
    per_vertex = floor + h.launch + h.completion + handle + start
    per_vertex[costs.preloaded] = 0  # a resident input is there before the run: nothing to wait for
    parts = {
        "critical_path_ns": int(max(0, critical_path_ns(mg, per_vertex).max(initial=0) - handle)),  # last: seen
        "kernel_ns": int(kern.max(initial=0)),
        "link_ns": int(max(pcie.max(initial=0) * 1e9 * link, p2p.max(initial=0))),
        "host_ns": host_ns,
    }
    parts["lower_bound_ns"] = max(parts.values())
    return parts


def plan_bound(mg, profile="h100") -> dict[str, int]:
    """``lower_bound`` of ``mg`` on a profile (a ``MachineProfile``, or a name or path for ``load_profile``)."""
    from turnip.machine.profile import MachineProfile, load_profile

    prof = profile if isinstance(profile, MachineProfile) else load_profile(profile)
    return lower_bound(VertexCosts(mg, prof))
