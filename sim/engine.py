"""The discrete-event model: virtual GPUs driven by the same ``turnip.sched`` core as the real runtime.

State it owns (virtual time in integer ns):
  host_free_ns        when the single host thread is free to issue the next command
  compute_free_ns[g]  when GPU g's kernel engine is free (kernels run one at a time, in issue order but for
                      launch groups under way, which take turns: ``kq``, ``_interleave``; one that starts
                      behind another takes the profile's concurrency factor, ``overlap_factor``)
  pcie[2g + d]        the copy in flight on GPU g's host link in direction d (0: h2d, 1: d2h) as
                      [v, bytes left, rate, last update ns, token, end ns, 2g + d]; both directions share the
                      link: when both run each gets its share of ``pcie_both_bytes_per_s``, and the survivor
                      speeds up again when the other finishes (stale completions are recognised by their token)
  caps                the host behind the links (``MachineProfile.host_*_total_bytes_per_s``; None for one
                      GPU or a profile without them): with 2 or more GPUs copying, every active host copy's
                      rate is recomputed whenever one starts or ends (``_share``), scaled down so that each
                      direction's total and, with both directions running, the total of all stay within the
                      host's rate for that many GPUs (the rates of each set of copies in flight are worked
                      out once per plan and link factor: ``_share_rates``)
  copies_active[g]    copies touching GPU g now (kernels issued meanwhile are slowed and noisier)
  p2p_active[g]       of which GPU<->GPU copies (``kernel_slowdown_with_p2p``)
  bucket[g]           GPU g's power bucket (ns at the power limit, as of bucket_t[g]): a kernel at full
                      clock spends its power over the limit's per ns, the bucket refills one per ns (less
                      what an idle GPU draws), and an empty one slows kernels that draw more than the limit;
                      under the shared-clock model it goes into debt and the debt lowers the GPU's clock
                      for every kernel (``MachineProfile``)
Launch groups (``turnip.sched.groups``; on for plans of several GPUs unless ``TURNIP_LAUNCH_GROUPS`` says
otherwise): the core launches a group's head alone; here its members run back to back on its GPU behind that
one issue (costing the head's launch plus ``group_member_launch_ns`` per other member), and one completion
event, the last member's, reaches the host loop for all of them. A group's members become ready one after
another, as a captured graph's nodes do, so a kernel issued on the GPU while a group is under way runs at the
next kernel boundary, not behind the whole group, and two groups under way take turns (``INTERLEAVE``; each
kernel next to start is the one ready longest, ``_interleave``): traced on four H100s, a rotary issued behind a
13-kernel group started within 12 µs, and two groups' kernels alternated.
Events are handled in time order, ties in the order they were scheduled: the order of a SimPy
``Environment``'s timeouts, kept in a heap of plain tuples (``Simulation._loop``). Each launched vertex is an
event when the host has issued it (handled at once when nothing pending comes first) and one when its
completion reaches the scheduler; host link copies one more when their bytes are through. Every run records its
issue order (``SimResult.order``), which ``det-replay`` replays (``fastest_run``). What does not change from
run to run of a plan (per-vertex lists, the scheduler's tables, the host's shared rates, the last few seeds'
draws) is built once per timing model (``PlanData``).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from sim.timing import Draws, TimingModel
from turnip.machine.costs import ENG_H2D, ENG_KERNEL, ENG_P2P, host_costs, link_rates
from turnip.machine.profile import MachineProfile, host_total_bytes_per_s
from turnip.memgraph.plan import MemGraph
from turnip.sched import Scheduler
from turnip.sched.groups import group_events_on, launch_groups, launch_groups_on, training_step
from turnip.sched.replay import issue_order


@dataclass(slots=True)
class SimResult:
    policy: str
    seed: int
    mean_only: bool
    makespan_ns: int
    bound: dict
    n_vertices: int
    wall_s: float  # host seconds to set the run up (scheduler, draws) and run it
    issue_ns: np.ndarray = field(repr=False)
    start_ns: np.ndarray = field(repr=False)
    end_ns: np.ndarray = field(repr=False)
    done_ns: np.ndarray = field(repr=False)
    stream: np.ndarray = field(repr=False)
    host_start_ns: np.ndarray = field(repr=False)
    handle_ns: np.ndarray = field(repr=False)  # host time spent handling each vertex's completion
    order: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int64))  # issue order
    host_factor: float = 1.0  # the run's host speed factor (drawn or given)
    link_factor: float = 1.0  # the run's host link time factor (drawn or given)

    @property
    def lower_bound_ns(self) -> int:
        return self.bound["lower_bound_ns"]

    def host_cost_ns(self) -> np.ndarray:
        """Host time per vertex: issuing its command plus handling its completion (as a real run's
        ``turnip.runtime.RunResult.host_cost_ns``)."""
        return (self.issue_ns - self.host_start_ns) + self.handle_ns

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

    EAGER = True  # a command whose issue comes before every pending event is issued at once, not through the heap
    INTERLEAVE = True  # kernels of launch groups under way and those issued meanwhile take turns (``_interleave``)

    def __init__(
        self,
        mg: MemGraph,
        prof: MachineProfile,
        policy: str = "nondet",
        seed: int = 0,
        mean_only: bool = False,
        tm: TimingModel | None = None,
        order=None,
        power_level: list[float] | None = None,
        host: float | None = None,
        link: float | None = None,
        ordered_sums: bool = True,
        draws: Draws | None = None,
        groups: bool | None = None,
    ):
        """``order``: the recorded issue order ``det-replay`` replays (``turnip.sched.replay``);
        ``power_level``: each GPU's power bucket at the start (ns; None: empty; ``simulate`` starts a run in
        the steady state of runs back to back); ``host``: the run's host speed factor (every host cost times
        it) in place of the one drawn from ``host_excess_sd``; ``link``: the host links' time factor for this
        run (every copy between host and GPU pushes its bytes ``link`` times slower; its latency stays) in
        place of the one drawn from ``link_excess_sd`` (``TimingModel.link_factor``: correlated with the host
        factor, drawn or given); ``draws``: this seed's draws (``TimingModel.draws``), when already taken;
        ``groups``: kernels dispatched in launch groups (``turnip.sched.groups``; None: ``launch_groups_on``, on
        for several GPUs), a group's members run one after another behind its head's issue, one completion for
        all."""
        t0 = time.perf_counter()
        if host is not None and not host > 0:
            raise ValueError(f"host speed factor must be > 0, got {host}")
        if link is not None and (not link > 0 or math.isinf(link)):
            raise ValueError(f"host link factor must be > 0 and finite, got {link}")
        if mg.n_gpus > prof.n_gpus:
            raise ValueError(f"plan uses {mg.n_gpus} GPUs; profile {prof.name!r} has {prof.n_gpus}")
        self.mg, self.prof, self.policy, self.seed, self.mean_only = mg, prof, policy, seed, mean_only
        self.tm = tm = tm or TimingModel(mg, prof)
        pd = plan_data(tm) if tm.mg is mg else PlanData(tm)
        if groups is None:
            groups = launch_groups_on(mg.n_gpus)
        self.core = pd.scheduler(policy, prof.streams_per_gpu, order, ordered_sums, groups)
        self.members = self.core.groups.members if self.core.groups is not None else {}
        # this seed's draws as lists (kept on the plan's data: every policy's run of the seed takes the same)
        self.draws, self.f, self.fc, self.stall = pd.draws(seed, mean_only, draws)
        d = self.draws
        self.eng, self.gpu, self.src, self.kernel_ns, self.overlap = pd.eng, pd.gpu, pd.src, pd.kernel_ns, pd.overlap
        self.host_factor = d.host if host is None else float(host)  # this run's host speed: every host cost x it
        h = host_costs(tm, self.host_factor)
        launch, self.handle_ns, self.handle_cmd_ns, self.completion_ns, self.poll_ns = h
        self.limited = power_limited(prof)
        self.clock = self.limited and prof.power_slow_gemm > 0.0  # the shared-clock model
        self.power_cap = 0.0
        self.refill = 1.0 - prof.power_idle_weight  # per ns of idle
        if self.limited:
            pm = power_model(mg, prof, tm)
            self.pw_flops, self.pw_rate, self.pw_other, self.power_cap = pm.flops, pm.rate, pm.other, pm.cap
            self.pw_slow, self.window = pm.slow, prof.power_window_s * 1e9
            self.draw_loss = 1.0 - prof.power_clock_draw  # what theta 1 takes off a flop-bound kernel's draw
        self.bucket = [min(self.power_cap, x) for x in power_level] if power_level else [0.0] * mg.n_gpus
        self.throttled = False  # a kernel of this run was slowed by the power limit
        self.bucket_t = [0] * mg.n_gpus
        # a kernel's duration under the power model, ``(g, start, dur, v) -> dur`` (None: no power limit)
        self.power = (self._power_clock() if self.clock else self._power_limited()) if self.limited else None
        self.nbytes = pd.nbytes
        self.launch_ns = pd.launch_ns if launch is tm.launch_ns else launch.tolist()
        if self.members:  # a group's graph: its head's launch and a node's cost per other member
            self.launch_ns = list(self.launch_ns)
            member = prof.group_member_launch_ns  # as the runtime captures the plan's groups: member events or not
            if not group_events_on(mg, pd.training) and prof.group_member_noevent_launch_ns:
                member = prof.group_member_noevent_launch_ns
            per = int(member * self.host_factor)
            for h, m in self.members.items():
                self.launch_ns[h] += per * (len(m) - 1)
                for u in m[1:]:  # issued by the head's command: no issue of their own
                    self.launch_ns[u] = 0
        self.switch_ns = int(prof.gpu_switch_launch_ns * self.host_factor) if mg.n_gpus > 1 else 0
        self.last_gpu = 0  # the GPU of the command issued last (a kernel for another one pays switch_ns)
        n, g = mg.n, mg.n_gpus
        self.issue, self.start, self.end, self.done = [0] * n, [0] * n, [0] * n, [0] * n
        self.handle = [0] * n  # host time spent handling each vertex's completion
        self.order: list[int] = []
        self.inflight = 0  # vertices issued and not yet seen done (the host loop polls each one's end event)
        self.host_free = 0
        self.compute_free = [0] * g
        # with launch groups: each GPU's kernels not yet ended, [start, end, v, unit (its group's head), dur,
        # ready], in start order (those ended are dropped when ``_interleave`` reads it); when the last group
        # member due to start on it does; each unit's expected completion (-1 once seen: its other events are
        # stale) and issue number
        self.interleave = bool(self.members) and self.INTERLEAVE
        self.kq: list[list[list[int]]] = [[] for _ in range(g)]
        self.grp_until = [0] * g
        self.kdone = [0] * n if self.interleave else []
        self.useq: dict[int, int] = {}
        self.copies_active = [0] * g
        self.p2p_active = [0] * g  # of which GPU<->GPU copies
        self.slow_p2p = prof.kernel_slowdown_with_p2p or prof.kernel_slowdown_with_copies
        # by kernel: 1 + (slow_p2p - 1) x the memory share of its roofline (``p2p_slowdown_memory_share``), else None
        self.slow_p2p_v = tm.p2p_slowdowns(self.slow_p2p) if prof.p2p_slowdown_memory_share else None
        self.ports = ([0] * g, [0] * g) if prof.p2p_ports_serial else None  # each GPU's NVLink out, in: free at
        self.pcie: list[list | None] = [None] * (2 * g)
        self.link_factor = link = tm.link_factor(self.host_factor, d.link_z) if link is None else float(link)
        solo, shared = link_rates(prof)  # bytes per ns, this run's link ``link`` times slower
        self.rate_solo, self.rate_shared = tuple(x / link for x in solo), tuple(x / link for x in shared)
        self.caps = host_caps(prof, g, link)
        self._shares = None if self.caps is None else pd.share_rates(link)  # ``_share_rates`` of each state
        self._armed = None  # with caps: (the record whose end the one live timer waits for, that end's ns)
        self._copying = 0  # with caps: the host link copies in flight, 2 bits per GPU (1: to it, 2: from it)
        self._q: list[tuple[int, int, int]] = []  # pending events: (t_ns, seq, code), see ``_loop``
        self._seq = 0  # events scheduled so far: ties in time go in the order they were scheduled
        self._through: list = [None]  # the copy record of each bytes-through event (its token: its index)
        self._setup_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ driver loop
    def run(self) -> SimResult:
        t0 = time.perf_counter()
        batch = self.core.start_ids(0)
        self.order += batch
        self.host_free = self._issue_times(batch, 0)  # issued one after another from 0
        for i, v in enumerate(batch):
            heapq.heappush(self._q, (self.issue[v], i, v << 1))
        self._seq = len(batch)
        self._loop()
        if not self.core.finished:  # pragma: no cover - the core raises SchedulerStall first
            raise self.core.stall_error()
        arr = lambda x: np.fromiter(x, dtype=np.int64, count=len(x))  # noqa: E731
        issue, done = arr(self.issue), arr(self.done)
        return SimResult(
            policy=self.policy,
            seed=self.seed,
            mean_only=self.mean_only,
            makespan_ns=int(done.max()) if len(done) else 0,
            bound=plan_bound(self.tm, self.host_factor, self.link_factor),
            host_factor=self.host_factor,
            link_factor=self.link_factor,
            n_vertices=self.mg.n,
            wall_s=self._setup_s + time.perf_counter() - t0,
            issue_ns=issue,
            start_ns=arr(self.start),
            end_ns=arr(self.end),
            done_ns=done,
            stream=arr(self.core.stream_of),  # each vertex's slot, -1 for the resident inputs
            host_start_ns=issue - arr(self.launch_ns),
            handle_ns=arr(self.handle),
            order=arr(self.core.groups.expand(self.order) if self.core.groups is not None else self.order),
        )

    def _loop(self) -> None:
        """Handle events in time order, ties in the order they were scheduled (as a SimPy ``Environment`` orders
        its timeouts), until none is left.

        Pending events are ``(t_ns, seq, code)`` in the heap ``_q``: code ``2v`` vertex v issued, ``2v + 1`` its
        completion reaching the host, ``-k`` the bytes of the host link copy ``_through[k]`` through (if its
        record still carries token k: a copy whose rate changed since has a later event). A completion hands the
        host a batch of commands to issue one after another; their issue events take the next numbers at once,
        and each one whose issue comes before every pending event is handled right there (``EAGER``), as the
        heap would pop it next; from the first that does not, the rest of the batch goes through the heap (and
        is handled the same way when popped). A host link copy in flight is a record ``[v, bytes left, rate,
        their ns, token, end ns (-1: not worked out, ``_share``), slot]`` in ``pcie[slot]`` (slot 2g + d: GPU g,
        direction d); one alone on its GPU's link (the common case) is handled here, the rest by ``_reschedule``
        and, under the host's caps, ``_share`` (which take and return the next event number)."""
        q, pop, push, ceil = self._q, heapq.heappop, heapq.heappush, math.ceil
        prof, eager, through, pcie = self.prof, self.EAGER, self._through, self.pcie
        eng, gpu, src, nbytes, stall = self.eng, self.gpu, self.src, self.nbytes, self.stall
        kernel_ns, f, fc, overlap = self.kernel_ns, self.f, self.fc, self.overlap
        issue, start, end, done, handle = self.issue, self.start, self.end, self.done, self.handle
        launch, order, complete, members = self.launch_ns, self.order, self.core.complete_ids, self.members
        compute_free, copies_active, ports = self.compute_free, self.copies_active, self.ports
        p2p_active, slow_p2p, slow_p2p_v = self.p2p_active, self.slow_p2p, self.slow_p2p_v
        start_latency, slowdown = prof.kernel_start_latency_ns, prof.kernel_slowdown_with_copies
        p2p_latency, p2p_rate, copy_latency = prof.p2p_latency_ns, prof.p2p_bytes_per_s, prof.copy_latency_ns
        completion, poll, handle_ns, handle_cmd = self.completion_ns, self.poll_ns, self.handle_ns, self.handle_cmd_ns
        rate_solo, rate_shared, caps = self.rate_solo, self.rate_shared, self.caps
        power = self.power
        kernel, p2p, h2d = ENG_KERNEL, ENG_P2P, ENG_H2D
        host_free, inflight, seq = self.host_free, self.inflight, self._seq
        switch_ns, last_gpu = self.switch_ns, self.last_gpu
        interleave, kdone, grp_until, kq, useq = self.interleave, self.kdone, self.grp_until, self.kq, self.useq
        while q:
            now, _, code = pop(q)
            if code < 0:  # a host link copy's bytes through, if its record still carries this event's token
                rec = through[-code]
                if rec[4] != -code:
                    continue  # its rate changed since: a later event stands
                v, i = rec[0], rec[6]
                pcie[i] = None
                copies_active[i >> 1] -= 1
                other = pcie[i ^ 1]
                if caps is not None:
                    self._armed = None  # it was this copy's
                    self._copying -= (1 + (i & 1)) << (i & -2)
                    seq = self._share(now, seq)
                elif other is not None:  # the other direction has the link to itself again
                    seq = self._reschedule(other, now, rate_solo[other[6] & 1], seq)
                t = now + (copy_latency + stall[v])  # then its latency and any stall
                end[v] = t
                push(q, (t + completion, seq, (v << 1) | 1))  # its completion reaches the host loop
                seq += 1
                continue
            if code & 1:  # v's completion reaches the host loop
                v = code >> 1
                e = eng[v]
                if interleave and e == kernel:
                    k = kdone[v]
                    if k != now:  # rescheduled since (``_interleave``): moved later, it waits again; moved
                        if k > now:  # earlier, its own event came (or comes) first
                            push(q, (k, seq, code))
                            seq += 1
                        continue
                    kdone[v] = -1  # seen: any other event of it is stale
                polled = now + poll * inflight  # the loop queries every in-flight vertex's end event in turn
                seen = host_free if host_free > polled else polled  # and sees it once it is free
                done[v] = seen
                inflight -= 1
                if e == p2p:
                    copies_active[src[v]] -= 1
                    copies_active[gpu[v]] -= 1
                    p2p_active[src[v]] -= 1
                    p2p_active[gpu[v]] -= 1
                batch = complete(v, seen)
                if members and v in members:  # a launch group: every member done with its head
                    for m in members[v]:
                        done[m] = seen
                # it handles the completion (the longer, the more commands it hands back), then issues them
                n = len(batch)
                h = handle_ns + handle_cmd * n
                handle[v] = h
                host_free = t = seen + h
                if not n:
                    continue
                order += batch
                k = seq  # the batch's issue events take the next numbers
                seq += n
                popped, wait = False, not eager
            else:  # an issue the heap held back: handled as a batch of one, issued at now
                batch, popped = (code >> 1,), True
            for v in batch:
                if popped:
                    t = now
                else:  # its issue time (``_issue_times``, inlined)
                    t += launch[v]
                    if switch_ns and gpu[v] != last_gpu:
                        last_gpu = gpu[v]
                        if eng[v] == kernel:
                            t += switch_ns
                    issue[v] = t
                    if wait or (q and q[0][0] <= t):  # a pending event comes first: this and the rest wait
                        wait = True
                        push(q, (t, k, v << 1))
                        k += 1
                        continue
                    k += 1
                inflight += 1  # v is issued at t
                e = eng[v]
                if e == kernel:
                    g = gpu[v]
                    ready = t + start_latency
                    if interleave and ready < grp_until[g]:  # a group's members still to start: take turns
                        seq = self._interleave(v, g, t, ready, power, seq)
                        continue
                    if members and v in members:  # a launch group: its members one after another
                        done_at = self._run_group(members[v], g, t, ready, power)
                    else:
                        busy = compute_free[g] > ready
                        s = compute_free[g] if busy else ready
                        if copies_active[g]:  # slowed and noisier while copies run
                            sp = (slow_p2p_v[v] if slow_p2p_v else slow_p2p) if p2p_active[g] else slowdown
                            dur = kernel_ns[v] * fc[v] * sp
                        else:
                            dur = kernel_ns[v] * f[v]
                        dur = int(dur * overlap[v]) if busy else int(dur)  # it shares the GPU with the one before
                        if power is not None:
                            dur = power(g, s, dur, v)
                        start[v] = s
                        end[v] = compute_free[g] = done_at = s + dur
                        if interleave:  # queued, its unit numbered in issue order
                            kq[g].append([s, done_at, v, v, dur, ready])
                            useq[v] = len(useq)
                    if interleave:
                        kdone[v] = done_at + completion
                    push(q, (done_at + completion, seq, (v << 1) | 1))
                    seq += 1
                elif e == p2p:
                    dur = int((p2p_latency + nbytes[v] * 1e9 / p2p_rate) * f[v]) + stall[v]
                    s = t
                    if ports is not None:  # after the copies out of its source and into its GPU issued before
                        s = max(t, ports[0][src[v]], ports[1][gpu[v]])
                        ports[0][src[v]] = ports[1][gpu[v]] = s + dur
                    start[v], end[v] = s, s + dur
                    copies_active[src[v]] += 1
                    copies_active[gpu[v]] += 1
                    p2p_active[src[v]] += 1
                    p2p_active[gpu[v]] += 1
                    push(q, (s + dur + completion, seq, (v << 1) | 1))
                    seq += 1
                else:  # a host link copy: its bytes at its link's rate (shared, when both directions run)
                    d = 0 if e == h2d else 1
                    g = gpu[v]
                    i = g + g + d
                    start[v] = t
                    copies_active[g] += 1
                    other = pcie[i ^ 1]
                    if caps is not None:  # the host's caps: every copy's rate may change
                        pcie[i] = [v, nbytes[v] * (f[v] if other is None else fc[v]), 0.0, t, 0, 0, i]
                        self._copying += (1 + d) << (g + g)
                        seq = self._share(t, seq)
                    elif other is None:  # alone on the link (``_reschedule``, inlined)
                        pcie[i] = rec = [v, nbytes[v] * f[v], rate_solo[d], t, 0, 0, i]
                        rec[4] = token = len(through)
                        through.append(rec)
                        delay = ceil(rec[1] / rec[2] - 1e-6)
                        push(q, (t + (delay if delay > 0 else 0), seq, -token))
                        seq += 1
                    else:
                        rec = [v, nbytes[v] * fc[v], rate_shared[d], t, 0, 0, i]
                        seq = self._reschedule(other, t, rate_shared[1 - d], seq)
                        pcie[i] = rec
                        seq = self._reschedule(rec, t, rec[2], seq)
            if not popped:
                host_free = t
        self.host_free, self.inflight, self._seq, self.last_gpu = host_free, inflight, seq, last_gpu

    def _issue_times(self, batch: list[int], t: int) -> int:
        """Issue the commands ``batch`` one after another from ``t`` (``issue``): each one its launch cost after
        the one before, a kernel or launch group for another GPU than the command before it ``switch_ns`` more (a
        copy costs none but moves the host to its GPU too). The last one's issue time."""
        issue, launch, gpu, eng = self.issue, self.launch_ns, self.gpu, self.eng
        switch_ns, last = self.switch_ns, self.last_gpu
        for v in batch:
            t += launch[v]
            if switch_ns and gpu[v] != last:
                last = gpu[v]
                if eng[v] == ENG_KERNEL:
                    t += switch_ns
            issue[v] = t
        self.last_gpu = last
        return t

    def _run_group(self, members: list[int], g: int, t: int, ready: int, power) -> int:
        """A launch group issued at ``t`` on GPU ``g``: its kernels one after another (each as a kernel issued at
        ``t`` would run), queued with the group numbered in issue order (``kq``, ``useq``); the last one's end."""
        issue, start, end, head = self.issue, self.start, self.end, members[0]
        kq = self.kq[g] if self.interleave else None
        prev = ready
        for u, (s, dur) in zip(members, self._in_turn(members, g, ready, power), strict=True):
            issue[u], start[u] = t, s
            end[u] = fin = s + dur
            if kq is not None:
                kq.append([s, fin, u, head, dur, prev])
                prev = fin
        if kq is not None:
            self.useq[head] = len(self.useq)
            self.grp_until[g] = s
        self.compute_free[g] = fin
        return fin

    def _in_turn(self, members: list[int], g: int, ready: int, power) -> list[tuple[int, int]]:
        """(start, duration) of ``members`` run one after another on GPU ``g`` behind its queue, ready at
        ``ready``: slowed while copies run, shared with the kernel before (``overlap``), under the power model."""
        compute_free, kernel_ns, f, fc, overlap = self.compute_free[g], self.kernel_ns, self.f, self.fc, self.overlap
        p2p = self.p2p_active[g]
        slowdown = self.slow_p2p if p2p else self.prof.kernel_slowdown_with_copies
        by_kernel = self.slow_p2p_v if p2p else None
        copies, out = self.copies_active[g], []
        for u in members:
            busy = compute_free > ready
            s = compute_free if busy else ready
            sp = by_kernel[u] if by_kernel else slowdown
            dur = kernel_ns[u] * fc[u] * sp if copies else kernel_ns[u] * f[u]
            dur = int(dur * overlap[u]) if busy else int(dur)  # it shares the GPU with the one before
            if power is not None:
                dur = power(g, s, dur, u)
            out.append((s, dur))
            compute_free = s + dur
        return out

    def _interleave(self, v: int, g: int, t: int, ready: int, power, seq: int) -> int:
        """Issue kernel or group ``v`` on GPU ``g`` while a launch group has members still to start: from the
        next kernel boundary, every unit (a group, or a kernel alone) runs its kernels in order, and the kernel
        to start next is the one ready longest (a group member is ready when the one before it ends; ties: the
        unit issued first), as a GPU's streams share it. A unit whose end moves earlier gets a new completion
        event; one whose end moves later keeps its event, which waits again when it comes (``kdone``, ``_loop``).
        Returns the next event number."""
        kq, members, issue, useq = self.kq[g], self.members, self.issue, self.useq
        i, queued = 0, len(kq)
        while i < queued and kq[i][1] <= ready:  # the kernels ended by ``ready`` (no earlier than the last call's)
            i += 1
        if i:
            del kq[:i]
        running = kq[0] if kq and kq[0][0] <= ready else None
        b = running[1] if running is not None else ready
        pending: dict[int, list] = {}  # each unit's kernels not yet started, in order
        old_end: dict[int, int] = {}  # and the end of its last one
        for e in kq[1:] if running is not None else kq:
            u = e[3]
            es = pending.get(u)
            if es is None:
                pending[u] = es = []
            es.append(e)
            old_end[u] = e[1]
        # the new unit's kernels: durations as they would take queued behind everything issued before (the power
        # model sees them in that order), then placed by turns (a member after the first: ready when the one
        # before it ends)
        mem = members[v] if v in members else [v]
        new = []
        for u, (_, dur) in zip(mem, self._in_turn(mem, g, ready, power), strict=True):
            issue[u] = t
            new.append([0, 0, u, v, dur, -1])
        new[0][5] = ready
        pending[v] = new
        useq[v] = len(useq)
        push, pop = heapq.heappush, heapq.heappop
        hq = [(es[0][5], useq[u], u, 0) for u, es in pending.items()]  # each unit's next kernel: ready, unit
        heapq.heapify(hq)
        cur, out = b, []
        while hq:
            rdy, n, u, k = pop(hq)
            es = pending[u]
            e = es[k]
            s = cur if cur > rdy else rdy
            e[0] = s
            e[1] = cur = s + e[4]
            out.append(e)
            if k + 1 < len(es):
                es[k + 1][5] = cur
                push(hq, (cur, n, u, k + 1))
        start, end = self.start, self.end
        last_grp = 0  # the start of the last group member due: a kernel issued before it takes turns
        for e in out:
            start[e[2]], end[e[2]] = e[0], e[1]
            if e[3] in members:  # a group (of two or more: ``LaunchGroups.members``)
                last_grp = e[0]
        self.grp_until[g] = last_grp
        kq[:] = ([running] if running is not None else []) + out
        self.compute_free[g] = cur
        completion, kdone = self.completion_ns, self.kdone
        for u, es in pending.items():
            fin = es[-1][1]
            if u == v or fin < old_end[u]:  # new, or earlier than its pending event: an event of its own
                kdone[u] = fin + completion
                heapq.heappush(self._q, (fin + completion, seq, (u << 1) | 1))
                seq += 1
            elif fin > old_end[u]:  # later: its pending event, when it comes, waits again (``_loop``)
                kdone[u] = fin + completion
        return seq

    def _power_limited(self):
        """The duration of kernel v, ``dur`` ns at full clock, starting at ``start`` on GPU g under the power limit
        (a function of ``(g, start, dur, v)`` over this run's buckets): the bucket refills one token per ns up to
        its capacity; the kernel spends w per ns (its flop rate over the rate its class sustains at the limit, or
        the memory-bound weight) and, once the bucket is empty, runs w times slower when w > 1. Kernels start in
        order on a GPU's engine."""
        bucket, bucket_t, cap, refill = self.bucket, self.bucket_t, self.power_cap, self.refill
        pw_rate, pw_flops, other = self.pw_rate, self.pw_flops, self.pw_other

        def power(g: int, start: int, dur: int, v: int) -> int:
            rate = pw_rate[v]
            w = pw_flops[v] / (dur * rate) if rate > 0.0 and dur > 0 else other
            idle = start - bucket_t[g]
            level = bucket[g] + (idle if idle > 0 else 0) * refill
            if level > cap:
                level = cap
            if w <= 1.0:
                level += (1.0 - w) * dur
                if level > cap:
                    level = cap
            elif level >= (w - 1.0) * dur:
                level -= (w - 1.0) * dur
            else:
                t_full = level / (w - 1.0)  # at full clock until the bucket is empty, then at the sustained rate
                dur = int(t_full + (dur - t_full) * w)
                level = 0.0
                self.throttled = True
            bucket[g], bucket_t[g] = level, start + dur
            return dur

        return power

    def _power_clock(self):
        """The duration of kernel v, ``dur`` ns at full clock, starting at ``start`` on GPU g under the shared-clock
        model (a function of ``(g, start, dur, v)`` over this run's buckets): the GPU's throttle theta (its
        bucket's debt over the window, held for the kernel) slows it by its class's factor and lowers its draw;
        the bucket gains the limit less the draw for every ns it runs."""
        bucket, bucket_t, cap, refill = self.bucket, self.bucket_t, self.power_cap, self.refill
        pw_rate, pw_flops, other, pw_slow = self.pw_rate, self.pw_flops, self.pw_other, self.pw_slow
        window, draw_loss = self.window, self.draw_loss

        def power(g: int, start: int, dur: int, v: int) -> int:
            idle = start - bucket_t[g]
            level = bucket[g] + (idle if idle > 0 else 0) * refill
            if level > cap:
                level = cap
            rate = pw_rate[v]
            w = pw_flops[v] / (dur * rate) if rate > 0.0 and dur > 0 else other
            if level < 0.0:
                theta = -level / window
                if theta > THETA_MAX:
                    theta = THETA_MAX
                if rate > 0.0:
                    kept = 1.0 - theta * draw_loss
                    w *= kept if kept > 0.0 else 0.0
                dur = int(dur * (1.0 + theta * (pw_slow[v] - 1.0)))
                self.throttled = True
            level += (1.0 - w) * dur
            bucket[g], bucket_t[g] = level if level < cap else cap, start + dur
            return dur

        return power

    def end_levels(self, gap_ns: int, end: int) -> list[float]:
        """Each GPU's bucket ``gap_ns`` after this run's end ``end`` (its makespan): where the next run back to back
        starts."""
        bt = zip(self.bucket, self.bucket_t, strict=True)
        return [min(self.power_cap, b + (max(0, end - t) + gap_ns) * self.refill) for b, t in bt]

    # ------------------------------------------------------------------ host link sharing
    def _reschedule(self, rec: list, now: int, rate: float, seq: int) -> int:
        """Copy record ``rec`` goes on at ``rate`` from ``now``: an event (number ``seq``) when its bytes are
        through at that rate; the next event number."""
        rec[1] -= rec[2] * (now - rec[3])
        rec[2], rec[3] = rate, now
        rec[4] = token = len(self._through)
        self._through.append(rec)
        delay = math.ceil(rec[1] / rate - 1e-6)
        heapq.heappush(self._q, (now + (delay if delay > 0 else 0), seq, -token))
        return seq + 1

    def _share(self, now: int, seq: int) -> int:
        """Every active host copy's rate under the host's caps (``_share_rates``); one timer is set (event number
        ``seq``), for the copy that ends first at these rates (the first in slot order on a tie). The next event
        number.

        A copy whose rate changes at ``now`` ends at ``now + max(0, ceil(y))``, y its bytes left over its rate less
        1e-6; before F exactly when y <= F - now - 1 (ceil(y) < K for an integer K >= 1 iff y <= K - 1), so only a
        copy that ends first so far has its end worked out (the others' wait, -1, until their rate stays put)."""
        rates = self._shares.get(self._copying)
        if rates is None:
            rates = self._shares[self._copying] = self._share_rates(self._copying)
        pcie, ceil, inf = self.pcie, math.ceil, math.inf
        first, first_ns, lim = None, inf, inf  # lim: first_ns - now - 1 (-inf while first_ns is now)
        for i, r in rates:
            rec = pcie[i]
            old = rec[2]
            if r != old:
                left = rec[1] - old * (now - rec[3])
                rec[1] = left
                rec[2] = r
                rec[3] = now
                y = left / r - 1e-6
                if y > lim:
                    rec[5] = -1
                    continue
                rec[5] = end = now + ceil(y) if y > 0 else now
            else:
                end = rec[5]  # as when its rate last changed, if worked out then
                if end < 0:
                    y = rec[1] / r - 1e-6
                    rec[5] = end = rec[3] + ceil(y) if y > 0 else rec[3]
                if end >= first_ns:
                    continue
            first, first_ns = rec, end
            lim = end - now - 1 if end > now else -inf
        # one timer, for the copy that ends first (a timer per copy would be set again at every change)
        armed = self._armed
        if first is None or (armed is not None and armed[0] is first and armed[1] == first_ns):
            return seq  # the timer set stands
        if armed is not None:
            armed[0][4] = 0  # stale
        first[4] = token = len(self._through)
        self._through.append(first)
        self._armed = (first, first_ns)
        heapq.heappush(self._q, (first_ns if first_ns > now else now, seq, -token))
        return seq + 1

    def _share_rates(self, copying: int) -> tuple[tuple[int, float], ...]:
        """(slot 2g + d, rate) of every host copy in flight when ``copying`` says which (2 bits per GPU: 1 to it,
        2 from it), in GPU order: its GPU's solo rate for its direction (the shared rate when its GPU copies both
        ways), each direction's copies scaled down to the host's total for the GPUs copying that way, then, with
        both directions running on 2 or more GPUs, all of them to the host's total both ways. The same for the
        same ``copying``: kept per run's link factor (``PlanData.share_rates``)."""
        solo, shared, caps = self.rate_solo, self.rate_shared, self.caps
        act = []  # (slot, direction, its GPU's rate)
        sum_h = sum_d = 0.0
        n_h = n_d = n_any = 0
        for g in range(self.mg.n_gpus):
            both = (copying >> 2 * g) & 3
            if both == 3:
                act += ((2 * g, 0, shared[0]), (2 * g + 1, 1, shared[1]))
                sum_h, sum_d, n_h, n_d, n_any = sum_h + shared[0], sum_d + shared[1], n_h + 1, n_d + 1, n_any + 1
            elif both == 1:
                act.append((2 * g, 0, solo[0]))
                sum_h, n_h, n_any = sum_h + solo[0], n_h + 1, n_any + 1
            elif both == 2:
                act.append((2 * g + 1, 1, solo[1]))
                sum_d, n_d, n_any = sum_d + solo[1], n_d + 1, n_any + 1
        cap_h, cap_d = caps[0][n_h], caps[1][n_d]
        k = (cap_h / sum_h if cap_h is not None and sum_h > cap_h else 1.0,
             cap_d / sum_d if cap_d is not None and sum_d > cap_d else 1.0)  # fmt: skip
        cap, tot = caps[2][n_any], sum_h * k[0] + sum_d * k[1]
        if n_h and n_d and cap is not None and tot > cap:
            k = (k[0] * cap / tot, k[1] * cap / tot)
        return tuple((i, base * k[d]) for i, d, base in act)


