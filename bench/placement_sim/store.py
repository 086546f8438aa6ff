"""The simulator's store: `TieredKVStore`'s placement-relevant behaviour, in counts.

Blocks are dense integer ids; their state is numpy columns (tier code, last access, cold copy,
pending background move) and the hot and warm pools are slot arrays, as in the real store. A
request brings its blocks into hot (warm -> hot copy, cold -> hot read that stalls the request,
new blocks computed into hot); when hot or warm is full the store demotes its least recently
used idle blocks (its own fallback: an `OrderedDict` LRU per pool, as the real store keeps); a
cold record, once written, stays valid until evicted (blocks are immutable), so re-demoting it
writes nothing; background promotions go through one low-priority lane and land after their
transfer time. It implements `PlacementStore` (checked by mypy in `replay.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from typing import NamedTuple

import numpy as np

from kvagentd.kvcache.base import BlockKey, Tier
from kvagentd.kvcache.placement.base import (CODE_OF, COLD, HOT, NONE, WARM, BlockStates,
                                             Capacities)
from kvagentd.kvcache.placement.stats import sorted_unique

AccessListener = Callable[[Sequence[BlockKey], str], None]
_POOLS = (HOT, WARM)


@dataclass(frozen=True, slots=True)
class Latencies:
    """Seconds per block read from each tier on the request path."""

    warm_read_s: float = 40e-6  # host -> device copy of one block
    cold_read_s: float = 300e-6  # one O_DIRECT block read incl. queueing


@dataclass(slots=True)
class SimCounters:
    hot_hits: int = 0
    warm_hits: int = 0
    cold_hits: int = 0  # cold reads on the request path (stalls)
    first_touches: int = 0  # blocks computed for the first time
    recomputed: int = 0  # blocks seen before but evicted since, computed again
    stall_s: float = 0.0
    copy_s: float = 0.0
    bytes_foreground: int = 0  # moved by requests and the store's own room-making
    bytes_background: int = 0  # moved by placement's plans and prefetch
    cold_write_bytes: int = 0
    foreground_demotions: int = 0
    background_promotions: int = 0
    evicted: int = 0
    misses_by_class: dict[str, int] = field(default_factory=dict)  # by session kind / tier

    @property
    def bytes_migrated(self) -> int:
        return self.bytes_foreground + self.bytes_background


class PoolView(NamedTuple):
    capacity: int
    num_free: int


class SimStore:
    def __init__(self, caps: Capacities, n_blocks: int, keys: Sequence[BlockKey], *,
                 block_bytes: int = 368_640, latencies: Latencies = Latencies(),
                 clock: Callable[[], float], access_listener: AccessListener | None = None,
                 session_names: Sequence[str] = (), seed: int = 0) -> None:
        self.caps = {HOT: caps.hot, WARM: caps.warm}
        self.lat = latencies
        self.block_bytes = block_bytes
        self.clock = clock
        self.listener = access_listener
        self.keys = keys
        self.id_of: dict[BlockKey, int] = {k: i for i, k in enumerate(keys)}
        # keys made by `RequestTrace.block_keys` spell their id: read it, no dict lookup
        spelled = np.zeros((len(keys), 2), dtype=">u8")
        spelled[:, 1] = np.arange(len(keys))
        self._spelled = (all(map((16).__eq__, map(len, keys)))
                         and b"".join(keys) == spelled.tobytes())
        self.session_names = list(session_names)
        self.tier = np.full(n_blocks, NONE, dtype=np.int8)
        self.last_access = np.zeros(n_blocks, dtype=np.float64)
        self.owner = np.zeros(n_blocks, dtype=np.int32)  # session index of its last use
        self.cold_copy = np.zeros(n_blocks, dtype=bool)
        self.seen = np.zeros(n_blocks, dtype=bool)
        self.pending_at = np.full(n_blocks, np.inf)
        self.pending_dst = np.zeros(n_blocks, dtype=np.int8)
        self.pending: set[int] = set()
        self.slot_of = np.full(n_blocks, -1, dtype=np.int64)
        self.owners = {t: np.full(self.caps[t], -1, dtype=np.int64) for t in _POOLS}
        self.free_slots = {t: list(range(self.caps[t] - 1, -1, -1)) for t in _POOLS}
        self.reserved = {HOT: 0, WARM: 0}
        self.lru: dict[int, OrderedDict[int, None]] = {HOT: OrderedDict(), WARM: OrderedDict()}
        self.lane_free_at = 0.0
        self.c = SimCounters()
        self._nrng = np.random.default_rng(seed)

    # ---------------------------------------------------------------- PlacementStore
    def pool(self, tier: Tier) -> PoolView:
        t = CODE_OF[tier]
        return PoolView(self.caps[t], self._free(t))

    def ids_of(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """The id of each key (-1: not a block of this store)."""
        n = len(keys)
        if self._spelled and n >= 128:  # below that, the dict's lookups cost less
            raw = b"".join(keys)
            if len(raw) == 16 * n:  # every key 16 bytes: the two halves of a big-endian id
                half = np.frombuffer(raw, dtype=">u8").reshape(n, 2)
                ok = (half[:, 0] == 0) & (half[:, 1] < len(self.keys))
                ids = half[:, 1].astype(np.int64)
                ids[~ok] = -1
                return ids
        return np.fromiter(map(self.id_of.get, keys, repeat(-1)), np.int64, n)

    def block_states(self, keys: Sequence[BlockKey]) -> BlockStates:
        ids = self.ids_of(keys)
        ok = ids >= 0
        safe = np.where(ok, ids, 0)
        tier = np.where(ok, self.tier[safe], NONE).astype(np.int8)
        known = tier != NONE
        idle = known & ~np.isfinite(self.pending_at[safe])
        return BlockStates(known, tier, idle, np.where(ok, self.last_access[safe], 0.0))

    def least_recent_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        return list(map(self.keys.__getitem__, islice(self.lru[CODE_OF[tier]], max(0, n))))

    def sample_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        t = CODE_OF[tier]
        cap = self.caps[t]
        if n <= 0 or cap == 0:
            return []
        owners = sorted_unique(self.owners[t][self._nrng.integers(0, cap, size=n)])
        owners = owners[owners >= 0]
        owners = owners[~np.isfinite(self.pending_at[owners])]  # pending: not idle
        return list(map(self.keys.__getitem__, owners.tolist()))

    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        dst = CODE_OF[tier]
        now = self.clock()
        n = 0
        for k in keys:
            i = self.id_of.get(k)
            if i is None or i in self.pending or self.tier[i] in (NONE, dst) \
                    or int(self.tier[i]) < dst or self._free(dst) <= 0:
                continue
            if background:
                per = self.lat.cold_read_s if self.tier[i] == COLD else self.lat.warm_read_s
                self.lane_free_at = max(self.lane_free_at, now) + per
                self.pending_at[i] = self.lane_free_at
                self.pending_dst[i] = dst
                self.pending.add(i)
                self.reserved[dst] += 1
                self._unidle(i)
            else:
                self._move(i, dst, background=True)
            n += 1
        return n

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        dst = CODE_OF[tier]
        ids = self._ids(keys)
        t = self.tier[ids]
        ids = ids[(t != NONE) & (t < dst) & ~np.isfinite(self.pending_at[ids])]
        if ids.size == 0:
            return 0
        if dst != COLD and self._free(dst) < ids.size:
            self._make_room(dst, int(ids.size), frozenset(ids.tolist()), background=True)
            ids = ids[:max(0, self._free(dst))]
        self._move_many(ids, dst, background=True)
        return int(ids.size)

    def _ids(self, keys: Sequence[BlockKey]) -> np.ndarray:
        ids = self.ids_of(keys)
        return sorted_unique(ids[ids >= 0])

    def evict(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for k in keys:
            i = self.id_of.get(k)
            if i is None or i in self.pending or self.tier[i] == NONE:
                continue
            self._leave(i)
            self.tier[i] = NONE
            self.cold_copy[i] = False
            n += 1
        self.c.evicted += n
        return n

    # ---------------------------------------------------------------- request path
    def access(self, ids: np.ndarray, session: int) -> int:
        """One request of session index `session` touching block ids `ids`, in order; returns
        how many of its blocks were read from cold."""
        now = self.clock()
        if self.pending:
            self.complete_pending(now)
            for i in self.pending.intersection(ids.tolist()):
                self._cancel(i)
        c = self.c
        tiers = self.tier[ids]
        hot = tiers == HOT
        n_hot = int(hot.sum())
        c.hot_hits += n_hot
        n_cold = 0
        if n_hot < ids.size:
            warm = tiers == WARM
            cold = tiers == COLD
            absent = tiers == NONE
            n_warm, n_cold = int(warm.sum()), int(cold.sum())
            c.warm_hits += n_warm
            c.cold_hits += n_cold
            c.copy_s += n_warm * self.lat.warm_read_s
            c.stall_s += n_cold * self.lat.cold_read_s
            if absent.any():
                seen = self.seen[ids[absent]]
                n_seen = int(seen.sum())
                c.recomputed += n_seen
                c.first_touches += int(absent.sum()) - n_seen
                self.seen[ids[absent]] = True
            if n_warm or n_cold:
                name = self.session_names[session] if session < len(self.session_names) else ""
                kind = name.split("-", 1)[0].split(":", 1)[0]
                for t, n in (("warm", n_warm), ("cold", n_cold)):
                    if n:
                        key = f"{kind}/{t}"
                        c.misses_by_class[key] = c.misses_by_class.get(key, 0) + n
            up = ids[~hot]
            self._make_room(HOT, int(up.size), frozenset(ids.tolist()), background=False)
            up = up[:max(0, self._free(HOT))]  # what the store cannot make room for stays
            new = self.tier[up] == NONE
            self._place_many(up[new], HOT)
            self._move_many(up[~new], HOT, background=False)
        self.last_access[ids] = now
        self.owner[ids] = session
        lru = self.lru[HOT]
        for i in ids.tolist():
            if i in lru:
                lru.move_to_end(i)
        if self.listener is not None:
            keys = self.keys
            self.listener([keys[i] for i in ids.tolist()],
                          self.session_names[session] if session < len(self.session_names)
                          else "")
        return n_cold

    def preload_cold(self, ids: np.ndarray, t: float) -> None:
        """Blocks that exist before the trace starts (archived sessions), in cold."""
        new = ids[self.tier[ids] == NONE]
        self.tier[new] = COLD
        self.cold_copy[new] = True
        self.seen[new] = True
        self.last_access[new] = t

    # ---------------------------------------------------------------- background lane
    def complete_pending(self, now: float) -> None:
        done = sorted((float(self.pending_at[i]), i) for i in self.pending
                      if self.pending_at[i] <= now)
        for _, i in done:
            dst = int(self.pending_dst[i])
            self._cancel(i)
            if self._free(dst) > 0:
                self._move(i, dst, background=True)
                self.c.background_promotions += 1

    def next_pending(self) -> float | None:
        return min((float(self.pending_at[i]) for i in self.pending), default=None)

    def _cancel(self, i: int) -> None:
        self.pending.discard(i)
        self.reserved[int(self.pending_dst[i])] -= 1
        self.pending_at[i] = np.inf
        t = int(self.tier[i])
        if t in self.lru:
            self.lru[t][i] = None

    # ---------------------------------------------------------------- internals
    def _free(self, t: int) -> int:
        if t == COLD:
            return 1 << 60
        return len(self.free_slots[t]) - self.reserved[t]

    def _unidle(self, i: int) -> None:
        t = int(self.tier[i])
        if t in self.lru:
            self.lru[t].pop(i, None)

    def _leave(self, i: int) -> None:
        """Take block `i` out of its pool (slot freed, not idle any more)."""
        t = int(self.tier[i])
        if t in self.lru:
            self.lru[t].pop(i, None)
            s = int(self.slot_of[i])
            self.owners[t][s] = -1
            self.free_slots[t].append(s)
            self.slot_of[i] = -1

    def _place(self, i: int, t: int) -> None:
        """Put block `i` (out of every pool) into tier `t` as its most recent idle block."""
        self.tier[i] = t
        if t in self.lru:
            s = self.free_slots[t].pop()
            self.owners[t][s] = i
            self.slot_of[i] = s
            self.lru[t][i] = None

    def _leave_many(self, ids: np.ndarray) -> None:
        """Take blocks `ids` out of their pools (slots freed, not idle any more)."""
        for t in _POOLS:
            sel = ids[self.tier[ids] == t]
            if sel.size == 0:
                continue
            lru = self.lru[t]
            for i in sel.tolist():
                lru.pop(i, None)
            slots = self.slot_of[sel]
            self.owners[t][slots] = -1
            self.free_slots[t].extend(slots.tolist())
            self.slot_of[sel] = -1

    def _place_many(self, ids: np.ndarray, t: int) -> None:
        """Put blocks `ids` (out of every pool) into tier `t`, most recent last."""
        self.tier[ids] = t
        if t in self.lru and ids.size:
            free = self.free_slots[t]
            slots = free[-ids.size:][::-1]
            del free[-ids.size:]
            sl = np.asarray(slots, dtype=np.int64)
            self.owners[t][sl] = ids
            self.slot_of[ids] = sl
            self.lru[t].update(dict.fromkeys(ids.tolist()))

    def _move_many(self, ids: np.ndarray, t: int, *, background: bool) -> None:
        if ids.size == 0:
            return
        self._leave_many(ids)
        if t == COLD:
            fresh = ~self.cold_copy[ids]
            self.c.cold_write_bytes += int(fresh.sum()) * self.block_bytes
            self.cold_copy[ids] = True
        self._place_many(ids, t)
        if background:
            self.c.bytes_background += int(ids.size) * self.block_bytes
        else:
            self.c.bytes_foreground += int(ids.size) * self.block_bytes

    def _move(self, i: int, t: int, *, background: bool) -> None:
        self._leave(i)
        if t == COLD and not self.cold_copy[i]:
            self.c.cold_write_bytes += self.block_bytes
            self.cold_copy[i] = True
        self._place(i, t)
        if background:
            self.c.bytes_background += self.block_bytes
        else:
            self.c.bytes_foreground += self.block_bytes

    def _make_room(self, t: int, n: int, protect: frozenset[int], *, background: bool) -> None:
        """The store's own fallback: demote the least recently used idle blocks of `t`."""
        short = n - self._free(t)
        if short <= 0 or t == COLD:
            return
        victims = []
        for i in self.lru[t]:
            if i not in protect:
                victims.append(i)
                if len(victims) == short:
                    break
        lower = WARM if t == HOT else COLD
        if lower == WARM:
            self._make_room(WARM, len(victims), protect, background=background)
        v = np.asarray(victims, dtype=np.int64)
        fits = max(0, min(v.size, self._free(lower)))  # as the store: warm full -> cold
        self._move_many(v[:fits], lower, background=background)
        self._move_many(v[fits:], COLD, background=background)
        if not background:
            self.c.foreground_demotions += int(v.size)

    def check(self) -> None:
        """Capacity and pool bookkeeping hold (tests)."""
        for t in _POOLS:
            used = int((self.tier == t).sum())
            assert used + self.reserved[t] <= self.caps[t], (t, used, self.caps[t])
            assert used == self.caps[t] - len(self.free_slots[t])
            assert len(self.lru[t]) + sum(1 for i in self.pending if self.tier[i] == t) == used
