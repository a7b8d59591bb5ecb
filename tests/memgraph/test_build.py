"""BuildMemgraph on the paper's worked example, policies, caps and budget errors."""

import numpy as np
import pytest

from turnip.memgraph.build import BudgetError, BuildConfig, build_memgraph
from turnip.memgraph.interp import evaluate_taskgraph, random_inputs, random_order, run_memgraph
from turnip.memgraph.plan import DEP_MEMORY, KIND_OFFLOAD, KIND_RELOAD
from turnip.memgraph.verify import verify
from turnip.models import llama_prefill, matmul_example

pytestmark = pytest.mark.unit
UNIT = 256


def check(mg, tg, rng, orders=3, rtol=1e-5):
    assert verify(mg, tg) == []
    inputs = random_inputs(tg, rng)
    ref = evaluate_taskgraph(tg, inputs)
    for _ in range(orders):
        out = run_memgraph(mg, tg, inputs, random_order(mg, rng))
        assert set(out) == set(np.flatnonzero(tg.is_output).tolist())
        for t, x in out.items():
            np.testing.assert_allclose(x.astype(np.float32), ref[t].astype(np.float32), rtol=rtol, atol=rtol)


def test_paper_example_five_locations_adds_memory_deps_only(rng):
    tg = matmul_example(UNIT)
    mg = build_memgraph(tg, 5 * UNIT)
    assert mg.n == tg.n  # no offload/reload
    # reusing memory needs memory deps; here data paths imply them all, so they are dropped at emission
    assert (mg.dep_kind == DEP_MEMORY).sum() == mg.stats["n_memory_edges"] == 0
    assert mg.stats["n_memory_edges_dropped"] > 0
    full = build_memgraph(tg, 5 * UNIT, BuildConfig(reduce_memory_edges=False))
    assert (full.dep_kind == DEP_MEMORY).sum() == mg.stats["n_memory_edges_dropped"]
    assert mg.stats["peak_nbytes_per_gpu"][0] == 5 * UNIT
    check(mg, tg, rng)


def test_paper_example_four_locations_offloads_and_reloads(rng):
    tg = matmul_example(UNIT)
    mg = build_memgraph(tg, 4 * UNIT)
    off = np.flatnonzero(mg.kind == KIND_OFFLOAD)
    rel = np.flatnonzero(mg.kind == KIND_RELOAD)
    assert len(off) == 1 and len(rel) == 1
    assert mg.tensor[off[0]] == mg.tensor[rel[0]]
    assert off[0] in mg.deps(rel[0]).tolist()  # offload -> reload
    assert mg.stats["peak_nbytes_per_gpu"][0] <= 4 * UNIT
    check(mg, tg, rng)


@pytest.mark.parametrize("policy", ["furthest", "lru", "largest"])
def test_policies_under_pressure(policy, rng):
    tg = llama_prefill("tiny", seq=32, n_gpus=2, dtype="fp32")
    mg = build_memgraph(tg, 40_000, policy=policy)
    assert mg.stats["n_offload"] + mg.stats["n_clean_evict"] > 0
    check(mg, tg, rng, orders=2)


def test_clean_eviction_skips_device_to_host_copy(rng):
    tg = llama_prefill("tiny", seq=32, dtype="fp16", tiles={"t": 8, "h": 2, "f": 80})
    mg = build_memgraph(tg, 26_000)
    assert mg.stats["n_clean_evict"] > 0
    inputs = set(np.flatnonzero(tg.kind == 0).tolist())
    assert not any(int(mg.tensor[o]) in inputs for o in np.flatnonzero(mg.kind == KIND_OFFLOAD))
    check(mg, tg, rng, orders=2, rtol=2e-2)


def test_lookahead_caps(rng):
    tg = llama_prefill("tiny", seq=32, dtype="fp32")
    base = build_memgraph(tg, 1 << 20)
    capped = build_memgraph(tg, 1 << 20, BuildConfig(lookahead_vertices=2))
    byte_capped = build_memgraph(tg, 1 << 20, BuildConfig(lookahead_nbytes=4096))
    assert capped.stats["peak_nbytes_per_gpu"][0] < base.stats["peak_nbytes_per_gpu"][0]
    assert byte_capped.stats["peak_nbytes_per_gpu"][0] < base.stats["peak_nbytes_per_gpu"][0]
    for mg in (capped, byte_capped):
        check(mg, tg, rng, orders=1)


def test_custom_order(rng):
    tg = matmul_example(UNIT)
    order = [0, 1, 2, 3, 4, 5, 8, 7, 6, 9, 10, 11, 12, 13, 14]
    mg = build_memgraph(tg, 5 * UNIT, BuildConfig(order=tuple(order)))
    check(mg, tg, rng)