class PlanData:
    """What every run of one plan on one profile shares, built once (``plan_data``): the timing model's
    per-vertex lists and a scheduler per policy and options, of which each run takes a fresh copy
    (``Scheduler.fresh``)."""

    MAX_SCHEDULERS = 16  # a det-replay scheduler per recorded order: the cache starts over past this many
    DRAWS_KEPT = 4  # the draws of this many seeds are kept (the oldest goes first)

    def __init__(self, tm: TimingModel):
        mg = tm.mg
        self.tm = tm
        self.eng, self.gpu, self.src = tm.eng.tolist(), mg.gpu.tolist(), mg.src_gpu.tolist()
        self.kernel_ns, self.overlap, self.nbytes = tm.kernel_ns.tolist(), tm.overlap.tolist(), tm.nbytes.tolist()
        self.launch_ns = tm.launch_ns.tolist()
        self.training = training_step(mg)  # by default its launch groups record their last member's end event only
        self._sched: dict[tuple, Scheduler] = {}
        self._groups = None
        self._shares: dict[float, dict] = {}
        self._draws: dict = {}

    def draws(self, seed, mean_only: bool, given: Draws | None = None) -> tuple:
        """``TimingModel.draws`` of ``seed`` (``mean_only``: the means), or ``given``, with its per-vertex lists
        (``_draw_lists``), kept for the last ``DRAWS_KEPT`` integer seeds: runs of every policy with one seed
        share them."""
        if given is not None:
            return next((x for x in self._draws.values() if x[0] is given), None) or _draw_lists(given)
        if not mean_only and type(seed) is not int:
            return _draw_lists(self.tm.draws(np.random.default_rng(seed)))
        key = None if mean_only else seed
        got = self._draws.get(key)
        if got is None:
            got = _draw_lists(self.tm.draws(None if mean_only else np.random.default_rng(seed)))
            if len(self._draws) >= self.DRAWS_KEPT:
                del self._draws[next(iter(self._draws))]
            self._draws[key] = got
        return got

    def launch_groups(self):
        """The plan's launch groups (``turnip.sched.groups.launch_groups``), built on first use."""
        if self._groups is None:
            self._groups = launch_groups(self.tm.mg)
        return self._groups

    def share_rates(self, link: float) -> dict:
        """The host copies' rates under the host's caps per state of the links (``Simulation._share_rates``) at
        host link factor ``link``, filled as runs meet the states."""
        d = self._shares.get(link)
        if d is None:
            if len(self._shares) >= self.MAX_SCHEDULERS:
                self._shares.clear()
            d = self._shares[link] = {}
        return d

    def scheduler(self, policy: str, streams_per_gpu: int, order=None, ordered_sums: bool = True,
                  groups: bool = False) -> Scheduler:  # fmt: skip
        """A scheduler in its initial state, as ``Scheduler(mg, policy, streams_per_gpu, order=order,
        ordered_sums=ordered_sums)`` (``nondet-cp``: the critical path of the timing model's means), with the
        plan's launch groups (``launch_groups``, built once) when ``groups``."""
        tm = self.tm

        def make() -> Scheduler:
            dur = tm.mean_ns() if policy == "nondet-cp" else None
            gr = self.launch_groups() if groups else None
            return Scheduler(tm.mg, policy, streams_per_gpu, dur_ns=dur, order=order, ordered_sums=ordered_sums,
                             groups=gr)  # fmt: skip

        if (order is None) != (policy != "det-replay"):
            return make()  # the scheduler's own error
        key = (policy, streams_per_gpu, ordered_sums, groups,
               None if order is None else issue_order(order).tobytes())  # fmt: skip
        s = self._sched.get(key)
        if s is None:
            if len(self._sched) >= self.MAX_SCHEDULERS:
                self._sched.clear()
            s = self._sched[key] = make()
        return s.fresh()


