"""BuildMemgraph: simulate an execution of the taskgraph in a fixed order V, placing every tensor in a
byte arena per GPU and emitting the memgraph (offload/reload vertices, data and memory dependencies).

Two horizons walk V. ``alloc`` runs ahead reserving output space (simMalloc); when it cannot and nothing
is pending, the next vertex's space is made by eviction (simMallocOffld). Otherwise ``exec`` emits the next
vertex: evicted operands are reloaded first (simMallocForceReld), operands with no future use are freed
(simFree). A reservation over a freed range depends on that range's last users (a memory dependency).

Builder state per taskgraph tensor t: ``loc[t]`` the memgraph vertex whose buffer holds t on its GPU
(-1: not on the GPU), ``host_ok[t]`` whether the host copy is current (evict without a copy),
``host_src[t]`` the offload that wrote it (-1: the tensor's initial host data), and per buffer the
vertices that wrote it (``writers``) and that touched it at all (``users``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

from turnip.memgraph.arena import ALIGN, Arena, Ghosts, aligned
from turnip.memgraph.emit import Emitter
from turnip.memgraph.evict import POLICIES, POLICIES_MANY, find_victims
from turnip.memgraph.plan import KIND_INPUT, KIND_TRANSFER, MemGraph
from turnip.taskgraph import TaskGraph


class BudgetError(RuntimeError):
    """One vertex cannot run within the GPU memory budget. ``shape`` and ``tensor``: its largest operand's shape
    and name, where known (for advice on the tile to shrink)."""

    shape: tuple | None = None
    tensor: str = ""


@dataclass(frozen=True)
class BuildConfig:
    policy: str = "furthest"  # eviction policy: furthest | lru | largest
    lookahead_vertices: int | None = None  # cap on alloc - exec
    lookahead_nbytes: int | None = None  # cap on bytes reserved ahead
    order: tuple[int, ...] | None = None  # V; default index order
    resident_nbytes: int = 0  # per GPU: inputs kept on the GPU across runs (loaded once, never evicted)
    keep_inputs: tuple[int, ...] = ()  # inputs resident whatever resident_nbytes says (a training step's state)
    reduce_memory_edges: bool = True  # drop memory edges that other paths imply (reachability unchanged)
    workspace_nbytes: int = 0  # per stream slot, kept free at the top of each GPU's arena for kernels' scratch
    workspace_slots: int = 5  # stream slots the workspace is reserved for (the runtime's streams per GPU)
    relay_slots: int = 0  # per GPU: slots below the workspace through which other GPUs' reloads are relayed
    relay_slot_nbytes: int = 0  # bytes per relay slot (reloads of larger tensors go direct)


def _uses(tg: TaskGraph, order: np.ndarray):
    """Per tensor, the sorted V positions of the vertices that use it (operand, or sum_into target)."""
    n = tg.n
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    owner = np.repeat(np.arange(n), np.diff(tg.arg_ptr))
    t = tg.arg_idx.astype(np.int64)
    p = pos[owner]
    keys = np.lexsort((p, t))
    t, p = t[keys], p[keys]
    ptr = np.zeros(n + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(np.bincount(t, minlength=n))
    return pos, ptr, p


class _Build:
    def __init__(self, tg: TaskGraph, budget: list[int], cfg: BuildConfig, progress=None):
        self.tg, self.cfg, self.progress = tg, cfg, progress
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {cfg.policy!r}; choose from {sorted(POLICIES)}")
        self.key = POLICIES[cfg.policy]
        self.V = np.asarray(cfg.order if cfg.order is not None else range(tg.n), dtype=np.int64)
        if sorted(self.V.tolist()) != list(range(tg.n)):
            raise ValueError("order must be a permutation of the taskgraph's vertices")
        self.pos, self.use_ptr, self.use_pos = _uses(tg, self.V)
        self.next_use = self.use_ptr[:-1].copy()  # index into use_pos of the next use >= exec
        self.last_use = np.full(tg.n, -1, dtype=np.int64)
        self.ws_nbytes = cfg.workspace_slots * aligned(cfg.workspace_nbytes) if cfg.workspace_nbytes else 0
        if self.ws_nbytes >= min(budget):
            raise BudgetError(f"workspace of {self.ws_nbytes} bytes ({cfg.workspace_slots} slots) leaves nothing of "
                              f"a budget of {min(budget)} bytes")  # fmt: skip
        # relays (``relay_slots``): GPU g's reloads taken in turn by GPU g, g+1, ...: another GPU k copies the
        # tensor from the host into a slot of k's (over k's host link), then to g (NVLink), so one GPU's loads
        # use every GPU's link while the others idle (a layers split's stages run one after another). Each
        # helper keeps ``relay_slots`` slots per GPU it serves: a slot's next load waits for the copy out of it,
        # and within one destination that is the order the destination runs in
        n = len(budget)
        self.relay_nbytes = aligned(cfg.relay_slot_nbytes) if cfg.relay_slots > 0 and n > 1 else 0
        relay_total = (n - 1) * cfg.relay_slots * self.relay_nbytes
        if relay_total and self.ws_nbytes + relay_total >= min(budget) // 2:
            raise BudgetError(f"{(n - 1) * cfg.relay_slots} relay slots of {self.relay_nbytes} bytes take half of a "
                              f"budget of {min(budget)} bytes")  # fmt: skip
        self.arenas = [Arena(b - self.ws_nbytes - relay_total) for b in budget]
        self.relay_base = [b - self.ws_nbytes - relay_total for b in budget]
        # relay_users[k][g][s]: what the next load into helper k's slot s for GPU g waits for
        self.relay_users = [[[[] for _ in range(cfg.relay_slots)] for _ in range(n)] for _ in range(n)]
        self.relay_next = [[0] * n for _ in range(n)]  # [k][g]: helper k's next slot for GPU g
        self.relay_turn = [0] * n  # per GPU: whose turn it is to load its next reload
        self.n_relayed = self.relayed_nbytes = 0
        self.ghosts = [Ghosts() for _ in budget]
        self.host = Arena(1 << 62)
        self.em = Emitter(tg, budget, reduce=cfg.reduce_memory_edges)
        n = tg.n
        self.loc = np.full(n, -1, dtype=np.int64)
        self.off = np.full(n, -1, dtype=np.int64)  # arena offset of t's current buffer / reservation
        self.host_ok = tg.kind == KIND_INPUT
        self.host_src = np.full(n, -1, dtype=np.int64)
        self.host_off = np.full(n, -1, dtype=np.int64)
        self.reserved_edges: dict[int, list[int]] = {}
        self.pinned: set[int] = set()
        self.reserved_nbytes = 0
        self.n_clean = self.clean_nbytes = 0
        self.resident = self.place_resident(cfg.resident_nbytes)
        self.never_evict = np.zeros(n, dtype=bool)
        self.never_evict[list(self.resident)] = True
        self.key_many = POLICIES_MANY[cfg.policy]

    def place_resident(self, nbytes: int) -> set[int]:
        """Steady state: ``keep_inputs`` stay resident, then the first inputs in V order that fit in
        ``nbytes`` per GPU."""
        keep, used = set(), [0] * len(self.arenas)
        for v in self.cfg.keep_inputs:
            v, g = int(v), int(self.tg.gpu[v])
            if self.tg.kind[v] != KIND_INPUT:
                raise ValueError(f"keep_inputs: vertex {v} ({self.tg.name[v]}) is not an input")
            off = self.arenas[g].malloc(self.tg.nbytes[v], v)
            if off < 0:
                raise BudgetError(f"GPU {g}: the {len(self.cfg.keep_inputs)} inputs that must stay resident do not "
                                  f"fit in {self.arenas[g].capacity} bytes (at {self.tg.name[v]}). Raise the budget")
            self.off[v] = off
            keep.add(v)
        for v in self.V:
            v = int(v)
            g = int(self.tg.gpu[v])
            if self.tg.kind[v] == KIND_INPUT and v not in keep and used[g] + aligned(self.tg.nbytes[v]) <= nbytes:
                off = self.arenas[g].malloc(self.tg.nbytes[v], v)
                if off >= 0:
                    used[g] += aligned(self.tg.nbytes[v])
                    self.off[v] = off
                    keep.add(v)
        return keep

    # -- horizons ---------------------------------------------------------------------------------
    def run(self) -> MemGraph:
        tg, V, n = self.tg, self.V, self.tg.n
        self.alloc = exe = 0
        cap_v, cap_b = self.cfg.lookahead_vertices, self.cfg.lookahead_nbytes
        while exe < n:
            alloc = self.alloc
            room = (
                alloc < n
                and (cap_v is None or alloc - exe < cap_v)
                and (cap_b is None or alloc == exe or self.reserved_nbytes + tg.nbytes[V[alloc]] <= cap_b)
            )
            if room and self.reserve(int(V[alloc]), evict=False):
                self.alloc += 1
            elif alloc == exe:
                self.reserve(int(V[alloc]), evict=True)
                self.alloc += 1
            else:
                self.execute(int(V[exe]))
                exe += 1
                if self.progress is not None and exe % 2048 == 0:
                    self.progress(exe)
        return self.finish()

    def needs_space(self, v: int) -> bool:
        return self.tg.op[v] != "sum_into"

    def reserves(self, v: int) -> bool:
        """Whether v takes a reservation ahead of execution (resident inputs got their place up front)."""
        return self.needs_space(v) and v not in self.resident

    def reserve(self, v: int, evict: bool) -> bool:
        """simMalloc (evict=False) / simMallocOffld (evict=True) for v's output."""
        if not self.reserves(v):
            return True
        g = int(self.tg.gpu[v])
        off = self.arenas[g].malloc(self.tg.nbytes[v], v)
        if off < 0:
            if not evict:
                return False
            off = self.make_room(g, int(self.tg.nbytes[v]), v, {int(a) for a in self.tg.args(v)}, v)
            if off < 0:
                raise self.budget_error(v, g, int(self.tg.nbytes[v]))
        self.off[v] = off
        self.reserved_edges[v] = self.ghosts[g].take(off, off + aligned(self.tg.nbytes[v]))
        self.reserved_nbytes += int(self.tg.nbytes[v])
        return True

    def make_room(self, g: int, nbytes: int, v: int, keep: set[int], owner: int) -> int:
        """Evict a contiguous range chosen by the policy and claim it for ``owner``; -1 if none exists."""
        arena = self.arenas[g]
        cur = int(self.pos[v])
        victims, off = find_victims(
            arena, aligned(nbytes), lambda t: self.evictable(t, keep), lambda t: self.key(self, t, cur),
            lambda ts: self.evictable_many(ts, keep, cur),
        )
        if off < 0:
            return -1
        for t in victims:
            self.evict(t)
        arena.claim(off, nbytes, owner)
        return off

    def evictable_many(self, ts: np.ndarray, keep: set[int], cur: int) -> tuple[np.ndarray, np.ndarray]:
        """``evictable`` and the policy's key for an array of tensors."""
        ok = (self.loc[ts] >= 0) & ~self.never_evict[ts]
        held = keep | self.pinned
        if held:
            ok &= ~np.isin(ts, np.fromiter(held, np.int64, len(held)))
        return ok, self.key_many(self, ts, cur)

    def evictable(self, t: int, keep: set[int]) -> bool:
        return t not in keep and t not in self.pinned and self.loc[t] >= 0 and t not in self.resident

    def evict(self, t: int) -> None:
        g = int(self.tg.gpu[t])
        buf = int(self.loc[t])
        users = self.em.last_users(buf)
        if not self.host_ok[t]:
            if self.host_off[t] < 0:
                self.host_off[t] = self.host.malloc(self.tg.nbytes[t], t)
            o = self.em.offload(t, buf, int(self.host_off[t]))
            users.append(o)
            self.host_ok[t], self.host_src[t] = True, o
        else:
            self.n_clean += 1
            self.clean_nbytes += int(self.tg.nbytes[t])
        off = int(self.off[t])
        self.arenas[g].release(off)
        self.ghosts[g].put(off, off + aligned(self.tg.nbytes[t]), users)
        self.loc[t] = -1

    # -- execution --------------------------------------------------------------------------------
    def execute(self, v: int) -> None:
        tg = self.tg
        args = [int(a) for a in tg.args(v)]
        self.pinned = set(args)
        if self.needs_space(v):
            self.pinned.add(v)
        for t in args:
            if self.loc[t] < 0:
                self.reload(t, v)
        edges = self.reserved_edges.pop(v, [])
        self.reserved_nbytes -= int(tg.nbytes[v]) if self.reserves(v) else 0
        params = {"resident": True} if v in self.resident else None
        g = int(tg.gpu[v])
        k = self.relay_helper(g, int(tg.nbytes[v])) if tg.kind[v] == KIND_INPUT and v not in self.resident else g
        if k == g:
            mv = mi = self.em.kernel(v, [int(self.loc[t]) for t in args], int(self.off[v]), edges, params)
        else:  # the input's first load, relayed
            mi, mv = self.relayed(v, k, g, int(self.off[v]), edges,
                                  lambda slot, waits: self.em.kernel(v, [], slot, waits, params, gpu=k))  # fmt: skip
        if tg.kind[v] == KIND_INPUT:
            if self.host_off[v] < 0:
                self.host_off[v] = self.em.input_host(v)
            self.em.host_offset[mi] = self.host_off[v]
        if tg.op[v] == "sum_into":
            acc = int(tg.acc[v])
            self.host_ok[acc] = False
        else:
            self.loc[v] = mv
        cur = int(self.pos[v])
        for t in {*args, v}:
            self.last_use[t] = cur
            self.advance(t, cur)
        self.pinned = set()

    def advance(self, t: int, cur: int) -> None:
        """Move t's next-use pointer past ``cur``; free t if nothing will use it again. Host copies are
        never reused for another tensor, so host memory needs no dependencies."""
        i, end = self.next_use[t], self.use_ptr[t + 1]
        while i < end and self.use_pos[i] <= cur:
            i += 1
        self.next_use[t] = i
        if (
            i == end
            and not self.tg.is_output[t]
            and self.loc[t] >= 0
            and self.needs_space(t)
            and t not in self.resident
        ):
            g = int(self.tg.gpu[t])
            off = int(self.off[t])
            self.arenas[g].release(off)
            self.ghosts[g].put(off, off + aligned(self.tg.nbytes[t]), self.em.last_users(int(self.loc[t])))
            self.loc[t] = -1

    def reload(self, t: int, v: int) -> None:
        """simMallocForceReld: bring t back to its GPU before v runs; may evict or cancel reservations."""
        g = int(self.tg.gpu[t])
        arena = self.arenas[g]
        off = arena.malloc(self.tg.nbytes[t], t)
        while off < 0:
            off = self.make_room(g, int(self.tg.nbytes[t]), v, self.pinned, t)
            if off < 0:
                if self.alloc - 1 <= self.pos[v]:
                    raise self.budget_error(v, g, int(self.tg.nbytes[t]))
                self.cancel(int(self.V[self.alloc - 1]))
                off = arena.malloc(self.tg.nbytes[t], t)
        self.off[t] = off
        edges = self.ghosts[g].take(off, off + aligned(self.tg.nbytes[t]))
        k = self.relay_helper(g, int(self.tg.nbytes[t]))
        host_off, host_src = int(self.host_off[t]), int(self.host_src[t])
        if k == g:
            self.loc[t] = self.em.reload(t, off, host_off, host_src, edges)
        else:
            _, self.loc[t] = self.relayed(t, k, g, off, edges,
                                          lambda slot, waits: self.em.reload(t, slot, host_off, host_src, waits, gpu=k))

    def relayed(self, t: int, k: int, g: int, off: int, edges: list[int], load) -> tuple[int, int]:
        """Bring tensor t to ``off`` on GPU g through helper k: ``load(slot, waits)`` emits its load into k's next
        slot for g (after ``waits``, the copy out of that slot before), then a copy to g after ``edges``.
        Returns (the load, the copy); counts the relay."""
        S = self.cfg.relay_slots
        s = self.relay_next[k][g]
        self.relay_next[k][g] = (s + 1) % S
        waits = self.relay_users[k][g]
        r = load(self.relay_base[k] + ((g - k - 1) % len(self.arenas) * S + s) * self.relay_nbytes, waits[s])
        x = self.em.relay(t, r, g, off, edges)
        waits[s] = [x]  # the slot's next load waits for this copy out of it
        self.n_relayed += 1
        self.relayed_nbytes += int(self.tg.nbytes[t])
        return r, x

    def relay_helper(self, g: int, nbytes: int) -> int:
        """The GPU whose host link brings GPU g's next reload: g itself, or in turn each other GPU (relays on,
        the tensor fits a slot)."""
        if not self.relay_nbytes or nbytes > self.relay_nbytes:
            return g
        n = len(self.arenas)
        turn = self.relay_turn[g]
        self.relay_turn[g] = (turn + 1) % n
        return (g + turn) % n

    def cancel(self, w: int) -> None:
        """Give back the newest reservation (allocHzn steps back); its range keeps its memory deps."""
        self.alloc -= 1
        if self.reserves(w):
            g = int(self.tg.gpu[w])
            off = int(self.off[w])
            self.arenas[g].release(off)
            self.ghosts[g].put(off, off + aligned(self.tg.nbytes[w]), self.reserved_edges.pop(w))
            self.off[w] = -1
            self.reserved_nbytes -= int(self.tg.nbytes[w])

    def budget_error(self, v: int, g: int, nbytes: int) -> BudgetError:
        tg = self.tg
        args = [int(a) for a in tg.args(v)]
        need = sum(aligned(tg.nbytes[a]) for a in args if tg.gpu[a] == g) + aligned(tg.nbytes[v])
        cap = self.arenas[g].capacity
        biggest = max([v, *args], key=lambda a: tg.nbytes[a])
        err = BudgetError(
            f"vertex {v} ({tg.name[v]}, op {tg.op[v]}) on gpu {g} cannot get {nbytes} bytes: its inputs and "
            f"output need {need} bytes against a budget of {cap} bytes (free ranges fragmented or pinned by "
            f"operands). Reduce the tile size of its largest tensor ({tg.name[biggest]}, shape "
            f"{tg.shape[biggest]}, {tg.nbytes[biggest]} bytes) or raise the budget."
        )
        err.shape, err.tensor = tuple(int(x) for x in tg.shape[biggest]), str(tg.name[biggest])
        return err

    def finish(self) -> MemGraph:
        tg = self.tg
        outs = [int(self.loc[t]) if self.loc[t] >= 0 else int(self.host_src[t]) for t in np.flatnonzero(tg.is_output)]
        resident = int(sum(int(tg.nbytes[t]) for t in self.resident))
        return self.em.build(
            outs,
            host_nbytes=self.host.peak,
            stats={
                "peak_nbytes_per_gpu": [a.peak for a in self.arenas],
                "host_peak_nbytes": int(self.host.peak),
                "host_input_nbytes": int(self.em.input_host_nbytes),
                "resident_input_nbytes": resident,
                "policy": self.cfg.policy,
                "n_clean_evict": self.n_clean,
                "workspace_slot_nbytes": aligned(self.cfg.workspace_nbytes) if self.ws_nbytes else 0,
                "workspace_slots": self.cfg.workspace_slots if self.ws_nbytes else 0,
                "clean_evict_nbytes": self.clean_nbytes,
                "n_relayed": self.n_relayed,
                "relayed_nbytes": self.relayed_nbytes,
                "relay_slots": self.cfg.relay_slots if self.relay_nbytes else 0,
                "relay_slot_nbytes": self.relay_nbytes,
            },
        )


def build_memgraph(
    tg: TaskGraph, budget_nbytes, config: BuildConfig | None = None, *, policy: str | None = None, progress=None
) -> MemGraph:
    """Compile ``tg`` under a per-GPU budget (an int for every GPU, or a list) into a MemGraph."""
    cfg = config or BuildConfig()
    if policy is not None:
        cfg = dataclasses.replace(cfg, policy=policy)
    budget = [int(budget_nbytes)] * tg.n_gpus if np.ndim(budget_nbytes) == 0 else [int(b) for b in budget_nbytes]
    if len(budget) != tg.n_gpus:
        raise ValueError(f"{len(budget)} budgets for {tg.n_gpus} GPUs")
    if min(budget) < ALIGN:
        raise BudgetError(f"budget {min(budget)} bytes is below one {ALIGN}-byte allocation unit")
    t0 = time.perf_counter()
    mg = _Build(tg, budget, cfg, progress).run()
    mg.stats["build_s"] = time.perf_counter() - t0
    return mg


__all__ = ["BudgetError", "BuildConfig", "build_memgraph", "KIND_TRANSFER"]
