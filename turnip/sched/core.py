"""The scheduler core: dependency counts, ready queues, resources and a dispatch policy.

State it owns (every vertex ``v`` is in exactly one state, ``status[v]``):
  WAITING   some dependency not done (``missing[v] > 0``)
  READY     all dependencies done; queued in its GPU's heap (``heaps``), put aside while its copy engine is
            busy (``parked``), parked on its lock (``lock_wait``: held, or not its turn), or (fixed-order
            classes) waiting for its turn in its fixed-order lane
  RUNNING   launched: holds one stream slot of its issuing GPU, its copy engine (if a copy) and its
            sum-into lock (if in a lock group) until its completion event arrives
  DONE      completed
Resources: ``streams_per_gpu`` slots per GPU; one host→device and one device→host engine per GPU; one
engine per directed GPU→GPU link; one lock per lock group. The issuing GPU of a vertex is ``gpu[v]``,
except a transfer, which is issued by (and ordered on) its source GPU.

Dispatch launches the best-ranked ready vertex whose engine and lock are free. A GPU's heap holds the ranks of
its ready vertices, kernels and copies together; one whose engine turns out busy when it comes up is moved to
that engine's ``parked`` heap, and each release of an engine moves its best parked vertex back: whenever an
engine is free, the best of its ready vertices is in its GPU's heap, so the heap's best launchable vertex is
the best of all.

Fixed-order vertices sit in lanes (per GPU; per engine queue for ``det-replay``), each issued strictly in
sequence by a pointer; of a GPU's ready lane heads the best rank goes first.

Ordered sums (``ordered_sums``, default on; always under ``det-replay``): each sum-into lock is handed to its
members in one fixed sequence (``lock_turns``: compile order, or the recorded order for ``det-replay``), so an
accumulator's partials are added in the same order in every run and the sum is bitwise reproducible. A ready
member that is not next is parked in ``lock_wait``; the holder's completion wakes the next member if it is
ready. The sequence is a topological order of the memgraph (as the lanes are), so the first member not yet
launched never waits on a later one: nothing stalls. Off, the lock goes to whichever member is ready first.

Invariants (``validate()``): a RUNNING vertex holds exactly its resources and nothing else holds them;
``missing[v]`` equals its dependencies not DONE; a queued vertex is READY; lane pointers only pass launched
vertices; lock pointers only pass launched members and a parked member is blocked (its lock held, or not its
turn); counts agree.

Drivers: ``start`` and ``complete`` answer with commands (``Launch`` / ``Copy``); ``start_ids`` and
``complete_ids`` with the same launches as vertex ids alone (each one's stream slot in ``stream_of``), which
spares a simulator a command object per vertex. The tables built from the plan (successors, ranks, lanes,
lock turns) never change during a run: ``fresh()`` gives a scheduler in its initial state that shares them.

Launch groups (``groups``, ``turnip.sched.groups``): a group's head is queued and launched like any vertex;
its other members are never queued (their state stays WAITING while the head runs) and the head's completion
marks every member DONE, in launch order, before their successors outside the group are made ready.

Policies: ``nondet`` (launch anything ready whose resources are free, best compile order first),
``nondet-cp`` (best = longest critical path), ``det`` (each GPU issues all its vertices in compile order),
``det-kernels`` (only kernels in fixed per-GPU order; copies as ``nondet``), ``det-replay`` (a recorded
issue order, ``order=``, replayed fixed: each engine queue — per GPU its kernels, host→device and
device→host copies, per link its transfers — and each sum-into lock strictly in the recorded sequence;
adapts nothing at run time).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

import numpy as np

from turnip.memgraph.plan import (
    KIND_INPUT,
    KIND_KERNEL,
    KIND_NAMES,
    KIND_OFFLOAD,
    KIND_RELOAD,
    KIND_TRANSFER,
    MemGraph,
)
from turnip.sched.errors import ProtocolError, SchedulerStall, StuckVertex
from turnip.sched.events import Copy, CopyDone, KernelDone, Launch, RunStarted
from turnip.sched.priority import critical_path_ns, rough_dur_ns, topo_order
from turnip.sched.replay import check_order, issue_order, lock_turns, split_order

WAITING, READY, RUNNING, DONE = 0, 1, 2, 3
POLICIES = ("nondet", "nondet-cp", "det", "det-kernels", "det-replay")
_FIXED = {"nondet": (), "nondet-cp": (), "det": ("kernel", "copy"), "det-kernels": ("kernel",),
          "det-replay": ("kernel", "copy")}  # fmt: skip


class Scheduler:
    """Pure state machine over one memgraph run. ``handle(event) -> list of commands``."""

    def __init__(
        self,
        mg: MemGraph,
        policy: str = "nondet",
        streams_per_gpu: int = 5,
        dur_ns: np.ndarray | None = None,
        order=None,
        ordered_sums: bool = True,
        groups=None,
    ):
        """``order``: for ``det-replay`` (only), the recorded issue order to replay (vertex ids or commands,
        ``turnip.sched.replay``). ``ordered_sums``: hand each sum-into lock to its members in compile order
        (bitwise reproducible sums); off, in the order they become ready (``det-replay`` always replays).
        ``groups``: launch groups (``turnip.sched.groups.LaunchGroups``) dispatched as units: a group's head
        launches on its slot with its members behind it (``members_of``), and its completion completes them all."""
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if (policy == "det-replay") != (order is not None):
            raise ValueError("det-replay replays a recorded issue order: pass order= (the order of a nondet run)"
                             if order is None else f"order= is for det-replay, not {policy}")  # fmt: skip
        if streams_per_gpu < 1:
            raise ValueError("streams_per_gpu must be >= 1")
        self.mg, self.policy, self.streams_per_gpu = mg, policy, streams_per_gpu
        n, g = mg.n, mg.n_gpus
        self.n, self.n_gpus = n, g
        kind = mg.kind.astype(np.int64)
        gpu = mg.gpu.astype(np.int64)
        src = mg.src_gpu.astype(np.int64)
        owner = np.where(kind == KIND_TRANSFER, src, gpu)
        # engine ids: h2d[g] = g, d2h[g] = G + g, link(s, d) = 2G + s*G + d; kernel queue of g = 2G + G*G + g
        engine = np.where(kind == KIND_OFFLOAD, g + gpu, gpu)
        engine = np.where(kind == KIND_TRANSFER, 2 * g + src * g + gpu, engine)
        engine = np.where(kind == KIND_KERNEL, -1, engine)
        queue = np.where(kind == KIND_KERNEL, 2 * g + g * g + gpu, engine)
        self._n_engines = 2 * g + g * g
        self.kind = kind.tolist()
        self.owner = owner.tolist()
        self.engine = engine.tolist()
        self.queue = queue.tolist()
        self.lock = mg.lock_group.astype(np.int64).tolist()
        self._lock_gpus: dict[int, list[int]] = {}
        for lk, og in sorted(set(zip(self.lock, owner.tolist(), strict=True))):
            if lk >= 0:
                self._lock_gpus.setdefault(lk, []).append(og)
        self._engine_name = np.array(["h2d", "kernel", "p2p", "d2h", "h2d"])[kind].tolist()
        from_host = (kind == KIND_INPUT) | (kind == KIND_RELOAD)
        self._src = np.where(from_host, -1, np.where(kind == KIND_TRANSFER, src, gpu)).tolist()
        self._dst = np.where(kind == KIND_OFFLOAD, -1, gpu).tolist()
        succ_ptr, succ_idx = mg.successors()
        self.succ_ptr, self.succ_idx = succ_ptr.tolist(), succ_idx.tolist()

        # priority rank: lower launches first. Heaps hold ranks; _by_rank maps back to vertices.
        self.groups = groups
        self._members = groups.members if groups is not None else {}
        grouped = np.zeros(n, dtype=bool)  # members other than their group's head: launched by the head
        for m in self._members.values():
            grouped[m[1:]] = True
        if order is not None:  # det-replay: the recorded position, then the resident inputs
            if groups is not None:
                order = groups.expand(issue_order(order).tolist())
            rec = check_order(mg, order)
            order = np.concatenate([rec, np.flatnonzero(mg.preloaded())])
        else:
            order = topo_order(mg)
        if policy == "nondet-cp":
            cp = critical_path_ns(mg, rough_dur_ns(mg) if dur_ns is None else dur_ns)
            by_rank = np.lexsort((np.arange(n), -cp))
        else:
            by_rank = order
        rank = np.empty(n, dtype=np.int64)
        rank[by_rank] = np.arange(n)
        self.rank, self._by_rank = rank.tolist(), by_rank.tolist()

        # fixed-order classes: lanes of vertices in compile (topological) or recorded order, per GPU
        # (det, det-kernels) or per engine queue (det-replay); each lane belongs to its vertices' GPU.
        # resident inputs were loaded when the plan was loaded: done before the run starts
        self.preloaded = np.flatnonzero(mg.preloaded()).tolist()
        fixed = _FIXED[policy]
        is_fixed = np.zeros(n, dtype=bool)
        if "kernel" in fixed:
            is_fixed |= kind == KIND_KERNEL
        if "copy" in fixed:
            is_fixed |= kind != KIND_KERNEL
        is_fixed[self.preloaded] = False
        is_fixed[grouped] = False
        self.fixed = is_fixed.tolist()
        fo = order[is_fixed[order]]
        lane = queue if policy == "det-replay" else owner
        n_lanes = self._n_engines + g if policy == "det-replay" else g
        self._lanes = split_order(fo, lane[fo], n_lanes)
        self._lane_of = np.where(is_fixed, lane, -1).tolist()
        self._gpu_lanes = [[i for i in range(n_lanes) if self._lanes[i] and owner[self._lanes[i][0]] == gg]
                           for gg in range(g)]  # fmt: skip
        # a GPU whose every vertex is in one lane or launched by its group's head (``det``: nothing enters its
        # heap) dispatches that lane alone
        only = (not (~is_fixed & ~mg.preloaded() & ~grouped).any()) and n_lanes == g
        self._one_lane = [ln[0] if only and len(ln) == 1 else -1 for ln in self._gpu_lanes]
        # each GPU's dispatch, a function of (scheduler, GPU, list the launched vertices are appended to): its
        # heap alone, its one lane alone, or its lanes and heap together (``_dispatch_lanes``)
        self._dispatch_of = [
            Scheduler._dispatch_lane if one >= 0 else Scheduler._dispatch_lanes if ln else Scheduler._dispatch_heap
            for ln, one in zip(self._gpu_lanes, self._one_lane, strict=True)
        ]
        # ordered sums: each sum-into lock in compile order (det-replay: the recorded order), the topological
        # order the lanes follow too, so the first member not yet launched never waits on a later one
        self.ordered_sums = ordered_sums or policy == "det-replay"
        self._lock_seq = lock_turns(order, self.lock) if self.ordered_sums else None
        self._succ = [self.succ_idx[a:b] for a, b in zip(self.succ_ptr, self.succ_ptr[1:], strict=False)]
        # where a vertex goes once ready: its GPU's heap (the GPU, >= 0), its lane (-1: fixed order), a lock
        # check first (-2), or nowhere (-3: a group's member, launched by its head)
        self._ready_q = np.where(grouped, -3, np.where(is_fixed, -1, np.where(mg.lock_group >= 0, -2, owner))).tolist()
        indegree = mg.indegree()
        self._extra = groups.extra if groups is not None else {}  # a group head's added dependencies (copies)
        for h, xs in self._extra.items():
            indegree[h] += len(xs)
            for x in xs:
                self._succ[x] = [*self._succ[x], h]
        self._indegree = indegree.tolist()
        pre = mg.preloaded()
        self._roots = np.flatnonzero((indegree == 0) & ~pre).tolist()  # ready at the start
        self._reset()

    def _reset(self) -> None:
        """The run's state, before ``start``: every vertex WAITING, every resource free."""
        n, g = self.n, self.n_gpus
        self.missing = list(self._indegree)
        self.status = bytearray(n)
        self.stream_of = [-1] * n
        self.free_streams = [list(range(self.streams_per_gpu - 1, -1, -1)) for _ in range(g)]
        self.engine_holder = [-1] * self._n_engines
        self.lock_holder: dict[int, int] = {}
        self.lock_wait: dict[int, list[int]] = {}
        self.heaps: list[list[int]] = [[] for _ in range(g)]  # per GPU
        self.parked: list[list[int]] = [[] for _ in range(self._n_engines)]  # per engine
        self._ptr = [0] * len(self._lanes)
        self._lock_ptr = dict.fromkeys(self._lock_seq or (), 0)
        self.n_running = 0
        self.n_done = 0
        self.now_ns = 0
        self.started = False
        self._dirty = bytearray(g)
        self._dirty_list: list[int] = []

    def fresh(self) -> Scheduler:
        """A new scheduler of the same plan, policy and options in its initial state (before ``start``). It
        shares this one's tables, which nothing changes, so it costs a copy of the state alone: a simulator
        builds the tables once per plan and a fresh scheduler per run."""
        s = object.__new__(Scheduler)
        s.__dict__.update(self.__dict__)
        s._reset()
        return s

    @property
    def finished(self) -> bool:
        return self.n_done == self.n

    # ---------------------------------------------------------------- events
    def handle(self, event) -> list:
        """Apply one event; return the commands to perform now (possibly none)."""
        if type(event) is KernelDone or type(event) is CopyDone:
            if (self.kind[event.v] == KIND_KERNEL) != (type(event) is KernelDone):
                raise ProtocolError(f"{type(event).__name__} for {self.mg.label(event.v)}")
            return self.complete(event.v, event.t_ns)
        if type(event) is RunStarted:
            return self.start(event.t_ns)
        raise ProtocolError(f"unknown event {event!r}")

    def start(self, t_ns: int = 0) -> list:
        return [self.command(v) for v in self.start_ids(t_ns)]

    def complete(self, v: int, t_ns: int) -> list:
        """Fast path of ``handle(KernelDone/CopyDone)``: vertex ``v`` finished at ``t_ns``."""
        return [self.command(u) for u in self.complete_ids(v, t_ns)]

    def command(self, v: int):
        """The command of launched vertex ``v``: ``Launch`` or ``Copy`` on its stream slot."""
        e, g = self.engine[v], self.owner[v]
        if e < 0:
            return Launch(v, g, self.stream_of[v])
        return Copy(v, self._engine_name[v], self._src[v], self._dst[v], g, self.stream_of[v])

    def start_ids(self, t_ns: int = 0) -> list[int]:
        """``start`` as the launched vertices alone, in issue order (each one's slot: ``stream_of``)."""
        if self.started:
            raise ProtocolError("RunStarted twice")
        self.started, self.now_ns = True, t_ns
        missing, status = self.missing, self.status
        ready = list(self._roots)  # and those whose dependencies are all resident inputs, in index order
        for v in self.preloaded:
            status[v] = DONE
            self.n_done += 1
            for s in self._succ[v]:
                missing[s] -= 1
                if missing[s] == 0:
                    ready.append(s)
        for v in sorted(ready):
            if status[v] == WAITING:
                self._make_ready(v)
        return self._dispatch_dirty()

    def complete_ids(self, v: int, t_ns: int) -> list[int]:
        """``complete`` as the launched vertices alone, in issue order (each one's slot: ``stream_of``): what a
        simulator needs, without a command object per vertex."""
        status = self.status
        if status[v] != RUNNING:
            raise ProtocolError(f"completion of {self.mg.label(v)}, which is not running (state {status[v]})")
        self.now_ns = t_ns
        if self._members and v in self._members:
            return self._complete_group(v, self._members[v])
        status[v] = DONE
        self.n_done += 1
        self.n_running -= 1
        owner = self.owner
        g = owner[v]
        self.free_streams[g].append(self.stream_of[v])
        e = self.engine[v]
        if e >= 0:
            self.engine_holder[e] = -1
            if self.parked[e]:  # its best parked vertex back into the heap
                heappush(self.heaps[g], heappop(self.parked[e]))
        dirty, dl = self._dirty, self._dirty_list  # GPUs to dispatch besides g (g always is)
        if self.lock[v] >= 0:
            self._release(self.lock[v])
        missing, ready_q, heaps, rank = self.missing, self._ready_q, self.heaps, self.rank
        for s in self._succ[v]:
            m = missing[s] - 1
            missing[s] = m
            if m == 0:  # ready (``_make_ready``, inlined)
                q = ready_q[s]  # its GPU, when it goes to the GPU's heap at once
                if q == -3:  # a group's member: its head launches it
                    continue
                status[s] = READY
                if q >= 0:
                    heappush(heaps[q], rank[s])
                else:
                    if q == -2:
                        lk = self.lock[s]
                        if self._lock_blocks(lk, s):
                            heappush(self.lock_wait.setdefault(lk, []), rank[s])
                            continue
                        heappush(heaps[owner[s]], rank[s])
                    q = owner[s]
                if q != g and not dirty[q]:
                    dirty[q] = 1
                    dl.append(q)
        if dl:
            if not dirty[g]:
                dirty[g] = 1
                dl.append(g)
            return self._dispatch_dirty()
        out: list[int] = []  # ``_dispatch_dirty`` of g alone, inlined
        self._dispatch_of[g](self, g, out)
        if not out and self.n_running == 0 and self.n_done < self.n:
            raise self.stall_error()
        return out

    def members_of(self, v: int) -> list[int] | None:
        """The members of the launch group that ``v`` heads (``v`` first, in launch order), or None."""
        return self._members.get(v)

    def _complete_group(self, v: int, members: list[int]) -> list[int]:
        """``complete_ids`` of the group headed by ``v``: every member done, in launch order; their successors
        outside the group made ready."""
        status, missing = self.status, self.missing
        g = self.owner[v]
        self.n_running -= 1
        self.free_streams[g].append(self.stream_of[v])
        for m in members:
            status[m] = DONE
            for s in self._succ[m]:
                missing[s] -= 1
                if missing[s] == 0:
                    self._make_ready(s)
        self.n_done += len(members)
        self._mark(g)
        return self._dispatch_dirty()

    # ---------------------------------------------------------------- internals
    def _mark(self, g: int) -> None:
        if not self._dirty[g]:
            self._dirty[g] = 1
            self._dirty_list.append(g)

    def _release(self, lk: int) -> None:
        """Lock ``lk``'s holder completed: the lock is free; its GPUs are dispatched and its next waiter woken."""
        del self.lock_holder[lk]
        for og in self._lock_gpus[lk]:
            self._mark(og)
        waiters = self.lock_wait.get(lk)
        if waiters:  # wake one waiter only (the next in turn, or the best): the others could not take it
            self._wake(lk, waiters)

    def _make_ready(self, v: int) -> None:
        if self._ready_q[v] == -3:  # a group's member: its head launches it
            return
        self.status[v] = READY
        if not self.fixed[v]:
            lk = self.lock[v]
            if lk >= 0 and self._lock_blocks(lk, v):
                heappush(self.lock_wait.setdefault(lk, []), self.rank[v])
                return
            heappush(self.heaps[self.owner[v]], self.rank[v])
        self._mark(self.owner[v])

    def _lock_blocks(self, lk: int, v: int) -> bool:
        """Lock ``lk`` is held, or (ordered sums) it is not ``v``'s turn."""
        return lk in self.lock_holder or (self._lock_seq is not None and self._lock_seq[lk][self._lock_ptr[lk]] != v)

    def _wake(self, lk: int, waiters: list[int]) -> None:
        """Lock ``lk`` was released: move its next waiter (ordered sums: the next member, if parked; else the
        best) from ``lock_wait`` to its class heap."""
        if self._lock_seq is None:
            r = heappop(waiters)
        else:
            seq, p = self._lock_seq[lk], self._lock_ptr[lk]
            r = self.rank[seq[p]] if p < len(seq) else -1
            if r not in waiters:
                return
            waiters.remove(r)
            heapify(waiters)
        if not waiters:
            del self.lock_wait[lk]
        u = self._by_rank[r]
        heappush(self.heaps[self.owner[u]], r)
        self._mark(self.owner[u])

    def _dispatch_dirty(self) -> list[int]:
        out: list[int] = []
        dl, dirty, dispatch = self._dirty_list, self._dirty, self._dispatch_of
        if len(dl) > 1:
            dl.sort()
        for g in dl:
            dirty[g] = 0
            dispatch[g](self, g, out)
        dl.clear()
        if not self.started:
            return out
        if self.n_running == 0 and self.n_done < self.n:
            raise self.stall_error()
        return out

    def _dispatch_lanes(self, g: int, out: list[int]) -> None:
        """Launch on GPU ``g`` what its free stream slots, engines and locks allow, best rank first (of its fixed
        lanes' heads and its heap); append the launched vertices to ``out``."""
        streams = self.free_streams[g]
        if not streams:
            return
        heap, holder, engine, gpu_lanes = self.heaps[g], self.engine_holder, self.engine, self._gpu_lanes[g]
        lanes, ptr, rank, status = self._lanes, self._ptr, self.rank, self.status
        launched = 0
        while streams:
            best_r, best_ln = self.n, -1  # n: above every rank
            for ln in gpu_lanes:  # fixed lanes: their heads only, when ready and their engine and lock are free
                p = ptr[ln]
                if p < len(lanes[ln]):
                    u = lanes[ln][p]
                    if status[u] == READY and rank[u] < best_r:
                        e = engine[u]
                        if e < 0 or holder[e] < 0:
                            lk = self.lock[u]
                            if lk < 0 or not self._lock_blocks(lk, u):
                                best_r, best_ln = rank[u], ln
            v = -1
            while heap and heap[0] < best_r:  # the heap's best launchable vertex, if better than the lanes'
                r = heappop(heap)
                u = self._by_rank[r]
                e = engine[u]
                if e >= 0 and holder[e] >= 0:
                    heappush(self.parked[e], r)  # back when its engine is released
                    continue
                lk = self.lock[u]
                if lk >= 0 and self._lock_blocks(lk, u):
                    heappush(self.lock_wait.setdefault(lk, []), r)
                    if e >= 0 and self.parked[e]:  # the engine's next best is now the best of its parked
                        heappush(heap, heappop(self.parked[e]))
                    continue
                v = u
                break
            if v < 0:
                if best_ln < 0:
                    break
                v = lanes[best_ln][ptr[best_ln]]
                ptr[best_ln] += 1
                lk = self.lock[v]
            # launch v (it holds its slot, engine and lock until its completion)
            status[v] = RUNNING
            self.stream_of[v] = streams.pop()
            launched += 1
            if lk >= 0:
                self.lock_holder[lk] = v
                if self._lock_seq is not None:
                    self._lock_ptr[lk] += 1
            e = engine[v]
            if e >= 0:
                holder[e] = v
            out.append(v)
        self.n_running += launched

    def _dispatch_lane(self, g: int, out: list[int]) -> None:
        """``_dispatch_lanes`` of a GPU whose every vertex is in one lane (``_one_lane``): its head while it can
        launch."""
        ln = self._one_lane[g]
        streams, lane, p = self.free_streams[g], self._lanes[ln], self._ptr[ln]
        holder, engine, lock, status = self.engine_holder, self.engine, self.lock, self.status
        launched = 0
        while streams and p < len(lane):
            v = lane[p]
            if status[v] != READY:
                break
            e = engine[v]
            if e >= 0 and holder[e] >= 0:
                break
            lk = lock[v]
            if lk >= 0:
                if self._lock_blocks(lk, v):
                    break
                self.lock_holder[lk] = v
                if self._lock_seq is not None:
                    self._lock_ptr[lk] += 1
            p += 1
            # launch v (it holds its slot, engine and lock until its completion)
            status[v] = RUNNING
            self.stream_of[v] = streams.pop()
            launched += 1
            if e >= 0:
                holder[e] = v
            out.append(v)
        self._ptr[ln] = p
        self.n_running += launched

    def _dispatch_heap(self, g: int, out: list[int]) -> None:
        """``_dispatch_lanes`` of a GPU without fixed-order lanes: its heap alone."""
        streams, heap = self.free_streams[g], self.heaps[g]
        if not (streams and heap):
            return
        holder, engine, lock, by_rank = self.engine_holder, self.engine, self.lock, self._by_rank
        launched = 0
        while streams and heap:
            r = heappop(heap)
            v = by_rank[r]
            e = engine[v]
            if e >= 0 and holder[e] >= 0:
                heappush(self.parked[e], r)  # back when its engine is released
                continue
            lk = lock[v]
            if lk >= 0:
                if self._lock_blocks(lk, v):
                    heappush(self.lock_wait.setdefault(lk, []), r)
                    if e >= 0 and self.parked[e]:  # the engine's next best is now the best of its parked
                        heappush(heap, heappop(self.parked[e]))
                    continue
                self.lock_holder[lk] = v
                if self._lock_seq is not None:
                    self._lock_ptr[lk] += 1
            # launch v (it holds its slot, engine and lock until its completion)
            self.status[v] = RUNNING
            self.stream_of[v] = streams.pop()
            launched += 1
            if e >= 0:
                holder[e] = v
            out.append(v)
        self.n_running += launched

    # ---------------------------------------------------------------- diagnostics
    def stall_error(self, limit: int = 20) -> SchedulerStall:
        left = [v for v in range(self.n) if self.status[v] != DONE]
        stuck = [StuckVertex(v, self.mg.label(v), self.waits_for(v)) for v in left[:limit]]
        return SchedulerStall(self.now_ns, len(left), stuck)

    def waits_for(self, v: int) -> str:
        """Human-readable reason why ``v`` has not launched (or 'running' / 'done')."""
        st = self.status[v]
        if st == DONE:
            return "nothing (done)"
        if st == RUNNING:
            return "its own completion (running)"
        h = -1 if self.groups is None else int(self.groups.head[v])
        if st == WAITING and h != v and h >= 0:
            return f"its launch group's head {h} ({'running' if self.status[h] == RUNNING else 'not launched'})"
        if st == WAITING:
            deps = self.mg.deps(v).tolist() + self._extra.get(v, [])
            return "dependencies " + ", ".join(str(u) for u in deps if self.status[u] != DONE)
        g, why = self.owner[v], []
        if not self.free_streams[g]:
            why.append(f"a stream slot of gpu {g}")
        e = self.engine[v]
        if e >= 0 and self.engine_holder[e] >= 0:
            why.append(f"the {self._engine_name[v]} engine (held by {self.engine_holder[e]})")
        lk = self.lock[v]
        if lk >= 0 and lk in self.lock_holder:
            why.append(f"lock group {lk} (held by {self.lock_holder[lk]})")
        elif lk >= 0 and self._lock_seq is not None and self._lock_seq[lk][self._lock_ptr[lk]] != v:
            why.append(f"its turn for lock group {lk} (next is {self._lock_seq[lk][self._lock_ptr[lk]]})")
        if self.fixed[v]:
            ln = self._lane_of[v]
            lane, p = self._lanes[ln], self._ptr[ln]
            if p < len(lane) and lane[p] != v:
                which = f"replayed {self._engine_name[v]} queue" if self.policy == "det-replay" else "fixed order"
                why.append(f"its turn in gpu {g}'s {which} (next is {lane[p]})")
        return "; ".join(why) or "a dispatch (ready and launchable)"

    def validate(self) -> None:
        """Check every invariant of the state; raise AssertionError naming the first violation."""
        n, st = self.n, self.status
        running = [v for v in range(n) if st[v] == RUNNING]
        assert self.n_running == len(running), "n_running disagrees with states"
        assert self.n_done == sum(1 for v in range(n) if st[v] == DONE), "n_done disagrees with states"
        for v in range(n):
            m = sum(1 for u in self.mg.deps(v).tolist() + self._extra.get(v, []) if st[u] != DONE)
            assert self.missing[v] == m, f"missing[{v}]={self.missing[v]}, expected {m}"
            if self._ready_q[v] == -3:  # a group's member (not its head) waits until its whole group is done
                assert st[v] in (WAITING, DONE), f"state of group member {v}"
                continue
            assert (st[v] == WAITING) == (m > 0) or st[v] == WAITING and not self.started, f"state of {v}"
        per_gpu = [0] * self.n_gpus
        streams_used: set[tuple[int, int]] = set()
        for v in running:
            g = self.owner[v]
            per_gpu[g] += 1
            assert (g, self.stream_of[v]) not in streams_used, f"stream {self.stream_of[v]} of gpu {g} shared"
            streams_used.add((g, self.stream_of[v]))
            e = self.engine[v]
            assert e < 0 or self.engine_holder[e] == v, f"{v} runs without its engine"
            assert self.lock[v] < 0 or self.lock_holder.get(self.lock[v]) == v, f"{v} runs without its lock"
        for g in range(self.n_gpus):
            assert per_gpu[g] + len(self.free_streams[g]) == self.streams_per_gpu, f"gpu {g} slot count"
            assert not {(g, s) for s in self.free_streams[g]} & streams_used, f"gpu {g} free list"
        for ln, lane in enumerate(self._lanes):
            p = self._ptr[ln]
            assert all(st[u] >= RUNNING for u in lane[:p]), f"lane {ln} passed a vertex"
            assert all(st[u] <= READY for u in lane[p:]), f"lane {ln} skipped a vertex"
        for e, v in enumerate(self.engine_holder):
            assert v < 0 or (st[v] == RUNNING and self.engine[v] == e), f"engine {e} held by {v}"
        for lk, v in self.lock_holder.items():
            assert st[v] == RUNNING and self.lock[v] == lk, f"lock {lk} held by {v}"
        for lk, seq in (self._lock_seq or {}).items():
            p = self._lock_ptr[lk]
            assert all(st[u] >= RUNNING for u in seq[:p]) and all(st[u] <= READY for u in seq[p:]), f"lock {lk} turn"
        for lk, w in self.lock_wait.items():
            assert w, f"lock {lk} has an empty wait list"
            blocked = self._lock_seq is None or all(self._lock_blocks(lk, self._by_rank[r]) for r in w)
            assert blocked, f"lock {lk}: a parked member's turn came and it was not woken"
        queued = [self._by_rank[r] for h in self.heaps + self.parked for r in h]
        queued += [self._by_rank[r] for w in self.lock_wait.values() for r in w]
        assert len(queued) == len(set(queued)), "a vertex is queued twice"
        for v in queued:
            assert st[v] == READY and not self.fixed[v], f"queued vertex {v} in state {st[v]}"
        if self.started:
            n_ready_free = sum(1 for v in range(n) if st[v] == READY and not self.fixed[v])
            assert n_ready_free == len(queued), "a ready vertex is in no queue"

    def state_counts(self) -> dict[str, int]:
        c = np.bincount(np.frombuffer(bytes(self.status), dtype=np.uint8), minlength=4)
        return dict(zip(("waiting", "ready", "running", "done"), c.tolist(), strict=True))

    def describe(self, v: int) -> str:
        return f"{KIND_NAMES[self.kind[v]]} {v}: {self.waits_for(v)}"
