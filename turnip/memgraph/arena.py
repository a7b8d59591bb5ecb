"""Byte arenas for BuildMemgraph: a first-fit allocator over coalesced free ranges, and the "ghosts" of
freed ranges that remember which memgraph vertices touched them last.

Arena state: ``largest`` bounds the biggest free range from above; ``free`` is a sorted list of disjoint,
non-adjacent [start, end) ranges; ``used`` maps the start of every allocated range to (end, owner). Every
range start and length is a multiple of ALIGN.
Ghost state: sorted disjoint (start, end, users) triples; a new allocation over a ghost must depend on its
users (memory dependency), after which that part of the ghost is forgotten (the new occupant's users will
be ordered after it).
"""

from __future__ import annotations

import bisect

ALIGN = 256


def aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class Arena:
    __slots__ = ("capacity", "free", "used", "in_use", "peak", "largest")

    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGN
        self.free: list[list[int]] = [[0, self.capacity]] if self.capacity > 0 else []
        self.used: dict[int, tuple[int, object]] = {}
        self.in_use = 0
        self.peak = 0
        self.largest = self.capacity  # upper bound on the largest free range: quick rejects

    def malloc(self, nbytes: int, owner) -> int:
        """First fit; returns the offset or -1."""
        n = aligned(nbytes)
        if n > self.largest:
            return -1
        for i, r in enumerate(self.free):
            off = r[0]
            if r[1] - off >= n:
                if r[1] - off == n:
                    del self.free[i]
                else:
                    r[0] = off + n
                self._take(off, n, owner)
                return off
        self.largest = max((e - b for b, e in self.free), default=0)  # the scan failed: the bound is exact
        return -1

    def claim(self, off: int, nbytes: int, owner) -> None:
        """Allocate exactly [off, off + aligned(nbytes)), which must be free."""
        n, end = aligned(nbytes), off + aligned(nbytes)
        i = bisect.bisect_right(self.free, [off, float("inf")]) - 1
        r = self.free[i]
        assert r[0] <= off and end <= r[1], (off, end, r)
        tail = [end, r[1]]
        if r[0] == off:
            del self.free[i]
        else:
            r[1] = off
            i += 1
        if tail[1] > tail[0]:
            self.free.insert(i, tail)
        self._take(off, n, owner)

    def _take(self, off: int, n: int, owner) -> None:
        self.used[off] = (off + n, owner)
        self.in_use += n
        self.peak = max(self.peak, self.in_use)

    def release(self, off: int) -> None:
        end, _ = self.used.pop(off)
        self.in_use -= end - off
        fr = self.free
        i = bisect.bisect_left(fr, [off, off])
        if i > 0 and fr[i - 1][1] == off:
            i -= 1
            fr[i][1] = end
        else:
            fr.insert(i, [off, end])
        if i + 1 < len(fr) and fr[i + 1][0] == fr[i][1]:
            fr[i][1] = fr[i + 1][1]
            del fr[i + 1]
        self.largest = max(self.largest, fr[i][1] - fr[i][0])

    def segment_array(self):
        """``segments`` as an (n, 3) int64 array of (start, end, owner), owner -1 for free ranges (owners are
        tensor ids)."""
        import numpy as np

        nu, nf = len(self.used), len(self.free)
        a = np.empty((nu + nf, 3), dtype=np.int64)
        if nu:
            a[:nu, 0] = list(self.used)
            a[:nu, 1:] = list(self.used.values())
        if nf:
            a[nu:, :2] = self.free
            a[nu:, 2] = -1
        return a[np.argsort(a[:, 0], kind="stable")]

    def segments(self) -> list[tuple[int, int, object]]:
        """All ranges in offset order: (start, end, owner), owner None for free ranges."""
        segs = [(s, e, o) for s, (e, o) in self.used.items()] + [(s, e, None) for s, e in self.free]
        segs.sort(key=lambda x: x[0])
        return segs


class Ghosts:
    __slots__ = ("starts", "items")

    def __init__(self):
        self.starts: list[int] = []
        self.items: list[tuple[int, int, tuple]] = []

    def take(self, start: int, end: int) -> list[int]:
        """Users of every ghost overlapping [start, end); the overlapped parts are forgotten."""
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        users: list[int] = []
        keep: list[tuple[int, int, tuple]] = []
        j = i
        while j < len(self.items) and self.items[j][0] < end:
            s, e, u = self.items[j]
            if e > start:
                users.extend(u)
                if s < start:
                    keep.append((s, start, u))
                if e > end:
                    keep.append((end, e, u))
            else:
                keep.append((s, e, u))
            j += 1
        if j > i:
            self.items[i:j] = keep
            self.starts[i:j] = [k[0] for k in keep]
        return users

    def put(self, start: int, end: int, users) -> None:
        """Record a freed range; it must not overlap a live ghost (callers ``take`` first)."""
        self.take(start, end)
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.items.insert(i, (start, end, tuple(users)))
