"""Launch groups: the rule that forms them, the core dispatching them as units under every policy, the
simulator and the CPU backend running grouped plans to the same results."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnip.memgraph.plan import KIND_KERNEL
from turnip.sched import POLICIES, KernelDone, Launch, Scheduler, topo_order
from turnip.sched.groups import LaunchGroups, launch_groups
from turnip.sched.testing import chain, drive, make_memgraph, random_memgraph

pytestmark = pytest.mark.unit


def check_groups(mg, gr: LaunchGroups, wide: bool = False) -> None:
    """Every invariant of ``turnip.sched.groups`` on ``mg`` (``wide``: of wide groups)."""
    pre = mg.preloaded()
    pos = np.empty(mg.n, dtype=np.int64)
    pos[topo_order(mg)] = np.arange(mg.n)
    for h, members in gr.members.items():
        assert members[0] == h and len(members) >= 2
        assert all(gr.head[m] == h for m in members)
        assert list(pos[members]) == sorted(pos[members])
        own, frontier = set(), mg.deps(h).tolist()  # every ancestor of the head: done when it is ready
        while frontier:
            u = frontier.pop()
            if u not in own:
                own.add(u)
                frontier += mg.deps(u).tolist()
        extra = gr.extra.get(h, [])  # what the head waits for too: before it in the order, so no descendants
        assert all(pos[x] < pos[h] if mg.kind[x] != KIND_KERNEL else wide and pos[gr.head[x]] < pos[h] for x in extra)
        for m in members:
            assert mg.kind[m] == KIND_KERNEL and mg.gpu[m] == mg.gpu[h] and mg.lock_group[m] < 0 and not pre[m]
            for u in mg.deps(m).tolist():
                assert gr.head[u] == h or u in own or pre[u] or u in extra, (h, m, u)
    grouped = {m for ms in gr.members.values() for m in ms}
    assert all(gr.head[v] == v for v in range(mg.n) if v not in grouped)


def test_a_chain_is_one_group_and_one_launch():
    mg = chain(5)
    gr = launch_groups(mg)
    assert gr.members == {0: [0, 1, 2, 3, 4]} and gr.n_units == 1
    s = Scheduler(mg, groups=gr)
    cmds = s.start(0)
    assert [c.v for c in cmds] == [0] and s.members_of(0) == [0, 1, 2, 3, 4]
    assert s.waits_for(3).startswith("its launch group's head 0")
    s.validate()
    assert s.complete(0, 1) == [] and s.finished
    s.validate()


def test_groups_end_where_another_gpu_or_engine_reads():
    # 0 -> 1 -> 2 on GPU 0; 1 is read by a transfer (3) to GPU 1, whose kernel 4 reads it; 5 on GPU 0 reads 2
    mg = make_memgraph(["kernel", "kernel", "kernel", "transfer", "kernel", "kernel"],
                       [[], [0], [1], [1], [3], [2]], n_gpus=2, gpus=[0, 0, 0, 1, 1, 0],
                       src_gpus=[0, 0, 0, 0, 1, 0])  # fmt: skip
    gr = launch_groups(mg, wide=False)
    assert gr.members == {0: [0, 1], 2: [2, 5]}
    check_groups(mg, gr)
    wide = launch_groups(mg, wide=True)  # the transfer waits for the group's end: 0, 1, 2, 5 one group
    assert wide.members == {0: [0, 1, 2, 5]} and wide.extra == {}
    check_groups(mg, wide, wide=True)


def test_a_member_needs_no_dependency_beyond_the_heads():
    # 2 reads 0 and 1 (two roots): it cannot join 0's group, whose head does not wait for 1
    mg = make_memgraph(["kernel"] * 3, [[], [], [0, 1]])
    gr = launch_groups(mg, wide=False)
    assert gr.members == {} and gr.n_units == 3
    # wide: 2 joins the later root's group, whose head waits for the earlier root too
    wide = launch_groups(mg, wide=True)
    (h,) = wide.members
    assert wide.members[h] == [h, 2] and wide.extra == {h: [1 - h]} and wide.n_units == 2
    check_groups(mg, wide, wide=True)


def test_wide_heads_wait_only_for_groups_that_start_before_them():
    # 3 reads 0 and 2, where 2 is in 1's group: 3 cannot join 0's group (its head would wait for 1's group,
    # which starts after it); it joins 1's, whose head waits for 0
    mg = make_memgraph(["kernel"] * 4, [[], [], [1], [0, 2]])
    gr = launch_groups(mg, wide=True)
    assert gr.members == {1: [1, 2, 3]} and gr.extra == {1: [0]}
    check_groups(mg, gr, wide=True)


def test_small_kernels_that_need_nothing_join_the_latest_open_group():
    # 0 -> 1 on GPU 0 (1 MiB each); 2 and 3 read only a resident input (4): small ones join 0's open group (wide)
    kinds, deps = ["kernel"] * 4 + ["input"], [[], [0], [4], [4], []]
    mg = make_memgraph(kinds, deps, nbytes=[1 << 20, 1 << 20, 4096, 4096, 4096])
    mg.params[4]["resident"] = True
    assert launch_groups(mg, wide=False).members == {0: [0, 1]}
    wide = launch_groups(mg, wide=True)
    assert wide.members == {0: [0, 1, 2, 3]} and wide.n_units == 2  # the resident input counts as a unit
    check_groups(mg, wide, wide=True)
    big = launch_groups(mg, wide=True, small_nbytes=4096)  # not small enough: each its own launch
    assert big.members == {0: [0, 1]}


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(2, 40), n_gpus=st.integers(1, 3), policy=st.sampled_from(POLICIES),
       streams=st.integers(1, 5), p_edge=st.sampled_from([0.05, 0.1, 0.3]), wide=st.booleans(),
       small=st.booleans())  # fmt: skip
def test_grouped_runs_finish_under_every_policy(seed, n, n_gpus, policy, streams, p_edge, wide, small):
    """Random plans, random completion orders: groups (narrow and wide, every kernel small or none) respect
    their invariants, every vertex finishes after its dependencies, no slot is shared, and a recorded grouped
    run replays."""
    rng = np.random.default_rng(seed)
    mg = random_memgraph(rng, n, n_gpus, p_edge)
    gr = launch_groups(mg, max_members=int(rng.integers(2, 6)), wide=wide, small_nbytes=1 << 62 if small else 0)
    check_groups(mg, gr, wide)
    order = None
    if policy == "det-replay":
        order = [c.v for c in drive(Scheduler(mg, "nondet", streams, groups=gr), rng)]
        assert sorted(gr.expand(order)) == sorted(gr.expand(gr.expand(order)))
    s = Scheduler(mg, policy, streams, order=order, groups=gr)
    running, t, finish = list(s.start(0)), 0, {}
    while running:
        c = running.pop(int(rng.integers(len(running))))
        for m in s.members_of(c.v) or (c.v,):
            assert all(u in finish or mg.preloaded()[u] or gr.head[u] == c.v for u in mg.deps(m).tolist())
        t += 1
        for m in s.members_of(c.v) or (c.v,):
            finish[m] = t
        running += s.complete(c.v, t)
        s.validate()
    assert s.finished and len(finish) == mg.n - int(mg.preloaded().sum())


def test_simulator_runs_groups_as_one_launch_each():
    from sim.engine import simulate
    from turnip.compile import compile_model
    from turnip.machine.profile import load_profile

    tg, mg = compile_model("llama-tiny", 64, 2, "64MiB", dtype="fp32", split="data", resident="auto")
    prof = load_profile("h100-calibrated")
    gr = launch_groups(mg)
    assert gr.members and gr.n_units < mg.n
    plain = simulate(mg, prof, "nondet", seed=0, mean_only=True, groups=False)
    grouped = simulate(mg, prof, "nondet", seed=0, mean_only=True, groups=True)
    assert grouped.makespan_ns < plain.makespan_ns  # the same kernels, fewer commands for the host
    for h, members in gr.members.items():  # members one after another behind their head's issue
        ends = grouped.end_ns[members]
        assert (np.diff(ends) > 0).all() and (grouped.start_ns[members[1:]] >= ends[:-1]).all()
        assert (grouped.done_ns[members] == grouped.done_ns[h]).all()
    replay = simulate(mg, prof, "det-replay", seed=0, mean_only=True, order=grouped.order, groups=True)
    assert sorted(grouped.order.tolist()) == sorted(set(range(mg.n)) - set(np.flatnonzero(mg.preloaded())))
    assert replay.makespan_ns > 0


@pytest.mark.parametrize("split,kib,wide", [("data", 96, False), ("tensor", 64, False), ("data", 96, True),
                                             ("tensor", 64, True)])  # fmt: skip
def test_cpu_backend_grouped_run_equals_plain(split, kib, wide, monkeypatch):
    """A grouped run on the CPU backend (chaos, poisoned arenas; narrow and wide groups) gives the plain run's
    outputs bitwise, under a budget that offloads."""
    monkeypatch.setenv("TURNIP_WIDE_GROUPS", "1" if wide else "0")
    from turnip.compile import compile_model
    from turnip.memgraph.verify import verify
    from turnip.runtime import execute, open_backend
    from turnip.runtime.weights import random_inputs_for, tile_inputs

    tg, mg = compile_model("llama-tiny", 32, 2, kib << 10, dtype="fp32", split=split, resident="auto")
    assert verify(mg, tg) == [] and mg.stats["n_offload"] > 0
    values = tile_inputs(tg, random_inputs_for(tg, seed=5))
    outs = []
    for groups in (False, True):
        with open_backend("cpu", mg, 3, chaos=0.2, chaos_max_s=0.0002, poison=True, groups=groups) as be:
            assert (be.groups is not None) == groups
            be.write_inputs(values)
            res = execute(mg, be, "nondet", 3, seed=1)
            outs.append(be.read_outputs())
            if groups:
                assert be.groups.members
                for members in be.groups.members.values():
                    assert (res.done_ns[members] == res.done_ns[members[0]]).all()
                    assert (res.start_ns[members[1:]] >= res.end_ns[members[:-1]]).all()
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        np.testing.assert_array_equal(outs[1][k], outs[0][k], err_msg=str(k))


def test_launch_command_of_a_group_is_its_heads():
    s = Scheduler(chain(3), groups=launch_groups(chain(3)))
    (c,) = s.handle.__self__.start(0)
    assert type(c) is Launch and c.v == 0
    assert s.handle(KernelDone(0, 5)) == [] and s.finished


def test_cli_launch_groups_flag(capsys):
    """``--launch-groups on|off|auto`` on simulate, run and train; auto is on for a plan of two GPUs."""
    import re

    from turnip.cli import main

    ms = {}
    for g in ("off", "on", "auto"):
        assert main(["simulate", "llama-tiny:64:2:1MiB", "--runs", "1", "--mean-only", "--launch-groups", g]) == 0
        ms[g] = float(re.search(r"makespan\s+mean ([\d.]+) ms", capsys.readouterr().out).group(1))
    assert ms["on"] == ms["auto"] < ms["off"]  # the same kernels, fewer commands for the simulated host
    run = ["run", "--model", "llama-tiny", "--seq", "64", "--gpus", "2", "--budget", "1MiB", "--backend", "cpu",
           "--repeat", "1", "--warmup", "0"]  # fmt: skip
    for g in ("off", "on"):
        assert main([*run, "--launch-groups", g]) == 0
        assert "host cost / command" in capsys.readouterr().out
    assert main(["train", "--model", "llama-tiny", "--seq", "16", "--batch", "2", "--gpus", "2", "--budget", "1MiB",
                 "--backend", "cpu", "--steps", "1", "--launch-groups", "on"]) == 0  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main(["simulate", "llama-tiny:64:2:1MiB", "--launch-groups", "sometimes"])
    assert e.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_wide_groups_by_default_for_training_steps_only(monkeypatch):
    """Unset, ``TURNIP_WIDE_GROUPS`` means wide groups for a training step and narrow ones for a prompt, and
    ``TURNIP_GROUP_EVENTS`` a captured group's end event on its last member only in a training step."""
    from turnip.compile import compile_model
    from turnip.sched.groups import wide_groups_on
    from turnip.train import LoraConfig, TrainSpec

    monkeypatch.delenv("TURNIP_WIDE_GROUPS", raising=False)
    _, step = compile_model("llama-tiny", 32, 2, "64MiB", dtype="fp32", split="data", resident="auto",
                            train=TrainSpec(2, LoraConfig(rank=4), "auto"))  # fmt: skip
    _, prompt = compile_model("llama-tiny", 32, 2, "64MiB", dtype="fp32", split="data", resident="auto")
    assert wide_groups_on(step) and not wide_groups_on(prompt)
    assert launch_groups(step).members == launch_groups(step, wide=True).members
    assert launch_groups(step).n_units < launch_groups(step, wide=False).n_units
    check_groups(step, launch_groups(step), wide=True)
    monkeypatch.setenv("TURNIP_WIDE_GROUPS", "0")
    assert not wide_groups_on(step)
    monkeypatch.setenv("TURNIP_WIDE_GROUPS", "1")
    assert wide_groups_on(prompt)
    from turnip.sched.groups import group_events_on  # members' end events: off for a training step

    monkeypatch.delenv("TURNIP_GROUP_EVENTS", raising=False)
    assert group_events_on(prompt) and not group_events_on(step)
    monkeypatch.setenv("TURNIP_GROUP_EVENTS", "1")
    assert group_events_on(step)
    monkeypatch.setenv("TURNIP_GROUP_EVENTS", "0")
    assert not group_events_on(prompt)
