"""The CUDA backend on a real GPU: tiny LLaMA plans against the numpy taskgraph evaluation, one and two
GPUs, failure handling and the no-allocation rule. Skipped without a CUDA device."""

import threading

import numpy as np
import pytest

from tests.runtime.helpers import gpus, reference, rel_err, tiny_llama
from turnip.memgraph.interp import evaluate_taskgraph
from turnip.runtime import VertexFailed, execute, open_backend

pytestmark = pytest.mark.gpu


needs_gpu = pytest.mark.skipif(gpus() < 1, reason="needs a CUDA device")


def _assert_runs_correct(mg, be, ref, seeds=range(2), tol: float = 2e-2, policy: str = "nondet"):
    """Run ``mg`` once per seed on a loaded backend; every run's outputs match ``ref`` within ``tol``."""
    res = None
    for seed in seeds:
        res = execute(mg, be, policy, seed=seed)
        out = be.read_outputs()
        assert max(rel_err(out[t], ref[t]) for t in out) <= tol
    return res


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


@needs_gpu
def test_budget_not_a_multiple_of_256_keeps_the_workspace_aligned():
    """A budget of any byte count: the stream slots' workspace (cuBLASLt's, cuDNN's) stays 256-byte aligned."""
    from turnip.compile import build_with_resident
    from turnip.models import llama_prefill

    tg = llama_prefill("7b", seq=256, n_layers=1, dtype="fp16", tiles={"t": 256})
    mg = build_with_resident(tg, (1 << 30) + 12, None, "0", workspace="1MiB")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        assert all(c.ws_ptr % 256 == 0 for row in be.sctx for c in row)
        be.write_inputs(inputs)
        execute(mg, be, "nondet", seed=0)
        out = be.read_outputs()
        assert max(rel_err(out[t], ref[t]) for t in out) <= 2e-2


@needs_gpu
@pytest.mark.parametrize("n_gpus", [1, 2])
def test_registered_host_regions_match_numpy(n_gpus):
    """``host_register=True``: plain host memory pinned in place, the input region once its inputs are written
    (before any is copied), the offload region at the first run (offloads and reloads through it); the outputs
    match numpy run after run, and the backend closes cleanly."""
    if gpus() < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA devices")
    tg, mg = tiny_llama((48 if n_gpus == 1 else 24) * 1024, "fp16", n_gpus=n_gpus)
    assert (mg.kind == 3).sum() > 0  # offloads: the offload region is used
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, host_register=True) as be:
        assert not any(r.pinned for r in be._regions)
        be.write_inputs(inputs)
        assert [r.pinned for r in be._regions] == [True, False]
        _assert_runs_correct(mg, be, ref, range(3))
        assert all(r.pinned for r in be._regions)


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mode", [{}, {"graphs": False}, {"bound": False}], ids=["graphs", "direct", "numba-launch"])
def test_tiny_llama_on_two_gpus_with_transfers(mode):
    """Two devices: every kernel launched with its own device's function handles and library plans."""
    tg, mg = tiny_llama(1 << 20, "fp16", n_gpus=2)
    assert (mg.kind == 2).sum() > 0
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, **mode) as be:
        be.write_inputs(inputs)
        _assert_runs_correct(mg, be, ref, range(3))


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
def test_outputs_read_on_a_thread_per_gpu_are_the_serial_reads(monkeypatch):
    """``TURNIP_PARALLEL_READS=1``: outputs left on two GPUs copied by a thread per GPU, bit for bit the
    outputs read one after another (and the numpy result)."""
    from turnip.compile import compile_model
    from turnip.runtime.layout import output_sources

    tg, mg = compile_model("llama-tiny", 64, 2, 1 << 22, dtype="fp16", split="data", resident="auto")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        assert {be.lay.gpu[o] for _, o, on_host in output_sources(mg) if not on_host} == {0, 1}
        _assert_runs_correct(mg, be, ref, range(1))
        monkeypatch.delenv("TURNIP_PARALLEL_READS", raising=False)
        serial = be.read_outputs()
        monkeypatch.setenv("TURNIP_PARALLEL_READS", "1")
        parallel = be.read_outputs()
    assert serial.keys() == parallel.keys()
    for t in serial:
        assert parallel[t].dtype == serial[t].dtype and parallel[t].shape == serial[t].shape
        np.testing.assert_array_equal(parallel[t], serial[t])


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
        res = _assert_runs_correct(mg, be, ref)
        assert res.makespan_ns > 0 and not be.timing_failures


@needs_gpu
@pytest.mark.parametrize("mode", [{}, {"graph_events": True}, {"lib_graphs": False}, {"group_events": False}],
                         ids=["graphs", "graph-events", "direct-cudnn", "tail-event"])  # fmt: skip
