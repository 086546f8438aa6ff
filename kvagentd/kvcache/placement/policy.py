"""Placement policies: pure functions from (snapshot, heat, capacities, now) to an immutable Plan.

A `Plan` is a tuple of `Move`s, ordered so that demotions free room before promotions use it,
that never takes a tier over its capacity at any step (given a start within capacity), and
that holds at most `max_moves` migrations plus at most `max_moves` evictions.

Policies (peers, selectable by `placement.policy`):
- `lru`: keeps head-room in hot and warm by demoting the least recently used idle blocks;
  never promotes ahead of a request.
- `heat`: ranks blocks by heat (see `heat.py`); hot = heat >= hot_factor x mean, warm = heat
  >= warm_factor x mean, filled by heat within capacity. Incumbents get a hysteresis bonus
  (their heat counts x (1 + hysteresis)) and idle incumbents keep their tier while there is
  room, so blocks do not ping-pong. Blocks below threshold are never promoted.
- `heat+prefetch`: `heat` plus the wants of a `Prefetcher` (predictive preload, co-access,
  neighbours), ranked above heat-eligible blocks and moved with the background I/O queue.
All policies: pinned blocks stay; in-use blocks stay hot; unpinned idle cold blocks whose last
access is older than the cold TTL are evicted.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from ..base import BlockInfo, BlockKey, Tier

from .heat import gather

if TYPE_CHECKING:
    from .heat import HeatMap

# Column codes of a snapshot view. NOTE: codes live only inside numpy columns; tiers
# themselves are compared as enums through these tables, never by ordinal.
HOT, WARM, COLD, NONE = 0, 1, 2, 3
_CODE = {Tier.HOT: HOT, Tier.WARM: WARM, Tier.COLD: COLD, None: NONE}
_TIER = {HOT: Tier.HOT, WARM: Tier.WARM, COLD: Tier.COLD}
_LEVEL = {Tier.HOT: 0, Tier.WARM: 1, Tier.COLD: 2}
# NOTE: Enum.__hash__ runs in Python; mapping member identities keeps a 100k-block snapshot cheap
_CODE_BY_ID = {id(t): c for t, c in _CODE.items()}
_col = [itemgetter(i) for i in range(7)]

HEADROOM_FRACTION = 0.05  # free share of hot / warm kept for new blocks and foreground reads


class Reason(enum.Enum):
    HEAT = "heat"
    LRU = "lru"
    CAPACITY = "capacity"
    TTL = "ttl"
    PREDICT = "prefetch-predict"
    COACCESS = "prefetch-coaccess"
    NEIGHBOUR = "prefetch-neighbour"
    WARMUP = "warmup"

    @property
    def is_prefetch(self) -> bool:
        return self in _PREFETCH


_PREFETCH = frozenset({Reason.PREDICT, Reason.COACCESS, Reason.NEIGHBOUR, Reason.WARMUP})


class Action(enum.Enum):
    PROMOTE = "promote"
    DEMOTE = "demote"
    EVICT = "evict"


@dataclass(frozen=True, slots=True)
class Move:
    """Move `key` from `src` to `dst`; `dst=None` means evict (forget the block)."""

    key: BlockKey
    src: Tier
    dst: Tier | None
    reason: Reason

    @property
    def action(self) -> Action:
        if self.dst is None:
            return Action.EVICT
        return Action.PROMOTE if _LEVEL[self.dst] < _LEVEL[self.src] else Action.DEMOTE

    @property
    def background(self) -> bool:
        """Use the store's low-priority I/O queue (prefetch, or anything read from cold)."""
        return self.reason.is_prefetch or self.src is Tier.COLD


@dataclass(frozen=True, slots=True)
class Plan:
    moves: tuple[Move, ...]
    policy: str
    considered: int = 0  # blocks examined
    mean_heat: float = 0.0

    def __iter__(self) -> Iterator[Move]:
        return iter(self.moves)

    def __len__(self) -> int:
        return len(self.moves)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.moves:
            k = f"{m.action.value}:{m.reason.value}"
            out[k] = out.get(k, 0) + 1
        return out


@dataclass(frozen=True, slots=True)
class Capacities:
    """Tier capacities in blocks (cold is bounded by bytes in the store, not here)."""

    hot: int
    warm: int


@dataclass(frozen=True, slots=True)
class Want:
    """A prefetch wish: bring `key` up to `tier` (never down)."""

    tier: Tier
    reason: Reason


