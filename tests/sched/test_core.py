import numpy as np
import pytest

from turnip.sched import (
    POLICIES,
    Copy,
    CopyDone,
    KernelDone,
    Launch,
    ProtocolError,
    RunStarted,
    Scheduler,
    SchedulerStall,
)
from turnip.sched.replay import engine_orders
from turnip.sched.testing import chain, drive, make_memgraph, random_memgraph, recorded_order, scheduler

pytestmark = pytest.mark.unit


def done(cmd, t=0):
    return KernelDone(cmd.v, t) if type(cmd) is Launch else CopyDone(cmd.v, t)


def test_chain_runs_in_order():
    s = Scheduler(chain(4))
    cmds = s.handle(RunStarted(0))
    seen = []
    while cmds:
        assert len(cmds) == 1
        seen.append(cmds[0].v)
        cmds = s.handle(done(cmds[0], len(seen)))
        s.validate()
    assert seen == [0, 1, 2, 3] and s.finished


def test_stream_slots_limit_launches():
    mg = make_memgraph(["kernel"] * 7, [[]] * 7)
    s = Scheduler(mg, streams_per_gpu=5)
    cmds = s.handle(RunStarted(0))
    assert [c.v for c in cmds] == [0, 1, 2, 3, 4]
    assert sorted(c.stream for c in cmds) == [0, 1, 2, 3, 4]
    more = s.handle(KernelDone(2, 10))
    assert [(c.v, c.stream) for c in more] == [(5, cmds[2].stream)]
    s.validate()


def test_copy_engines_one_at_a_time_per_direction():
    mg = make_memgraph(["input", "input", "kernel", "offload"], [[], [], [0], [2]])
    s = Scheduler(mg)
    cmds = s.handle(RunStarted(0))
    assert cmds == [Copy(0, "h2d", -1, 0, 0, cmds[0].stream)]
    cmds = s.handle(CopyDone(0, 5))
    assert {type(c) for c in cmds} == {Copy, Launch} and {c.v for c in cmds} == {1, 2}
    cmds = s.handle(KernelDone(2, 6))
    assert cmds == [Copy(3, "d2h", 0, -1, 0, cmds[0].stream)]


def test_transfer_issued_by_source_gpu_on_its_link():
    mg = make_memgraph(["kernel", "transfer", "transfer"], [[], [0], [0]], n_gpus=3, gpus=[0, 1, 2], src_gpus=[0, 0, 0])
    s = Scheduler(mg)
    s.handle(RunStarted(0))
    cmds = s.handle(KernelDone(0, 1))
    assert [(c.v, c.engine, c.src_gpu, c.dst_gpu, c.gpu) for c in cmds] == [
        (1, "p2p", 0, 1, 0),
        (2, "p2p", 0, 2, 0),
    ]


def test_lock_group_never_overlaps():
    mg = make_memgraph(["kernel"] * 4, [[]] * 4, lock_groups=[7, 7, -1, 7])
    s = Scheduler(mg)
    cmds = s.handle(RunStarted(0))
    assert [c.v for c in cmds] == [0, 2]
    assert [c.v for c in s.handle(KernelDone(0, 1))] == [1]
    assert [c.v for c in s.handle(KernelDone(1, 2))] == [3]
    s.validate()


def test_det_issues_in_compile_order_per_gpu():
    # 1 depends on a slow input 0; 2 is independent. nondet runs 2 at once, det waits for 1's turn.
    mg = make_memgraph(["input", "kernel", "kernel"], [[], [0], []])
    assert [c.v for c in Scheduler(mg, "nondet").handle(RunStarted(0))] == [0, 2]
    s = Scheduler(mg, "det")
    assert [c.v for c in s.handle(RunStarted(0))] == [0]
    assert [c.v for c in s.handle(CopyDone(0, 1))] == [1, 2]
    s.validate()


def test_det_kernels_orders_kernels_only():
    mg = make_memgraph(["input", "kernel", "kernel", "input"], [[], [0], [], []])
    s = Scheduler(mg, "det-kernels")
    assert [c.v for c in s.handle(RunStarted(0))] == [0]
    assert [c.v for c in s.handle(CopyDone(0, 1))] == [1, 2, 3]


def test_det_replay_waits_for_each_engine_queues_turn():
    # recorded: kernel 1 (after the input) before kernel 2; the replay holds 2 back although it is ready
    mg = make_memgraph(["input", "kernel", "kernel"], [[], [0], []])
    s = Scheduler(mg, "det-replay", order=[0, 1, 2])
    assert [c.v for c in s.handle(RunStarted(0))] == [0]
    assert "replayed kernel queue" in s.waits_for(2)
    assert [c.v for c in s.handle(CopyDone(0, 1))] == [1, 2]
    s.validate()
    s = Scheduler(mg, "det-replay", order=[2, 0, 1])  # kernel 2 first, then the input and kernel 1
    assert [c.v for c in s.handle(RunStarted(0))] == [2, 0]