def test_launch_groups_agree(mode):
    """Launch groups (one captured graph per group, or each member's launch in turn where a member is not
    captured): the numpy result, bitwise the ungrouped run's, every member's end event timed."""
    tg, mg = tiny_llama(1 << 20, "fp16", resident="auto")
    inputs, ref = reference(tg)
    outs = []
    for groups in (False, True):
        with open_backend("cuda", mg, groups=groups, **mode) as be:
            be.write_inputs(inputs)
            assert (be.groups is not None) == groups
            if groups:
                assert be.groups.members and {be._work[h][0] for h in be.groups.members} <= {"GG", "seq"}
            res = _assert_runs_correct(mg, be, ref)
            assert not be.timing_failures
            outs.append(be.read_outputs())
            if groups:
                for members in be.groups.members.values():
                    assert (res.end_ns[members[1:]] >= res.end_ns[members[:-1]]).all()
    for t in outs[0]:
        np.testing.assert_array_equal(outs[1][t], outs[0][t])


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("split", ["tensor", "data"])
def test_launch_groups_on_two_gpus(split):
    """Grouped runs of a two-GPU plan (the tensor split and the prompt's data split): the numpy result."""
    from turnip.compile import compile_model

    tg, mg = compile_model("llama-tiny", 64, 2, 1 << 20, dtype="fp16", split=split, resident="auto")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, groups=True) as be:
        be.write_inputs(inputs)
        assert be.groups.members
        _assert_runs_correct(mg, be, ref, range(3))


