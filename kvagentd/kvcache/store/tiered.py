"""TieredKVStore: hot and warm block arenas over a cold tier, behind the `KVStore` contract.

The block table (`table.py`) holds all block metadata under one owner lock; copies and I/O run
outside it through the `Migrator` (prepare -> copy -> complete). Readers of a MIGRATING block
wait. Storage faults never raise into callers: an unreadable cold block becomes LOST and is
reported as `missing`.

References: a session references every block it committed or made resident (`sessions` of a
block); `drop_session` removes the reference and frees blocks nobody references. A request
holds use-references (`users`) from `ensure_resident` / `commit` until `release`; a block in
use is never moved, demoted or evicted by anyone else.

Moves are plans (`room.py`): making room in a tier, and moving named blocks, are computed as
ordered legs and executed by one executor (`mover.py`), leg by leg.

The cold tier talks to the store through `cold_link` (`coldlink.py`): which records must stay
(pinned, in use), which were evicted, and failovers: when the cold tier starts writing to a
stand-in device because the SSD failed, hot and warm blocks forget their SSD copy, so
demoting them writes them again (to the stand-in) instead of relying on a copy that may be
unreadable.

Shared cold tier: a cold tier shared with other boxes (the remote tier) is asked on a miss
past the blocks this store lists (`ColdTier.lookup`); what it holds becomes COLD blocks here
(`ColdLink.shared_found`). Freshly computed blocks are offered to it at `commit`
(`ColdTier.offer`).

Persistence: the write-behind (`writebehind.py`, when configured) writes committed hot and
warm blocks to the cold tier every interval and saves the session -> keys map, so a power
cut loses at most that interval of KV; `close()` writes the rest and saves the map. A new
store over the same cold directory rebuilds its block table from the cold tier's entries,
so `match_prefix` finds those blocks after a restart.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from kvagentd.kvcache import keys as keymod
from kvagentd.kvcache.base import (BlockInfo, BlockKey, ColdTier, ColdTierFactory, KVGeometry,
                                   KVStore, MatchResult, Residency, Tier, VerifyProgress)
from kvagentd.kvcache.store.coldlink import ColdLink
from kvagentd.kvcache.store.mover import Mover
from kvagentd.kvcache.store.persist import load_table, persist_blocks
from kvagentd.kvcache.placement.base import BlockStates
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.room import ROUNDS
from kvagentd.kvcache.store.state import STATE_TIER, BlockMeta, BlockState
from kvagentd.kvcache.store.table import BlockTable
from kvagentd.kvcache.store.budget import WriteBudget
from kvagentd.kvcache.store.writebehind import WriteBehind, WriteBehindPolicy

log = structlog.get_logger(__name__)

AccessListener = Callable[[list[BlockKey], str], None]


class TieredKVStore(KVStore):
    """Block store over a hot pool (`device`), a warm pool (host memory, pinned with CUDA)
    and an optional cold tier, built by `cold(listener)` with the store's `cold_link` as its
    listener.
    Pools are allocated once here and never grow."""

    def __init__(self, geometry: KVGeometry, namespace: bytes, *, hot_bytes: int, warm_bytes: int,
                 cold: ColdTierFactory | None = None, device: str | torch.device = "cpu",
                 access_listener: AccessListener | None = None, persist_on_shutdown: bool = True,
                 prefetch_queue: int = 64, write_behind: WriteBehindPolicy | None = None,
                 write_budget: WriteBudget | None = None) -> None:
        self.geometry = geometry
        self.namespace = namespace
        self.device = torch.device(device)
        self.access_listener = access_listener
        self.persist_on_shutdown = persist_on_shutdown
        shape, dt = geometry.block_shape, geometry.dtype
        self._pools = {
            Tier.HOT: BlockPool.from_bytes("hot", hot_bytes, shape, dt, self.device),
            Tier.WARM: BlockPool.from_bytes("warm", warm_bytes, shape, dt, "cpu", pin_memory=True),
        }
        self._t = BlockTable()
        self._cond = self._t.cond
        self.counters = dict(match_calls=0, matched_blocks=0, loaded_hot=0, loaded_warm=0,
                             loaded_cold=0, lost=0, demoted=0, promoted=0, dedup=0,
                             prefetch_queued=0, prefetch_dropped=0, evicted=0, relocated=0,
                             cold_copies_dropped=0, expired=0, dropped=0,
                             shared_found=0)
        self.cold_link = ColdLink(self._t, self._pools, self.counters)
        self._cold: ColdTier | None = cold(self.cold_link) if cold is not None else None
        if self._cold is not None and self._cold.namespace != namespace:
            self._cold.close()
            raise ValueError("the cold tier was opened for another namespace")
        self.write_budget = write_budget
        self._mover = Mover(self._pools, self._t, self._cold, staged=self.device.type != "cpu",
                            counters=self.counters, prefetch_queue=prefetch_queue,
                            budget=write_budget)
        self._mig = self._mover.migrator
        self._closed = False
        self._wb = (WriteBehind(self._t, self._pools, self._cold, write_behind,
                                epoch=lambda: self.cold_link.epoch, budget=write_budget)
                    if self._cold is not None and write_behind is not None
                    and write_behind.enabled else None)
        if self._cold is not None:
            load_table(self._t, self._cold)

    @property
    def cold(self) -> ColdTier | None:
        """The cold tier this store built (None without one)."""
        return self._cold

    # -- service -----------------------------------------------------------------------------
    @property
    def write_behind(self) -> WriteBehind | None:
        """The write-behind of committed blocks to the cold tier (None when off)."""
        return self._wb

    def start(self) -> None:
        """Start the background (prefetch) mover and the write-behind."""
        self._mover.start()
        if self._wb is not None:
            self._wb.start()

    def stop(self) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        return self.stats()

    def health(self) -> dict[str, Any] | None:
        """The store has no check of its own (maintenance watches the cold tier)."""
        return None

    def reload(self, config: object) -> None:
        """Nothing of the store is reloadable (pool sizes are fixed at start)."""

    # -- lookups -----------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        return keymod.block_keys(self.namespace, token_ids, self.geometry.block_tokens)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Blocks this store lists; past them, blocks a shared cold tier holds (another box
        computed them), which become known here as COLD blocks."""
        keys = self.block_keys(token_ids)
        n = 0
        with self._cond:
            for k in keys:
                m = self._t.meta.get(k)
                if m is None or m.state in (BlockState.LOST, BlockState.FREE):
                    break
                n += 1
        if n < len(keys) and self._cold is not None:
            found = self._cold.lookup(keys[n:])
            if found:
                n += self.cold_link.shared_found(keys[n:n + found])
        with self._cond:
            self.counters["match_calls"] += 1
            self.counters["matched_blocks"] += n
        return MatchResult(keys[:n], n * self.geometry.block_tokens)

    def hot_arena(self) -> torch.Tensor:
        return self._pools[Tier.HOT].arena

    def warm_arena(self) -> torch.Tensor:
        return self._pools[Tier.WARM].arena

    def pool(self, tier: Tier) -> BlockPool:
        """The hot or warm pool (read-only use: fragmentation figures, capacity)."""
        return self._pools[tier]

    # -- the inference path ------------------------------------------------------------------
    def ensure_resident(self, keys: Sequence[BlockKey], session: str) -> Residency:
        metas: list[BlockMeta] = []
        missing: int | None = None
        with self._cond:
            for i, k in enumerate(keys):
                m = self._t.wait_settled(k)
                if m is None or m.state is BlockState.LOST:
                    missing = i
                    break
                self._t.hold(session, m)
                m.sessions.add(session)
                metas.append(m)
            # where each block comes from (another request may be moving a shared block now,
            # or have lost it while this one waited: LOST until someone recomputes it)
            source = [m.tier or STATE_TIER.get(m.src_state) or Tier.HOT  # type: ignore[arg-type]
                      for m in metas]
        for _ in range(ROUNDS):  # a shared block may be mid-way through another request's move
            if self._mover.staged:
                self._mover.bring(metas, Tier.WARM)
            self._mover.bring(metas, Tier.HOT)
            with self._cond:
                while any(m.state is BlockState.MIGRATING for m in metas):
                    self._cond.wait()
                if all(m.state in (BlockState.HOT, BlockState.LOST) for m in metas):
                    break
        loaded = {"hot": 0, "warm": 0, "cold": 0}
        with self._cond:
            n_ok = len(metas)
            for i, m in enumerate(metas):
                if m.state is not BlockState.HOT:
                    n_ok = i
                    missing = i
                    break
            for m in metas[n_ok:]:
                self._t.unhold(session, m)
            slots = [m.slot for m in metas[:n_ok]]
            now = time.time()
            for m, src in zip(metas[:n_ok], source):
                m.last_access = now
                loaded[src.value] += 1
            for t, c in loaded.items():
                self.counters[f"loaded_{t}"] += c
        return Residency([s for s in slots if s is not None], missing, loaded)

    def allocate_hot(self, n: int, session: str) -> list[int] | None:
        for _ in range(ROUNDS):
            with self._cond:
                slots = self._pools[Tier.HOT].allocate(n)
                if slots is not None:
                    self._t.leases.add_private(session, slots)
                    return slots
            if not self._mover.make_room(Tier.HOT, n, drop=True):
                return None
        return None

    def commit(self, session: str, token_ids: Sequence[int], slots: Sequence[int],
               first_block: int) -> list[BlockKey]:
        keys = self.block_keys(token_ids)[first_block:first_block + len(slots)]
        if len(keys) != len(slots):
            raise ValueError(f"{len(slots)} slots but only {len(keys)} full blocks from {first_block}")
        with self._cond:
            fresh, dedup = self._t.add_computed(session, keys, slots, self._pools[Tier.HOT],
                                                time.time())
            self.counters["dedup"] += dedup
        if fresh and self._cold is not None:  # held by `session`: the slots stay put until release
            arena = self._pools[Tier.HOT].arena
            self._cold.offer([k for k, _ in fresh], [arena[s] for _, s in fresh], session=session)
        return keys

    def release(self, session: str) -> None:
        with self._cond:
            for k in self._t.leases.take_held(session):
                m = self._t.meta.get(k)
                if m is not None:
                    m.users -= 1
                    self._t.touch(m)
            slots = self._t.leases.take_private(session)
            if slots:
                self._pools[Tier.HOT].free(slots)
            self._cond.notify_all()

    def record_access(self, keys: Iterable[BlockKey], session: str) -> None:
        keys = list(keys)
        now = time.time()
        with self._cond:
            for k in keys:
                m = self._t.meta.get(k)
                if m is not None:
                    m.last_access = now
                    self._t.touch(m)
        if self.access_listener is not None:
            try:
                self.access_listener(keys, session)
            except Exception:  # a policy bug must not break inference
                log.exception("access_listener_failed", session=session)

    # -- explicit moves ----------------------------------------------------------------------
    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        if background:
            return self._mover.enqueue(keys, tier)
        return self._mover.promote_now(keys, tier)

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        with self._cond:
            down = [k for k in keys if (m := self._t.meta.get(k)) is not None and m.tier is not None
                    and m.tier.above(tier) and m.pins == 0]
        moved = self._mover.move(down, tier, make_room=True) if down else 0
        with self._cond:
            self.counters["demoted"] += moved
        return moved

    def pin(self, keys: Sequence[BlockKey]) -> None:
        with self._cond:
            for k in keys:
                if (m := self._t.meta.get(k)) is not None:
                    m.pins += 1
                    self._t.touch(m)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._cond:
            for k in keys:
                if (m := self._t.meta.get(k)) is not None and m.pins > 0:
                    m.pins -= 1
                    self._t.touch(m)

    # -- forgetting --------------------------------------------------------------------------
    def drop_session(self, session: str, keys: Sequence[BlockKey]) -> None:
        with self._cond:
            _, drop_cold = self._t.forget_idle(keys, self._pools, unreferenced_only=True,
                                               session=session)
        if drop_cold and self._cold is not None:
            self._cold.delete(drop_cold)

    def evict(self, keys: Sequence[BlockKey]) -> int:
        with self._cond:
            n, drop_cold = self._t.forget_idle(keys, self._pools, unreferenced_only=False)
            self.counters["evicted"] += n
        if drop_cold and self._cold is not None:
            self._cold.delete(drop_cold)
        return n

    def drop_cold_copies(self, deficit: int) -> tuple[int, int]:
        """Free cold-tier space without losing a block: delete the cold records of blocks that
        are resident in hot or warm (copies written ahead by write-behind or left by a
        promotion), most recently used first (the least likely to be demoted soon, when the
        copy would save a write), until `deficit` bytes. The blocks stay; write-behind or a
        demotion writes them again later. Returns (records, bytes)."""
        if self._cold is None or deficit <= 0:
            return 0, 0
        bb = self.geometry.block_bytes  # a raw record is this plus its header (at least)
        with self._cond:
            resident = [m for m in self._t.meta.values()
                        if m.in_cold and m.tier is not None and m.tier is not Tier.COLD
                        and m.state is not BlockState.MIGRATING]
            resident.sort(key=lambda m: m.last_access, reverse=True)
            keys: list[BlockKey] = []
            for m in resident:
                if len(keys) * bb >= deficit:
                    break
                if self._t.drop_cold_copy(m):
                    keys.append(m.key)
            self.counters["cold_copies_dropped"] += len(keys)
        if keys:
            self._cold.evict(keys)
            log.warning("store_cold_copies_dropped_for_space", records=len(keys),
                        bytes=len(keys) * bb, deficit=deficit)
        return len(keys), len(keys) * bb

    def pause_write_behind(self, reason: str | None) -> None:
        """Stop (a reason) or resume (None) write-behind's writes: below the cold disk's free
        space floor, copies of resident blocks would take the room that blocks living only in
        the cold tier need. Demotions still write."""
        if self._wb is not None:
            self._wb.pause(reason)

    def expire_cold(self, now: float | None = None) -> int:
        """Forget cold-only blocks whose TTL has run out (refreshed by cold reads) and that
        nobody used in the store for a TTL either; never a pinned or in-use block. Records no
        block refers to any more go too. Returns the blocks forgotten."""
        if self._cold is None:
            return 0
        now = time.time() if now is None else now
        ttl = self._cold.ttl_s
        drop, n = self.cold_link.forget_expired(self._cold.expired(now), now, ttl)
        if drop:
            self._cold.evict(drop)
            log.info("store_cold_expired", blocks=n, records=len(drop))
        return n

    def relocate(self, tier: Tier, moves: Sequence[tuple[int, int]]) -> int:
        if tier is Tier.COLD:
            return 0
        with self._cond:
            n = self._t.relocate(self._pools[tier], tier, moves)
            self.counters["relocated"] += n
        return n

    def occupancy(self, tier: Tier) -> np.ndarray:
        """Used-slot bitmap of the hot or warm pool (a copy), for defrag planning."""
        with self._cond:
            return self._pools[tier].occupancy()

    def busy_slots(self, tier: Tier) -> list[int]:
        """Used slots that `relocate` would skip now: in use, private or mid-migration."""
        with self._cond:
            return self._t.busy_slots(tier)

    # -- views -------------------------------------------------------------------------------
    def snapshot(self) -> list[BlockInfo]:
        with self._cond:
            return self._t.infos(self.geometry.block_bytes)

    def session_blocks(self) -> dict[str, dict[str, int]]:
        """Per session: how many referenced blocks sit in each tier (and LOST / moving)."""
        with self._cond:
            return self._t.session_blocks()

    def keys_of_session(self, session: str) -> list[BlockKey]:
        with self._cond:
            return [m.key for m in self._t.meta.values() if session in m.sessions]

    def stats(self) -> dict[str, Any]:
        bb = self.geometry.block_bytes
        with self._cond:
            out = self._t.stats(self._pools, bb)
            out.update(migrations=self._mig.moved, migration_failures=self._mig.failed,
                       **self.counters)
        n_cold = out["states"].get("cold", 0)
        cold: dict[str, Any] = {}
        if self._cold is not None:
            cold.update(self._cold.stats())
            # the tier's records also include cold copies of warm blocks (and, after a
            # failover, records left on the SSD): `records`; `blocks` are those cold now
            cold["records"] = cold.get("blocks", 0)
        cold.update(blocks=n_cold, bytes=n_cold * bb)
        out["tiers"]["cold"] = cold
        out["write_budget"] = (self.write_budget.status() if self.write_budget is not None
                               else None)
        out["write_behind"] = (self._wb.status() if self._wb is not None
                               else {"enabled": False})
        return out

    def check_integrity(self) -> None:
        with self._cond:
            self._t.check_integrity(self._pools)

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """Scrub the cold tier now (see `ColdTier.verify`). With `repair`, records dropped
        from the cold index are forgotten here too: a block that lived only there becomes
        LOST (its tokens are recomputed on next use)."""
        if self._cold is None:
            return {"checked": 0, "corrupt": 0, "missing": 0, "repaired": 0, "bytes": 0, "moved": 0}
        before = set(self._cold.keys()) if repair else set()
        report = self._cold.verify(repair=repair, rate_bytes_per_s=rate_bytes_per_s,
                                   progress=progress)
        if repair:
            self.cold_link.records_gone(before - set(self._cold.keys()))
        return report

    # -- shutdown ----------------------------------------------------------------------------
    def persist(self, batch: int = 64) -> int:
        """Write hot and warm blocks that sessions reference to the cold tier and save the
        session map (see `persist.persist_blocks`); returns how many blocks were written."""
        if self._cold is None:
            return 0
        return persist_blocks(self._t, self._pools, self._cold, release=self.release,
                              batch=batch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._wb is not None:
            self._wb.stop()
        self._mover.close()
        if self.persist_on_shutdown:
            self.persist()
        if self._cold is not None:
            self._cold.close()

    # -- placement's view of a few blocks (`placement.base.PlacementStore`) -------------------
    def block_states(self, keys: Sequence[BlockKey]) -> BlockStates:
        """What a placement round needs of the blocks it looks at (`BlockTable.block_states`),
        in O(len(keys)), without a snapshot of every block."""
        with self._cond:
            return self._t.block_states(keys)

    def least_recent_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        """Up to `n` idle blocks of the hot or warm tier, least recently used first: the order
        in which the store's own room-making demotes them. O(n)."""
        with self._cond:
            return self._t.least_recent_idle(tier, n)

    def sample_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        """Idle blocks of the hot or warm tier found in `n` slots drawn at random (distinct,
        at most `n`; fewer where slots are free or busy). O(n)."""
        cap = self._pools[tier].capacity
        if n <= 0 or cap == 0:
            return []
        slots = random.sample(range(cap), min(n, cap))
        with self._cond:
            return self._t.idle_at(tier, slots)