def _draw_lists(d: Draws) -> tuple[Draws, list, list, list]:
    """``d`` and its factors, contended factors and stalls as lists (what the event loop reads)."""
    return d, d.factor.tolist(), d.factor_contended.tolist(), d.stall_ns.tolist()


def plan_data(tm: TimingModel) -> PlanData:
    """``tm``'s ``PlanData``, built on first use and kept on ``tm``."""
    if getattr(tm, "_plan_data", None) is None:
        tm._plan_data = PlanData(tm)
    return tm._plan_data


def host_caps(prof: MachineProfile, n_gpus: int, link: float = 1.0) -> tuple[list, list, list] | None:
    """The host's total rates in bytes per ns (h2d, d2h, both directions), each a list over the number of GPUs
    copying at once, 0 to ``n_gpus`` (None: no cap, below 2 GPUs or without the profile's table), a run's host
    link ``link`` times slower; None when no cap can apply (one GPU, or a profile without the tables): the
    simulator then runs each GPU's link on its own."""
    tables = (prof.host_h2d_total_bytes_per_s, prof.host_d2h_total_bytes_per_s, prof.host_both_total_bytes_per_s)
    if n_gpus < 2 or not any(tables):
        return None
    at = lambda t, n: None if (c := host_total_bytes_per_s(t, n)) is None else c / 1e9 / link  # noqa: E731
    h, d, b = ([at(t, n) for n in range(n_gpus + 1)] for t in tables)
    return h, d, b


