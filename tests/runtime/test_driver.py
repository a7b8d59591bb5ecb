"""The driver loop: the same scheduler class as the simulator, legal command streams, failure handling,
the watchdog, Ctrl-C, and the shared trace schema."""

import threading
import time

import numpy as np
import pytest

from tests.runtime.helpers import dag, reference, tiny_llama
from turnip.runtime import RuntimeStall, VertexFailed, execute, open_backend
from turnip.sched import CopyDone, KernelDone, RunStarted, Scheduler
from turnip.trace import SPAN_COLUMNS

pytestmark = pytest.mark.cpu_runtime


def assert_legal(mg, spans, streams_per_gpu: int) -> None:
    """A run (simulated or real) obeyed the plan: every vertex started after its dependencies were done (a
    launch group's member: those outside its group; the drivers group kernels by default on several GPUs);
    a stream slot, a copy engine or a sum-into lock was never held by two launches at once."""
    from turnip.sched.groups import launch_groups, launch_groups_on

    head = launch_groups(mg).head if launch_groups_on(mg.n_gpus) else np.arange(mg.n)
    start, done = np.asarray(spans["host_start_ns"]), np.asarray(spans["done_ns"])
    issued = np.asarray(spans["issue_ns"])
    for v in range(mg.n):
        for u in mg.deps(v).tolist():
            if head[u] == head[v] and head[v] != v:
                continue  # in v's group, before it on its stream
            assert done[u] <= start[v] or done[v] == 0, f"vertex {v} issued before dependency {u} was done"
    kind, gpu, stream = mg.kind, np.asarray(spans["gpu"]), np.asarray(spans["stream"])
    held = {}
    for v in range(mg.n):
        if done[v] == 0 and issued[v] == 0:
            continue  # preloaded (resident) input
        if head[v] != v:
            continue  # a group's member: on its head's slot, launched with it
        assert 0 <= stream[v] < streams_per_gpu
        held.setdefault(("slot", int(gpu[v]), int(stream[v])), []).append(v)
        if kind[v] != 1:
            held.setdefault(("engine", int(kind[v] == 3), int(mg.src_gpu[v]), int(mg.gpu[v])), []).append(v)
        if mg.lock_group[v] >= 0:
            held.setdefault(("lock", int(mg.lock_group[v])), []).append(v)
    for key, vs in held.items():
        iv = sorted((issued[v], done[v], v) for v in vs)
        for (_, a1, a), (b0, _, b) in zip(iv, iv[1:], strict=False):
            assert a1 <= b0, f"{key} held by {a} and {b} at once"


def test_runtime_and_simulator_drive_the_same_scheduler_legally(monkeypatch):
    sim = pytest.importorskip("sim")
    tg, mg = dag(2, 2)
    calls = {"n": 0}
    original = Scheduler.complete_ids  # what every completion goes through (``complete`` included)

    def counting(self, v, t_ns):
        calls["n"] += 1
        return original(self, v, t_ns)

    monkeypatch.setattr(Scheduler, "complete_ids", counting)
    from turnip.machine.profile import h100
    from turnip.sched.groups import launch_groups

    gr = launch_groups(mg)  # two GPUs: both drivers dispatch launch groups by default, one completion each
    assert gr.members and gr.n_units < mg.n
    r = sim.simulate(mg, h100(), "nondet", seed=0)
    assert calls["n"] == gr.n_units
    assert_legal(mg, r.trace(mg).spans, 5)
    inputs, _ = reference(tg)
    with open_backend("cpu", mg, 5, chaos=0.3, chaos_max_s=0.0003) as be:
        be.write_inputs(inputs)
        res = execute(mg, be, "nondet", seed=1, record_order=True)
    assert calls["n"] == 2 * gr.n_units
    assert_legal(mg, res.trace(mg).spans, 5)

    # the runtime's completions, replayed into a fresh core in the same order, give the same commands
    core = Scheduler(mg, "nondet", 5, groups=gr)
    replay = list(core.handle(RunStarted(0)))
    for v in np.argsort(res.done_ns, kind="stable").tolist():
        if gr.head[v] != v:  # a group's member: done with its head
            continue
        ev = KernelDone(v, int(res.done_ns[v])) if mg.kind[v] == 1 else CopyDone(v, int(res.done_ns[v]))
        replay += core.handle(ev)
    core.validate()
    assert core.finished and [c.v for c in replay] == [c.v for c in res.order]


def test_trace_schema_and_csv_row():
    tg, mg = tiny_llama()
    inputs, _ = reference(tg)
    with open_backend("cpu", mg, chaos=0.1, chaos_max_s=0.0002) as be:
        be.write_inputs(inputs)
        res = execute(mg, be, seed=0)
    tr = res.trace(mg, {"model": "llama-tiny"})
    assert set(tr.spans) == set(SPAN_COLUMNS)
    s = tr.spans
    assert (s["host_start_ns"] <= s["issue_ns"]).all() and (s["issue_ns"] <= s["start_ns"]).all()
    assert (s["start_ns"] <= s["end_ns"]).all() and (s["end_ns"] <= s["done_ns"]).all()
    assert res.makespan_ns == s["done_ns"].max()
    assert tr.to_chrome()["traceEvents"]
    row = res.row(mg, {"model": "llama-tiny"}, {"lower_bound_ns": 5, "kernel_ns": 3})
    for col in ("model", "policy", "seed", "mean_only", "lower_bound_ns", "makespan_ns", "gpu_busy_frac",
                "offload_nbytes", "reload_nbytes", "bound_kernel_ns", "n_vertices"):  # fmt: skip
        assert col in row
    assert row["offload_nbytes"] == mg.stats["offload_nbytes"]


