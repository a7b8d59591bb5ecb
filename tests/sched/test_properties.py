"""Random memgraphs, random legal completion orders, every policy: the core's safety properties."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from turnip.sched import POLICIES, CopyDone, KernelDone, Launch, Scheduler, topo_order
from turnip.sched.replay import engine_orders
from turnip.sched.testing import drive, random_memgraph, recorded_order, scheduler

pytestmark = pytest.mark.property


class CoreMachine(RuleBasedStateMachine):
    """Complete any running vertex at any step; check every invariant after every event."""

    @initialize(
        seed=st.integers(0, 2**31),
        n=st.integers(1, 40),
        n_gpus=st.integers(1, 3),
        policy=st.sampled_from(POLICIES),
        streams=st.integers(1, 5),
        ordered=st.booleans(),
    )
    def setup(self, seed, n, n_gpus, policy, streams, ordered):
        self.mg = random_memgraph(np.random.default_rng(seed), n, n_gpus)
        self.s = scheduler(self.mg, policy, streams, np.random.default_rng(seed), ordered_sums=ordered)
        self.streams = streams
        self.lock_launches: dict[int, list[int]] = {}  # lock group -> its members in launch order
        self.running: list = []
        self.t = 0
        self.start_t = [-1] * n
        self.end_t = [-1] * n
        self._take(self.s.start(0))

    def _take(self, cmds):
        for c in cmds:
            assert self.start_t[c.v] == -1, f"vertex {c.v} launched twice"
            self.start_t[c.v] = self.t
            for u in self.mg.deps(c.v).tolist():
                assert 0 <= self.end_t[u] <= self.t, f"{c.v} started before its dependency {u}"
            if self.mg.lock_group[c.v] >= 0:
                self.lock_launches.setdefault(int(self.mg.lock_group[c.v]), []).append(c.v)
        self.running += cmds

    @rule(pick=st.integers(0, 10**6))
    def complete_one(self, pick):
        if not self.running:
            return
        c = self.running.pop(pick % len(self.running))
        self.t += 1
        self.end_t[c.v] = self.t
        self._take(self.s.handle(KernelDone(c.v, self.t) if type(c) is Launch else CopyDone(c.v, self.t)))

    @invariant()
    def state_is_valid(self):
        self.s.validate()

    @invariant()
    def resources_within_limits(self):
        per_gpu, engines, locks = {}, set(), set()
        for c in self.running:
            per_gpu[c.gpu] = per_gpu.get(c.gpu, 0) + 1
            if type(c) is not Launch:
                key = (c.engine, c.src_gpu, c.dst_gpu)
                assert key not in engines, f"two copies on engine {key}"
                engines.add(key)
            lk = int(self.mg.lock_group[c.v])
            if lk >= 0:
                assert lk not in locks, f"lock group {lk} held twice"
                locks.add(lk)
        assert all(k <= self.streams for k in per_gpu.values())

    @invariant()
    def ordered_sums_take_turns(self):
        # ordered: each lock's members launch in compile order (det-replay: the recorded order, its ranks)
        if self.s.ordered_sums:
            pos = self.s.rank if self.s.policy == "det-replay" else np.argsort(topo_order(self.mg)).tolist()
            for lk, vs in self.lock_launches.items():
                assert vs == sorted(vs, key=pos.__getitem__), f"lock group {lk} launched out of turn: {vs}"

    @invariant()
    def progress_until_done(self):
        if not self.running:
            assert self.s.finished and all(t >= 0 for t in self.end_t), "stopped with vertices left"


CoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=200, deadline=None, suppress_health_check=list(HealthCheck)
)
TestCore = CoreMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), policy=st.sampled_from(POLICIES), lifo=st.booleans())
def test_any_order_runs_each_vertex_once(seed, policy, lifo):
    mg = random_memgraph(np.random.default_rng(seed), 60, 3, p_edge=0.05)
    s = scheduler(mg, policy, 3, np.random.default_rng(seed))
    todo, t, count = s.start(), 0, np.zeros(mg.n, dtype=int)
    while todo:
        c = todo.pop() if lifo else todo.pop(0)
        count[c.v] += 1
        t += 1
        todo += s.handle(KernelDone(c.v, t) if type(c) is Launch else CopyDone(c.v, t))
    assert s.finished and (count == 1).all()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n_gpus=st.integers(1, 3), streams=st.integers(1, 5))
def test_det_replay_reissues_the_recorded_order_whatever_the_timing(seed, n_gpus, streams):
    rng = np.random.default_rng(seed)
    mg = random_memgraph(rng, 50, n_gpus)
    rec = recorded_order(mg, streams, rng)
    replayed = drive(Scheduler(mg, "det-replay", streams, order=rec), rng)
    assert engine_orders(mg, replayed) == engine_orders(mg, rec)
