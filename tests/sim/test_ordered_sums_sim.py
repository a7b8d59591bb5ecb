"""The simulator takes ``ordered_sums`` as the runtime does: each sum-into group's members issue in compile
order with it (whatever order their partials finish in), in any order without it."""

import numpy as np
import pytest

from sim.engine import simulate
from turnip.compile import compile_model
from turnip.machine.profile import load_profile
from turnip.memgraph.verify import verify
from turnip.sched.priority import topo_order

pytestmark = pytest.mark.sim


def _groups_in_order(mg, order) -> bool:
    rank = np.empty(mg.n, dtype=np.int64)
    rank[topo_order(mg)] = np.arange(mg.n)
    seen: dict[int, int] = {}
    for v in order.tolist():
        lk = int(mg.lock_group[v])
        if lk >= 0:
            if rank[v] < seen.get(lk, -1):
                return False
            seen[lk] = rank[v]
    return True


def test_simulated_sum_into_groups_follow_compile_order_only_when_asked():
    tg, mg = compile_model("llama-tiny", seq=64, gpus=4, budget=64 * 1024, dtype="fp32", tiles={"h": 1, "f": 40})
    assert verify(mg, tg) == []
    assert (np.bincount(mg.lock_group[mg.lock_group >= 0]) >= 3).sum() >= 8
    prof = load_profile("h100-calibrated")
    ordered = [simulate(mg, prof, "nondet", seed) for seed in range(6)]
    assert all(_groups_in_order(mg, r.order) for r in ordered)
    unordered = [simulate(mg, prof, "nondet", seed, ordered_sums=False) for seed in range(6)]
    assert all(r.makespan_ns > 0 for r in unordered)
    assert not all(_groups_in_order(mg, r.order) for r in unordered), "no run took a group out of order"
