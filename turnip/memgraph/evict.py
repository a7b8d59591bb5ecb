"""Eviction policies: choose a contiguous range of the arena to free for an allocation.

A policy is a key ``(builder, tensor, position) -> float``: higher means better to evict. A candidate range
is a run of adjacent free or evictable segments covering the request; its score is the lowest key among
the tensors in it, and the best-scoring range wins (ties: lowest offset).
"""

from __future__ import annotations

import math

import numpy as np


def furthest_next_use(b, t: int, cur: int) -> float:
    i = b.next_use[t]
    return math.inf if i >= b.use_ptr[t + 1] else float(b.use_pos[i])


def least_recently_used(b, t: int, cur: int) -> float:
    return float(cur - b.last_use[t])


def largest(b, t: int, cur: int) -> float:
    return float(b.tg.nbytes[t])


POLICIES = {"furthest": furthest_next_use, "lru": least_recently_used, "largest": largest}


def _furthest_many(b, ts: np.ndarray, cur: int) -> np.ndarray:
    i = b.next_use[ts]
    done = i >= b.use_ptr[ts + 1]
    return np.where(done, np.inf, b.use_pos[np.minimum(i, len(b.use_pos) - 1)].astype(np.float64))


NUMPY_MIN_SEGMENTS = 64  # arenas of more segments than this are searched in numpy (it pays off on many)

# the same keys for an array of tensors at once (``find_victims``'s vectorized search)
POLICIES_MANY = {
    "furthest": _furthest_many,
    "lru": lambda b, ts, cur: (cur - b.last_use[ts]).astype(np.float64),
    "largest": lambda b, ts, cur: b.tg.nbytes[ts].astype(np.float64),
}


def find_victims(arena, nbytes: int, evictable, key, many=None) -> tuple[list[int], int]:
    """Best range of ``nbytes``: (tensors to evict, start offset), or ([], -1) when none exists. For every
    start segment, the shortest run of free or evictable segments from it that covers ``nbytes`` is a
    candidate scored by its lowest key; the best score wins, ties to the lowest offset. ``many(owners) ->
    (evictable mask, keys)`` does the same per array of tensors: the search then runs in numpy."""
    if many is not None and len(arena.used) + len(arena.free) > NUMPY_MIN_SEGMENTS:
        return _find_many(arena.segment_array(), nbytes, many)
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


def _find_many(segs: np.ndarray, nbytes: int, many) -> tuple[list[int], int]:
    """``find_victims`` in numpy over ``Arena.segment_array``: window ends by binary search on the running
    sizes, window minima from a sparse table (min over [i, e) = min of two overlapping power-of-two blocks)."""
    n = len(segs)
    if n == 0:
        return [], -1
    start, end, owner = segs[:, 0], segs[:, 1], segs[:, 2]
    occ = np.flatnonzero(owner >= 0)
    ok = owner < 0
    keys = np.full(n, np.inf)
    if occ.size:
        ok_o, key_o = many(owner[occ])
        ok[occ] = ok_o
        keys[occ] = np.where(ok_o, key_o, np.inf)
    bad = np.flatnonzero(~ok)
    nxt = np.searchsorted(bad, np.arange(n))  # the first segment at or after i that cannot go
    run_end = np.full(n, n, dtype=np.int64)
    has = nxt < bad.size
    run_end[has] = bad[nxt[has]]
    cum = np.concatenate(([0], np.cumsum(end - start)))
    e = np.searchsorted(cum, cum[:-1] + nbytes, side="left")  # window [i, e) is the shortest from i
    valid = ok & (e <= run_end)
    if not valid.any():
        return [], -1
    length = np.where(valid, e - np.arange(n), 1)
    levels = [keys]
    while (1 << len(levels)) <= int(length.max()):
        prev, h = levels[-1], 1 << (len(levels) - 1)
        levels.append(np.minimum(prev, np.concatenate((prev[h:], np.full(h, np.inf)))))
    k = np.floor(np.log2(length)).astype(np.int64)
    idx = np.arange(n)
    table = np.stack(levels)
    right = np.clip(np.where(valid, e, 1) - (1 << k), 0, n - 1)
    score = np.minimum(table[k, idx], table[k, right])
    score = np.where(valid, score, -np.inf)
    i = int(np.argmax(score))  # the first of the best: ties to the lowest offset
    victims = [int(o) for o in owner[i : int(e[i])] if o >= 0]
    return victims, int(start[i])
