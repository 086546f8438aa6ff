"""Write-behind: committed hot and warm blocks reach the cold tier within an interval, so a
power cut (or kill -9) loses at most that interval of KV, not every hot and warm block.

Every `interval_s` one round writes the blocks that sessions reference and that have no cold
copy yet, oldest commit first (a session's prefix before its tail: a prefix match stops at
the first missing block), at most `rate_bytes_per_s`, then saves the session references and
makes the cold index durable (`ColdTier.save_refs`). A block written here needs no write when
it is demoted later.

Blocks are never held while they are written: a use-reference would move them to the
recent end of the idle LRU and keep them from being demoted. Instead a batch is copied into a
staging arena outside the owner lock and written only where the block did not move meanwhile
(same block, version and slot): a slot is reused only after a completed move, which bumps the
version. Nothing here raises into the store: a failed round is logged and counted.

Rounds write nothing while the cold tier takes no records (read-only) or is not durable (the
RAM shadow serves while the SSD fails: copies there would not survive a power cut, and would
push out of the size-capped shadow records that exist nowhere else), nor while paused (the
cold disk below its free space floor: `pause`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog

from kvagentd.kvcache.base import BlockKey, ColdTier, Tier
from kvagentd.kvcache.store.budget import WriteBudget
from kvagentd.kvcache.store.persist import SCAN_CHUNK, collect_refs
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import BlockMeta, BlockState
from kvagentd.kvcache.store.table import POOL_TIERS, BlockTable

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class WriteBehindPolicy:
    """`interval_s` between rounds (0: off), the write rate cap, blocks per cold write."""

    interval_s: float = 30.0
    rate_bytes_per_s: int = 64 << 20
    batch_blocks: int = 8

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0


class RoundResult(NamedTuple):
    """One round: blocks and bytes written, blocks skipped (moved while copied), blocks the
    cold tier refused, blocks still without a cold copy when it ended, and its seconds."""

    written: int
    bytes: int
    moved: int
    refused: int
    left: int
    seconds: float


class WriteBehind:
    """The write-behind of one store (`table`, `pools`, `cold`); a thread while started.
    `epoch()` is the store's cold failover count: copies written across a failover are not
    relied on (the next round writes them again, to the tier that serves then)."""

    def __init__(self, table: BlockTable, pools: dict[Tier, BlockPool], cold: ColdTier,
                 policy: WriteBehindPolicy, *, epoch: Callable[[], int],
                 clock: Callable[[], float] = time.time,
                 budget: WriteBudget | None = None) -> None:
        self.t, self.pools, self.cold, self.policy = table, pools, cold, policy
        self.budget = budget
        self.over_budget = 0  # rounds that stopped for the SSD's write budget
        self.epoch = epoch
        self.clock = clock
        shape, dtype = pools[Tier.HOT].block_shape, pools[Tier.HOT].arena.dtype
        n = max(1, policy.batch_blocks) if policy.enabled else 1
        self.staging = BlockPool("write-behind", n, shape, dtype, "cpu", pin_memory=True).arena
        self.block_bytes = pools[Tier.HOT].block_bytes or pools[Tier.WARM].block_bytes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one round at a time (the thread, `flush`)
        self.rounds = self.errors = 0
        self.written_blocks = self.written_bytes = self.refused = 0
        self.last: RoundResult | None = None
        self.last_at: float | None = None
        self._refs_saved: dict[str, tuple[BlockKey, ...]] | None = None
        self.paused: str | None = None  # why rounds write no blocks now (None: they do)

    def pause(self, reason: str | None) -> None:
        """Rounds write no blocks while `reason` is set (the cold disk below its floor)."""
        if (reason is None) != (self.paused is None):  # a change of state, not of wording
            if reason is None:
                log.info("write_behind_resumed")
            else:
                log.warning("write_behind_paused", reason=reason)
        self.paused = reason

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        if not self.policy.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="kv-write-behind", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            try:
                self.run_round()
            except Exception:  # the thread outlives any one bad round
                self.errors += 1
                log.exception("write_behind_round_failed")

    # -- one round -----------------------------------------------------------------------------
    def run_round(self) -> RoundResult:
        """Write every unsaved block (as of now), then save the references."""
        with self._lock:
            t0 = time.monotonic()
            written = nbytes = moved = refused = 0
            if self.cold.durable and not self.cold.read_only and self.paused is None:
                todo = self._unsaved()
                step = max(1, self.policy.batch_blocks)
                for i in range(0, len(todo), step):
                    if self._stop.is_set():
                        break
                    batch = todo[i:i + step]
                    if self.budget is not None and not self.budget.take(
                            len(batch) * self.block_bytes):
                        self.over_budget += 1  # the rest waits (in RAM) for the next round
                        break
                    w, m, r = self._write(batch)
                    written, moved, refused = written + w, moved + m, refused + r
                    nbytes += w * self.block_bytes
                    self._pace(nbytes, t0)
            self._save_refs()
            res = RoundResult(written, nbytes, moved, refused, len(self._unsaved()),
                              time.monotonic() - t0)
            self.rounds += 1
            self.written_blocks += written
            self.written_bytes += nbytes
            self.refused += refused
            self.last, self.last_at = res, self.clock()
        if written or refused:
            log.info("write_behind_round", written=written, moved=moved, refused=refused,
                     left=res.left, seconds=round(res.seconds, 3))
        return res

    def _pace(self, nbytes: int, t0: float) -> None:
        rate = self.policy.rate_bytes_per_s
        if rate > 0:
            ahead = nbytes / rate - (time.monotonic() - t0)
            if ahead > 0:
                self._stop.wait(ahead)

    def _unsaved(self) -> list[BlockMeta]:
        """Settled hot and warm blocks that sessions reference and that have no cold copy,
        in commit order (the table's insertion order)."""
        out: list[BlockMeta] = []
        with self.t.cond:
            metas = list(self.t.meta.values())
        for i in range(0, len(metas), SCAN_CHUNK):
            with self.t.cond:
                out += [m for m in metas[i:i + SCAN_CHUNK]
                        if m.tier in POOL_TIERS and m.sessions and not m.in_cold]
        return out

    def _write(self, batch: list[BlockMeta]) -> tuple[int, int, int]:
        """Copy, check, write one batch; returns (written, moved meanwhile, refused)."""
        with self.t.cond:
            seen = [(m, m.tier, m.slot, m.version) for m in batch
                    if self.t.meta.get(m.key) is m and m.tier in POOL_TIERS and not m.in_cold]
            epoch = self.epoch()
        for j, (_, tier, slot, _) in enumerate(seen):
            assert tier is not None and slot is not None
            self.staging[j].copy_(self.pools[tier].arena[slot])
        with self.t.cond:
            ok = [self.t.meta.get(m.key) is m and m.tier is tier and m.slot == slot
                  and m.version == v for m, tier, slot, v in seen]
        keep = [j for j, good in enumerate(ok) if good]
        if not keep:
            return 0, len(seen), 0
        keys = [seen[j][0].key for j in keep]
        stored = self.cold.put_many(keys, [self.staging[j] for j in keep])
        with self.t.cond:
            if self.epoch() == epoch:  # not across a failover (see the class docstring)
                for j, good in zip(keep, stored):
                    m = seen[j][0]
                    if good and self.t.meta.get(m.key) is m \
                            and m.state is not BlockState.COLD:
                        m.in_cold = True
        n = sum(stored)
        return n, len(seen) - len(keep), len(keep) - n

    def _save_refs(self) -> None:
        """Save the session -> keys map of blocks with a cold copy when it changed."""
        refs = collect_refs(self.t)
        if refs == self._refs_saved:
            return
        self.cold.save_refs({s: list(ks) for s, ks in refs.items()})
        self._refs_saved = refs

    # -- views ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        last = self.last
        return {"enabled": self.policy.enabled, "paused": self.paused,
                "rounds_over_budget": self.over_budget,
                "interval_s": self.policy.interval_s,
                "rate_bytes_per_s": self.policy.rate_bytes_per_s, "rounds": self.rounds,
                "errors": self.errors, "written_blocks": self.written_blocks,
                "written_bytes": self.written_bytes, "refused_blocks": self.refused,
                "last_round_at": self.last_at,
                "last_round_s": round(last.seconds, 4) if last else None,
                "unsaved_blocks": last.left if last else None}


__all__ = ["RoundResult", "WriteBehind", "WriteBehindPolicy"]