def plan_bound(tm: TimingModel, host: float = 1.0, link: float = 1.0) -> dict:
    """The plan's lower bound (``turnip.machine.bound.lower_bound``) for a run at host speed factor ``host``
    (``MachineProfile.host_excess_sd``) and host link factor ``link``, computed once per timing model and pair of
    factors (a power-limited run's passes, and every policy's run of one seed, share it)."""
    from turnip.machine.bound import lower_bound

    if host == 1.0 and link == 1.0:
        if getattr(tm, "_bound", None) is None:
            tm._bound = lower_bound(tm)
        return tm._bound
    bounds = getattr(tm, "_bounds", None)
    if bounds is None or len(bounds) >= BOUNDS_KEPT:
        bounds = tm._bounds = {}
    b = bounds.get((host, link))
    if b is None:
        b = bounds[host, link] = lower_bound(tm, host, link)
    return b


BOUNDS_KEPT = 64  # bounds of runs' (host, link) factors kept per timing model: the cache starts over past this many


def plan_estimate(tm: TimingModel) -> int:
    """The plan's floor estimate (``turnip.machine.bound.floor_estimate``: model floors, host costs, each GPU's
    host link on its own), computed once per timing model: where the power model starts a run."""
    from turnip.machine.bound import floor_estimate

    if getattr(tm, "_estimate", None) is None:
        tm._estimate = floor_estimate(tm)["estimate_ns"]
    return tm._estimate