def test_det_replay_issues_the_recorded_order_on_every_engine():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        mg = random_memgraph(rng, 60, 1 + seed % 3, p_edge=0.05)
        rec = recorded_order(mg, 3, rng)
        replayed = drive(Scheduler(mg, "det-replay", 3, order=rec), rng)  # other completion times
        assert engine_orders(mg, replayed) == engine_orders(mg, rec)
        assert sorted(c.v for c in replayed) == list(range(mg.n))


def test_det_replay_refuses_orders_it_cannot_replay():
    mg = make_memgraph(["input", "kernel", "kernel"], [[], [0], [1]])
    for order, why in (
        (None, "pass order="),
        ([0, 1], "lacks 1 vertices"),
        ([0, 1, 1, 2], "2 times"),
        ([0, 2, 1], "before its dependency"),
        ([0, 1, 7], "plan has 3 vertices"),
    ):
        with pytest.raises(ValueError, match=why):
            Scheduler(mg, "det-replay", order=order)
    with pytest.raises(ValueError, match="for det-replay"):
        Scheduler(mg, "nondet", order=[0, 1, 2])


def test_nondet_cp_prefers_longest_path():
    # 0 and 1 ready; 1 heads a long chain, so cp picks it first when one slot is free
    mg = make_memgraph(["kernel"] * 5, [[], [], [1], [2], [3]])
    assert [c.v for c in Scheduler(mg, "nondet", streams_per_gpu=1).start()] == [0]
    assert [c.v for c in Scheduler(mg, "nondet-cp", streams_per_gpu=1).start()] == [1]


def test_stall_names_stuck_vertices():
    # vertex 0 depends on 1 and 1 on 0: nothing can ever start
    mg = make_memgraph(["kernel", "kernel", "kernel"], [[1], [0], []])
    with pytest.raises(ValueError, match="cycle"):
        Scheduler(mg)
    mg2 = make_memgraph(["kernel", "kernel"], [[], [0]])
    s = Scheduler(mg2)
    s.start()
    s.missing[1] += 1  # simulate a dependency that never completes
    with pytest.raises(SchedulerStall) as e:
        s.complete(0, 42)
    assert e.value.t_ns == 42 and e.value.stuck[0].v == 1
    assert "kernel#1" in str(e.value) and "dependencies" in str(e.value)


def test_protocol_errors():
    s = Scheduler(chain(2))
    s.start()
    with pytest.raises(ProtocolError):
        s.handle(KernelDone(1, 1))
    with pytest.raises(ProtocolError):
        s.handle(CopyDone(0, 1))
    with pytest.raises(ProtocolError):
        s.handle(RunStarted(0))


def test_unknown_policy():
    with pytest.raises(ValueError, match="nondet"):
        Scheduler(chain(2), "fifo")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_finishes_a_mixed_graph(policy):
    mg = make_memgraph(
        ["input", "kernel", "offload", "reload", "kernel", "transfer", "kernel"],
        [[], [0], [1], [2], [3], [4], [5]],
        n_gpus=2,
        gpus=[0, 0, 0, 0, 0, 1, 1],
        src_gpus=[0, 0, 0, 0, 0, 0, 1],
    )
    s = scheduler(mg, policy)
    todo = s.start()
    t = 0
    while todo:
        t += 1
        todo = todo[1:] + s.handle(done(todo[0], t))
        s.validate()
    assert s.finished and s.state_counts()["done"] == mg.n


def test_empty_graph():
    s = Scheduler(make_memgraph([], [], n_gpus=1))
    assert s.start() == [] and s.finished
    assert np.asarray(s.status).size == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_fresh_scheduler_repeats_a_new_ones_run(policy):
    """``fresh`` after a finished run (and one cut short) starts from the initial state: its run, completions
    arriving in the same random order, is a new scheduler's, command for command."""
    for seed in range(6):
        mg = random_memgraph(np.random.default_rng(seed), 80, 1 + seed % 3, p_edge=0.05)
        for ordered_sums in (True, False):
            s = scheduler(mg, policy, 3, np.random.default_rng(seed), ordered_sums)
            first = drive(s, np.random.default_rng(seed + 1))
            cut = s.fresh()
            cut.complete(cut.start()[0].v, 1)  # a run left half done: fresh ignores it
            for t in (s.fresh(), cut.fresh()):
                assert drive(t, np.random.default_rng(seed + 1)) == first
                t.validate()
            assert drive(s.fresh(), np.random.default_rng(seed + 2)) == drive(
                scheduler(mg, policy, 3, np.random.default_rng(seed), ordered_sums), np.random.default_rng(seed + 2)
            )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_launched_ids_are_the_commands_vertices(policy):
    mg = random_memgraph(np.random.default_rng(9), 80, 2, p_edge=0.05)
    a, b = scheduler(mg, policy, 2, np.random.default_rng(9)), scheduler(mg, policy, 2, np.random.default_rng(9))
    cmds, ids, t = a.start(0), b.start_ids(0), 0
    while cmds:
        assert [c.v for c in cmds] == ids and all(c.stream == b.stream_of[c.v] for c in cmds)
        assert cmds == [b.command(v) for v in ids]
        t += 1
        cmds, ids = a.complete(cmds[-1].v, t) + cmds[:-1], b.complete_ids(ids[-1], t) + ids[:-1]
    assert a.finished and b.finished
