"""The SimPy model: virtual GPUs driven by the same ``turnip.sched`` core as the real runtime.

State it owns (virtual time in integer ns):
  host_free_ns        when the single host thread is free to issue the next command
  compute_free_ns[g]  when GPU g's kernel engine is free (kernels run one at a time, in issue order; one
                      that starts behind another takes the profile's concurrency factor, ``overlap_factor``)
  pcie[g][d]          the copy in flight on GPU g's host link in direction d (0: h2d, 1: d2h) as
                      [v, bytes left, rate, last update ns, token]; both directions share the link: when
                      both run each gets its share of ``pcie_both_bytes_per_s``, and the survivor speeds up
                      again when the other finishes (stale completions are recognised by their token)
  copies_active[g]    copies touching GPU g now (kernels issued meanwhile are slowed and noisier)
  bucket[g]           GPU g's power bucket (ns of full-clock busy time beyond its sustained duty, as of
                      bucket_t[g]): the power limit (``MachineProfile.power_duty``)
Each launched vertex costs one ``Timeout`` when the host has issued it, one when its completion reaches the
scheduler, and host-link copies one more when their bytes are through. No generator process per vertex.
Every run records its issue order (``SimResult.order``), which ``det-replay`` replays (``fastest_run``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from sim.timing import TimingModel
from turnip.machine.costs import ENG_H2D, ENG_KERNEL, ENG_P2P
from turnip.machine.profile import MachineProfile
from turnip.memgraph.plan import MemGraph
from turnip.sched import Scheduler


@dataclass(slots=True)
class SimResult:
    policy: str
    seed: int
    mean_only: bool
    makespan_ns: int
    bound: dict
    n_vertices: int
    wall_s: float
    issue_ns: np.ndarray = field(repr=False)
    start_ns: np.ndarray = field(repr=False)
    end_ns: np.ndarray = field(repr=False)
    done_ns: np.ndarray = field(repr=False)
    stream: np.ndarray = field(repr=False)
    host_start_ns: np.ndarray = field(repr=False)
    order: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int64))  # issue order

    @property
    def lower_bound_ns(self) -> int:
        return self.bound["lower_bound_ns"]

    def trace(self, mg: MemGraph, meta: dict | None = None):
        """This run in the shared trace schema (``turnip.trace.Trace``), memory counter included."""
        from turnip.memgraph.timeline import memory_timeline
        from turnip.trace import Trace, spans_from_plan

        spans = spans_from_plan(mg, self.issue_ns, self.start_ns, self.end_ns, self.done_ns, self.stream,
                                self.host_start_ns)  # fmt: skip
        mem = memory_timeline(mg, self.start_ns, self.end_ns, self.makespan_ns)
        info = {"policy": self.policy, "seed": self.seed, "mean_only": self.mean_only} | (meta or {})
        return Trace(spans, mem, info)


class Simulation:
    """One run of one memgraph under one policy and seed."""

    def __init__(
        self,
        mg: MemGraph,
        prof: MachineProfile,
        policy: str = "nondet",
        seed: int = 0,
        mean_only: bool = False,
        tm: TimingModel | None = None,
        order=None,
        power_full: bool = False,
    ):
        """``order``: the recorded issue order ``det-replay`` replays (``turnip.sched.replay``);
        ``power_full``: start with the power bucket full (the GPU rested before the run), not empty."""
        if mg.n_gpus > prof.n_gpus:
            raise ValueError(f"plan uses {mg.n_gpus} GPUs; profile {prof.name!r} has {prof.n_gpus}")
        import simpy

        self.mg, self.prof, self.policy, self.seed, self.mean_only = mg, prof, policy, seed, mean_only
        self.tm = tm = tm or TimingModel(mg, prof)
        self.env = simpy.Environment()
        dur = tm.mean_ns() if policy == "nondet-cp" else None
        self.core = Scheduler(mg, policy, prof.streams_per_gpu, dur_ns=dur, order=order)
        d = tm.draws(None if mean_only else np.random.default_rng(seed))
        self.f, self.fc, self.stall = d.factor.tolist(), d.factor_contended.tolist(), d.stall_ns.tolist()
        self.eng = tm.eng.tolist()
        self.gpu = mg.gpu.tolist()
        self.src = mg.src_gpu.tolist()
        self.kernel_ns = tm.kernel_ns.tolist()
        self.overlap = tm.overlap.tolist()
        self.duty = prof.power_duty  # 1.0: no power limit
        self.handle_ns = prof.handle_ns
        self.power_cap = prof.power_duty * prof.power_burst_s * 1e9
        self.bucket = [self.power_cap if power_full else 0.0] * mg.n_gpus
        self.bucket_t = [0] * mg.n_gpus
        self.nbytes = tm.nbytes.tolist()
        self.launch_ns = tm.launch_ns.tolist()
        n, g = mg.n, mg.n_gpus
        self.issue, self.start, self.end, self.done = [0] * n, [0] * n, [0] * n, [0] * n
        self.stream = [-1] * n
        self.order: list[int] = []
        self.host_free = 0
        self.compute_free = [0] * g
        self.copies_active = [0] * g
        self.pcie: list[list] = [[None, None] for _ in range(g)]
        self._token = 0
        both = prof.pcie_both_bytes_per_s / (prof.h2d_bytes_per_s + prof.d2h_bytes_per_s)
        self.rate_solo = (prof.h2d_bytes_per_s / 1e9, prof.d2h_bytes_per_s / 1e9)  # bytes per ns
        self.rate_shared = (min(1.0, both) * self.rate_solo[0], min(1.0, both) * self.rate_solo[1])

    # ------------------------------------------------------------------ driver loop
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self._perform(self.core.start(0))
        self.env.run()
        if not self.core.finished:  # pragma: no cover - the core raises SchedulerStall first
            raise self.core.stall_error()
        from turnip.machine.bound import lower_bound

        arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        issue = arr(self.issue)
        return SimResult(
            policy=self.policy,
            seed=self.seed,
            mean_only=self.mean_only,
            makespan_ns=max(self.done, default=0),
            bound=self._bound(lower_bound),
            n_vertices=self.mg.n,
            wall_s=time.perf_counter() - t0,
            issue_ns=issue,
            start_ns=arr(self.start),
            end_ns=arr(self.end),
            done_ns=arr(self.done),
            stream=arr(self.stream),
            host_start_ns=issue - arr(self.launch_ns),
            order=arr(self.order),
        )

    def _bound(self, lower_bound) -> dict:
        """The plan's lower bound, computed once per timing model."""
        if getattr(self.tm, "_bound", None) is None:
            self.tm._bound = lower_bound(self.tm)
        return self.tm._bound

    def _perform(self, cmds: list) -> None:
        now = self.env.now
        t = self.host_free if self.host_free > now else now
        for c in cmds:
            v = c.v
            t += self.launch_ns[v]
            self.issue[v] = t
            self.stream[v] = c.stream
            self.order.append(v)
            self.env.timeout(t - now, v).callbacks.append(self._on_issued)
        self.host_free = t

    def _on_issued(self, ev) -> None:
        v, now = ev.value, self.env.now
        e = self.eng[v]
        if e == ENG_KERNEL:
            g = self.gpu[v]
            ready = now + self.prof.kernel_start_latency_ns
            busy = self.compute_free[g] > ready
            start = self.compute_free[g] if busy else ready
            if self.copies_active[g]:
                dur = self.kernel_ns[v] * self.fc[v] * self.prof.kernel_slowdown_with_copies
            else:
                dur = self.kernel_ns[v] * self.f[v]
            dur = int(dur * self.overlap[v]) if busy else int(dur)  # it shares the GPU with the one before
            if self.duty < 1.0:
                dur = self._power_limited(g, start, dur)
            self.start[v], self.end[v] = start, start + dur
            self.compute_free[g] = start + dur
            self._deliver(v, start + dur - now)
        elif e == ENG_P2P:
            p = self.prof
            dur = int((p.p2p_latency_ns + self.nbytes[v] * 1e9 / p.p2p_bytes_per_s) * self.f[v])
            dur += self.stall[v]
            self.start[v], self.end[v] = now, now + dur
            self.copies_active[self.src[v]] += 1
            self.copies_active[self.gpu[v]] += 1
            self._deliver(v, dur)
        else:
            self._pcie_start(v, now, 0 if e == ENG_H2D else 1)

    def _power_limited(self, g: int, start: int, dur: int) -> int:
        """Duration of a kernel of ``dur`` ns at full clock starting at ``start`` on GPU g under the power
        limit: tokens (ns of full-clock busy time) accrue at ``power_duty`` per ns up to the bucket's capacity
        and a kernel spends one per ns; once the bucket is empty it goes on at ``power_duty`` of its speed.
        Kernels start in order on a GPU's engine."""
        duty = self.duty
        level = min(self.power_cap, self.bucket[g] + duty * max(0, start - self.bucket_t[g]))
        drain = (1.0 - duty) * dur
        if level >= drain:
            level -= drain
        else:
            t_full = level / (1.0 - duty)  # at full clock until the bucket is empty, then slower
            dur = int(t_full + (dur - t_full) / duty)
            level = 0.0
        self.bucket[g], self.bucket_t[g] = level, start + dur
        return dur

    def _deliver(self, v: int, delay_ns: int) -> None:
        """The completion of v reaches the scheduler ``completion_ns`` after the device finishes it."""
        self.env.timeout(delay_ns + self.prof.completion_ns, v).callbacks.append(self._on_done)

    def _on_done(self, ev) -> None:
        v, now = ev.value, self.env.now
        seen = self.host_free if self.host_free > now else now  # the host loop sees it once it is free
        self.done[v] = seen
        self.host_free = seen + self.handle_ns  # and handles it before issuing anything else
        if self.eng[v] == ENG_P2P:
            self.copies_active[self.src[v]] -= 1
            self.copies_active[self.gpu[v]] -= 1
        cmds = self.core.complete(v, seen)
        if cmds:
            self._perform(cmds)

    # ------------------------------------------------------------------ host link sharing
    def _pcie_start(self, v: int, now: int, d: int) -> None:
        g = self.gpu[v]
        self.start[v] = now
        self.copies_active[g] += 1
        link = self.pcie[g]
        other = link[1 - d]
        if other is None:
            rec = [v, self.nbytes[v] * self.f[v], self.rate_solo[d], now, 0]
        else:
            rec = [v, self.nbytes[v] * self.fc[v], self.rate_shared[d], now, 0]
            self._reschedule(other, now, self.rate_shared[1 - d], g, 1 - d)
        link[d] = rec
        self._reschedule(rec, now, rec[2], g, d)

    def _reschedule(self, rec: list, now: int, rate: float, g: int, d: int) -> None:
        rec[1] -= rec[2] * (now - rec[3])
        rec[2], rec[3] = rate, now
        self._token += 1
        rec[4] = self._token
        delay = max(0, math.ceil(rec[1] / rate - 1e-6))
        self.env.timeout(delay, (g, d, self._token)).callbacks.append(self._on_bytes_through)

    def _on_bytes_through(self, ev) -> None:
        g, d, token = ev.value
        link = self.pcie[g]
        rec = link[d]
        if rec is None or rec[4] != token:
            return  # rescheduled since
        now, v = self.env.now, rec[0]
        link[d] = None
        self.copies_active[g] -= 1
        other = link[1 - d]
        if other is not None:
            self._reschedule(other, now, self.rate_solo[1 - d], g, 1 - d)
        tail = self.prof.copy_latency_ns + self.stall[v]
        self.end[v] = now + tail
        self._deliver(v, tail)


