"""Defragmentation of the block arenas (hot, warm) and segment compaction of the cold tier.

A pool is a fixed arena of slots; fragmentation is a layout question: free slots scattered
between used ones. `measure` reports used / free / largest contiguous free run and
`ratio = 1 - largest_free_run / free` (0 = all free space in one run). `plan_compaction` is
pure: it moves the highest movable used slots into the lowest free slots until every movable
block sits below every free slot; blocks in use by a running request stay where they are.
`apply_plan` executes it through `store.relocate` (atomic with respect to readers, skips a block
that became busy since planning) in chunks sized so that each call, which holds the store's
lock, stays under `max_pause_s`; on CUDA it then returns cached allocator memory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Callable, Sequence

import numpy as np
import structlog
import torch

from kvagentd.kvcache.base import Tier

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class FragStats:
    tier: str
    capacity: int
    used: int
    free: int
    largest_free_run: int
    ratio: float  # 1 - largest_free_run / free; 0.0 when nothing is free
    cuda: dict[str, int] | None = None  # reserved / allocated / inactive_split bytes on CUDA

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_bitmap(used: np.ndarray) -> tuple[int, int, int, float]:
    """(used, free, largest free run, ratio) of a boolean occupancy bitmap."""
    used = np.asarray(used, dtype=bool)
    n_used = int(used.sum())
    free = used.size - n_used
    if free == 0:
        return n_used, 0, 0, 0.0
    edges = np.diff(np.concatenate(([0], (~used).astype(np.int8), [0])))
    run = int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())
    return n_used, free, run, 1.0 - run / free


def cuda_memory(device: torch.device | str) -> dict[str, int] | None:
    """torch's caching-allocator figures for a CUDA device; None elsewhere."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    s = torch.cuda.memory_stats(dev)
    return {"reserved_bytes": int(s.get("reserved_bytes.all.current", 0)),
            "allocated_bytes": int(s.get("allocated_bytes.all.current", 0)),
            "inactive_split_bytes": int(s.get("inactive_split_bytes.all.current", 0))}


@dataclass(frozen=True, slots=True)
class DefragPlan:
    tier: str
    moves: tuple[tuple[int, int], ...]  # (src slot, dst slot), each dst free at planning time
    before: FragStats
    predicted: FragStats

    def as_dict(self, *, max_moves: int = 64) -> dict[str, Any]:
        return {"tier": self.tier, "num_moves": len(self.moves),
                "moves": [list(m) for m in self.moves[:max_moves]],
                "before": self.before.as_dict(), "predicted": self.predicted.as_dict()}


def plan_compaction(tier: str, used: np.ndarray, busy: Sequence[int] | np.ndarray = (),
                    *, cuda: dict[str, int] | None = None) -> DefragPlan:
    """Pure: moves that pack every movable used slot below every free slot.

    `used` is the occupancy bitmap; `busy` lists used slots that must not move (in use).
    Each move's destination is a slot free at planning time and its source a movable used
    slot above it, so moves are independent and may be applied in any chunking.
    """
    used = np.asarray(used, dtype=bool).copy()
    fixed = np.zeros(used.size, dtype=bool)
    if len(busy):
        fixed[np.asarray(busy, dtype=np.int64)] = True
    before = FragStats(tier, used.size, *measure_bitmap(used), cuda=cuda)
    holes = np.flatnonzero(~used)  # ascending
    movable = np.flatnonzero(used & ~fixed)[::-1]  # descending
    k = min(holes.size, movable.size)
    n = int(np.count_nonzero(holes[:k] < movable[:k])) if k else 0
    # holes ascending and sources descending: the pairs with hole < source form a prefix.
    src, dst = movable[:n], holes[:n]
    used[dst] = True
    used[src] = False
    moves = tuple(zip(src.tolist(), dst.tolist()))
    return DefragPlan(tier, moves, before, FragStats(tier, used.size, *measure_bitmap(used)))


@dataclass(slots=True)
class DefragResult:
    tier: str
    planned: int
    moved: int = 0
    skipped: int = 0
    chunks: int = 0
    max_pause_s: float = 0.0
    total_s: float = 0.0
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    dry_run: bool = False
    plan: dict[str, Any] | None = None
    note: str = ""
    pauses_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("pauses_s")
        return d


def apply_plan(store: Any, tier: Tier, plan: DefragPlan, *, max_pause_s: float,
               progress: Callable[[int, int], None] | None = None,
               should_continue: Callable[[], bool] = lambda: True,
               first_chunk: int = 256) -> DefragResult:
    """Run `plan` through `store.relocate` in chunks whose duration adapts to `max_pause_s`.

    Stops early (and says so in `note`) when `should_continue()` turns False between chunks,
    e.g. when a request arrives. Every applied chunk leaves the store consistent.
    """
    res = DefragResult(plan.tier, len(plan.moves))
    chunk = max(1, first_chunk)
    i = 0
    t_start = time.perf_counter()
    while i < len(plan.moves):
        if not should_continue():
            res.note = f"stopped for load after {i} of {len(plan.moves)} moves"
            break
        part = plan.moves[i:i + chunk]
        t0 = time.perf_counter()
        moved = store.relocate(tier, part)
        dt = time.perf_counter() - t0
        res.pauses_s.append(dt)
        res.moved += moved
        res.skipped += len(part) - moved
        res.chunks += 1
        i += len(part)
        if progress is not None:
            progress(i, len(plan.moves))
        # Aim at 70 % of the bound; a block move costs about the same every time.
        per_move = dt / max(1, len(part))
        chunk = max(1, min(4 * chunk, int(0.7 * max_pause_s / per_move) if per_move > 0 else 4 * chunk))
        time.sleep(0)  # let waiting readers take the lock between chunks
    res.total_s = time.perf_counter() - t_start
    res.max_pause_s = max(res.pauses_s, default=0.0)
    return res