def power_limited(prof: MachineProfile) -> bool:
    """Whether ``prof`` models a power limit (``MachineProfile.power_gemm_flops_rate`` and the fields by it)."""
    return prof.power_duty < 1.0 or prof.power_gemm_flops_rate > 0.0 or prof.power_attn_flops_rate > 0.0


@dataclass(frozen=True, slots=True)
class PowerModel:
    """Per vertex: flops and the flop rate per ns its class sustains at the power limit (0.0: the kernel draws
    ``other`` of the limit: ``power_memory_weight``, or 1 / ``power_duty`` for every kernel under the uniform
    model); ``cap``: the bucket's capacity (ns at the limit); ``energy``: per GPU, its kernels' energy at the
    limit (ns: a GEMM's is its flops over its class's rate, another kernel's ``other`` x its floor); ``slow``:
    per vertex, its class's slowdown at throttle 1 (the shared-clock model; 1.0 otherwise)."""

    flops: list
    rate: list
    other: float
    cap: float
    energy: list
    slow: list


def power_model(mg: MemGraph, prof: MachineProfile, tm: TimingModel) -> PowerModel:
    """``prof``'s power limit for ``mg`` (cached on ``tm``, built for the same profile)."""
    from turnip.machine.costs import clock_slowdowns, cost_class

    if getattr(tm, "_power", None) is not None:
        return tm._power
    uniform = prof.power_duty < 1.0
    rates = {} if uniform else {"gemm": prof.power_gemm_flops_rate / 1e9, "attention": prof.power_attn_flops_rate / 1e9}
    is_kern = tm.eng == ENG_KERNEL
    classes = [cost_class(op) if k else None for op, k in zip(mg.op, is_kern.tolist(), strict=True)]
    rate = [rates.get(c, 0.0) if c else 0.0 for c in classes]
    other = 1.0 / prof.power_duty if uniform else prof.power_memory_weight
    flops = np.asarray(mg.flops, dtype=np.float64)
    r = np.asarray(rate)
    kern = np.flatnonzero(is_kern)
    per = np.where(r[kern] > 0.0, flops[kern] / np.where(r[kern] > 0.0, r[kern], 1.0),
                   other * tm.kernel_ns[kern].astype(np.float64))  # fmt: skip
    energy = np.bincount(mg.gpu[kern], per, minlength=mg.n_gpus).tolist()
    slows = clock_slowdowns(prof)
    slow = [slows[c] if c else 1.0 for c in classes]
    tm._power = PowerModel(flops.tolist(), rate, other, prof.power_burst_s * 1e9, energy, slow)
    return tm._power


