"""The one executor of moves: plans from `room.py`, executed leg by leg through the `Migrator`
(prepare under the owner lock -> copy outside it -> complete under it).

`make_room` frees slots in a pool by demoting its least recently used idle blocks (and, for
room a request needs now, dropping them for recompute when nothing takes them); `bring`
moves a request's own (held) blocks up to hot in prefix order; `move` moves named idle
blocks (placement, operators). Background promotions (prefetch) queue to one mover thread and
never delay a foreground request for more than `BG_BATCH` blocks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import structlog

from kvagentd.kvcache.base import BlockKey, ColdTier, Tier
from kvagentd.kvcache.store.budget import WriteBudget
from kvagentd.kvcache.store.migration import Migrator, Transfer
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.room import ROUNDS, Drop, Leg, PoolState, plan_drop, plan_moves, plan_room
from kvagentd.kvcache.store.state import BlockMeta, BlockState
from kvagentd.kvcache.store.table import POOL_TIERS, BlockTable

log = structlog.get_logger(__name__)

BG_BATCH = 8  # background promotions per cold read: bounds how long a foreground read waits


class Mover:
    """Moves blocks between the tiers of one store. `counters` is the store's (demoted,
    promoted, lost, dropped, prefetch_queued, prefetch_dropped, cold_copies_dropped)."""

    def __init__(self, pools: dict[Tier, BlockPool], table: BlockTable, cold: ColdTier | None,
                 *, staged: bool, counters: dict[str, int], prefetch_queue: int = 64,
                 budget: WriteBudget | None = None) -> None:
        self.pools, self.t, self.cold = pools, table, cold
        self.budget = budget  # the SSD's write budget: demotions that do not fit become drops
        self._block_bytes = pools[Tier.HOT].block_bytes or pools[Tier.WARM].block_bytes
        self.staged = staged  # hot <-> cold goes through warm (the hot pool is on a GPU)
        self.counters = counters
        self.migrator = Migrator(pools, table.owners, cold, table.cond)
        self._bg: queue.Queue[tuple[list[BlockKey], Tier] | None] = queue.Queue(prefetch_queue)
        self._bg_thread: threading.Thread | None = None

    def _count(self, name: str, n: int) -> None:
        with self.t.cond:
            self.counters[name] += n

    # -- plans ---------------------------------------------------------------------------------
    def _pool_states(self) -> dict[Tier, PoolState]:
        """Caller holds the lock."""
        def idle(t: Tier) -> PoolState:
            return PoolState(self.pools[t].num_free,
                             lambda n, ex: self.t.idle_victims(t, n, ex),
                             lambda n, ex: self.t.idle_victims(t, n, ex, copied=True))
        return {t: idle(t) for t in POOL_TIERS}

    def make_room(self, tier: Tier, n: int, exclude: frozenset[BlockKey] = frozenset(), *,
                  drop: bool = False) -> bool:
        """Demote least-recently-used idle, unpinned blocks until `n` slots of `tier` are
        free. With `drop` (room a request needs now), blocks that no lower tier takes are
        dropped for recompute instead (`plan_drop`)."""
        for _ in range(ROUNDS):
            with self.t.cond:
                plan = plan_room(tier, n, self._pool_states(), has_cold=self._cold_writable(),
                                 staged=self.staged, exclude=exclude)
            if plan is None:
                break
            if not plan:
                return True
            moved = self.apply(plan, make_room=False)
            self._count("demoted", sum(moved.values()))
            if not moved:
                break
        with self.t.cond:
            if self.pools[tier].num_free >= n:
                return True
        return self._drop_for_room(tier, n, exclude) if drop else False

    def _drop_for_room(self, tier: Tier, n: int, exclude: frozenset[BlockKey]) -> bool:
        """Free `n` slots of `tier` by dropping idle blocks (see `plan_drop`)."""
        for _ in range(ROUNDS):
            with self.t.cond:
                plan = plan_drop(tier, n, self._pool_states(), exclude)
            if plan is None:
                return False
            if not plan:
                return True
            for step in plan:
                if isinstance(step, Drop):
                    self.drop(step)
                else:
                    self._count("demoted", sum(self.apply([step], make_room=False).values()))
        with self.t.cond:
            return self.pools[tier].num_free >= n

    def drop(self, step: Drop) -> int:
        """Give up the slots of the step's blocks that are still idle in its tier: those with a
        cold copy move to the cold tier (no I/O), the others are forgotten (counted in
        `dropped`); returns how many slots were freed."""
        with self.t.cond:
            todo = [m for k in step.keys if (m := self.t.meta.get(k)) is not None
                    and m.tier is step.tier and m.users == 0 and m.pins == 0]
            kept = [m for m in todo if m.in_cold]
            gone = [m for m in todo if not m.in_cold]
            stale = [m.key for m in gone if m.stale_cold]
            for m in gone:
                self.t.forget(m, self.pools)
            self.counters["dropped"] += len(gone)
            transfers = self.migrator.prepare(kept, Tier.COLD) if kept else []
            assert transfers is not None
            for tr in transfers:
                self.t.touch(tr.meta)
        n = len(gone) + (self._run(transfers) if transfers else 0)
        if stale and self.cold is not None:
            self.cold.delete(stale)
        if gone:
            log.warning("store_blocks_dropped", tier=step.tier.value, blocks=len(gone),
                        kept_in_cold=len(kept), reason="no lower tier takes them")
        return n

    def _cold_writable(self) -> bool:
        """The cold tier takes demotions now (not read-only for wear or an operator, and the
        SSD's write budget has a block's worth left)."""
        return self.cold is not None and not self.cold.read_only and (
            self.budget is None or self.budget.available() >= self._block_bytes)

    def bring(self, metas: list[BlockMeta], dst: Tier) -> None:
        """Move a request's held blocks up to `dst` (to warm: only cold ones), in prefix
        order, as far as room can be made."""
        def wanted(m: BlockMeta) -> bool:
            t = m.tier
            return t is not None and dst.above(t) and (dst is Tier.HOT or t is Tier.COLD)

        with self.t.cond:
            n = sum(1 for m in metas if wanted(m))
        if n == 0:
            return
        self.make_room(dst, n, drop=True)
        with self.t.cond:
            where = [(m.key, m.tier) for m in metas if m.tier is not None and wanted(m)]
            where = where[:self.pools[dst].num_free]
        self.apply(plan_moves(where, dst, staged=self.staged), make_room=False, held=True)

    def move(self, keys: Sequence[BlockKey], dst: Tier, *, make_room: bool) -> int:
        """Move the named idle blocks to `dst` along their routes; returns how many arrived."""
        with self.t.cond:
            where = [(k, m.tier) for k in keys if (m := self.t.meta.get(k)) is not None
                     and m.tier is not None and m.users == 0]
        moved = self.apply(plan_moves(where, dst, staged=self.staged), make_room=make_room)
        return sum(n for (_, d), n in moved.items() if d is dst)

    def promote_now(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        with self.t.cond:
            up = [k for k in keys if (m := self.t.meta.get(k)) is not None and m.tier is not None
                  and tier.above(m.tier)]
        moved = self.move(up, tier, make_room=False) if up else 0
        self._count("promoted", moved)
        return moved

    # -- the executor --------------------------------------------------------------------------
    def apply(self, legs: Sequence[Leg], *, make_room: bool, held: bool = False
              ) -> dict[tuple[Tier, Tier], int]:
        """Execute a plan leg by leg; returns blocks moved per (src, dst). A leg moves only
        the blocks still settled in its source tier (idle ones, or also those in use when
        `held`: the caller's own), into as many slots as its destination has; with
        `make_room`, room is made there first."""
        moved: dict[tuple[Tier, Tier], int] = {}
        for leg in legs:
            if leg.dst is Tier.COLD and self.cold is None:
                continue
            if make_room and leg.dst is not Tier.COLD:
                self.make_room(leg.dst, len(leg.keys), exclude=frozenset(leg.keys))
            with self.t.cond:
                todo = [m for k in leg.keys if (m := self.t.meta.get(k)) is not None
                        and m.tier is leg.src and (held or m.users == 0)]
                if leg.dst is not Tier.COLD:
                    todo = todo[:self.pools[leg.dst].num_free]
                if not todo:
                    continue
                if leg.dst is Tier.COLD and self.budget is not None:
                    # blocks with a cold copy cost no write; of the others, as many as the
                    # budget has room for (the rest stay; room they hold is made by drops)
                    need = [m for m in todo if not m.in_cold]
                    granted = self.budget.take_blocks(len(need), self._block_bytes)
                    left = {id(m) for m in need[granted:]}
                    todo = [m for m in todo if id(m) not in left]
                    if not todo:
                        continue
                transfers = self.migrator.prepare(todo, leg.dst)
                assert transfers is not None
                for tr in transfers:
                    self.t.touch(tr.meta)
            n = self._run(transfers)
            if n:
                moved[(leg.src, leg.dst)] = moved.get((leg.src, leg.dst), 0) + n
        return moved

    def _run(self, transfers: list[Transfer]) -> int:
        ok = self.migrator.copy(transfers)
        with self.t.cond:
            for i, tr in enumerate(transfers):
                if ok[i] and tr.dst is Tier.COLD and not tr.wrote and tr.meta.recheck_cold:
                    ok[i] = False  # relied on a copy on a failed device: stays resident
            lost = self.migrator.complete(transfers, ok)
            for tr in transfers:
                self.t.touch(tr.meta)
                if tr.meta.recheck_cold:
                    tr.meta.recheck_cold = False
                    self.counters["cold_copies_dropped"] += self.t.drop_cold_copy(tr.meta)
            self.counters["lost"] += len(lost)
        if lost and self.cold is not None:
            with self.t.cond:  # unreadable records go; a block revived meanwhile keeps its own
                gone = [m.key for m in lost if m.state is BlockState.LOST]
            self.cold.delete(gone)
        return sum(ok)

    # -- background promotions -----------------------------------------------------------------
    def enqueue(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        """Queue a background promotion; 0 (counted as dropped) when the queue is full."""
        try:
            self._bg.put_nowait((list(keys), tier))
        except queue.Full:
            self._count("prefetch_dropped", len(keys))
            return 0
        self._count("prefetch_queued", len(keys))
        self.start()
        return len(keys)

    def start(self) -> None:
        if self._bg_thread is None:
            self._bg_thread = threading.Thread(target=self._bg_loop, name="kv-prefetch",
                                               daemon=True)
            self._bg_thread.start()

    def _bg_loop(self) -> None:
        while True:
            item = self._bg.get()
            if item is None:
                return
            keys, tier = item
            for i in range(0, len(keys), BG_BATCH):
                try:
                    self.promote_now(keys[i:i + BG_BATCH], tier)
                except Exception:  # the mover must outlive any one bad request
                    log.exception("prefetch_failed", blocks=len(keys))

    def close(self) -> None:
        """Stop the background mover (queued promotions are dropped)."""
        if self._bg_thread is None:
            return
        while True:
            try:
                self._bg.put(None, timeout=1.0)
                break
            except queue.Full:
                try:
                    self._bg.get_nowait()
                except queue.Empty:
                    pass
        self._bg_thread.join(timeout=30.0)
