"""Trace-driven simulator: replays requests against the daemon's own placement service.

`SimStore` models the tiered store's placement-relevant behaviour with counts instead of
tensors: a request brings its blocks into hot (warm -> hot copy, cold -> hot read that stalls
the request, new blocks computed into hot); when hot or warm is full the store demotes its least
recently used idle blocks (its own fallback, as the real store does); a cold record, once
written, stays valid until evicted (blocks are immutable), so re-demoting it writes nothing;
background promotions go through one low-priority lane and land after their transfer time.

`simulate()` drives the real `PlacementService` (same HeatMap, policy, Prefetcher, apply
step) with a simulated clock: rounds every `interval_s` of trace time, neighbour prefetches
flushed after each request. Idle stretches with nothing to do are skipped (a round with no new
access and an empty plan changes nothing until the next request, prefetch due time or TTL).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Sequence

from kvagentd.config import KVConfig, PlacementConfig
from kvagentd.kvcache.base import BlockInfo, BlockKey, Tier
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.base import PlacementStore
from kvagentd.kvcache.placement.feed import AccessListener
from kvagentd.kvcache.placement.policy import Capacities

from .request_trace import Request

_LEVEL = {Tier.HOT: 0, Tier.WARM: 1, Tier.COLD: 2}


@dataclass(frozen=True, slots=True)
class Latencies:
    """Seconds per block read from each tier on the request path, and per migrated byte."""

    hot_read_s: float = 0.0
    warm_read_s: float = 40e-6  # host -> device copy of one block
    cold_read_s: float = 300e-6  # one O_DIRECT block read incl. queueing
    migrate_s_per_byte: float = 1.0 / 8e9


@dataclass(slots=True)
class _Block:
    tier: Tier
    last_access: float
    session: str
    cold_copy: bool = False
    pending: tuple[float, Tier] | None = None  # background move: (ready time, destination)
    info: BlockInfo | None = None  # cached snapshot row; None after any change


@dataclass(frozen=True, slots=True)
class _PoolView:
    capacity: int
    num_free: int


@dataclass(slots=True)
class SimCounters:
    hot_hits: int = 0
    warm_hits: int = 0
    cold_hits: int = 0  # cold reads on the request path (stalls)
    new_blocks: int = 0
    recomputed: int = 0  # known blocks that had been evicted (TTL) and were asked for again
    stall_s: float = 0.0
    copy_s: float = 0.0
    bytes_migrated: int = 0
    cold_write_bytes: int = 0
    foreground_demotions: int = 0  # demotions the store had to make on the request path
    background_promotions: int = 0
    evicted: int = 0
    misses_by_class: dict[str, int] = field(default_factory=dict)  # non-hot reads by session kind


class SimStore:
    """The placement-facing surface of the store (snapshot/promote/demote/evict), in counts."""

    def __init__(self, caps: Capacities, lat: Latencies, block_bytes: int, clock: SimClock,
                 access_listener: AccessListener | None = None) -> None:
        self.caps = caps
        self.lat = lat
        self.block_bytes = block_bytes
        self.clock = clock
        self.blocks: dict[BlockKey, _Block] = {}
        self.used = {Tier.HOT: 0, Tier.WARM: 0, Tier.COLD: 0}
        self.reserved = {Tier.HOT: 0, Tier.WARM: 0}
        self.pending: dict[BlockKey, _Block] = {}
        self.lane_free_at = 0.0
        self.c = SimCounters()
        self.access_listener = access_listener
        self.seen: set[BlockKey] = set()

    # ---------------------------------------------------------------- capacity
    def pool(self, tier: Tier) -> _PoolView:
        """Capacity and free slots of hot / warm (the store's `pool(tier)` surface)."""
        cap = self.caps.hot if tier is Tier.HOT else self.caps.warm
        return _PoolView(cap, max(0, self._room(tier)))

    def _room(self, tier: Tier) -> int:
        if tier is Tier.COLD:
            return 1 << 60
        cap = self.caps.hot if tier is Tier.HOT else self.caps.warm
        return cap - self.used[tier] - self.reserved[tier]

    def _set_tier(self, key: BlockKey, b: _Block, tier: Tier) -> None:
        self.used[b.tier] -= 1
        if tier is Tier.COLD and not b.cold_copy:
            self.c.cold_write_bytes += self.block_bytes
            b.cold_copy = True
        b.tier = tier
        b.info = None
        self.used[tier] += 1

    def _make_room(self, tier: Tier, protect: set[BlockKey]) -> bool:
        """The store's own fallback: demote the least recently used idle block of `tier`."""
        if self._room(tier) > 0:
            return True
        if tier is Tier.COLD:
            return True
        cands = [(b.last_access, k) for k, b in self.blocks.items()
                 if b.tier is tier and b.pending is None and k not in protect]
        if not cands:
            return False
        _, victim = min(cands)
        nxt = Tier.WARM if tier is Tier.HOT else Tier.COLD
        if not self._make_room(nxt, protect):
            nxt = Tier.COLD  # as the store does: warm cannot take it, so straight to cold
        self._set_tier(victim, self.blocks[victim], nxt)
        self.c.bytes_migrated += self.block_bytes
        self.c.foreground_demotions += 1
        return True

    # ---------------------------------------------------------------- request path
    def access(self, session: str, keys: Sequence[BlockKey]) -> None:
        now = self.clock.t
        self.complete_pending(now)
        protect = set(keys)
        tiers: list[Tier | None] = []
        for k in keys:
            b = self.blocks.get(k)
            if b is None:
                tiers.append(None)
                if k in self.seen:
                    self.c.recomputed += 1
                else:
                    self.c.new_blocks += 1
                    self.seen.add(k)
                if self._make_room(Tier.HOT, protect):
                    self.blocks[k] = _Block(Tier.HOT, now, session)
                    self.used[Tier.HOT] += 1
                continue
            if b.pending is not None:
                self._cancel(k, b)
            tiers.append(b.tier)
            if b.tier is not Tier.HOT:
                kind = session.split("-", 1)[0].split(":", 1)[0] + "/" + b.tier.value
                self.c.misses_by_class[kind] = self.c.misses_by_class.get(kind, 0) + 1
            if b.tier is Tier.HOT:
                self.c.hot_hits += 1
            elif b.tier is Tier.WARM:
                self.c.warm_hits += 1
                self.c.copy_s += self.lat.warm_read_s
            else:
                self.c.cold_hits += 1
                self.c.stall_s += self.lat.cold_read_s
            b.last_access = now
            b.session = session
            b.info = None
            if b.tier is not Tier.HOT and self._make_room(Tier.HOT, protect):
                self._set_tier(k, b, Tier.HOT)
                self.c.bytes_migrated += self.block_bytes
        if self.access_listener is not None:
            # as the real store: the listener hears keys and session only
            self.access_listener(list(keys), session)

    # ---------------------------------------------------------------- background lane
    def complete_pending(self, now: float) -> None:
        done = [(b.pending[0], k) for k, b in self.pending.items()
                if b.pending is not None and b.pending[0] <= now]
        for _, k in sorted(done):
            b = self.pending.pop(k)
            assert b.pending is not None
            dst = b.pending[1]
            b.pending = None
            self.reserved[dst] -= 1
            self._set_tier(k, b, dst)
            self.c.bytes_migrated += self.block_bytes
            self.c.background_promotions += 1

    def _cancel(self, key: BlockKey, b: _Block) -> None:
        assert b.pending is not None
        self.reserved[b.pending[1]] -= 1
        b.pending = None
        b.info = None
        self.pending.pop(key, None)

    def next_pending(self) -> float | None:
        return min((b.pending[0] for b in self.pending.values() if b.pending), default=None)

    # ---------------------------------------------------------------- placement surface
    def snapshot(self) -> list[BlockInfo]:
        bb = self.block_bytes
        out = []
        for k, b in self.blocks.items():
            if b.info is None:
                b.info = BlockInfo(k, None if b.pending else b.tier, False, False, (b.session,),
                                   b.last_access, bb)
            out.append(b.info)
        return out

    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        n = 0
        now = self.clock.t
        for k in keys:
            b = self.blocks.get(k)
            if b is None or b.pending is not None or _LEVEL[b.tier] <= _LEVEL[tier]:
                continue
            if self._room(tier) <= 0:
                continue
            if background:
                per = self.lat.cold_read_s if b.tier is Tier.COLD else self.lat.warm_read_s
                self.lane_free_at = max(self.lane_free_at, now) + per
                b.pending = (self.lane_free_at, tier)
                b.info = None
                self.reserved[tier] += 1
                self.pending[k] = b
            else:
                self._set_tier(k, b, tier)
                self.c.bytes_migrated += self.block_bytes
            n += 1
        return n

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        n = 0
        for k in keys:
            b = self.blocks.get(k)
            if b is None or b.pending is not None or _LEVEL[b.tier] >= _LEVEL[tier]:
                continue
            if self._room(tier) <= 0:
                continue
            self._set_tier(k, b, tier)
            self.c.bytes_migrated += self.block_bytes
            n += 1
        return n

    def evict(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for k in keys:
            b = self.blocks.get(k)
            if b is None or b.pending is not None:
                continue
            del self.blocks[k]
            self.used[b.tier] -= 1
            n += 1
        self.c.evicted += n
        return n

    def preload_cold(self, items: Iterable[tuple[BlockKey, str]], t: float) -> None:
        """Blocks that exist before the trace starts (archived sessions), in cold."""
        for k, s in items:
            if k not in self.blocks:
                self.blocks[k] = _Block(Tier.COLD, t, s, cold_copy=True)
                self.used[Tier.COLD] += 1
                self.seen.add(k)

    def min_cold_access(self) -> float | None:
        return min((b.last_access for b in self.blocks.values() if b.tier is Tier.COLD),
                   default=None)

    def check(self) -> None:
        for t in (Tier.HOT, Tier.WARM):
            cap = self.caps.hot if t is Tier.HOT else self.caps.warm
            assert self.used[t] + self.reserved[t] <= cap, (t, self.used[t], cap)


def _is_placement_store(store: SimStore) -> PlacementStore:
    return store  # mypy checks that SimStore implements the protocol


class SimClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(slots=True)
class SimResult:
    policy: str
    trace: str
    requests: int
    block_accesses: int
    counters: SimCounters
    rounds: int
    decision_s: float
    decided_blocks: int
    moves: dict[str, int] = field(default_factory=dict)

    def rate(self, n: int) -> float:
        reads = self.counters.hot_hits + self.counters.warm_hits + self.counters.cold_hits
        return n / reads if reads else 0.0

    @property
    def hot_hit_rate(self) -> float:
        return self.rate(self.counters.hot_hits)

    @property
    def warm_hit_rate(self) -> float:
        return self.rate(self.counters.warm_hits)

    @property
    def cold_hit_rate(self) -> float:
        return self.rate(self.counters.cold_hits)

    @property
    def decision_us_per_block(self) -> float:
        return 1e6 * self.decision_s / self.decided_blocks if self.decided_blocks else 0.0

    def as_dict(self) -> dict[str, object]:
        c = self.counters
        return {"policy": self.policy, "trace": self.trace, "requests": self.requests,
                "block_accesses": self.block_accesses, "hot_hit_rate": self.hot_hit_rate,
                "warm_hit_rate": self.warm_hit_rate, "cold_hit_rate": self.cold_hit_rate,
                "cold_stalls": c.cold_hits, "stall_s": c.stall_s, "copy_s": c.copy_s,
                "new_blocks": c.new_blocks, "recomputed": c.recomputed,
                "bytes_migrated": c.bytes_migrated, "cold_write_bytes": c.cold_write_bytes,
                "foreground_demotions": c.foreground_demotions,
                "background_promotions": c.background_promotions, "evicted": c.evicted,
                "misses_by_class": dict(sorted(c.misses_by_class.items())),
                "rounds": self.rounds, "decision_us_per_block": self.decision_us_per_block,
                "moves": self.moves}


_LATENCIES, _CONFIG, _KV = Latencies(), PlacementConfig(), KVConfig()


def simulate(requests: Sequence[Request], policy: str, caps: Capacities, *,
             latencies: Latencies = _LATENCIES, block_bytes: int = 368_640,
             config: PlacementConfig = _CONFIG, kv_config: KVConfig = _KV,
             preload: Iterable[tuple[BlockKey, str]] = (), trace_name: str = "",
             check: bool = False) -> SimResult:
    """Replay `requests` (sorted by time) against `policy`; see module docstring."""
    cfg = replace(config, policy=policy)  # type: ignore[arg-type]
    t0 = requests[0].time if requests else 0.0
    clock = SimClock(t0)
    feed = AccessFeed(clock=clock)
    store = SimStore(caps, latencies, block_bytes, clock, feed.record)
    store.preload_cold(preload, t0)
    svc = PlacementService(store, feed, cfg, kv_config, clock=clock, persist_summary=False)
    interval = cfg.interval_s
    next_round = t0 + interval
    decision_s = 0.0
    decided = 0
    moves: dict[str, int] = {}
    active = False  # any request since the last round
    idle_plan_empty = False
    n_access = 0

    def do_round(t: float) -> None:
        nonlocal decision_s, decided, idle_plan_empty, active
        clock.t = t
        store.complete_pending(t)
        plan = svc.run_round()
        rr = svc.last_round
        assert rr is not None
        decision_s += rr.decision_s
        decided += rr.blocks
        for k, v in plan.counts().items():
            moves[k] = moves.get(k, 0) + v
        idle_plan_empty = not active and len(plan) == 0
        active = False
        if check:
            store.check()

    for req in requests:
        while next_round <= req.time:
            if idle_plan_empty and not active:
                # nothing changes until a request, a prefetch due time or a TTL expiry
                wake = [req.time]
                due = svc.prefetcher.next_due(next_round)
                if due is not None:
                    wake.append(due)
                mca = store.min_cold_access()
                if mca is not None:
                    wake.append(mca + kv_config.cold_ttl_s)
                pend = store.next_pending()
                if pend is not None:
                    wake.append(pend)
                target = min(wake)
                if target > next_round:
                    steps = int((target - next_round) // interval)
                    next_round += steps * interval
                    if next_round > req.time:
                        break
            do_round(next_round)
            next_round += interval
        clock.t = req.time
        store.access(req.session, req.keys)
        svc.flush_prefetch()
        n_access += len(req.keys)
        active = True
        if check:
            store.check()
    return SimResult(policy, trace_name, len(requests), n_access, store.c, svc.rounds,
                     decision_s, decided, moves)

