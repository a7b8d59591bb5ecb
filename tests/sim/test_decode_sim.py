"""Decode steps in the simulator: a plan over a cache larger than the budget runs under every policy above
its lower bound, its cache blocks crossing the host link."""

import pytest

from sim import simulate
from turnip.machine.profile import load_profile
from turnip.memgraph.plan import KIND_INPUT
from turnip.sched import POLICIES

pytestmark = pytest.mark.sim


def test_every_policy_runs_a_decode_step_above_its_lower_bound():
    from turnip.decode import DecodeShape, state_inputs
    from turnip.models import LLAMA
    from turnip.plancache import PlanCache

    plans = PlanCache(LLAMA["tiny"], 24_000, 1, "fp16", 8, verify=True)
    tg, mg = plans.get("decode", 4, 6)
    assert tg.meta["decode"] == tg.meta["decode"] | {"n_blocks": 6, "block": 8} and DecodeShape(4, 6, 8).slots == 48
    streamed = (mg.kind == KIND_INPUT) & ~mg.preloaded()
    cache = set(state_inputs(tg))
    assert any(int(t) in cache for t in mg.tensor[streamed])
    prof = load_profile("h100")
    order = simulate(mg, prof, "nondet", 0).order
    for policy in POLICIES:
        r = simulate(mg, prof, policy, 0, mean_only=True, order=order if policy == "det-replay" else None)
        assert 0 < r.lower_bound_ns < r.makespan_ns, policy