@pytest.mark.skipif(gpus() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("split,n_gpus,kib", [("layers", 2, 48), ("tensor", 2, 48), ("tensor", 4, 64)])
def test_relayed_loads_match_numpy(split, n_gpus, kib):
    """Loads relayed through the other GPUs' relay slots (``BuildConfig.relay_slots``): the host copy on one GPU,
    the peer copy to the GPU that reads it; the numpy result, with and without launch groups."""
    from turnip.compile import build_with_resident
    from turnip.memgraph.build import BuildConfig
    from turnip.models import llama_prefill

    if gpus() < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA devices")
    tg = llama_prefill("tiny", seq=64, n_gpus=n_gpus, dtype="fp16", split=split)
    mg = build_with_resident(tg, kib << 10, BuildConfig(relay_slots=1, relay_slot_nbytes=8192), "0")
    assert mg.stats["n_relayed"] > 0 and mg.stats["n_reload"] > 0
    inputs, ref = reference(tg)
    for groups in (False, True):
        with open_backend("cuda", mg, groups=groups) as be:
            be.write_inputs(inputs)
            _assert_runs_correct(mg, be, ref, range(3))


@needs_gpu
def test_two_gpu_plan_on_one_device():
    """Both plan GPUs mapped onto device 0: separate arenas, transfers as peer copies within one context."""
    tg, mg = tiny_llama(1 << 20, "fp16", n_gpus=2)
    inputs, ref = reference(tg)
    with open_backend("cuda", mg, devices=[0, 0]) as be:
        be.write_inputs(inputs)
        _assert_runs_correct(mg, be, ref)


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
        _assert_runs_correct(mg, be, ref, tol=1e-2)


# ---------------------------------------------------------------- faults: the run stops, the next one works


@needs_gpu
def test_copy_error_names_the_vertex():
    tg, mg = tiny_llama(48 * 1024, "fp16")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        v = next(u for u in range(mg.n) if be._work[u][0] == "h2d")
        w = be._work[v]
        be._work[v] = (w[0], w[1], 0, w[3], w[4])  # a null host pointer: the driver refuses the copy
        with pytest.raises(VertexFailed, match=f"#{v}"):
            execute(mg, be)
        be._work[v] = w
        _assert_runs_correct(mg, be, ref, [11])


@needs_gpu
def test_launch_error_names_the_vertex():
    """A kernel launch the driver refuses (a block larger than the device allows) stops the run."""
    from cuda_kernels.launch import RawLaunch

    tg, mg = tiny_llama(1 << 20, "fp16")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        v = next(u for u in range(mg.n) if be._work[u][0] == "g" and isinstance(be._work[u][2], RawLaunch))
        w, b = be._work[v], be._work[v][2]
        be._work[v] = ("r", b.func, b.gx, b.gy, b.gz, 4096, 1, 1, b.shmem, b.params, b.keep)
        with pytest.raises(VertexFailed, match=f"#{v}.*cuLaunchKernel"):
            execute(mg, be)
        be._work[v] = w
        _assert_runs_correct(mg, be, ref, [11])


@needs_gpu
def test_interrupt_during_a_7b_width_run_leaves_the_backend_usable():
    """Ctrl-C in the middle of a LLaMA-7B-shaped run: the in-flight work finishes, the error propagates,
    the next run in the same process is right."""
    from cuda_kernels.launch import LibCall
    from turnip.compile import build_with_resident, make_taskgraph
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tg = make_taskgraph("llama-7b", 2048, 1, "fp16", n_layers=1, budget_nbytes=2 << 30)
    mg = build_with_resident(tg, 2 << 30, None, "auto")
    inputs = tile_inputs(tg, random_inputs_for(tg, 2))
    ref = evaluate_taskgraph(tg, inputs)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        kernels = [u for u in range(mg.n) if mg.kind[u] == 1]
        v = kernels[len(kernels) // 2]
        w = be._work[v]

        def interrupt(ctx):
            raise KeyboardInterrupt

        be._work[v] = ("l", LibCall(interrupt, 0, "interrupt"))
        with pytest.raises(KeyboardInterrupt):
            execute(mg, be)
        assert not be.in_flight()
        be._work[v] = w
        _assert_runs_correct(mg, be, ref, [11], tol=1e-2)


@needs_gpu
def test_stall_names_the_vertex_in_flight():
    """A vertex that does not finish within the watchdog's limit stops the run with RuntimeStall naming it;
    the backend waits for it and stays usable."""
    from cuda_kernels._numba import cuda
    from cuda_kernels.codegen import jit
    from cuda_kernels.launch import LibCall
    from turnip.runtime import RuntimeStall

    spin = jit("def kern(n):\n    for _ in range(n):\n        cuda.nanosleep(1000000)\n")
    spin[1, 1](1)  # compiled now, not inside the run
    cuda().synchronize()
    tg, mg = tiny_llama(1 << 20, "fp16")
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        v = int(np.flatnonzero(mg.kind == 1)[3])
        w = be._work[v]
        be._work[v] = ("l", LibCall(lambda ctx: spin[1, 1, ctx.numba_stream](1500), 0, "spin"))
        with pytest.raises(RuntimeStall, match=f"#{v}"):
            execute(mg, be, stall_s=0.3)
        be._work[v] = w
        _assert_runs_correct(mg, be, ref, [11])


@needs_gpu
def test_close_gives_device_memory_back():
    """Open and close a 4 GiB plan three times: device memory returns to where it was (arenas, graphs,
    library handles and pinned regions are all released at close)."""
    import ctypes
    import gc

    from cuda_kernels._numba import cuda
    from turnip.compile import build_with_resident, make_taskgraph

    cuda().current_context()  # cuMemGetInfo needs a current context (this test may be the process's first)
    lib = ctypes.CDLL("libcuda.so.1")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    tg = make_taskgraph("llama-7b", 1024, 1, "fp16", n_layers=1, budget_nbytes=4 << 30)
    mg = build_with_resident(tg, 4 << 30, None, "auto")
    def free_now() -> int:
        gc.collect()
        assert lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        return free.value

    for _ in range(3):
        before = free_now()
        with open_backend("cuda", mg) as be:
            be.write_inputs({t: np.zeros(tg.shape[t], np.float16 if tg.dtype[t] == "fp16" else np.int32)
                             for t in np.flatnonzero(tg.kind == 0).tolist()})  # fmt: skip
            execute(mg, be)
            held = free_now()
        after = free_now()
        assert before - held >= 4 << 30  # the arena was there
        assert after >= before - (256 << 20), (before, held, after)


@needs_gpu
def test_the_host_probe_runs_while_other_plans_come_and_go():
    """``turnip.calibrate.HostProbe`` stays loaded while calibration opens, runs and closes other plans: its
    runs before and after give the same outputs, and every sample has an issue time and a link rate."""
    from turnip.calibrate import HostProbe

    tg, mg = tiny_llama(1 << 20, "fp16", resident="0")  # streams its weights, offloads nothing
    with HostProbe(plan=(tg, mg)) as probe:
        timed = probe.run(0)  # a sample: with start events, its copies' device times
        first = probe._be.read_outputs()
        for budget in (1 << 24, 48 * 1024):
            tg2, mg2 = tiny_llama(budget, "fp16")
            inputs, ref = reference(tg2)
            with open_backend("cuda", mg2) as be:
                be.write_inputs(inputs)
                _assert_runs_correct(mg2, be, ref)
            probe.sample()
        again = probe._be.read_outputs()
        plain = probe.host_runs(2)  # without start events: a plain run's host costs
    assert all(rel_err(again[t], first[t]) <= 1e-2 for t in first)
    assert len(probe.samples) == 3 and len(plain) == 2
    sent = timed.issue_ns > 0
    assert (timed.start_ns[sent] > timed.issue_ns[sent]).any()  # device starts
    assert all(np.array_equal(r.start_ns[sent], r.issue_ns[sent]) for r in plain)  # none: the issue times
    assert all(s["issue_ns"] > 0 and s["link_gbps"] > 0 for s in probe.samples), probe.samples


@pytest.mark.parametrize("n_gpus", [1, 2])
def test_packed_prompts_match_numpy(n_gpus, monkeypatch):
    """A batch of short prompts packed several to a token tile (the default): each prompt's attention and rotary
    stay its own on the GPU (the numpy evaluation of the packed taskgraph, which the CPU tests hold equal to one
    prompt per tile)."""
    from turnip.compile import compile_model

    if gpus() < n_gpus:
        pytest.skip(f"needs {n_gpus} CUDA device(s)")
    monkeypatch.delenv("TURNIP_PACK_PROMPTS", raising=False)
    tg, mg = compile_model("llama-tiny", 8, n_gpus, 1 << 20, dtype="fp16", batch=16, split="tensor", resident="auto")
    assert tg.meta["tiles"]["t"] > 8
    inputs, ref = reference(tg)
    with open_backend("cuda", mg) as be:
        be.write_inputs(inputs)
        _assert_runs_correct(mg, be, ref, range(2))
