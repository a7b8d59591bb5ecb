"""Dropping memory-dependency edges that other paths already imply, as the memgraph is emitted.

State: ``Ancestors`` owns, for each recently emitted vertex v, the set of v and its ancestors among the
last ``window`` (to ``window + frame``) vertices before it, as a Python int bitset, and ``n_dropped``, the
memory edges dropped so far. Bits are relative to the base of v's frame (``frame`` consecutive vertex ids
share one base, ``window`` below the frame's first id, or 0), so a vertex combines the sets of parents of
its own frame with plain ORs and only parents of earlier frames need a right shift (which drops the bits
that fell out of the window). Sets older than the window are forgotten.

The test. v's set starts as v itself plus the sets of its data dependencies; then its memory dependencies,
newest first: one already in the set is dropped, any other is kept and its set joins.

Why dropping is exact. Vertices are emitted in a topological order (every dependency of v is emitted
before v) and a vertex's dependencies are final when it is emitted. Each stored set holds only the vertex
and true ancestors of it (the union of its kept dependencies' sets, cut to the window). A memory
dependency u of v is dropped only when u is in the set of another dependency w of v, so a path
u -> ... -> w -> v of length >= 2 exists. Removing from a DAG any set of edges each of which has such a
path keeps every reachability relation: a longest path between two vertices uses no such edge (replacing
it by its path would give a longer one), so it survives. Hence the transitive closure of the memgraph is
unchanged. Data edges are never dropped.

What it misses. Within the window the test is exact: if u reaches another dependency w of v and u is at
most ``window`` vertices before v's frame, every vertex on the path is in the window, so u is in w's set
(or in the set of the kept dependency whose set holds w, for a dropped w). Implied memory edges longer
than that are kept.
"""

from __future__ import annotations

from turnip.memgraph.plan import DEP_MEMORY


class Ancestors:
    """Windowed ancestor bitsets over emission order; decides which memory dependencies are implied."""

    __slots__ = ("window", "frame", "sets", "top", "n_dropped")

    def __init__(self, window: int = 4096, frame: int = 512):
        if window < 0 or frame <= 0:
            raise ValueError("window must be >= 0 and frame > 0")
        self.window, self.frame = window, frame
        self.sets: list[int] = []  # by vertex id; 0 once older than the window (forgotten)
        self.top = [1 << (window + i) for i in range(frame)]  # a vertex's own bit, by its place in its frame
        self.n_dropped = 0

    def add(self, deps: dict[int, int]) -> tuple[list[int], list[int]]:
        """Register the next vertex (id ``len(self.sets)``) whose dependencies (distinct ids below it) map
        to their kind. Returns the dependencies kept and their kinds: all but the memory dependencies that
        another dependency implies. ``deps`` loses the dropped ones."""
        sets, fr, win = self.sets, self.frame, self.window
        v = len(sets)
        lo = v - v % fr  # first id of v's frame
        base = lo - win  # bit 0 of the sets in v's frame (0 in the first frames)
        if base > 0:
            anc = self.top[v - lo]
        else:
            base = 0
            anc = 1 << v
        mem = None
        for s, kind in deps.items():
            if kind == DEP_MEMORY:
                if mem is None:
                    mem = [s]
                else:
                    mem.append(s)
            elif s >= lo:
                anc |= sets[s]
            elif s >= base:  # an earlier frame: shift its set to v's base
                sb = s - s % fr - win
                anc |= sets[s] >> (base - sb if sb > 0 else base)
        if mem is not None:
            # newest first: a memory dependency already in the union of the data dependencies' and the kept
            # newer memory dependencies' sets is implied; a dropped one's set is inside the union
            mem.sort(reverse=True)
            for u in mem:
                if u >= base and (anc >> (u - base)) & 1:
                    del deps[u]
                    self.n_dropped += 1
                elif u >= lo:
                    anc |= sets[u]
                elif u >= base:
                    sb = u - u % fr - win
                    anc |= sets[u] >> (base - sb if sb > 0 else base)
        sets.append(anc)
        if v >= win + 2 * fr:
            sets[v - win - 2 * fr] = 0
        return list(deps), list(deps.values())
