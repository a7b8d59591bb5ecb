"""Compiled LLaMA plans (tiny shapes) under budgets that force offloads: the simulator respects them."""

import numpy as np
import pytest

from sim import fastest_run, simulate
from turnip import models
from turnip.machine.profile import h100
from turnip.memgraph import build
from turnip.memgraph.timeline import memory_timeline, peak_bytes
from turnip.sched import POLICIES

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module", params=[(64, 2, 1 << 15), (256, 1, 1 << 16), (64, 2, 1 << 16)])
def plan(request):
    seq, gpus, budget = request.param
    return build.build_memgraph(models.llama_prefill("tiny", seq, gpus), budget)


@pytest.mark.parametrize("policy", POLICIES)
def test_bytes_in_use_never_exceed_budget(plan, policy):
    order = fastest_run(plan, h100(), range(2)).order if policy == "det-replay" else None
    for seed in range(2):
        r = simulate(plan, h100(), policy, seed=seed, order=order)
        tl = memory_timeline(plan, r.start_ns, r.end_ns, r.makespan_ns)
        assert (peak_bytes(tl, plan.n_gpus) <= plan.budget_nbytes).all()
        assert r.lower_bound_ns <= r.makespan_ns


def test_every_dependency_respected_in_time(plan):
    from turnip.sched.groups import launch_groups

    head = launch_groups(plan).head  # plans of several GPUs run in launch groups by default
    r = simulate(plan, h100(), "nondet", seed=0)
    for v in range(plan.n):
        for u in plan.deps(v).tolist():
            assert r.end_ns[u] <= r.start_ns[v]
            assert r.done_ns[u] <= r.host_start_ns[v] or (plan.n_gpus > 1 and head[u] == head[v] != v)


def test_resident_inputs_are_loaded_before_the_run():
    tg = models.llama_prefill("tiny", 64, 1)
    mg = build.build_memgraph(tg, 1 << 16, build.BuildConfig(resident_nbytes=1 << 14))
    res = np.flatnonzero(mg.preloaded()).tolist()
    assert res
    for policy in POLICIES:
        order = fastest_run(mg, h100(), [0], True).order if policy == "det-replay" else None
        r = simulate(mg, h100(), policy, seed=0, mean_only=True, order=order)
        assert all(r.start_ns[v] == 0 and r.end_ns[v] == 0 for v in res)
        assert all(r.end_ns[v] > 0 for v in range(mg.n) if v not in set(res))
