"""The block table: everything the store knows about its blocks, and who holds them.

One owner lock (a Condition, `cond`) guards it all; every method here expects the caller to
hold it. Readers of a MIGRATING block wait on `cond` (`wait_settled`).

- `meta`: key -> `BlockMeta` (state, slot, pins, users, sessions, last access).
- `owners`: per pool, slot -> key of the block that lives there.
- `idle`: per pool, an LRU (`OrderedDict`) of its idle blocks: settled in that pool, unused
  and unpinned. A block enters at the most-recent end when it is accessed, released, unpinned
  or arrives in the tier, and leaves when it is used, pinned, moved or freed, so choosing
  victims costs O(victims), not O(blocks).
- `leases`: the use-references and private hot slots of running requests (`Leases`).

Its operations: blocks a request computed (`add_computed`), forgetting and relocating idle
blocks, victims for room-making, and the views (`stats`, per session, placement's view of a
few blocks) the store serves under the lock.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvagentd.kvcache.base import BlockInfo, BlockKey, Tier
from kvagentd.kvcache.store.leases import Leases
from kvagentd.kvcache.placement.base import BlockStates, block_states
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import BlockMeta, BlockState, IntegrityError, transition

POOL_TIERS = (Tier.HOT, Tier.WARM)
_POOL_OF_STATE = {BlockState.HOT: Tier.HOT, BlockState.WARM: Tier.WARM}


class BlockTable:
    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.meta: dict[BlockKey, BlockMeta] = {}
        self.owners: dict[Tier, dict[int, BlockKey]] = {t: {} for t in POOL_TIERS}
        self.idle: dict[Tier, OrderedDict[BlockKey, None]] = {t: OrderedDict() for t in POOL_TIERS}
        self.leases = Leases()
        # blocks a cold tier evicted although they were protected (a broken contract)
        self.protected_evicted: list[BlockKey] = []

    def touch(self, m: BlockMeta) -> None:
        """Call after any change of `m`'s state, users, pins or last access: `m` is in its
        pool's idle LRU iff settled in hot or warm, unused and unpinned; (re)entering puts it
        at the most-recent end."""
        for lru in self.idle.values():
            lru.pop(m.key, None)
        t = m.tier
        if t is not None and t in self.idle and m.users == 0 and m.pins == 0:
            self.idle[t][m.key] = None

    def wait_settled(self, key: BlockKey) -> BlockMeta | None:
        """The block's metadata once it is not MIGRATING (waits on `cond`)."""
        m = self.meta.get(key)
        while m is not None and m.state is BlockState.MIGRATING:
            self.cond.wait()
            m = self.meta.get(key)
        return m

    def hold(self, session: str, m: BlockMeta) -> None:
        """A use-reference of `session` on `m` (released by `unhold` or `release`)."""
        m.users += 1
        self.leases.hold(session, m.key)
        self.touch(m)

    def unhold(self, session: str, m: BlockMeta) -> None:
        self.leases.unhold(session, m.key)
        m.users -= 1
        self.touch(m)

    def add_computed(self, session: str, keys: Sequence[BlockKey], slots: Sequence[int],
                     hot: BlockPool, now: float) -> tuple[list[tuple[BlockKey, int]], int]:
        """Record the blocks `session` computed into its private hot `slots` (one per key) as
        HOT blocks it references and holds. A LOST block of the same key is revived in place;
        where the block exists otherwise, the duplicate slot goes back to `hot`. Raises
        ValueError, before any change, when a slot is not a private slot of `session`.
        Returns the (key, slot) pairs computed here (to offer to the cold tier) and how many
        duplicates were freed."""
        owners = self.owners[Tier.HOT]
        for s in slots:
            if not self.leases.is_private(session, s):
                raise ValueError(f"slot {s} is not a private slot of session {session!r}")
        fresh: list[tuple[BlockKey, int]] = []
        dedup = 0
        for key, s in zip(keys, slots):
            self.leases.claim_private(session, s)
            m = self.meta.get(key)
            if m is not None and m.state is BlockState.LOST:
                # recomputed: the fresh copy revives the block in place, so requests that
                # hold it (and its pins and sessions) keep referring to the same block
                transition(m, BlockState.FREE)
                m.slot, m.in_cold = s, False
                m.version += 1
                transition(m, BlockState.HOT)
                owners[s] = key
                fresh.append((key, s))
            elif m is not None:  # the same content exists: keep it, free the duplicate
                hot.free([s])
                dedup += 1
            else:
                m = BlockMeta(key, slot=s)
                transition(m, BlockState.HOT)
                owners[s] = key
                self.meta[key] = m
                fresh.append((key, s))
            m.sessions.add(session)
            m.last_access = now
            self.hold(session, m)
        return fresh, dedup

    def forget(self, m: BlockMeta, pools: dict[Tier, BlockPool]) -> None:
        """Drop an idle, settled block from the table (its pool slot is freed)."""
        t = m.tier
        if t is not None and t in pools:
            assert m.slot is not None
            pools[t].free([m.slot])
            del self.owners[t][m.slot]
            m.slot = None
        transition(m, BlockState.FREE)
        self.touch(m)
        del self.meta[m.key]

    def forget_idle(self, keys: Iterable[BlockKey], pools: dict[Tier, BlockPool], *,
                    unreferenced_only: bool, session: str | None = None
                    ) -> tuple[int, list[BlockKey]]:
        """Forget idle, unpinned, settled blocks (after dropping `session`'s reference); with
        `unreferenced_only`, only those no session references. Returns how many went and the
        cold records to delete."""
        drop_cold: list[BlockKey] = []
        n = 0
        for k in keys:
            m = self.meta.get(k)
            if m is None:
                continue
            if session is not None:
                m.sessions.discard(session)
            if m.users or m.pins or m.state is BlockState.MIGRATING \
                    or (unreferenced_only and m.sessions):
                continue
            if m.in_cold or m.stale_cold:
                drop_cold.append(k)
            self.forget(m, pools)
            n += 1
        return n, drop_cold

    def relocate(self, pool: BlockPool, tier: Tier, moves: Iterable[tuple[int, int]]) -> int:
        """Move idle, settled blocks of `pool` (`tier`) between slots, (src, dst) each; skips
        a free src, a used dst and blocks in use or moving. Returns how many moved."""
        owners, n = self.owners[tier], 0
        for src, dst in moves:
            key = owners.get(src)
            if key is None or pool.is_used(dst):
                continue
            m = self.meta[key]
            if m.users or m.state is BlockState.MIGRATING:
                continue
            pool.move(src, dst)
            del owners[src]
            owners[dst] = key
            m.slot = dst
            m.version += 1
            n += 1
        return n

    def idle_victims(self, tier: Tier, n: int, exclude: set[BlockKey], *,
                     copied: bool = False) -> list[BlockKey]:
        """Up to `n` least recently used idle blocks of `tier`, not in `exclude`; with
        `copied`, only blocks that have a cold copy."""
        out: list[BlockKey] = []
        if n <= 0:
            return out
        for k in self.idle[tier]:  # least recently used first
            if k not in exclude and (not copied or self.meta[k].in_cold):
                out.append(k)
                if len(out) == n:
                    break
        return out

    def drop_cold_copy(self, m: BlockMeta) -> int:
        """A resident block's cold copy is no longer relied on (its record is still deleted
        when the block is forgotten); returns 1 when it had one, else 0."""
        if not m.in_cold or m.state in (BlockState.COLD, BlockState.LOST):
            return 0
        m.in_cold = False
        m.stale_cold = True
        return 1

    def protected(self, keys: Iterable[BlockKey]) -> set[BlockKey]:
        """Which of `keys` must keep their cold records: pinned, in use, or being read from
        the cold tier right now."""
        out: set[BlockKey] = set()
        for k in keys:
            m = self.meta.get(k)
            if m is not None and (m.pins or m.users or (
                    m.state is BlockState.MIGRATING and m.src_state is BlockState.COLD)):
                out.add(k)
        return out

    # -- views ---------------------------------------------------------------------------------
    def infos(self, block_bytes: int) -> list[BlockInfo]:
        return [BlockInfo(m.key, m.tier, m.pins > 0, m.users > 0, tuple(sorted(m.sessions)),
                          m.last_access, block_bytes) for m in self.meta.values()]

    def session_blocks(self) -> dict[str, dict[str, int]]:
        """Per session: how many referenced blocks sit in each tier (and LOST / moving)."""
        out: dict[str, dict[str, int]] = {}
        for m in self.meta.values():
            for s in m.sessions:
                d = out.setdefault(s, {"hot": 0, "warm": 0, "cold": 0, "other": 0})
                d[m.tier.value if m.tier is not None else "other"] += 1
        return out

    def state_counts(self) -> tuple[dict[str, int], int, int]:
        """Blocks per state, pinned blocks, blocks in use."""
        by_state: dict[str, int] = {}
        pinned = in_use = 0
        for m in self.meta.values():
            by_state[m.state.value] = by_state.get(m.state.value, 0) + 1
            pinned += m.pins > 0
            in_use += m.users > 0
        return by_state, pinned, in_use

    def stats(self, pools: dict[Tier, BlockPool], block_bytes: int) -> dict[str, Any]:
        """The table's part of `TieredKVStore.stats`: blocks, per state, pinned, in use,
        private slots, and per pool tier its blocks, bytes and the pool's own figures."""
        by_state, pinned, in_use = self.state_counts()
        tiers: dict[str, dict[str, Any]] = {}
        for t in POOL_TIERS:
            n = by_state.get(t.value, 0)
            tiers[t.value] = {"blocks": n, "bytes": n * block_bytes, **pools[t].stats()}
        return {"block_bytes": block_bytes, "blocks": len(self.meta), "states": by_state,
                "pinned": pinned, "in_use": in_use,
                "private_slots": self.leases.private_count(), "tiers": tiers}

    # -- placement's view of a few blocks (through `TieredKVStore`) -----------------------------
    def block_states(self, keys: Sequence[BlockKey]) -> BlockStates:
        """Tier (None while moving or lost), idleness (settled, unused, unpinned) and last use
        of each of `keys`, in O(len(keys))."""
        ms = list(map(self.meta.get, keys))
        return block_states(
            [m is not None for m in ms], [m.tier if m is not None else None for m in ms],
            [m is not None and m.tier is not None and m.users == 0 and m.pins == 0
             for m in ms],
            [m.last_access if m is not None else 0.0 for m in ms])

    def least_recent_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        """Up to `n` idle blocks of `tier`, least recently used first. O(n)."""
        return list(itertools.islice(self.idle[tier], max(0, n)))

    def idle_at(self, tier: Tier, slots: Iterable[int]) -> list[BlockKey]:
        """The idle blocks living in `slots` of `tier`, in the order of `slots`."""
        owners, idle = self.owners[tier], self.idle[tier]
        return [k for s in slots if (k := owners.get(s)) is not None and k in idle]

    def busy_slots(self, tier: Tier) -> list[int]:
        """Used slots of `tier` a relocation must skip: in use, private or mid-migration."""
        busy = [s for s, k in self.owners[tier].items()
                if self.meta[k].users or self.meta[k].state is BlockState.MIGRATING]
        for m in self.meta.values():
            if m.state is BlockState.MIGRATING and m.dst_tier is tier and m.dst_slot is not None:
                busy.append(m.dst_slot)
        if tier is Tier.HOT:
            busy.extend(self.leases.private_slots())
        return sorted(busy)

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self, pools: dict[Tier, BlockPool]) -> None:
        """Raise `IntegrityError` on any broken invariant of the table and its pools."""
        if self.protected_evicted:
            raise IntegrityError(f"{len(self.protected_evicted)} pinned or in-use blocks lost "
                                 f"their only copy to cold eviction (first "
                                 f"{self.protected_evicted[0].hex()})")
        for t, pool in pools.items():
            pool.check_integrity()
            for s, k in self.owners[t].items():
                m = self.meta.get(k)
                if m is None or m.slot != s or m.tier is not t:
                    raise IntegrityError(f"{t.value} slot {s} owned by unknown or moved block")
        reserved = {t: 0 for t in POOL_TIERS}
        users = self.leases.counts()
        n_idle = 0
        for k, m in self.meta.items():
            if m.key != k or m.pins < 0 or m.users < 0:
                raise IntegrityError(f"block {k.hex()}: bad key or negative counts")
            if m.users != users.get(k, 0):
                raise IntegrityError(f"block {k.hex()}: {m.users} users, {users.get(k, 0)} held")
            if m.state is BlockState.FREE:
                raise IntegrityError(f"block {k.hex()}: FREE block still indexed")
            tier = m.tier
            if tier in POOL_TIERS and (m.slot is None or self.owners[tier].get(m.slot) != k):
                raise IntegrityError(f"block {k.hex()}: slot {m.slot} not owned")
            if m.state is BlockState.MIGRATING:
                if m.dst_slot is not None and m.dst_tier is not None:
                    reserved[m.dst_tier] += 1
                src = _POOL_OF_STATE.get(m.src_state) if m.src_state is not None else None
                if src is not None and (m.slot is None or self.owners[src].get(m.slot) != k):
                    raise IntegrityError(f"block {k.hex()}: source slot lost while moving")
            if m.state is BlockState.COLD and not m.in_cold:
                raise IntegrityError(f"block {k.hex()}: COLD without a cold record")
            idle = tier in POOL_TIERS and m.users == 0 and m.pins == 0
            n_idle += idle
            for it, lru in self.idle.items():
                if (k in lru) != (idle and tier is it):
                    raise IntegrityError(f"block {k.hex()}: idle LRU of {it.value} disagrees")
        if sum(len(lru) for lru in self.idle.values()) != n_idle:
            raise IntegrityError("idle LRU holds blocks that are not idle or not indexed")
        private = self.leases.private_count()
        for t, pool in pools.items():
            expect = len(self.owners[t]) + reserved[t] + (private if t is Tier.HOT else 0)
            if pool.num_used != expect:
                raise IntegrityError(f"{t.value}: {pool.num_used} used slots, {expect} accounted")