def test_budget_too_small_names_vertex_bytes_and_tile():
    tg = llama_prefill("tiny", seq=32, dtype="fp32")
    with pytest.raises(BudgetError) as e:
        build_memgraph(tg, 8192)
    msg = str(e.value)
    assert "vertex" in msg and "budget of 7936" not in msg and "bytes" in msg and "tile size" in msg
    with pytest.raises(BudgetError, match="below one 256-byte"):
        build_memgraph(tg, 100)


def test_host_and_resident_accounting():
    tg = matmul_example(UNIT)
    mg = build_memgraph(tg, 4 * UNIT)
    assert mg.stats["host_peak_nbytes"] == UNIT
    assert mg.stats["host_input_nbytes"] == 6 * UNIT
    assert mg.stats["resident_input_nbytes"] == 0


def test_resident_inputs_stay_loaded(rng):
    tg = llama_prefill("tiny", seq=32, dtype="fp32")
    mg = build_memgraph(tg, 90_000, BuildConfig(resident_nbytes=20_000))
    res = np.flatnonzero(mg.preloaded()).tolist()
    assert res and mg.stats["resident_input_nbytes"] == sum(int(mg.out_nbytes[v]) for v in res) <= 20_000
    resident_tensors = {int(mg.tensor[v]) for v in res}
    assert not any(int(mg.tensor[v]) in resident_tensors for v in np.flatnonzero(mg.kind == KIND_RELOAD))
    check(mg, tg, rng, orders=2)


def test_resident_inputs_with_reload_pressure(rng):
    """Giving back reservations during a reload skips resident inputs (they hold no reservation)."""
    from turnip.compile import build_with_resident

    tg = llama_prefill("tiny", seq=64, dtype="fp16")
    mg = build_with_resident(tg, 48 * 1024, resident=str(12 * 1024))
    assert mg.stats["resident_input_nbytes"] > 0 and mg.stats["n_reload"] > 0
    check(mg, tg, rng, orders=2, rtol=2e-2)


def test_resident_auto_keeps_weights_only_where_that_moves_fewer_bytes(rng):
    """``--resident auto``: a quarter of the budget where the plan then spills nothing (fewer bytes per run
    than streaming every input); none where keeping that quarter spills more activations than it saves."""
    from turnip.compile import build_with_resident, run_link_nbytes

    tg = llama_prefill("tiny", seq=64, dtype="fp16")
    kept = build_with_resident(tg, 512 * 1024, resident="auto")
    stream = build_with_resident(tg, 512 * 1024, resident="0")
    assert kept.preloaded().any() and not (kept.kind == KIND_OFFLOAD).any()
    assert run_link_nbytes(kept) < run_link_nbytes(stream)
    check(kept, tg, rng, orders=1, rtol=2e-2)
    tg = llama_prefill("tiny", seq=256, dtype="fp16")
    quarter = build_with_resident(tg, 256 * 1024, resident=str(64 * 1024))
    auto = build_with_resident(tg, 256 * 1024, resident="auto")
    assert (quarter.kind == KIND_OFFLOAD).any() and quarter.preloaded().any()
    assert not auto.preloaded().any() and run_link_nbytes(auto) < run_link_nbytes(quarter)
    check(auto, tg, rng, orders=1, rtol=2e-2)


def test_byte_lookahead_cap_with_resident_inputs(rng):
    """Resident inputs hold no reservation, so they must not shift the reserved-bytes count of the cap."""
    from turnip.memgraph.build import _Build

    tg = llama_prefill("tiny", seq=32, dtype="fp32")
    b = _Build(tg, [1 << 20], BuildConfig(lookahead_nbytes=4096, resident_nbytes=20_000))
    mg = b.run()
    assert b.reserved_nbytes == 0 and mg.stats["resident_input_nbytes"] > 0
    check(mg, tg, rng, orders=1)


@pytest.mark.parametrize("policy", ["furthest", "lru", "largest"])
def test_vectorized_victim_search_builds_the_same_plan(policy, monkeypatch):
    """``find_victims`` in numpy (arenas of many segments) chooses exactly what the scalar search chooses: the
    same memgraph, offsets and edges, on eviction-heavy plans."""
    import numpy as np

    from turnip.memgraph import evict
    from turnip.memgraph.build import BuildConfig, build_memgraph
    from turnip.models import LLAMA
    from turnip.train import lora_step

    tg = lora_step(LLAMA["tiny"], seq=32, batch=4, dtype="fp32", checkpoint="off")
    plans = []
    for threshold in (10**9, 0):  # every search scalar, then every search in numpy
        monkeypatch.setattr(evict, "NUMPY_MIN_SEGMENTS", threshold)
        plans.append(build_memgraph(tg, 160 * 1024, BuildConfig(policy=policy)))
    a, b = plans
    assert a.stats["n_offload"] > 50
    for f in ("kind", "tensor", "gpu", "out_offset", "host_offset", "in_idx", "dep_ptr", "dep_src", "dep_kind"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
