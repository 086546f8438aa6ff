"""What a store's cold tier tells (and asks) it: the `ColdListener` of one store.

The cold tier is built with this object as its listener (before the store's mover exists), so
it reaches only the block table, the pools and the store's counters, under the owner lock.

- `cold_protected`: records capacity eviction must keep (pinned, in use, being read).
- `cold_evicted`: records dropped for capacity; blocks that lived only there are forgotten,
  a protected one (which the cold tier must not pick) becomes LOST instead and
  `check_integrity` reports it.
- `cold_failed_over`: the cold tier writes to a stand-in now, so hot and warm blocks stop
  relying on copies on the failed device and are written again when demoted; `epoch` counts
  these failovers (the write-behind never trusts a copy written across one).
- `shared_found`: blocks a shared cold tier holds that this store did not list become COLD.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import time

import structlog

from kvagentd.kvcache.base import BlockKey, Tier
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import BlockMeta, BlockState, transition
from kvagentd.kvcache.store.table import BlockTable

log = structlog.get_logger(__name__)


class ColdLink:
    """The store's side of its cold tier (implements `ColdListener`)."""

    def __init__(self, table: BlockTable, pools: dict[Tier, BlockPool],
                 counters: dict[str, int]) -> None:
        self.t, self.pools, self.counters = table, pools, counters
        self.epoch = 0  # cold failovers seen

    def cold_protected(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Records capacity eviction must keep (see `BlockTable.protected`)."""
        with self.t.cond:
            return self.t.protected(keys)

    def cold_evicted(self, keys: list[BlockKey]) -> None:
        """The cold tier dropped records to stay under its cap."""
        with self.t.cond:
            for k in keys:
                m = self.t.meta.get(k)
                if m is None:
                    continue
                m.in_cold = False
                if m.state is not BlockState.COLD:
                    continue
                if m.pins or m.users:
                    transition(m, BlockState.LOST)
                    self.t.protected_evicted.append(k)
                    self.counters["lost"] += 1
                    log.error("store_protected_block_evicted", key=k.hex(), pins=m.pins,
                              users=m.users)
                else:
                    self.t.forget(m, self.pools)

    def cold_failed_over(self) -> None:
        """Hot and warm blocks (and those moving out of them) stop relying on their cold copy,
        so demoting them writes them to the tier that now serves; blocks read from the failing
        device meanwhile do the same when their move completes. Blocks that live only in the
        cold tier are left as they are: they read from the failed device or become LOST."""
        with self.t.cond:
            n = 0
            self.epoch += 1
            for m in self.t.meta.values():
                if not m.in_cold:
                    continue
                if m.state is BlockState.MIGRATING:
                    m.recheck_cold = True  # settled when its move completes
                    if m.src_state is BlockState.COLD:
                        continue
                if m.tier is not Tier.COLD:
                    n += self.t.drop_cold_copy(m)
            self.counters["cold_copies_dropped"] += n
        log.warning("store_cold_copies_dropped", blocks=n)

    def shared_found(self, keys: Sequence[BlockKey]) -> int:
        """List blocks the cold tier can read but this store did not know (or had LOST) as
        COLD; returns how many of `keys`, from the first, are listed now."""
        now = time.time()
        with self.t.cond:
            for i, k in enumerate(keys):
                m = self.t.meta.get(k)
                if m is None:
                    m = BlockMeta(k, in_cold=True, last_access=now)
                    transition(m, BlockState.COLD)
                    self.t.meta[k] = m
                elif m.state is BlockState.LOST:
                    transition(m, BlockState.FREE)
                    m.in_cold, m.last_access = True, now
                    transition(m, BlockState.COLD)
                elif m.state is BlockState.FREE:
                    return i
                self.counters["shared_found"] += 1
        return len(keys)

    def forget_expired(self, keys: Iterable[BlockKey], now: float, ttl_s: float
                       ) -> tuple[list[BlockKey], int]:
        """Of records whose TTL ran out: forget the cold-only blocks nobody used in the store
        for a TTL either (never a pinned or in-use one). Returns the records to evict
        (those, and orphans no block refers to) and how many blocks went."""
        drop: list[BlockKey] = []
        n = 0
        with self.t.cond:
            for k in keys:
                m = self.t.meta.get(k)
                if m is None:
                    drop.append(k)  # an orphan record
                elif (m.state is BlockState.COLD and m.users == 0 and m.pins == 0
                      and m.last_access + ttl_s < now):
                    drop.append(k)
                    self.t.forget(m, self.pools)
                    n += 1
            self.counters["expired"] += n
        return drop, n

    def records_gone(self, keys: Iterable[BlockKey]) -> None:
        """Records a scrub repair dropped: a block that lived only there becomes LOST (its
        tokens are recomputed on next use)."""
        with self.t.cond:
            for k in keys:
                m = self.t.meta.get(k)
                if m is None:
                    continue
                m.in_cold = False
                if m.state is BlockState.COLD:
                    transition(m, BlockState.LOST)
                    self.counters["lost"] += 1
