"""Belady's offline optimum (MIN): with the whole future known, keep the blocks whose next use
comes soonest. For a cache of `capacity` blocks it has the most hits any demand policy can have
on the trace; a block never used again is not kept at all (the optimum's admission).

With the warm tier as a second level, MIN over hot + warm capacity bounds hot-or-warm hits, and
since MIN is a stack algorithm both bounds hold at once (the blocks MIN keeps in the smaller
cache are a subset of those it keeps in the larger). Requests are taken as the flat sequence of
their block accesses. O(n log n) in the number of accesses.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Optimum:
    capacity: int
    hits: int
    accesses: int
    reaccesses: int  # accesses of blocks used before (the only ones a cache can hit)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def hit_rate_reaccess(self) -> float:
        return self.hits / self.reaccesses if self.reaccesses else 0.0


def next_use(blocks: np.ndarray) -> np.ndarray:
    """For each access, the index of the next access of the same block (len: never again)."""
    n = blocks.shape[0]
    order = np.argsort(blocks, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = blocks[order[1:]] == blocks[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(blocks: np.ndarray, capacity: int) -> Optimum:
    """Hits of the optimal cache of `capacity` blocks on the access sequence `blocks`."""
    n = int(blocks.shape[0])
    nxt = next_use(blocks)
    reaccesses = n - int(np.unique(blocks).size) if n else 0
    if capacity <= 0 or n == 0:
        return Optimum(capacity, 0, n, reaccesses)
    cached: dict[int, int] = {}  # block -> index of its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for i, (b, nu) in enumerate(zip(blocks.tolist(), nxt.tolist())):
        if cached.get(b) == i:
            hits += 1
        if nu == n:  # never used again: not worth a slot
            cached.pop(b, None)
            continue
        cached[b] = nu
        push(heap, (-nu, b))
        while len(cached) > capacity:
            neg, v = pop(heap)
            if cached.get(v) == -neg:
                del cached[v]
    return Optimum(capacity, hits, n, reaccesses)