def simulate(
    mg: MemGraph,
    prof: MachineProfile,
    policy: str = "nondet",
    seed: int = 0,
    mean_only: bool = False,
    tm: TimingModel | None = None,
    order=None,
    power_full: bool = False,
) -> SimResult:
    """Simulate one run. Same arguments → same result. ``det-replay`` needs ``order`` (``fastest_run``);
    ``power_full``: the GPUs start rested (their power bucket full)."""
    return Simulation(mg, prof, policy, seed, mean_only, tm, order, power_full).run()


def fastest_run(
    mg: MemGraph,
    prof: MachineProfile,
    seeds,
    mean_only: bool = False,
    tm: TimingModel | None = None,
    policy: str = "nondet",
    progress=None,
) -> SimResult:
    """The fastest of ``policy`` runs over ``seeds`` (the first on ties). Its ``order`` is the ``det-replay``
    baseline: the best order nondet found, replayed fixed (``simulate(..., order=r.order)``). ``progress``:
    called with the number of runs done."""
    tm = tm or TimingModel(mg, prof)
    best = None
    for i, s in enumerate(seeds, 1):
        r = simulate(mg, prof, policy, s, mean_only, tm)
        if best is None or r.makespan_ns < best.makespan_ns:
            best = r
        if progress is not None:
            progress(i)
    if best is None:
        raise ValueError("fastest_run needs at least one seed")
    return best