STEADY_PASSES = 4  # at most this many runs to reach the power bucket's steady state
THETA_MAX = 2.0  # the shared-clock model's deepest throttle (1: the clock of the largest GEMMs alone at the limit)
STEADY_TOL = 0.005  # a start level within this fraction of the makespan of where the run leaves it: settled


def _steady_guess(mg: MemGraph, prof: MachineProfile, tm: TimingModel) -> list[float]:
    """A first guess at each GPU's bucket level where runs back to back start: full when the run's floor estimate
    (``plan_estimate``) and the gap between runs leave more time than its kernels' energy at the limit (a GEMM's
    is its flops over its class's rate), else what the gap refills."""
    pm = power_model(mg, prof, tm)
    t = (plan_estimate(tm) + prof.run_gap_ns) * (1.0 - prof.power_idle_weight)
    if prof.power_slow_gemm > 0.0:  # shared clock: in debt, half the window (its throttle settles within a run)
        return [pm.cap if t > e else -0.5 * prof.power_window_s * 1e9 for e in pm.energy]
    return [pm.cap if t > e else min(pm.cap, float(prof.run_gap_ns)) for e in pm.energy]


def _steady_start(mg: MemGraph, prof: MachineProfile, tm: TimingModel, policy: str, host, link, ordered_sums,
                  groups) -> list[float]:  # fmt: skip
    """Where runs back to back start under the power limit, for every seed of these options: the start level
    at which the noise-free run (``mean_only``) settles from ``_steady_guess``, worked out once and kept on
    ``tm``. A seed's runs then start there and mostly settle in one pass (from the guess, an 8-GPU plan whose hub
    GPU the guess puts in debt took two). The same options give the same start, whatever was simulated before."""
    key = (policy, host, link, ordered_sums, groups)
    kept = getattr(tm, "_steady", None)
    if kept is None:
        kept = tm._steady = {}
    if key not in kept:
        guess = _steady_guess(mg, prof, tm)
        kept[key] = _settle(mg, prof, policy, 0, True, tm, None, guess, host, link, ordered_sums, groups)[1]
    return list(kept[key])


