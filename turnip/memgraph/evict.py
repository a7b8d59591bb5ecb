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
    """Best range of ``nbytes``: (tensors to evict, start offset), or ([], -1) when none exists."""
    segs = arena.segments()
    ok = [o is None or evictable(o) for _, _, o in segs]
    keys = [math.inf if o is None or not k else key(o) for (_, _, o), k in zip(segs, ok, strict=True)]
    best, best_i, best_j = -math.inf, -1, -1
    n = len(segs)
    for i in range(n):
        if not ok[i]:
            continue
        total, score, j = 0, math.inf, i
        while j < n and ok[j]:
            total += segs[j][1] - segs[j][0]
            score = min(score, keys[j])
            if total >= nbytes:
                break
            j += 1
        if total >= nbytes and score > best and j < n:
            best, best_i, best_j = score, i, j
    if best_i < 0:
        return [], -1
    victims = [segs[k][2] for k in range(best_i, best_j + 1) if segs[k][2] is not None]
    return victims, segs[best_i][0]
