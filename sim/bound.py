"""Lower bound on a plan's makespan: max(critical path, per-GPU kernel time, per-link transfer time).

Built from floor durations (no noise, no contention), so it holds for every sampled run. The critical path
counts each vertex's host launch and completion latency; ``host_ns`` is the launch cost of all commands
(one host thread issues them one after another).
"""

from __future__ import annotations

import numpy as np

from sim.timing import ENG_D2H, ENG_H2D, ENG_KERNEL, ENG_P2P, TimingModel
from turnip.sched.priority import critical_path_ns


def lower_bound(tm: TimingModel) -> dict[str, int]:
    """The bound and its parts (all ns): ``critical_path_ns``, ``kernel_ns`` (busiest GPU),
    ``link_ns`` (busiest host link or GPU<->GPU link), ``host_ns`` (launch cost of all commands)."""
    mg, p = tm.mg, tm.prof
    floor = tm.floor_ns()
    e, g = tm.eng, mg.gpu.astype(np.int64)
    gpus = max(mg.n_gpus, 1)
    kern = np.bincount(g[e == ENG_KERNEL], floor[e == ENG_KERNEL], minlength=gpus)
    nb = tm.nbytes.astype(np.float64)
    h2d = np.bincount(g[e == ENG_H2D], nb[e == ENG_H2D], minlength=gpus)
    d2h = np.bincount(g[e == ENG_D2H], nb[e == ENG_D2H], minlength=gpus)
    pcie = np.maximum.reduce([h2d / p.h2d_bytes_per_s, d2h / p.d2h_bytes_per_s, (h2d + d2h) / p.pcie_both_bytes_per_s])
    pair = mg.src_gpu.astype(np.int64) * gpus + g
    sel = e == ENG_P2P
    p2p = np.bincount(pair[sel], floor[sel].astype(np.float64), minlength=gpus * gpus)
    host = int(tm.launch_ns.sum())
    per_vertex = floor + tm.launch_ns + p.completion_ns  # a chain waits for each hand-over
    parts = {
        "critical_path_ns": int(critical_path_ns(mg, per_vertex).max(initial=0)),
        "kernel_ns": int(kern.max(initial=0)),
        "link_ns": int(max(pcie.max(initial=0) * 1e9, p2p.max(initial=0))),
        "host_ns": host,
    }
    parts["lower_bound_ns"] = max(parts.values())
    return parts