def test_raising_kernel_stops_the_run_naming_the_vertex():
    tg, mg = tiny_llama()
    inputs, ref = reference(tg)
    n_threads = threading.active_count()
    v = int(np.flatnonzero(mg.kind == 1)[20])
    be = open_backend("cpu", mg, chaos=0.2, chaos_max_s=0.0002)
    be.write_inputs(inputs)
    keep = be._fn[v]

    def boom():
        raise FloatingPointError("planted")

    be.inject(v, boom)
    with pytest.raises(VertexFailed, match="planted") as e:
        execute(mg, be, seed=0)
    assert e.value.v == v and f"#{v}(" in str(e.value)
    assert be.in_flight() == []
    be.inject(v, keep)  # the backend stays usable
    execute(mg, be, seed=1)
    out = be.read_outputs()
    assert all(np.allclose(out[t], ref[t], rtol=1e-4, atol=1e-4) for t in out)
    be.close()
    be.close()  # frees nothing twice
    assert threading.active_count() == n_threads


def test_watchdog_reports_the_vertices_in_flight():
    tg, mg = dag(1)
    inputs, _ = reference(tg)
    v = int(np.flatnonzero(mg.kind == 1)[3])
    with open_backend("cpu", mg) as be:
        be.write_inputs(inputs)
        work = be._fn[v]
        be.inject(v, lambda: (time.sleep(0.6), work()))
        with pytest.raises(RuntimeStall, match=f"#{v}\\(") as e:
            execute(mg, be, seed=0, stall_s=0.2)
        assert any(f"#{v}(" in s for s in e.value.in_flight)


def test_ctrl_c_stops_cleanly(monkeypatch):
    tg, mg = dag(1)
    inputs, _ = reference(tg)
    n_threads = threading.active_count()
    with open_backend("cpu", mg) as be:
        be.write_inputs(inputs)
        real_poll, calls = be.poll, {"n": 0}

        def poll(timeout_s):
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
            return real_poll(timeout_s)

        monkeypatch.setattr(be, "poll", poll)
        with pytest.raises(KeyboardInterrupt):
            execute(mg, be, seed=0)
        assert be.in_flight() == []
    assert threading.active_count() == n_threads


def test_missing_inputs_are_refused():
    from turnip.runtime import BackendError

    tg, mg = dag(1)
    with open_backend("cpu", mg) as be, pytest.raises(BackendError, match="no data for input"):
        execute(mg, be)


@pytest.mark.parametrize("n_gpus,resident", [(1, "0"), (2, str(24 * 1024))])
def test_det_replay_replays_the_fastest_nondet_order(n_gpus, resident):
    """The fastest of a few nondet runs' issue order, replayed under other chaos seeds: the same order on
    every engine, a legal run of a verified plan, and the recorded run's outputs bit for bit (sum-into
    locks are taken in the recorded order too, so even the rounding repeats)."""
    from turnip.memgraph.verify import verify
    from turnip.sched.replay import engine_orders

    tg, mg = tiny_llama(96 * 1024, n_gpus=n_gpus, resident=resident)
    assert verify(mg, tg) == []
    assert (resident != "0") == bool(mg.preloaded().any())
    inputs, ref = reference(tg)
    with open_backend("cpu", mg, 3, chaos=0.3, chaos_max_s=0.0003, poison=True) as be:
        be.write_inputs(inputs)
        recorded = []
        for seed in range(3):
            res = execute(mg, be, "nondet", 3, seed=seed, record_order=True)
            recorded.append((res.makespan_ns, seed, res, be.read_outputs()))
        _, _, best, best_out = min(recorded, key=lambda x: x[:2])
        for seed in range(3, 6):
            res = execute(mg, be, "det-replay", 3, seed=seed, record_order=True, order=best.order)
            assert engine_orders(mg, res.order) == engine_orders(mg, best.order)
            assert_legal(mg, res.trace(mg).spans, 3)
            out = be.read_outputs()
            for t, x in out.items():
                np.testing.assert_array_equal(x, best_out[t], err_msg=f"replay {seed}, tensor {t}")
                np.testing.assert_allclose(x, ref[t], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="order="):
            execute(mg, be, "det-replay", 3)


def test_host_cost_per_command_leaves_out_resident_inputs_and_group_members(monkeypatch):
    """``command_host_cost_ns``: the vertices a run issued as commands of their own, every one with a cost;
    resident inputs (loaded with the plan, never issued) and a launch group's other members are not among them."""
    from turnip.compile import compile_model

    monkeypatch.setenv("TURNIP_LAUNCH_GROUPS", "1")
    tg, mg = compile_model("llama-tiny", 64, 2, 1 << 20, dtype="fp32", split="data", resident="auto")
    assert mg.preloaded().any()
    inputs, _ = reference(tg)
    with open_backend("cpu", mg, groups=True) as be:
        be.write_inputs(inputs)
        r = execute(mg, be, "nondet", seed=0)
    hc = r.command_host_cost_ns()
    members = sum(len(m) - 1 for m in be.groups.members.values())
    assert members > 0 and len(hc) == mg.n - int(mg.preloaded().sum()) - members
    assert (hc > 0).all()
