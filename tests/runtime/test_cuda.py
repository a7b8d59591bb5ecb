"""The CUDA backend on a real GPU: tiny LLaMA plans against the numpy taskgraph evaluation, one and two
GPUs, failure handling and the no-allocation rule. Skipped without a CUDA device."""

import threading

import numpy as np
import pytest

from tests.runtime.helpers import reference, rel_err, tiny_llama
from turnip.memgraph.interp import evaluate_taskgraph
from turnip.runtime import VertexFailed, execute, open_backend

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        from cuda_kernels._numba import available, cuda, simulating

        return 0 if simulating() or not available() else len(cuda().gpus)
    except Exception:
        return 0


needs_gpu = pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA device")


@needs_gpu
@pytest.mark.parametrize("budget,resident", [(1 << 24, "0"), (48 * 1024, "0"), (1 << 20, "auto")])
@pytest.mark.parametrize("policy", ["nondet", "det"])
def test_tiny_llama_matches_numpy(budget, resident, policy):
    tg, mg = tiny_llama(budget, "fp16", resident=resident)
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        n_alloc, n_views = be.allocations, be.views_built
        for seed in range(3):
            execute(mg, be, policy, seed=seed)
            out = be.read_outputs()
            assert max(rel_err(out[t], ref[t]) for t in out) <= 2e-2
            assert not be.timing_failures
        assert (be.allocations, be.views_built) == (n_alloc, n_views)


@pytest.mark.skipif(_gpus() < 2, reason="needs two CUDA devices")
def test_tiny_llama_on_two_gpus_with_transfers():
    tg, mg = tiny_llama(1 << 20, "fp16", n_gpus=2)
    assert (mg.kind == 2).sum() > 0
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        for seed in range(3):
            execute(mg, be, "nondet", seed=seed)
            out = be.read_outputs()
            assert max(rel_err(out[t], ref[t]) for t in out) <= 2e-2


@needs_gpu
@pytest.mark.parametrize(
    "mode", [{}, {"graphs": False}, {"bound": False}, {"fast": False}, {"device_start": True}, {"graph_events": True}],
    ids=["graphs", "direct", "numba-launch", "numba-kernels", "start-events", "graph-events"],
)
def test_launch_modes_agree(mode):
    """Every way of launching gives the numpy result; graphs are captured for the bound kernels."""
    tg, mg = tiny_llama(1 << 20, "fp16", resident="auto")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, **mode) as be:
        be.write_inputs(inputs)
        tags = {w[0].lower() for w in be._work}
        assert ("g" in tags) == (mode.get("graphs", True) and mode.get("bound", True)), (tags, be.capture_failures)
        for seed in range(2):
            res = execute(mg, be, "nondet", seed=seed)
            out = be.read_outputs()
            assert max(rel_err(out[t], ref[t]) for t in out) <= 2e-2
        assert res.makespan_ns > 0 and not be.timing_failures


@needs_gpu
def test_two_gpu_plan_on_one_device():
    """Both plan GPUs mapped onto device 0: separate arenas, transfers as peer copies within one context."""
    tg, mg = tiny_llama(1 << 20, "fp16", n_gpus=2)
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, devices=[0, 0]) as be:
        be.write_inputs(inputs)
        for seed in range(2):
            execute(mg, be, "nondet", seed=seed)
            out = be.read_outputs()
            assert max(rel_err(out[t], ref[t]) for t in out) <= 2e-2


@needs_gpu
def test_raising_launcher_names_the_vertex():
    tg, mg = tiny_llama(48 * 1024, "fp16")
    inputs, _ = reference(tg)
    v = int(np.flatnonzero(mg.kind == 1)[5])
    n_threads = threading.active_count()

    def boom(stream, out, ins):
        raise ValueError("bad launch")

    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        w = be._work[v]
        be._work[v] = ("k", boom, None, None)
        with pytest.raises(VertexFailed, match=f"#{v}") as e:
            execute(mg, be)
        assert e.value.v == v
        be._work[v] = w
        execute(mg, be)  # the backend stays usable after an aborted run
    assert threading.active_count() == n_threads


@needs_gpu
def test_llama_7b_width_layer_matches_numpy():
    """One LLaMA-7B-shaped layer at 4096 tokens (tiles, GEMM shapes and library algorithms of the real
    model; concurrent GEMMs on several streams) against the numpy taskgraph evaluation."""
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tg = make_taskgraph("llama-7b", 4096, 1, "fp16", n_layers=1, budget_nbytes=4 << 30)
    mg = build_with_resident(tg, 4 << 30, None, "auto")
    inputs = tile_inputs(tg, random_inputs_for(tg, 1))
    ref = evaluate_taskgraph(tg, inputs)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        for seed in range(2):
            execute(mg, be, "nondet", seed=seed)
            out = be.read_outputs()
            assert max(rel_err(out[t], ref[t]) for t in out) <= 1e-2
