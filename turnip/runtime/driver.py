"""The driver loop: the ``turnip.sched.Scheduler`` (the very core the simulator drives) around a backend.

One thread does everything: it hands the scheduler's commands to the backend, polls the backend for
completions, feeds them back (``Scheduler.complete``, the fast path of ``handle(KernelDone/CopyDone)``),
and keeps per-vertex host timestamps in preallocated lists. The watchdog is part of the loop: when no
completion arrives for ``stall_s`` seconds it raises ``RuntimeStall`` with the vertices in flight.
On any error (a failed vertex, a stall, Ctrl-C) the backend is told to ``abort`` (in-flight work finishes
and is dropped) before the error propagates; the backend stays usable and ``close`` frees it once.

Times are integer ns from the start of the run on the host monotonic clock; device times come from the
backend (CUDA events on GPUs). They fill the shared trace schema (``turnip.trace``).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import numpy as np

from turnip.memgraph.plan import MemGraph
from turnip.runtime.errors import RuntimeStall
from turnip.sched import RunStarted, Scheduler


@dataclass(slots=True)
class RunResult:
    policy: str
    seed: int | None
    backend: str
    makespan_ns: int
    n_vertices: int
    wall_s: float
    host_start_ns: np.ndarray = field(repr=False)
    issue_ns: np.ndarray = field(repr=False)
    start_ns: np.ndarray = field(repr=False)
    end_ns: np.ndarray = field(repr=False)
    done_ns: np.ndarray = field(repr=False)
    stream: np.ndarray = field(repr=False)
    handle_ns: np.ndarray = field(repr=False)  # host time spent on each vertex's completion
    order: list = field(repr=False, default_factory=list)  # commands in issue order
    poll_ns: int = 0  # host time spent polling for completions (found or not), over the run
    command: np.ndarray | None = field(repr=False, default=None)  # per vertex: issued as a command of its own
    # (False for a launch group's members other than its head, which its head's command issues); None: all

    def host_cost_ns(self) -> np.ndarray:
        """Host time per vertex: issuing its command plus handling its completion (a launch group's: its head's;
        its other members 0)."""
        return (self.issue_ns - self.host_start_ns) + self.handle_ns

    def command_host_cost_ns(self) -> np.ndarray:
        """``host_cost_ns`` of the vertices issued as commands of their own: not a launch group's other members,
        not resident inputs (never issued in a run: counted, they made the median of a plan whose weights all
        stay on its GPUs 0)."""
        own = self.issue_ns > 0
        return self.host_cost_ns()[own if self.command is None else own & self.command]

    def trace(self, mg: MemGraph, meta: dict | None = None):
        """This run in the shared trace schema (``turnip.trace.Trace``), memory counter included."""
        from turnip.memgraph.timeline import memory_timeline
        from turnip.trace import Trace, spans_from_plan

        spans = spans_from_plan(mg, self.issue_ns, self.start_ns, self.end_ns, self.done_ns, self.stream,
                                self.host_start_ns)  # fmt: skip
        mem = memory_timeline(mg, self.start_ns, self.end_ns, self.makespan_ns)
        info = {"policy": self.policy, "seed": self.seed, "backend": self.backend, "source": "real"}
        return Trace(spans, mem, info | (meta or {}))

    def row(self, mg: MemGraph, meta: dict | None = None, bound: dict | None = None) -> dict:
        """One per-run CSV row with the columns simulated runs write (``sim.sweep``), plus ``backend``."""
        from analysis.metrics import run_metrics

        tr = self.trace(mg)
        row = dict(meta or {})
        row |= {"policy": self.policy, "seed": self.seed if self.seed is not None else -1, "mean_only": False}
        row["lower_bound_ns"] = (bound or {}).get("lower_bound_ns", -1)
        row |= run_metrics(tr.spans, mg.n_gpus)
        row |= {f"bound_{k}": v for k, v in (bound or {}).items() if k != "lower_bound_ns"}
        hc = self.command_host_cost_ns()
        row |= {"n_vertices": mg.n, "backend": self.backend, "run_wall_s": self.wall_s,
                "host_cost_us_p50": float(np.median(hc)) / 1e3 if len(hc) else 0.0}  # fmt: skip
        return row


AUTO_PROFILE = "auto"


def machine_profile(profile: str, backend: str, fallback: str = "h100") -> str:
    """``profile`` itself, or for ``auto`` the shipped profile of the GPU a ``cuda`` backend runs on (by its name:
    ``turnip.machine.profile.profile_for_gpu``) and ``fallback`` for the CPU backend: a run's lower bound is on the
    machine it runs on (an H200 beats an H100's bound wherever its faster memory or host link counts)."""
    if profile != AUTO_PROFILE:
        return profile
    if backend != "cuda":
        return fallback
    from turnip.machine.profile import profile_for_gpu

    try:
        from cuda_kernels._numba import cuda

        name = cuda().get_current_device().name
    except Exception:  # noqa: BLE001 - no GPU to ask (the run itself will say why): the fallback's bound
        return fallback
    return profile_for_gpu(name.decode() if isinstance(name, bytes) else str(name))


def lower_bound(mg: MemGraph, profile: str = "h100") -> dict:
    """The plan's lower bound (``turnip.machine.bound``) on a machine profile (resident inputs are not in
    the run)."""
    from turnip.machine.bound import plan_bound

    return plan_bound(mg, profile)


def execute(
    mg: MemGraph,
    backend,
    policy: str = "nondet",
    streams_per_gpu: int = 5,
    seed: int | None = None,
    stall_s: float = 60.0,
    record_order: bool = False,
    order=None,
    device_times: bool = True,
    ordered_sums: bool = True,
) -> RunResult:
    """Run ``mg`` once on ``backend`` under ``policy``; returns host and device timestamps per vertex.
    ``record_order``: keep the commands in issue order (``RunResult.order``); ``order``: the recorded order
    that ``det-replay`` replays (``turnip.sched.replay``), e.g. the ``order`` of the fastest nondet run;
    ``ordered_sums``: add each accumulator's partials in compile order, whatever order they finish in
    (bitwise reproducible outputs; off, in the order they finish)."""
    groups = getattr(backend, "groups", None)  # launch groups the backend was loaded with
    sched = Scheduler(mg, policy, streams_per_gpu, order=order, ordered_sums=ordered_sums, groups=groups)
    n = mg.n
    host_start, issue, done, stream, handle = [0] * n, [0] * n, [0] * n, [-1] * n, [0] * n
    order: list = []
    clock = time.perf_counter_ns
    submit, poll, complete = backend.submit, backend.poll, sched.complete
    stall_ns = int(stall_s * 1e9)
    backend.begin_run(seed)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection pass in the middle of the loop would stall every stream behind it
    t0 = clock()

    def issue_all(cmds) -> None:
        for c in cmds:
            v = c.v
            t = clock()
            submit(c)
            issue[v] = clock() - t0
            host_start[v] = t - t0
            stream[v] = c.stream
        if record_order:
            order.extend(cmds)

    try:
        issue_all(sched.handle(RunStarted(0)))
        last = clock()
        poll_ns = 0
        while not sched.finished:
            t = clock()
            vs = poll(min(0.05, stall_s))
            now = clock()
            poll_ns += now - t
            if not vs:
                if now - last > stall_ns:
                    raise RuntimeStall((now - last) / 1e9, [mg.label(u) for u in backend.in_flight()],
                                       sched.n_done, n)  # fmt: skip
                continue
            last = now
            for v in vs:
                t = clock()
                done[v] = t - t0
                cmds = complete(v, t - t0)
                handle[v] = clock() - t
                if cmds:
                    issue_all(cmds)
    except BaseException:
        backend.abort()
        raise
    finally:
        if gc_was_enabled:
            gc.enable()
    wall_s = (clock() - t0) / 1e9
    command = None if groups is None else groups.head == np.arange(n)  # a group's other members: issued by its head
    for h, members in groups.members.items() if groups is not None else ():  # and seen with it,
        for m in members[1:]:  # whose issue and handling are the group's host cost
            host_start[m] = issue[m] = issue[h]
            done[m], stream[m] = done[h], stream[h]
    arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    hs, iss, dn = arr(host_start), arr(issue), arr(done)
    if device_times:
        dev_start, dev_end = backend.end_run(t0)
        # device clocks and host clocks agree only to a few µs: keep the schema's ordering invariant
        st = np.minimum(np.maximum(dev_start, iss), dn)
        en = np.minimum(np.maximum(dev_end, st), dn)
        for members in groups.members.values() if groups is not None else ():  # a member starts after the one before
            for a, b in zip(members, members[1:], strict=False):
                st[b] = max(st[b], en[a])
                en[b] = max(en[b], st[b])
    else:
        st, en = iss, dn
    return RunResult(
        policy=policy,
        seed=seed,
        backend=backend.name,
        makespan_ns=int(dn.max(initial=0)),
        n_vertices=n,
        wall_s=wall_s,
        host_start_ns=hs,
        issue_ns=iss,
        start_ns=st,
        end_ns=en,
        done_ns=dn,
        stream=arr(stream),
        handle_ns=arr(handle),
        order=order,
        poll_ns=poll_ns,
        command=command,
    )