def _settle(mg, prof, policy, seed, mean_only, tm, order, level, host, link, ordered_sums, groups,
            once: bool = False) -> tuple[SimResult, list[float]]:  # fmt: skip
    """A run from power bucket ``level``, repeated from where the last left the buckets until the start level
    settles (``STEADY_TOL``; ``STEADY_PASSES`` at most; a run no kernel of which was slowed and that leaves every
    bucket fuller is settled: more would change nothing; ``once``: one run). Returns the last run (its
    ``wall_s`` over every pass) and the level it started at (where the last left them, if none settled)."""
    wall, draws = 0.0, None
    for _ in range(STEADY_PASSES):
        s = Simulation(mg, prof, policy, seed, mean_only, tm, order, level, host, link, ordered_sums, draws, groups)
        draws = s.draws  # the same seed's: the next pass takes them again
        res = s.run()
        wall += res.wall_s
        nxt = s.end_levels(prof.run_gap_ns, res.makespan_ns)
        moved = max(abs(a - b) for a, b in zip(nxt, level, strict=True))
        fuller = not s.throttled and all(a >= b for a, b in zip(nxt, level, strict=True))
        if once or fuller or moved <= STEADY_TOL * res.makespan_ns:
            break
        level = nxt
    res.wall_s = wall  # every pass
    return res, level


