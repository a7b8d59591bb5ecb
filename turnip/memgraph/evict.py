"""Eviction policies: choose a contiguous range of the arena to free for an allocation.

A policy is a key ``(builder, tensor, position) -> float``: higher means better to evict. A candidate range
is a run of adjacent free or evictable segments covering the request; its score is the lowest key among
the tensors in it, and the best-scoring range wins (ties: lowest offset).
"""

from __future__ import annotations

import math


def furthest_next_use(b, t: int, cur: int) -> float:
    i = b.next_use[t]
    return math.inf if i >= b.use_ptr[t + 1] else float(b.use_pos[i])


def least_recently_used(b, t: int, cur: int) -> float:
    return float(cur - b.last_use[t])


def largest(b, t: int, cur: int) -> float:
    return float(b.tg.nbytes[t])


POLICIES = {"furthest": furthest_next_use, "lru": least_recently_used, "largest": largest}


def find_victims(arena, nbytes: int, evictable, key) -> tuple[list[int], int]:
    """Best range of ``nbytes``: (tensors to evict, start offset), or ([], -1) when none exists. For every
    start segment, the shortest run of free or evictable segments from it that covers ``nbytes`` is a
    candidate scored by its lowest key; one pass per run of such segments (two pointers, a deque of
    window minima), keys computed only for evictable tensors."""
    from collections import deque

    segs = arena.segments()
    n = len(segs)
    best, best_i, best_j = -math.inf, -1, -1
    i = 0
    while i < n:
        o = segs[i][2]
        if o is not None and not evictable(o):
            i += 1
            continue
        a = i  # a run [a, b) of free or evictable segments
        b = i
        keys = []
        while b < n and (segs[b][2] is None or evictable(segs[b][2])):
            keys.append(math.inf if segs[b][2] is None else key(segs[b][2]))
            b += 1
        total, j, win = 0, a, deque()  # window [start, j): total bytes, deque of indices with rising keys
        for start in range(a, b):
            while j < b and total < nbytes:
                total += segs[j][1] - segs[j][0]
                while win and keys[win[-1] - a] >= keys[j - a]:
                    win.pop()
                win.append(j)
                j += 1
            if total < nbytes:
                break
            score = keys[win[0] - a]
            if score > best:
                best, best_i, best_j = score, start, j - 1
            total -= segs[start][1] - segs[start][0]
            if win and win[0] == start:
                win.popleft()
        i = b + 1
    if best_i < 0:
        return [], -1
    victims = [segs[k][2] for k in range(best_i, best_j + 1) if segs[k][2] is not None]
    return victims, segs[best_i][0]