@dataclass(frozen=True, slots=True)
class PolicyParams:
    hot_factor: float = 1.8
    warm_factor: float = 0.9
    hysteresis: float = 0.2
    window_fraction: float = 0.25
    cold_ttl_s: float = 3600.0
    headroom_fraction: float = HEADROOM_FRACTION
    active_s: float = 2.0  # used this recently: never demoted just to restore head-room

    def max_moves(self, caps: Capacities) -> int:
        return max(1, int(self.window_fraction * caps.hot))


@dataclass(slots=True)
class SnapshotView:
    """Columns of a store snapshot (one row per block with a tier)."""

    keys: list[BlockKey]
    tier: np.ndarray  # int8 codes HOT/WARM/COLD/NONE
    pinned: np.ndarray
    in_use: np.ndarray
    last_access: np.ndarray

    @classmethod
    def of(cls, snapshot: Sequence[BlockInfo]) -> SnapshotView:
        n = len(snapshot)
        code = _CODE_BY_ID.__getitem__
        return cls(list(map(_col[0], snapshot)),
                   np.fromiter(map(code, map(id, map(_col[1], snapshot))), np.int8, n),
                   np.fromiter(map(_col[2], snapshot), bool, n),
                   np.fromiter(map(_col[3], snapshot), bool, n),
                   np.fromiter(map(_col[5], snapshot), np.float64, n))

    def __len__(self) -> int:
        return len(self.keys)


class PlacementPolicy(ABC):
    """One interface for every policy."""

    name: str

    def __init__(self, params: PolicyParams) -> None:
        self.params = params

    @abstractmethod
    def plan(self, snapshot: Sequence[BlockInfo] | SnapshotView, heat: HeatMap,
             capacities: Capacities, now: float) -> Plan:
        """A plan for this round; `now` is wall-clock seconds (cold TTL). `snapshot` is the
        store's snapshot or its columns (`SnapshotView.of(snapshot)`)."""


def _view(snapshot: Sequence[BlockInfo] | SnapshotView) -> SnapshotView:
    return snapshot if isinstance(snapshot, SnapshotView) else SnapshotView.of(snapshot)


# ------------------------------------------------------------------------------------------
# Shared machinery: targets -> feasible, capped, ordered moves
# ------------------------------------------------------------------------------------------

def _expired(v: SnapshotView, now: float, ttl: float) -> np.ndarray:
    out: np.ndarray = (v.tier == COLD) & ~v.pinned & ~v.in_use & ((now - v.last_access) > ttl)
    return out


def _take_top(order: np.ndarray, eligible: np.ndarray, k: int) -> np.ndarray:
    """First `k` indices of `order` that are eligible."""
    if k <= 0:
        return order[:0]
    sel: np.ndarray = order[eligible[order]]
    return sel[:k]


