"""TieredKVStore: hot and warm block arenas over a cold store, behind the `KVStore` contract.

One owner lock (a Condition) guards all block metadata; copies and I/O run outside it through
`Migrator` (prepare -> copy -> complete). Readers of a MIGRATING block wait on the Condition.
Storage faults never raise into callers: an unreadable cold block becomes LOST and is reported
as `missing`.

References: a session references every block it committed or made resident (`sessions` of a
block); `drop_session` removes the reference and frees blocks nobody references. A request
holds use-references (`users`) from `ensure_resident` / `commit` until `release`; a block in
use is never moved, demoted or evicted by anyone else.

Victims: each pool keeps an LRU (`OrderedDict`) of its idle blocks (settled, unused, unpinned).
A block enters at the most-recent end when it is accessed, released, unpinned or arrives in
the tier, and leaves it when it is used, pinned, moved or freed, so making room costs
O(victims), not O(blocks).

Cold failover: when the cold backend starts writing to a stand-in device because the SSD
failed, `on_cold_failover()` makes hot and warm blocks forget their SSD copy, so demoting them
writes them again (to the stand-in) instead of relying on a copy that may be unreadable.

Persistence: `close()` writes hot and warm blocks that sessions reference to the cold store
and saves the session -> keys map; a new store over the same cold directory rebuilds its
block index from the cold index, so `match_prefix` finds those blocks after a restart.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import numpy as np
import structlog
import torch

from kvagentd.kvcache import keys as keymod
from kvagentd.kvcache.base import (BlockInfo, BlockKey, ColdBackend, KVGeometry, KVStore,
                                   MatchResult, Residency, Tier)
from kvagentd.kvcache.migration import Migrator
from kvagentd.kvcache.pool import BlockPool
from kvagentd.kvcache.state import STATE_TIER, BlockMeta, BlockState, IntegrityError, transition

log = structlog.get_logger(__name__)

AccessListener = Callable[[list[BlockKey], str], None]
_BG_BATCH = 8  # background promotions per cold read: bounds how long a foreground read waits
_PERSIST = "\x00persist"  # holder of the use-references taken while persisting


class TieredKVStore(KVStore):
    """Block store over a hot pool (`device`), a warm pool (host memory, pinned with CUDA)
    and an optional cold backend. Pools are allocated once here and never grow."""

    def __init__(self, geometry: KVGeometry, namespace: bytes, *, hot_bytes: int, warm_bytes: int,
                 cold: ColdBackend | None = None, device: str | torch.device = "cpu",
                 access_listener: AccessListener | None = None, persist_on_shutdown: bool = True,
                 prefetch_queue: int = 64) -> None:
        if cold is not None and getattr(cold, "namespace", namespace) != namespace:
            raise ValueError("the cold store was opened for another namespace")
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
        self._owners: dict[Tier, dict[int, BlockKey]] = {Tier.HOT: {}, Tier.WARM: {}}
        self._idle: dict[Tier, OrderedDict[BlockKey, None]] = {Tier.HOT: OrderedDict(),
                                                               Tier.WARM: OrderedDict()}
        self._cold = cold
        self._cond = threading.Condition(threading.Lock())
        self._mig = Migrator(self._pools, self._owners, cold, self._cond)
        self._staged = self.device.type != "cpu"  # hot <-> cold goes through warm
        self._meta: dict[BlockKey, BlockMeta] = {}
        self._held: dict[str, list[BlockKey]] = {}      # use-references per session
        self._private: dict[str, list[int]] = {}        # uncommitted hot slots per session
        self.counters = dict(match_calls=0, matched_blocks=0, loaded_hot=0, loaded_warm=0,
                             loaded_cold=0, lost=0, demoted=0, promoted=0, dedup=0,
                             prefetch_queued=0, prefetch_dropped=0, evicted=0, relocated=0,
                             cold_copies_dropped=0, expired=0)
        self._bg: queue.Queue[tuple[list[BlockKey], Tier] | None] = queue.Queue(prefetch_queue)
        self._bg_thread: threading.Thread | None = None
        self._closed = False
        self._stale_cold: set[BlockKey] = set()    # cold copies on a failed device
        self._recheck_cold: set[BlockKey] = set()  # read from it while it failed
        if cold is not None:
            self._load_cold_index(cold)

    def _load_cold_index(self, cold: ColdBackend) -> None:
        entries = getattr(cold, "entries", None)
        rows = entries() if entries is not None else [(k, time.time(), "") for k in cold.keys()]
        refs = getattr(cold, "load_refs", lambda: {})()
        with self._cond:
            for key, last_access, _session in rows:
                m = BlockMeta(key, in_cold=True, last_access=last_access)
                transition(m, BlockState.COLD)
                self._meta[key] = m
            for session, ks in refs.items():
                for k in ks:
                    if k in self._meta:
                        self._meta[k].sessions.add(session)
            for key, _last, session in rows:  # after a crash: the writer's session, if any
                m = self._meta[key]
                if session and not m.sessions:
                    m.sessions.add(session)
        if hasattr(cold, "on_evict"):
            cold.on_evict = self._on_cold_evict
        if hasattr(cold, "on_failover"):
            cold.on_failover = self.on_cold_failover
        log.info("store_index_loaded", blocks=len(rows), sessions=len(refs))

    # -- service -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background (prefetch) mover."""
        if self._bg_thread is None:
            self._bg_thread = threading.Thread(target=self._bg_loop, name="kv-prefetch", daemon=True)
            self._bg_thread.start()

    def stop(self) -> None:
        self.close()

    def status(self) -> dict[str, object]:
        return self.stats()

    # -- lookups -----------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        return keymod.block_keys(self.namespace, token_ids, self.geometry.block_tokens)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        keys = self.block_keys(token_ids)
        n = 0
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is None or m.state in (BlockState.LOST, BlockState.FREE):
                    break
                n += 1
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
                m = self._wait_settled(k)
                if m is None or m.state is BlockState.LOST:
                    missing = i
                    break
                m.users += 1
                self._lru_update(m)
                m.sessions.add(session)
                self._held.setdefault(session, []).append(k)
                metas.append(m)
            # where each block comes from (another request may be moving a shared block now,
            # or have lost it while this one waited: LOST until someone recomputes it)
            source = [m.tier or STATE_TIER.get(m.src_state) or Tier.HOT for m in metas]
        for _ in range(3):  # a shared block may be mid-way through another request's move
            if self._staged:
                self._bring(metas, Tier.WARM, only_from=Tier.COLD)
            self._bring(metas, Tier.HOT)
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
                self._unhold(session, m)
            slots = [m.slot for m in metas[:n_ok]]
            now = time.time()
            for m, src in zip(metas[:n_ok], source):
                m.last_access = now
                loaded[src.value] += 1
            for t, c in loaded.items():
                self.counters[f"loaded_{t}"] += c
        return Residency(slots, missing, loaded)

    def _lru_update(self, m: BlockMeta) -> None:
        """Caller holds the lock; call after any change of `m`'s state, users, pins or
        last access. `m` is in its pool's idle LRU iff settled in hot or warm, unused and
        unpinned; (re)entering puts it at the most-recent end."""
        for lru in self._idle.values():
            lru.pop(m.key, None)
        t = m.tier
        if t in self._idle and m.users == 0 and m.pins == 0:
            self._idle[t][m.key] = None

    def _wait_settled(self, key: BlockKey) -> BlockMeta | None:
        """Caller holds the lock; waits while the block is MIGRATING."""
        m = self._meta.get(key)
        while m is not None and m.state is BlockState.MIGRATING:
            self._cond.wait()
            m = self._meta.get(key)
        return m

    def _bring(self, metas: list[BlockMeta], dst: Tier, *, only_from: Tier | None = None) -> None:
        """Move the held `metas` up to `dst`, in order, as far as room can be made."""
        def wanted(m: BlockMeta) -> bool:
            t = m.tier
            return t is not None and dst.above(t) and (only_from is None or t is only_from)

        with self._cond:
            n = sum(1 for m in metas if wanted(m))
        if n == 0:
            return
        self._make_room(dst, n)
        with self._cond:
            todo = [m for m in metas if wanted(m)][:self._pools[dst].num_free]
            if not todo:
                return
            moves = self._mig.prepare(todo, dst)
            assert moves is not None
            for mv in moves:
                self._lru_update(mv.meta)
        self._run_prepared(moves)

    def allocate_hot(self, n: int, session: str) -> list[int] | None:
        for _ in range(4):
            with self._cond:
                slots = self._pools[Tier.HOT].allocate(n)
                if slots is not None:
                    self._private.setdefault(session, []).extend(slots)
                    return slots
            if not self._make_room(Tier.HOT, n):
                return None
        return None

    def commit(self, session: str, token_ids: Sequence[int], slots: Sequence[int],
               first_block: int) -> list[BlockKey]:
        keys = self.block_keys(token_ids)[first_block:first_block + len(slots)]
        if len(keys) != len(slots):
            raise ValueError(f"{len(slots)} slots but only {len(keys)} full blocks from {first_block}")
        with self._cond:
            priv = self._private.get(session, [])
            for s in slots:
                if s not in priv:
                    raise ValueError(f"slot {s} is not a private slot of session {session!r}")
            now = time.time()
            for key, s in zip(keys, slots):
                priv.remove(s)
                m = self._meta.get(key)
                if m is not None and m.state is BlockState.LOST:
                    # recomputed: the fresh copy revives the block in place, so requests that
                    # hold it (and its pins and sessions) keep referring to the same block
                    transition(m, BlockState.FREE)
                    m.slot, m.in_cold = s, False
                    m.version += 1
                    transition(m, BlockState.HOT)
                    self._owners[Tier.HOT][s] = key
                elif m is not None:  # the same content exists: keep it, free the duplicate
                    self._pools[Tier.HOT].free([s])
                    self.counters["dedup"] += 1
                else:
                    m = BlockMeta(key, slot=s)
                    transition(m, BlockState.HOT)
                    self._owners[Tier.HOT][s] = key
                    self._meta[key] = m
                m.users += 1
                m.sessions.add(session)
                m.last_access = now
                self._lru_update(m)
                self._held.setdefault(session, []).append(key)
        return keys

    def release(self, session: str) -> None:
        with self._cond:
            for k in self._held.pop(session, []):
                m = self._meta.get(k)
                if m is not None:
                    m.users -= 1
                    self._lru_update(m)
            slots = self._private.pop(session, [])
            if slots:
                self._pools[Tier.HOT].free(slots)
            self._cond.notify_all()

    def _unhold(self, session: str, m: BlockMeta) -> None:
        held = self._held.get(session, [])
        held.remove(m.key)
        m.users -= 1
        self._lru_update(m)

    def record_access(self, keys: Iterable[BlockKey], session: str) -> None:
        keys = list(keys)
        now = time.time()
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is not None:
                    m.last_access = now
                    self._lru_update(m)
        if self.access_listener is not None:
            try:
                self.access_listener(keys, session)
            except Exception:  # a policy bug must not break inference
                log.exception("access_listener_failed", session=session)

    # -- moves -------------------------------------------------------------------------------
    def _run_prepared(self, moves) -> int:
        ok = self._mig.copy(moves)
        with self._cond:
            if self._recheck_cold:  # a demotion that relied on a copy on a failed device
                for i, mv in enumerate(moves):
                    if ok[i] and mv.dst is Tier.COLD and not mv.wrote \
                            and mv.meta.key in self._recheck_cold:
                        ok[i] = False  # stays resident; written to the new backend next time
            lost = self._mig.complete(moves, ok)
            for mv in moves:
                self._lru_update(mv.meta)
                if self._recheck_cold and mv.meta.key in self._recheck_cold:
                    self._recheck_cold.discard(mv.meta.key)
                    self._drop_cold_copy(mv.meta)
            self.counters["lost"] += len(lost)
        if lost and self._cold is not None:
            with self._cond:  # unreadable records go; a block revived meanwhile keeps its own
                gone = [m.key for m in lost if m.state is BlockState.LOST]
            self._cold.delete(gone)
        return sum(ok)

    def _count(self, name: str, n: int) -> None:
        with self._cond:
            self.counters[name] += n

    def _movable(self, m: BlockMeta) -> bool:
        return m.users == 0 and m.tier is not None

    def _migrate(self, keys: Sequence[BlockKey], dst: Tier, *, make_room: bool) -> int:
        """Move idle blocks to `dst` (either direction); hot <-> cold stages via warm on GPU."""
        if dst is Tier.COLD and self._cold is None:
            return 0
        if self._staged:
            with self._cond:
                via_warm = [k for k in keys if (m := self._meta.get(k)) is not None and self._movable(m)
                            and {m.tier, dst} == {Tier.HOT, Tier.COLD}]
            if via_warm:
                self._migrate(via_warm, Tier.WARM, make_room=make_room)
        with self._cond:
            todo = [m for k in keys if (m := self._meta.get(k)) is not None and self._movable(m)
                    and m.tier is not dst and not (self._staged and {m.tier, dst} == {Tier.HOT, Tier.COLD})]
        if not todo:
            return 0
        if dst is not Tier.COLD and make_room:
            self._make_room(dst, len(todo), exclude={m.key for m in todo})
        with self._cond:
            todo = [m for m in todo if self._movable(m) and m.tier is not dst]
            if dst is not Tier.COLD:
                todo = todo[:self._pools[dst].num_free]
            if not todo:
                return 0
            moves = self._mig.prepare(todo, dst)
            assert moves is not None
            for mv in moves:
                self._lru_update(mv.meta)
        return self._run_prepared(moves)

    def _make_room(self, tier: Tier, n: int, exclude: set[BlockKey] = frozenset()) -> bool:
        """Demote least-recently-used idle, unpinned blocks of `tier` until `n` slots are free."""
        lower = Tier.WARM if tier is Tier.HOT else Tier.COLD
        for _ in range(4):
            with self._cond:
                pool = self._pools[tier]
                short = n - pool.num_free
                if short <= 0:
                    return True
                keys = []
                for k in self._idle[tier]:  # least recently used first
                    if k not in exclude:
                        keys.append(k)
                        if len(keys) == short:
                            break
                if not keys:
                    return False
            if lower is Tier.COLD and self._cold is None:
                return False
            moved = 0
            if lower is Tier.WARM:
                self._make_room(Tier.WARM, len(keys))
                moved = self._migrate(keys, Tier.WARM, make_room=False)
                if moved < len(keys) and self._cold is not None and not self._staged:
                    with self._cond:
                        rest = [k for k in keys if (m := self._meta.get(k)) is not None
                                and m.tier is Tier.HOT]
                    moved += self._migrate(rest, Tier.COLD, make_room=False)
            else:
                moved = self._migrate(keys, Tier.COLD, make_room=False)
            self._count("demoted", moved)
            if moved == 0:
                return False
        with self._cond:
            return self._pools[tier].num_free >= n

    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        if background:
            try:
                self._bg.put_nowait((list(keys), tier))
            except queue.Full:
                self._count("prefetch_dropped", len(keys))
                return 0
            self._count("prefetch_queued", len(keys))
            if self._bg_thread is None:
                self.start()
            return len(keys)
        with self._cond:
            up = [k for k in keys if (m := self._meta.get(k)) is not None and m.tier is not None
                  and tier.above(m.tier)]
        moved = self._migrate(up, tier, make_room=False) if up else 0
        self._count("promoted", moved)
        return moved

    def _bg_loop(self) -> None:
        while True:
            item = self._bg.get()
            if item is None:
                return
            keys, tier = item
            for i in range(0, len(keys), _BG_BATCH):
                try:
                    self.promote(keys[i:i + _BG_BATCH], tier)
                except Exception:  # the mover must outlive any one bad request
                    log.exception("prefetch_failed", blocks=len(keys))

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        with self._cond:
            down = [k for k in keys if (m := self._meta.get(k)) is not None and m.tier is not None
                    and m.tier.above(tier) and m.pins == 0]
        moved = self._migrate(down, tier, make_room=True) if down else 0
        self._count("demoted", moved)
        return moved

    def pin(self, keys: Sequence[BlockKey]) -> None:
        with self._cond:
            for k in keys:
                if (m := self._meta.get(k)) is not None:
                    m.pins += 1
                    self._lru_update(m)

    def unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._cond:
            for k in keys:
                if (m := self._meta.get(k)) is not None and m.pins > 0:
                    m.pins -= 1
                    self._lru_update(m)

    # -- cold failover -----------------------------------------------------------------------
    def on_cold_failover(self) -> int:
        """The cold backend switched to a stand-in because its device failed: hot and warm
        blocks (and those moving out of them) stop relying on their cold copy, so demoting
        them writes them to the backend that now serves; blocks read from the failing
        device meanwhile do the same when their move completes. Returns how many forgot
        their copy now. Blocks that live only in the cold tier are left as they are: they
        read from the failed device or become LOST."""
        with self._cond:
            n = 0
            for m in self._meta.values():
                if not m.in_cold:
                    continue
                if m.state is BlockState.MIGRATING:
                    self._recheck_cold.add(m.key)  # settled when its move completes
                    if m.src_state is BlockState.COLD:
                        continue
                if m.tier is not Tier.COLD:
                    n += self._drop_cold_copy(m)
        log.warning("store_cold_copies_dropped", blocks=n)
        return n

    def _drop_cold_copy(self, m: BlockMeta) -> int:
        """Caller holds the lock. A resident block's cold copy is no longer relied on (its
        record is still deleted when the block is forgotten)."""
        if not m.in_cold or m.state in (BlockState.COLD, BlockState.LOST):
            return 0
        m.in_cold = False
        self._stale_cold.add(m.key)
        self.counters["cold_copies_dropped"] += 1
        return 1

    # -- forgetting --------------------------------------------------------------------------
    def _forget(self, m: BlockMeta) -> None:
        """Caller holds the lock; `m` is idle and settled."""
        if m.tier in (Tier.HOT, Tier.WARM):
            self._pools[m.tier].free([m.slot])
            del self._owners[m.tier][m.slot]
            m.slot = None
        transition(m, BlockState.FREE)
        self._lru_update(m)
        self._stale_cold.discard(m.key)
        self._recheck_cold.discard(m.key)
        del self._meta[m.key]

    def drop_session(self, session: str, keys: Sequence[BlockKey]) -> None:
        drop_cold = []
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is None:
                    continue
                m.sessions.discard(session)
                if not m.sessions and m.users == 0 and m.pins == 0 and m.state is not BlockState.MIGRATING:
                    if m.in_cold or k in self._stale_cold:
                        drop_cold.append(k)
                    self._forget(m)
        if drop_cold and self._cold is not None:
            self._cold.delete(drop_cold)

    def evict(self, keys: Sequence[BlockKey]) -> int:
        drop_cold, n = [], 0
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is None or m.users or m.pins or m.state is BlockState.MIGRATING:
                    continue
                if m.in_cold or k in self._stale_cold:
                    drop_cold.append(k)
                self._forget(m)
                n += 1
            self.counters["evicted"] += n
        if drop_cold and self._cold is not None:
            self._cold.delete(drop_cold)
        return n

    def expire_cold(self, now: float | None = None) -> int:
        """Forget cold-only blocks whose TTL has run out (`ColdBackend.expired`, refreshed by
        cold reads) and that nobody used in the store for a TTL either; never a pinned or
        in-use block. Records no block refers to any more go too. Returns the blocks forgotten.
        For the placement / maintenance timers: expiry needs no capacity pressure."""
        expired = getattr(self._cold, "expired", None)
        if expired is None:
            return 0
        now = time.time() if now is None else now
        ttl = float(getattr(self._cold, "ttl_s", 0.0))
        keys = expired(now)
        drop, n = [], 0
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is None:
                    drop.append(k)  # an orphan record
                elif (m.state is BlockState.COLD and m.users == 0 and m.pins == 0
                      and m.last_access + ttl < now):
                    drop.append(k)
                    self._forget(m)
                    n += 1
            self.counters["expired"] += n
        if drop:
            self._cold.evict(drop)
            log.info("store_cold_expired", blocks=n, records=len(drop))
        return n

    def _on_cold_evict(self, keys: list[BlockKey]) -> None:
        """The cold store dropped records to stay under its cap."""
        with self._cond:
            for k in keys:
                m = self._meta.get(k)
                if m is None:
                    continue
                m.in_cold = False
                if m.state is BlockState.COLD and m.users == 0:
                    self._forget(m)

    def relocate(self, tier: Tier, moves: Sequence[tuple[int, int]]) -> int:
        if tier is Tier.COLD:
            return 0
        pool, owners, n = self._pools[tier], self._owners[tier], 0
        with self._cond:
            for src, dst in moves:
                key = owners.get(src)
                if key is None or pool.is_used(dst):
                    continue
                m = self._meta[key]
                if m.users or m.state is BlockState.MIGRATING:
                    continue
                pool.move(src, dst)
                del owners[src]
                owners[dst] = key
                m.slot = dst
                m.version += 1
                n += 1
            self.counters["relocated"] += n
        return n

    def occupancy(self, tier: Tier) -> np.ndarray:
        """Used-slot bitmap of the hot or warm pool (a copy), for defrag planning."""
        with self._cond:
            return self._pools[tier].occupancy()

    def busy_slots(self, tier: Tier) -> list[int]:
        """Used slots that `relocate` would skip now: in use, private or mid-migration."""
        with self._cond:
            owners = self._owners[tier]
            busy = [s for s, k in owners.items()
                    if self._meta[k].users or self._meta[k].state is BlockState.MIGRATING]
            for m in self._meta.values():
                if m.state is BlockState.MIGRATING and m.dst_tier is tier and m.dst_slot is not None:
                    busy.append(m.dst_slot)
            if tier is Tier.HOT:
                busy.extend(s for v in self._private.values() for s in v)
            return sorted(busy)

    # -- views -------------------------------------------------------------------------------
    def snapshot(self) -> list[BlockInfo]:
        bb = self.geometry.block_bytes
        with self._cond:
            return [BlockInfo(m.key, m.tier, m.pins > 0, m.users > 0, tuple(sorted(m.sessions)),
                              m.last_access, bb) for m in self._meta.values()]

    def session_blocks(self) -> dict[str, dict[str, int]]:
        """Per session: how many referenced blocks sit in each tier (and LOST / moving)."""
        out: dict[str, dict[str, int]] = {}
        with self._cond:
            for m in self._meta.values():
                for s in m.sessions:
                    d = out.setdefault(s, {"hot": 0, "warm": 0, "cold": 0, "other": 0})
                    d[m.tier.value if m.tier is not None else "other"] += 1
        return out

    def keys_of_session(self, session: str) -> list[BlockKey]:
        with self._cond:
            return [m.key for m in self._meta.values() if session in m.sessions]

    def stats(self) -> dict[str, object]:
        bb = self.geometry.block_bytes
        with self._cond:
            by_state: dict[str, int] = {}
            pinned = in_use = 0
            for m in self._meta.values():
                by_state[m.state.value] = by_state.get(m.state.value, 0) + 1
                pinned += m.pins > 0
                in_use += m.users > 0
            tiers = {}
            for t in (Tier.HOT, Tier.WARM):
                p = self._pools[t]
                tiers[t.value] = {"blocks": by_state.get(t.value, 0),
                                  "bytes": by_state.get(t.value, 0) * bb, **p.stats()}
            private = sum(len(v) for v in self._private.values())
            out: dict[str, object] = {
                "block_bytes": bb, "blocks": len(self._meta), "states": by_state,
                "pinned": pinned, "in_use": in_use, "private_slots": private,
                "tiers": tiers, "migrations": self._mig.moved, "migration_failures": self._mig.failed,
                **self.counters,
            }
        cold = {"blocks": by_state.get("cold", 0), "bytes": by_state.get("cold", 0) * bb}
        if self._cold is not None:
            cold.update(self._cold.stats())
        tiers["cold"] = cold
        return out

    def check_integrity(self) -> None:
        with self._cond:
            for t, pool in self._pools.items():
                pool.check_integrity()
                for s, k in self._owners[t].items():
                    m = self._meta.get(k)
                    if m is None or m.slot != s or m.tier is not t:
                        raise IntegrityError(f"{t.value} slot {s} owned by unknown or moved block")
            reserved = {Tier.HOT: 0, Tier.WARM: 0}
            users: dict[BlockKey, int] = {}
            for held in self._held.values():
                for k in held:
                    users[k] = users.get(k, 0) + 1
            n_idle = 0
            for k, m in self._meta.items():
                if m.key != k or m.pins < 0 or m.users < 0:
                    raise IntegrityError(f"block {k.hex()}: bad key or negative counts")
                if m.users != users.get(k, 0):
                    raise IntegrityError(f"block {k.hex()}: {m.users} users, {users.get(k, 0)} held")
                if m.state is BlockState.FREE:
                    raise IntegrityError(f"block {k.hex()}: FREE block still indexed")
                if m.tier in (Tier.HOT, Tier.WARM) and self._owners[m.tier].get(m.slot) != k:
                    raise IntegrityError(f"block {k.hex()}: slot {m.slot} not owned")
                if m.state is BlockState.MIGRATING:
                    if m.dst_slot is not None:
                        reserved[m.dst_tier] += 1
                    if m.src_state in (BlockState.HOT, BlockState.WARM):
                        src = Tier.HOT if m.src_state is BlockState.HOT else Tier.WARM
                        if self._owners[src].get(m.slot) != k:
                            raise IntegrityError(f"block {k.hex()}: source slot lost while moving")
                if m.state is BlockState.COLD and not m.in_cold:
                    raise IntegrityError(f"block {k.hex()}: COLD without a cold record")
                idle = m.tier in self._idle and m.users == 0 and m.pins == 0
                n_idle += idle
                for t, lru in self._idle.items():
                    if (k in lru) != (idle and m.tier is t):
                        raise IntegrityError(f"block {k.hex()}: idle LRU of {t.value} disagrees")
            if sum(len(lru) for lru in self._idle.values()) != n_idle:
                raise IntegrityError("idle LRU holds blocks that are not idle or not indexed")
            private = sum(len(v) for v in self._private.values())
            for t, pool in self._pools.items():
                expect = len(self._owners[t]) + reserved[t] + (private if t is Tier.HOT else 0)
                if pool.num_used != expect:
                    raise IntegrityError(f"{t.value}: {pool.num_used} used slots, {expect} accounted")

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None) -> dict[str, int]:
        """Scrub the cold tier now (see `ColdStore.verify`). With `repair`, records dropped
        from the cold index are forgotten here too: a block that lived only there becomes
        LOST (its tokens are recomputed on next use)."""
        if self._cold is None:
            return {"checked": 0, "corrupt": 0, "missing": 0, "repaired": 0, "bytes": 0}
        before = set(self._cold.keys()) if repair else set()
        report = self._cold.verify(repair=repair, rate_bytes_per_s=rate_bytes_per_s)
        if repair:
            gone = before - set(self._cold.keys())
            with self._cond:
                for k in gone:
                    m = self._meta.get(k)
                    if m is None:
                        continue
                    m.in_cold = False
                    if m.state is BlockState.COLD:
                        transition(m, BlockState.LOST)
                        self.counters["lost"] += 1
        return report

    # -- shutdown ----------------------------------------------------------------------------
    def persist(self, batch: int = 64) -> int:
        """Write hot and warm blocks that sessions reference to the cold tier (from their
        slots, held against moves meanwhile; GPU blocks staged through host memory a batch at
        a time) and save the session map; returns how many blocks were written."""
        if self._cold is None:
            return 0
        written = 0
        with self._cond:
            todo = [m for m in self._meta.values()
                    if m.tier in (Tier.HOT, Tier.WARM) and m.sessions and not m.in_cold]
            for m in todo:
                m.users += 1
                self._lru_update(m)
            self._held.setdefault(_PERSIST, []).extend(m.key for m in todo)
        put_many = getattr(self._cold, "put_many", None)
        try:
            for i in range(0, len(todo), batch):
                part = todo[i:i + batch]
                blocks = []
                for m in part:
                    b = self._pools[m.tier].arena[m.slot]
                    blocks.append(b if b.device.type == "cpu" else b.to("cpu"))
                keys = [m.key for m in part]
                res = put_many(keys, blocks) if put_many else \
                    [self._cold.put(k, b) for k, b in zip(keys, blocks)]
                with self._cond:
                    for m, r in zip(part, res):
                        if r:
                            m.in_cold = True
                            written += 1
        finally:
            self.release(_PERSIST)
        save = getattr(self._cold, "save_refs", None)
        if save is not None:
            with self._cond:
                refs: dict[str, list[BlockKey]] = {}
                for m in self._meta.values():
                    if m.in_cold:
                        for s in m.sessions:
                            refs.setdefault(s, []).append(m.key)
            save(refs)
        log.info("store_persisted", written=written, of=len(todo))
        return written

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bg_thread is not None:
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
        if self.persist_on_shutdown:
            self.persist()
        if self._cold is not None:
            self._cold.close()


def from_config(kv_config, geometry: KVGeometry, namespace: bytes, device: str | torch.device = "cpu",
                *, access_listener: AccessListener | None = None, file_io=None) -> TieredKVStore:
    """Build the store and its cold tier from `Config.kv` (a `KVConfig`)."""
    from kvagentd.kvcache.coldstore import ColdStore

    kv = kv_config
    cold = ColdStore(kv.cold_dir, geometry, namespace, codec=kv.cold_codec,
                     capacity_bytes=kv.cold_capacity_bytes, segment_bytes=kv.segment_bytes,
                     io_unit_bytes=kv.io_unit_bytes, o_direct=kv.o_direct, file_io=file_io,
                     ttl_s=kv.cold_ttl_s, io_threads=kv.io_threads)
    return TieredKVStore(geometry, namespace, hot_bytes=kv.hot_bytes,
                         warm_bytes=int(kv.hot_bytes * kv.warm_ratio), cold=cold, device=device,
                         access_listener=access_listener, persist_on_shutdown=kv.persist_on_shutdown)
