"""The CPU backend: real threads, chaos delays and poisoned arenas, so every run takes a different valid
order and a wrong memgraph would give wrong numbers. Outputs must equal the taskgraph evaluated without
memory limits: bit for bit where no sum-into reorders rounding, within fp tolerance otherwise."""

import numpy as np
import pytest

from tests.runtime.helpers import dag, reference, tiny_llama
from turnip.runtime import execute, open_backend

pytestmark = pytest.mark.cpu_runtime

RUNS = 50


def _chaos_runs(tg, mg, policy="nondet", exact=False, rtol=1e-5, runs=RUNS, streams=3):
    inputs, ref = reference(tg)
    orders = set()
    with open_backend("cpu", mg, streams, chaos=0.3, chaos_max_s=0.0003, poison=True) as be:
        be.write_inputs(inputs)
        for seed in range(runs):
            res = execute(mg, be, policy, streams, seed=seed)
            out = be.read_outputs()
            assert set(out) == set(ref[t] is not None and t for t in out)
            for t, x in out.items():
                if exact:
                    np.testing.assert_array_equal(x, ref[t], err_msg=f"run {seed}, tensor {t}")
                else:
                    np.testing.assert_allclose(x, ref[t], rtol=rtol, atol=rtol, err_msg=f"run {seed}, tensor {t}")
            orders.add(tuple(np.argsort(res.start_ns, kind="stable")[:200].tolist()))
    return orders


@pytest.mark.parametrize("seed,n_gpus", [(1, 1), (2, 2)])
def test_random_dags_under_tight_budgets(seed, n_gpus):
    tg, mg = dag(seed, n_gpus)
    assert mg.stats["n_offload"] > 0, "budget should force offloads"
    orders = _chaos_runs(tg, mg)
    assert len(orders) > RUNS // 2, "chaos should produce many different orders"


def test_random_dag_without_sum_into_is_bit_exact():
    tg, mg = dag(3, 2, p_sum_into=0.0)
    assert mg.stats["n_offload"] > 0
    _chaos_runs(tg, mg, exact=True)


def test_tiny_llama_under_a_tight_budget():
    tg, mg = tiny_llama(64 * 1024)
    assert mg.stats["n_offload"] > 0
    orders = _chaos_runs(tg, mg, rtol=1e-4)
    assert len(orders) > RUNS // 2


@pytest.mark.parametrize("policy", ["det", "det-kernels", "nondet-cp"])
def test_every_policy_gives_the_same_numbers(policy):
    tg, mg = tiny_llama(64 * 1024)
    _chaos_runs(tg, mg, policy, rtol=1e-4, runs=3)


def test_tiny_llama_fp16_and_resident_inputs():
    tg, mg = tiny_llama(96 * 1024, "fp16", resident="auto")
    assert any(p.get("resident") for p in mg.params)
    _chaos_runs(tg, mg, rtol=2e-2, runs=5)


def test_no_allocation_or_view_during_execution():
    tg, mg = tiny_llama(64 * 1024)
    inputs, _ = reference(tg)
    with open_backend("cpu", mg, chaos=0.2, chaos_max_s=0.0002) as be:
        be.write_inputs(inputs)
        before = (be.allocations, be.views_built)
        assert before[0] == mg.n_gpus + 2  # one arena per GPU, the host input and offload regions
        for seed in range(5):
            execute(mg, be, seed=seed)
        assert (be.allocations, be.views_built) == before


def test_outputs_read_as_views_of_the_offload_region():
    """``read_outputs(views=True)``: the values ``read_outputs()`` copies, an offloaded output (a prefill's keys and
    values under 64 KiB) as a view of the host offload region (no copy), one left on the GPU copied."""
    from turnip.models import llama_config
    from turnip.plancache import PlanCache
    from turnip.runtime.layout import output_sources
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tg, mg = PlanCache(llama_config("llama-tiny"), 64 << 10, 1, "fp32", 4).get("prefill", 2, 16)
    on_host = {t: h for t, _, h in output_sources(mg)}
    assert any(on_host.values()) and not all(on_host.values())
    with open_backend("cpu", mg, 2) as be:
        be.write_inputs(tile_inputs(tg, random_inputs_for(tg, seed=1)))
        execute(mg, be, "nondet", 2, seed=0)
        copies, views = be.read_outputs(), be.read_outputs(views=True)
        assert copies.keys() == views.keys() == on_host.keys()
        for t, h in on_host.items():
            np.testing.assert_array_equal(views[t], copies[t])
            assert np.shares_memory(views[t], be.host[1]) == h and not np.shares_memory(copies[t], be.host[1])