def _build_moves(v: SnapshotView, target: np.ndarray, score: np.ndarray, caps: Capacities,
                 max_moves: int, reasons: Mapping[int, Reason], default_reason: Reason,
                 expired: np.ndarray, bonus: float = 1.0,
                 active_since: float = float("inf")) -> tuple[Move, ...]:
    """Turn per-block target codes into a capped, feasible, ordered move list.

    Promotions are taken by `score` descending; each takes room from the free slots of its
    destination or, when none is left, from the lowest-scored block that the targets demote
    out of it (recursively for hot -> warm -> cold). Remaining budget goes to the other
    wanted hot -> warm demotions that fit free warm slots (restoring hot head-room without
    writing to cold: warm -> cold happens only when a block needs the room). Moves are
    emitted in decision order, so a demotion that frees room always precedes the promotion
    that needs it."""
    tier = v.tier
    movable = (tier != NONE) & ~v.pinned
    free = {HOT: caps.hot - int((tier == HOT).sum()), WARM: caps.warm - int((tier == WARM).sum())}
    down = movable & (target > tier) & ~v.in_use
    up = movable & (target < tier)
    dem = {src: deque(i for i in np.flatnonzero(down & (tier == src))[
        np.argsort(score[down & (tier == src)], kind="stable")].tolist())
        for src in (HOT, WARM)}
    pro_idx = np.flatnonzero(up)
    pro = pro_idx[np.argsort(-score[pro_idx], kind="stable")].tolist()
    out: list[Move] = []  # in decision order: every step fits at the moment it runs
    budget = max_moves
    keys = v.keys

    def reason(i: int) -> Reason:
        return reasons.get(i, default_reason)

    def demote_one(src: int, voluntary: bool = False) -> bool:
        """Demote the coldest wanted block out of `src`; False if impossible. A voluntary
        demotion (head-room only) never writes to cold and never displaces another block."""
        nonlocal budget
        q = dem[src]
        while q:
            i = q[0]
            dst = int(target[i])
            if voluntary:
                if src == WARM or free[WARM] <= 0:
                    return False
                if v.last_access[i] > active_since:
                    q.popleft()  # in active use: the next request would only pull it back
                    continue
                dst = WARM
            if dst == WARM and free[WARM] <= 0:
                if budget < 2 or not demote_one(WARM):
                    # warm is full of blocks that are themselves going up (a swap): the
                    # victim goes straight to cold, as the store's own fallback does
                    dst = COLD
            if budget < 1:
                return False
            q.popleft()
            budget -= 1
            free[src] += 1
            if dst in free:
                free[dst] -= 1
            r = Reason.CAPACITY if default_reason is Reason.HEAT else default_reason
            out.append(Move(keys[i], _TIER[src], _TIER[dst], r))
            return True
        return False

    for i in pro:
        if budget < 1:
            break
        dst = int(target[i])
        if free[dst] <= 0:
            # hysteresis: displace a block only for a clearly hotter one
            q = dem[dst]
            if q and score[i] <= score[q[0]] * bonus:
                continue
            if budget < 2 or not demote_one(dst):
                continue
        if budget < 1:
            break
        budget -= 1
        free[dst] -= 1
        src = int(tier[i])
        if src in free:
            free[src] += 1
        out.append(Move(keys[i], _TIER[src], _TIER[dst], reason(i)))
    while budget > 0 and dem[HOT]:
        if not demote_one(HOT, voluntary=True):
            break
    # evictions move no data but each unlinks a record: oldest first, as many as migrations
    exp = np.flatnonzero(expired)
    if exp.size > max_moves:
        exp = exp[np.argsort(v.last_access[exp], kind="stable")[:max_moves]]
    evictions = tuple(Move(keys[i], Tier.COLD, None, Reason.TTL) for i in exp.tolist())
    return evictions + tuple(out)


# ------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------

class LRUPolicy(PlacementPolicy):
    """Baseline: least recently used idle blocks move down to keep head-room."""

    name = "lru"

    def plan(self, snapshot: Sequence[BlockInfo] | SnapshotView, heat: HeatMap,
             capacities: Capacities, now: float) -> Plan:
        v = _view(snapshot)
        p = self.params
        expired = _expired(v, now, p.cold_ttl_s)
        score = v.last_access
        target = v.tier.copy()
        for src, nxt, cap in ((HOT, WARM, capacities.hot), (WARM, COLD, capacities.warm)):
            keep = cap - _headroom(cap, p)
            members = np.flatnonzero(target == src)
            excess = members.size - keep
            if excess > 0:
                cand = members[~v.pinned[members] & ~v.in_use[members]]
                victims = cand[np.argsort(score[cand], kind="stable")][:excess]
                target[victims] = nxt
        moves = _build_moves(v, target, score, capacities, p.max_moves(capacities), {},
                             Reason.LRU, expired, 1.0, now - p.active_s)
        return Plan(moves, self.name, len(v))


def _headroom(cap: int, p: PolicyParams) -> int:
    return int(math.ceil(cap * p.headroom_fraction)) if cap >= 4 else 0