def simulate(
    mg: MemGraph,
    prof: MachineProfile,
    policy: str = "nondet",
    seed: int = 0,
    mean_only: bool = False,
    tm: TimingModel | None = None,
    order=None,
    power_full: bool = False,
    host: float | None = None,
    link: float | None = None,
    ordered_sums: bool = True,
    groups: bool | None = None,
) -> SimResult:
    """Simulate one run. Same arguments → same result. ``det-replay`` needs ``order`` (``fastest_run``).
    ``host``: the run's host speed factor (every host cost times it; a host twice as slow: 2), in place of
    the one drawn from the profile's ``host_excess_sd``; ``link``: the run's host link time factor (copies
    between host and GPU push their bytes that many times slower: 1.25 for a link at 80% of the profile's), in
    place of the one drawn from ``link_excess_sd``; ``ordered_sums``: as the runtime's (``turnip.sched.Scheduler``:
    each sum-into group's partials added in compile order; False: in the order they finish); ``groups``: kernels
    in launch groups (``turnip.sched.groups``; None: ``launch_groups_on``, on for several GPUs).
    Under a power limit the run starts where runs back to back (``prof.run_gap_ns`` apart) leave the power
    bucket: from where the noise-free run settles (``_steady_start``, kept per options; ``det-replay``: a first
    guess, ``_steady_guess``) the run is repeated from where the last left it until the start level settles
    (``_settle``); ``power_full``: the GPUs start rested instead (their bucket full)."""
    if not power_limited(prof):
        return Simulation(
            mg, prof, policy, seed, mean_only, tm, order, host=host, link=link, ordered_sums=ordered_sums,
            groups=groups,
        ).run()
    tm = tm or TimingModel(mg, prof)
    if power_full:
        level = [power_model(mg, prof, tm).cap] * mg.n_gpus
    elif order is not None:
        level = _steady_guess(mg, prof, tm)
    else:
        level = _steady_start(mg, prof, tm, policy, host, link, ordered_sums, groups)
    return _settle(mg, prof, policy, seed, mean_only, tm, order, level, host, link, ordered_sums, groups,
                   once=power_full)[0]


def fastest_run(
    mg: MemGraph,
    prof: MachineProfile,
    seeds,
    mean_only: bool = False,
    tm: TimingModel | None = None,
    policy: str = "nondet",
    progress=None,
    host: float | None = None,
    link: float | None = None,
    groups: bool | None = None,
) -> SimResult:
    """The fastest of ``policy`` runs over ``seeds`` (the first on ties). Its ``order`` is the ``det-replay``
    baseline: the best order nondet found, replayed fixed (``simulate(..., order=r.order)``). ``progress``:
    called with the number of runs done; ``host``, ``link``, ``groups``: as ``simulate``'s."""
    tm = tm or TimingModel(mg, prof)
    best = None
    for i, s in enumerate(seeds, 1):
        r = simulate(mg, prof, policy, s, mean_only, tm, host=host, link=link, groups=groups)
        if best is None or r.makespan_ns < best.makespan_ns:
            best = r
        if progress is not None:
            progress(i)
    if best is None:
        raise ValueError("fastest_run needs at least one seed")
    return best
