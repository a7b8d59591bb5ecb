"""Launch groups: runs of kernels on one GPU that the scheduler dispatches as one unit.

A group is issued when its first member (its *head*) is ready, on the head's stream slot, its members one
after another in compile order (stream order keeps their dependencies); the scheduler sees one completion, the
last member's, and counts every member done then. One command and one completion instead of one per vertex:
the host's work per vertex is what stops one thread driving several GPUs (``turnip.runtime.execute``), and a
GPU backend launches a group as one captured CUDA graph.

The rule (``launch_groups``), over the plan's topological order (``topo_order``), per kernel ``w`` that is not
a resident input and not in a sum-into lock group: ``w`` joins the open group of one of its dependencies ``v``
(same GPU) when every dependency of ``w`` is a member of that group, an ancestor of its head (searched
``ANCESTOR_DEPTH`` dependency levels up), a resident input, or a copy (an input, reload or transfer) that comes
before the head in the order: the head then waits for that copy too (``extra``; a training step's adapters,
sent from GPU 0 at its start, would otherwise end a group at every adapter). So whatever a group needs from
outside is done once its head is ready: it is ready when its head is, and in the topological order the fixed
lanes of ``det`` follow, everything a head waits for comes before it, so no lane waits on a group it feeds.
A group closes after a member whose result something other than a kernel of its GPU reads (a transfer, an
offload, another GPU's kernel): those wait for the whole group, so a group ends where another engine or GPU
needs its result. ``max_members`` bounds a group.

Wide groups (``wide``; ``TURNIP_WIDE_GROUPS=1|0``; unset: on for training steps, off for prompts): a kernel
whose group (or itself, ungrouped) starts before the head in the order can become the head's ``extra``
dependency too, and a transfer no longer closes a group (it waits for the group's end; offloads and other
GPUs' kernels still close it), and a small kernel (output under ``SMALL_NBYTES``) that needs nothing the run
makes (every dependency a resident input: a training step's casts of its adapters) joins the group opened last
on its GPU, if still open, rather than being launched alone. None of this makes a cycle: what a head waits for
is a group or copy whose head comes before it in the order, and a group's members never wait for anything
after its head; a transfer reading a member comes after that member in the order, so no member of the group
waits for it. A LoRA step of 7B (8 x 1K, 16 GiB per GPU, data split) on 4 H100s: 18,777 dispatch units ->
11,295, 322.8 -> 302.0 ms in one process; a 4K prompt on 4 GPUs (data split): 2,060 -> 1,760 units but 32.6 ->
36.4 ms, its keys and values held back until their group ends (``benchmarks/results/multi_gpu/README.md``).

Invariants: every member of a group of two or more is a kernel on the head's GPU with no lock group; its
dependencies lie in the group, among the head's ancestors, among the resident inputs or among the head's
``extra`` dependencies (copies before the head in the order; with ``wide``, also kernels whose group's head,
or themselves, come before the head); members are in topological order, the head first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from turnip.memgraph.plan import KIND_KERNEL, KIND_TRANSFER, MemGraph

GROUPS_SWITCH = "TURNIP_LAUNCH_GROUPS"  # "1": launch groups on, "0": off; unset: on for plans of several GPUs
WIDE_SWITCH = "TURNIP_WIDE_GROUPS"  # "1": wide groups (module doc), "0": narrow; unset: wide for training steps
MAX_MEMBERS = 32
ANCESTOR_DEPTH = 4  # dependency levels searched for a head's ancestors
ANCESTOR_LIMIT = 256  # ancestors kept per head at most
SMALL_NBYTES = 1 << 20  # wide groups: a kernel writing less, that needs nothing the run makes, joins any open group


def launch_groups_on(n_gpus: int) -> bool:
    """Whether runs and simulations of a plan on ``n_gpus`` GPUs dispatch its kernels in launch groups by default:
    ``TURNIP_LAUNCH_GROUPS=1`` always, ``0`` never, unset on several GPUs, where one host thread issues for all
    of them (measured on four H200s: a 7B 4K prompt 22-25% and a LoRA step 11-24% faster; on one GPU within
    2%, either way: ``benchmarks/results/multi_gpu/README.md``)."""
    v = os.environ.get(GROUPS_SWITCH)
    return v == "1" if v in ("0", "1") else n_gpus > 1


@dataclass(frozen=True, slots=True)
class LaunchGroups:
    """``members``: head -> its members in launch order (the head first), groups of two or more only;
    ``head``: per vertex, its group's head (itself when it heads a group or is in none); ``units``: what
    ``expand`` puts in place of each vertex, ``units[1][units[0][v]:units[0][v + 1]]`` (a group's members for its
    head, the vertex alone when it is in no group, nothing for another member), built with the groups."""

    head: np.ndarray
    members: dict[int, list[int]]
    extra: dict[int, list[int]] = field(default_factory=dict)  # head -> what it waits for besides its own deps
    units: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        head, get, idx = self.head.tolist(), self.members.get, []
        ptr = [0]
        for v in range(len(head)):
            m = get(v)
            if m is not None:
                idx += m
            elif head[v] == v:
                idx.append(v)
            ptr.append(len(idx))
        object.__setattr__(self, "units", (np.asarray(ptr, dtype=np.int64), np.asarray(idx, dtype=np.int64)))

    @property
    def n_units(self) -> int:
        """Dispatch units: vertices less the members that are not heads."""
        return len(self.head) - sum(len(m) - 1 for m in self.members.values())

    def expand(self, order) -> list[int]:
        """An issue order of units (heads and ungrouped vertices) as one of vertices: each head followed by its
        other members (what ``det-replay`` and ``turnip.sched.replay.check_order`` take); members already in
        ``order`` are dropped and put back behind their head, so an expanded order expands to itself."""
        ptr, idx = self.units
        o = np.asarray(order, dtype=np.int64)
        first, n = ptr[o], ptr[o + 1] - ptr[o]  # each one's run in idx
        at = np.repeat(first - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        return idx[at].tolist()


def training_step(mg: MemGraph) -> bool:
    """Whether ``mg`` updates parameters (has Adam kernels): a memgraph carries no training flag of its own."""
    return any(op.startswith("adam") for op in mg.op)


def wide_groups_on(mg: MemGraph) -> bool:
    """Whether ``launch_groups`` builds wide groups for ``mg`` by default: ``TURNIP_WIDE_GROUPS=1`` always, ``0``
    never, unset for a training step (a plan that updates parameters: its gradients' transfers are off the
    step's critical path, where a prompt's keys and values are on it)."""
    v = os.environ.get(WIDE_SWITCH)
    return v == "1" if v in ("0", "1") else training_step(mg)


EVENTS_SWITCH = "TURNIP_GROUP_EVENTS"  # "1": every member of a captured group records its end event; "0": the last


def group_events_on(mg: MemGraph, training: bool | None = None) -> bool:
    """Whether a GPU backend's captured launch group records every member's end event (device times per
    member, for traces) or only its last member's (one event node per graph: less host time per launch):
    ``TURNIP_GROUP_EVENTS=1`` / ``0``; unset: every member's, except in a training step, whose runs read no
    device times by default (on four H200s a 7B LoRA step took 265.2 ms with the last event only, 290.7 with
    every member's: ``benchmarks/results/multi_gpu/README.md``)."""
    v = os.environ.get(EVENTS_SWITCH)  # ``training``: ``training_step(mg)`` where the caller keeps it
    if v in ("0", "1"):
        return v == "1"
    return not (training_step(mg) if training is None else training)


def launch_groups(
    mg: MemGraph, max_members: int = MAX_MEMBERS, order: np.ndarray | None = None, wide: bool | None = None,
    small_nbytes: int = SMALL_NBYTES,
) -> LaunchGroups:  # fmt: skip
    """The launch groups of ``mg`` (module doc); ``order``: the topological order to follow (default
    ``topo_order(mg)``); ``wide``: wide groups (None: ``wide_groups_on(mg)``); ``small_nbytes``: below this
    output size a wide group takes kernels that need nothing the run makes."""
    from turnip.sched.priority import topo_order

    wide = wide_groups_on(mg) if wide is None else wide
    n = mg.n
    kind, gpu, lock = mg.kind.tolist(), mg.gpu.tolist(), mg.lock_group.tolist()
    pre = mg.preloaded().tolist()
    succ_ptr, succ_idx = mg.successors()
    sp, si = succ_ptr.tolist(), succ_idx.tolist()
    dep_ptr, dep_src = mg.dep_ptr.tolist(), mg.dep_src.tolist()
    head = list(range(n))
    members: dict[int, list[int]] = {}
    ext: dict[int, set[int]] = {}  # an open group's head -> ancestors of the head (done when it is ready)

    def ancestors(ds: list[int]) -> set[int]:  # ``ds`` and their ancestors, ANCESTOR_DEPTH dependency levels up
        seen, frontier = set(ds), ds
        for _ in range(ANCESTOR_DEPTH - 1):
            nxt = []
            for u in frontier:
                for x in dep_src[dep_ptr[u] : dep_ptr[u + 1]]:
                    if x not in seen and not pre[x]:
                        seen.add(x)
                        nxt.append(x)
            if not nxt or len(seen) > ANCESTOR_LIMIT:
                break
            frontier = nxt
        return seen

    order = topo_order(mg) if order is None else order
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    pos = pos.tolist()
    extra: dict[int, list[int]] = {}
    latest: dict[int, int] = {}  # GPU -> the head of the group opened last on it
    small = (mg.out_nbytes < small_nbytes).tolist()
    for w in order.tolist():
        if kind[w] != KIND_KERNEL or pre[w] or lock[w] >= 0:
            continue
        ds = [u for u in dep_src[dep_ptr[w] : dep_ptr[w + 1]] if not pre[u]]
        h, add = -1, ()
        if wide and not ds and small[w]:  # needs nothing the run makes: it may join its GPU's latest open group
            c = latest.get(gpu[w], -1)
            if c in ext and len(members[c]) < max_members:
                h = c
        for v in ds:
            c = head[v]
            if c in ext and gpu[c] == gpu[w] and len(members[c]) < max_members:
                e = ext[c]
                # a copy that comes before the head in the order can become the head's dependency too (wide: a
                # kernel whose group starts before the head as well)
                add = [u for u in ds if not (head[u] == c or u in e)]
                if all(pos[u] < pos[c] if kind[u] != KIND_KERNEL else wide and pos[head[u]] < pos[c] for u in add):
                    h = c
                    break
        if h >= 0:
            head[w] = h
            members[h].append(w)
            if add:
                extra.setdefault(h, []).extend(add)
                ext[h].update(add)
        else:
            h = w
            members[w] = [w]
            ext[w] = ancestors(ds)
            latest[gpu[w]] = w
        g = gpu[w]
        if any(gpu[x] != g if kind[x] == KIND_KERNEL else not (wide and kind[x] == KIND_TRANSFER)
               for x in si[sp[w] : sp[w + 1]]):  # fmt: skip
            del ext[h]  # closed: what reads w's result elsewhere should not wait for more members
    groups = {h: m for h, m in members.items() if len(m) > 1}
    return LaunchGroups(np.asarray(head, dtype=np.int64), groups, {h: x for h, x in extra.items() if h in groups})