class HeatPolicy(PlacementPolicy):
    """Heat thresholds + capacity + hysteresis (see module docstring)."""

    name = "heat"

    def wants(self, v: SnapshotView, heat: HeatMap, rows: np.ndarray,
              now: float) -> dict[int, Want]:
        """Snapshot indices to raise regardless of heat (none for plain `heat`);
        `rows[i]` is the heat-map row of snapshot block i (-1: none)."""
        return {}

    def plan(self, snapshot: Sequence[BlockInfo] | SnapshotView, heat: HeatMap,
             capacities: Capacities, now: float) -> Plan:
        v = _view(snapshot)
        p = self.params
        n = len(v)
        if n == 0:
            return Plan((), self.name, 0)
        rows = heat.rows_of(v.keys)
        h = gather(heat.heat(), rows)
        tier = v.tier
        placed = tier != NONE
        mean = float(h[placed].mean()) if placed.any() else 0.0
        hot_thr, warm_thr = p.hot_factor * mean, p.warm_factor * mean
        bonus = np.float32(1.0 + p.hysteresis)
        expired = _expired(v, now, p.cold_ttl_s)

        wants = self.wants(v, heat, rows, now)
        want_hot = np.zeros(n, dtype=bool)
        want_warm = np.zeros(n, dtype=bool)
        reasons: dict[int, Reason] = {}
        for i, w in wants.items():
            if tier[i] == NONE or expired[i]:
                continue
            if w.tier is Tier.HOT:
                want_hot[i] = True
            else:
                want_warm[i] = True
            reasons[i] = w.reason

        fixed = ~placed | v.pinned
        target = tier.copy()
        free_pool = placed & ~fixed & ~expired
        forced_hot = free_pool & v.in_use  # being decoded: stays hot
        target[forced_hot] = HOT
        pool = free_pool & ~v.in_use

        # --- hot: forced, then prefetch wants, then heat-eligible, then idle incumbents
        h_hot = np.where(tier == HOT, h * bonus, h)
        fixed_hot = int(((tier == HOT) & fixed).sum()) + int(forced_hot.sum())
        room = capacities.hot - fixed_hot
        keep_room = room - _headroom(capacities.hot, p)
        group = np.zeros(n, dtype=np.int8)
        group[pool & (tier == HOT)] = 1
        group[pool & (h_hot >= hot_thr) & (h > 0)] = 2
        group[pool & want_hot] = 3
        order = np.lexsort((-h_hot, -group))
        # eligible blocks may use the head-room; idle incumbents only keep what is left of it
        strong = _take_top(order, group >= 2, room)
        weak = _take_top(order, group == 1, keep_room - strong.size)
        hot_set = np.zeros(n, dtype=bool)
        hot_set[strong] = True
        hot_set[weak] = True
        target[pool & hot_set] = HOT

        # --- warm: wants, heat-eligible, then displaced or idle incumbents of hot/warm
        rest = pool & ~hot_set
        h_warm = np.where((tier == WARM) | (tier == HOT), h * bonus, h)
        fixed_warm = int(((tier == WARM) & fixed).sum())
        room = capacities.warm - fixed_warm
        keep_room = room - _headroom(capacities.warm, p)
        group[:] = 0
        group[rest & ((tier == WARM) | (tier == HOT))] = 1
        group[rest & (h_warm >= warm_thr) & (h > 0)] = 2
        group[rest & (want_warm | want_hot)] = 3
        order = np.lexsort((-h_warm, -group))
        strong = _take_top(order, group >= 2, room)
        weak = _take_top(order, group == 1, keep_room - strong.size)
        warm_set = np.zeros(n, dtype=bool)
        warm_set[strong] = True
        warm_set[weak] = True
        target[rest & warm_set] = WARM
        target[rest & ~warm_set] = COLD

        score = h.astype(np.float64)
        # prefetch wishes rank above heat for promotion order
        for i in reasons:
            score[i] += 1e9
        moves = _build_moves(v, target, score, capacities, p.max_moves(capacities), reasons,
                             Reason.HEAT, expired, float(bonus), now - p.active_s)
        return Plan(moves, self.name, n, mean)


class HeatPrefetchPolicy(HeatPolicy):
    """`heat` plus the wants of a Prefetcher."""

    name = "heat+prefetch"

    def __init__(self, params: PolicyParams, prefetcher: object) -> None:
        super().__init__(params)
        self.prefetcher = prefetcher

    def wants(self, v: SnapshotView, heat: HeatMap, rows: np.ndarray,
              now: float) -> dict[int, Want]:
        by_key = self.prefetcher.wants(now)  # type: ignore[attr-defined]
        if not by_key:
            return {}
        inv = np.full(int(rows.max(initial=-1)) + 2, -1, dtype=np.int64)
        ok = rows >= 0
        inv[rows[ok]] = np.flatnonzero(ok)
        want_rows = heat.rows_of(list(by_key))
        out: dict[int, Want] = {}
        for w, r in zip(by_key.values(), want_rows.tolist()):
            if 0 <= r < inv.size - 1 and inv[r] >= 0:
                out[int(inv[r])] = w
        return out


POLICIES = ("lru", "heat", "heat+prefetch")


def make_policy(name: str, params: PolicyParams, prefetcher: object | None = None
                ) -> PlacementPolicy:
    """The policy named `name` (one of POLICIES)."""
    if name == "lru":
        return LRUPolicy(params)
    if name == "heat":
        return HeatPolicy(params)
    if name == "heat+prefetch":
        if prefetcher is None:
            raise ValueError("heat+prefetch needs a prefetcher")
        return HeatPrefetchPolicy(params, prefetcher)
    raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(POLICIES)}")
