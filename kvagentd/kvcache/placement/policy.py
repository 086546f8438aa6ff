"""Placement policies: pure functions from a round's view to an immutable `Plan`.

A round looks only at the blocks it has to decide about, never at every stored block: when the
hot or warm tier has less free room than its head-room (`headroom_fraction` of its capacity),
the service gathers candidates there (the store's least recently used idle blocks, a bounded
random sample of idle blocks and, in hot, the blocks used since hot was last short and the
last such round's runners-up) and the
policy picks which of them go down, and how far. Each policy ranks candidates by a score
(lowest leaves first) and demotes enough to restore the head-room plus a batch
(`batch_fraction`), so most rounds find nothing to do and a decision's cost is spread over a
batch. Candidates are rows of `AccessStats`; keys are looked up only for the blocks that move.

Policies (peers, selectable by `placement.policy`):
- `lru`: the least recently used idle blocks go down one tier (hot -> warm -> cold), as the
  store's own room-making would do; never promotes ahead of a request.
- `heat`: ranks by heat (`heat.py`); a hot victim ranked below what warm keeps goes straight to
  cold; in a round that makes room, promotes sampled warm blocks whose heat passes
  `hot_factor` x the mean heat looked at into the room beyond the head-room.
- `heat+prefetch`: `heat` plus the wants of a `Prefetcher` (predictive preload, co-access,
  neighbours), moved with the background I/O queue into free room.
- `reuse`: ranks by predicted reuse (`reuse_density`, LHD's hit density): the probability
  that the block is used again, from its category (the system prompt of its application) and
  use count, over the slot time it would hold: until then (from its own gaps or its
  category's) if it comes back, else as long as blocks stay in hot before placement moves them
  out (`AccessStats.hold_s`). A block whose rank is below
  what warm keeps goes straight to cold. This is admission control: a block used once, of an
  application whose blocks are rarely used twice, leaves hot first, however recent.
Pinned blocks and blocks in use are never moved (the store skips them: a plan is best effort);
cold TTL expiry is the store's (maintenance).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..base import BlockKey, Tier
from .base import CODE_OF, TIER_OF, Capacities, MoveBatch, Plan, Reason
from .heat import HeatMap
from .reuse import ReuseModel, reuse_density, reuse_model, reuse_tables
from .stats import AccessStats


@dataclass(frozen=True, slots=True)
class PolicyParams:
    hot_factor: float = 1.8  # heat: promote at >= hot_factor x the mean heat looked at
    warm_factor: float = 0.9  # heat: a hot victim below warm_factor x warm's mean goes to cold
    hysteresis: float = 0.2  # heat: a rising block must be this much hotter than the mean
    window_fraction: float = 0.25  # demotions (and promotions) per round <= this share of hot
    headroom_fraction: float = 0.03  # free share of hot / warm kept for foreground requests
    batch_fraction: float = 0.03  # demote at least this share of capacity when short
    sample: int = 64  # scoring policies: blocks of a tier drawn at random (at least)
    sample_per_victim: float = 2.0  # ... and per block to move out of hot
    warm_sample_per_victim: float = 1.0  # ... and per block to move out of warm
    lru_candidates: int = 32  # scoring policies: the store's least recently used ones
    carry_per_victim: float = 1.0  # ... and hot's runners-up of the last round, per victim

    def max_moves(self, caps: Capacities) -> int:
        return max(1, int(self.window_fraction * caps.hot))

    def headroom(self, cap: int) -> int:
        return int(math.ceil(cap * self.headroom_fraction)) if cap >= 4 else 0

    def batch(self, cap: int) -> int:
        return max(1, int(cap * self.batch_fraction))


@dataclass(frozen=True, slots=True)
class Candidates:
    """Blocks a round may move: `AccessStats` rows (scoring policies), or the store's own
    keys in its idle LRU order (`keys`, then `rows` is empty)."""

    rows: np.ndarray  # int64
    tier: np.ndarray  # int8 code of where each is (as far as placement knows)
    keys: Sequence[BlockKey] | None = None

    def __len__(self) -> int:
        return len(self.keys) if self.keys is not None else int(self.rows.shape[0])

    def without(self, rows: np.ndarray, stats: AccessStats) -> Candidates:
        """These candidates but `rows` (row-based candidates only)."""
        if self.keys is not None or rows.size == 0 or self.rows.size == 0:
            return self
        keep = stats.absent(self.rows, rows)
        if keep.all():
            return self
        return Candidates(self.rows[keep], self.tier[keep])

    def keys_at(self, stats: AccessStats, idx: np.ndarray) -> list[BlockKey]:
        if self.keys is not None:
            keys = self.keys
            return [keys[i] for i in idx.tolist()]
        return stats.keys_of(self.rows[idx])


NO_CANDIDATES = Candidates(np.zeros(0, np.int64), np.zeros(0, np.int8))

REASONS = tuple(Reason)  # `Wanted.reason` codes index this
_HEAT_CODE = REASONS.index(Reason.HEAT)


@dataclass(frozen=True, slots=True)
class Wanted:
    """Prefetch wishes by row: distinct `rows`, each with the tier code it is wished up to
    and the code of its reason (an index into `REASONS`)."""

    rows: np.ndarray  # int64
    tier: np.ndarray  # int8
    reason: np.ndarray  # int8

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def at(self, stats: AccessStats, rows: np.ndarray) -> np.ndarray:
        """The index of each of `rows` among the wishes (-1: not wished)."""
        if not len(self):
            return np.full(rows.shape[0], -1, dtype=np.int64)
        return stats.positions(rows, self.rows)


NO_WANTS = Wanted(np.zeros(0, np.int64), np.zeros(0, np.int8), np.zeros(0, np.int8))


@dataclass(frozen=True, slots=True)
class RoundView:
    """What one round knows: room per tier and the candidates it gathered."""

    now: float
    caps: Capacities
    free: Mapping[Tier, int]  # free slots of hot and warm
    victims: Mapping[Tier, Candidates]  # idle blocks of hot and of warm (tiers short of room)
    risers: Candidates = NO_CANDIDATES  # warm or cold blocks a policy may promote
    wanted: Wanted = NO_WANTS  # prefetch wishes, by row
    incoming: Mapping[Tier, int] = field(default_factory=dict)  # room the wishes need

    def need(self, tier: Tier, params: PolicyParams) -> int:
        """Blocks to move out of `tier` now (0 while its free room covers the head-room and
        the wished-for prefetches)."""
        cap = self.caps.of(tier)
        short = params.headroom(cap) - self.free.get(tier, 0) + self.incoming.get(tier, 0)
        return short + params.batch(cap) if short > 0 else 0


class PlacementPolicy(ABC):
    """One interface for every policy. `wants_sample`: whether candidates should include a
    random sample and the recently used blocks (scoring policies), not only the LRU tail."""

    name: str
    wants_sample = True
    uses_heat = False
    uses_prefetch = False

    def __init__(self, params: PolicyParams) -> None:
        self.params = params

    @abstractmethod
    def plan(self, view: RoundView, stats: AccessStats, heat: HeatMap | None) -> Plan:
        """The moves of this round (see module docstring)."""


# ------------------------------------------------------------------------------------------
# Shared machinery: scores -> ordered, capped batches
# ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Budget:
    left: int

    def take(self, idx: np.ndarray) -> np.ndarray:
        out = idx[:max(0, self.left)]
        self.left -= out.size
        return out


def _lowest(score: np.ndarray, n: int) -> np.ndarray:
    """Indices of the `n` lowest scores, lowest first (ties in index order); a partition,
    then a sort of only the `n` taken."""
    if n <= 0:
        return np.zeros(0, dtype=np.intp)
    if n >= score.size:
        return np.argsort(score, kind="stable")
    return _ranked(score, np.argpartition(score, n - 1)[:n])


def _ranked(score: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """`idx` (the `n` lowest, from a partition) lowest score first, ties in index order."""
    idx.sort()  # index order first, so the stable sort breaks ties by index
    out: np.ndarray = idx[np.argsort(score[idx], kind="stable")]
    return out


def _lowest_then(score: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """`_lowest(score, n)`, and the indices of the `m` scores ranked next (in no order): one
    partition at both ranks, so the `m` cost no sort."""
    k = min(n + m, score.size)
    if m <= 0 or k <= n:
        return _lowest(score, n), np.zeros(0, dtype=np.intp)
    if n <= 0:
        nxt = np.argpartition(score, k - 1)[:k] if k < score.size else np.arange(score.size)
        return np.zeros(0, dtype=np.intp), nxt
    kth = (n - 1, k - 1) if k < score.size else (n - 1,)
    part = np.argpartition(score, kth)
    return _ranked(score, part[:n]), part[n:k]


def _batch(stats: AccessStats, c: Candidates, idx: np.ndarray, src: Tier, dst: Tier,
           reason: Reason) -> list[MoveBatch]:
    if idx.size == 0:
        return []
    rows = c.rows[idx] if c.keys is None else None
    return [MoveBatch(tuple(c.keys_at(stats, idx)), src, dst, reason, rows)]


class Demotions(NamedTuple):
    batches: list[MoveBatch]
    runners_up: np.ndarray | None  # hot's candidates ranked next after its victims (rows)


def _demotions(view: RoundView, stats: AccessStats, p: PolicyParams,
               score: Mapping[Tier, np.ndarray], reason: Reason, budget: _Budget, *,
               direct_to_cold: bool, cold_below: float | None = None) -> Demotions:
    """Demote the lowest-scored candidates until hot and warm have their head-room back.

    Hot victims go to warm; warm makes room for them and for its own head-room by sending its
    lowest-scored candidates to cold. With `direct_to_cold`, hot victims compete with warm's
    candidates for warm's slots, and those that lose go straight to cold; with `cold_below`,
    hot victims scored below it go straight to cold. Order: everything bound for cold first,
    then hot -> warm, so every step fits.

    Hot's runners-up (row candidates only): the `carry_per_victim` x its need candidates
    ranked next after the victims that move. A sample finds a low-ranked block once; carried
    to the next round, it is compared with that round's candidates too, so each round chooses
    from more than its own sample (Redis's eviction pool), for a few hundred rows scored
    again."""
    hot = view.victims.get(Tier.HOT, NO_CANDIDATES)
    warm = view.victims.get(Tier.WARM, NO_CANDIDATES)
    s_hot = score.get(Tier.HOT, np.zeros(0))
    s_warm = score.get(Tier.WARM, np.zeros(0))
    need = view.need(Tier.HOT, p)
    n_hot = min(need, len(hot))
    carry = int(p.carry_per_victim * need) if hot.keys is None else 0
    ranked, after = _lowest_then(s_hot, n_hot, carry)
    v_hot = budget.take(ranked)
    runners = hot.rows[np.concatenate([ranked[v_hot.size:], after])] if carry else None
    # warm room: its head-room once the hot victims have arrived
    cap_w = view.caps.warm
    short_w = (p.headroom(cap_w) + v_hot.size - view.free.get(Tier.WARM, 0)
               + view.incoming.get(Tier.WARM, 0))
    n_warm = short_w + p.batch(cap_w) if short_w > 0 else 0
    out = np.zeros(v_hot.size, dtype=bool)  # hot victims that go straight to cold
    if cold_below is not None:
        out = s_hot[v_hot] < cold_below
    if direct_to_cold and n_warm > 0 and v_hot.size:
        s = np.concatenate([s_warm, s_hot[v_hot]])
        order = _lowest(s, n_warm)
        from_warm = order[order < len(warm)]
        out[order[order >= len(warm)] - len(warm)] = True
    elif cold_below is not None:
        from_warm = _lowest(s_warm, n_warm - int(out.sum()))
    else:
        from_warm = _lowest(s_warm, n_warm)
    from_warm = budget.take(from_warm)
    # what warm cannot take (budget spent, or no candidates to free its room) goes to cold
    room_w = view.free.get(Tier.WARM, 0) + from_warm.size
    rest = v_hot[~out]
    to_warm = rest[:max(0, room_w)]
    hot_to_cold = np.concatenate([v_hot[out], rest[max(0, room_w):]])
    return Demotions(_batch(stats, warm, from_warm, Tier.WARM, Tier.COLD, reason)
                     + _batch(stats, hot, hot_to_cold, Tier.HOT, Tier.COLD, reason)
                     + _batch(stats, hot, to_warm, Tier.HOT, Tier.WARM, reason), runners)


def _promotions(view: RoundView, stats: AccessStats, p: PolicyParams, eligible: np.ndarray,
                score: np.ndarray, reasons: np.ndarray, dst: np.ndarray, budget: _Budget,
                demoted: list[MoveBatch]) -> list[MoveBatch]:
    """Promote eligible risers, best score first, into the room beyond the head-room that is
    free once `demoted` has run (a promotion never displaces a block by itself). `reasons`:
    each riser's reason code (an index into `REASONS`); `dst`: the tier code it would rise to.
    In score order a riser is taken while its tier has room and the budget lasts (one numpy
    pass: the room a riser finds is its rank among the earlier ones bound for its tier)."""
    room = {t: view.free.get(t, 0) - p.headroom(view.caps.of(t)) for t in (Tier.HOT, Tier.WARM)}
    for b in demoted:
        room[b.src] = room.get(b.src, 0) + len(b)
        if b.dst in room:
            room[b.dst] -= len(b)
    r = view.risers
    order = np.flatnonzero(eligible)[np.argsort(-score[eligible], kind="stable")]
    order = order[dst[order] < r.tier[order]]  # only up (codes follow the tiers' order)
    if order.size == 0 or budget.left < 1:
        return []
    d = dst[order]
    take = np.zeros(order.size, dtype=bool)
    for t in (Tier.HOT, Tier.WARM):
        mine = np.flatnonzero(d == CODE_OF[t])
        take[mine[:max(0, room[t])]] = True
    order = order[take][:budget.left]
    budget.left -= order.size
    # one batch per (from, to, reason), in the order each first appears
    key = (r.tier[order].astype(np.int64) * 16 + dst[order]) * 256 + reasons[order]
    _, first = np.unique(key, return_index=True)
    out = []
    for i in np.sort(first).tolist():
        rr = r.rows[order[key == key[i]]]
        out.append(MoveBatch(tuple(stats.keys_of(rr)), TIER_OF[int(r.tier[order[i]])],
                             TIER_OF[int(dst[order[i]])], REASONS[int(reasons[order[i]])], rr))
    return out


# ------------------------------------------------------------------------------------------
# Scores
# ------------------------------------------------------------------------------------------

def _heat_of(heat: HeatMap | None, stats: AccessStats, rows: np.ndarray) -> np.ndarray:
    assert heat is not None, "heat policies keep a heat map"
    return heat.heat(rows, stats.tick).astype(np.float64)


# ------------------------------------------------------------------------------------------
# Policies
# ------------------------------------------------------------------------------------------

def _considered(view: RoundView) -> int:
    return sum(len(c) for c in view.victims.values()) + len(view.risers)


class LRUPolicy(PlacementPolicy):
    """Baseline: the least recently used idle blocks go down one tier to keep head-room."""

    name = "lru"
    wants_sample = False

    def plan(self, view: RoundView, stats: AccessStats, heat: HeatMap | None) -> Plan:
        budget = _Budget(self.params.max_moves(view.caps))
        score = {t: np.arange(len(c), dtype=np.float64) for t, c in view.victims.items()}
        moves = _demotions(view, stats, self.params, score, Reason.LRU, budget,
                           direct_to_cold=False).batches
        return Plan(tuple(moves), self.name, _considered(view))


class ReusePolicy(PlacementPolicy):
    """Predicted reuse decides what leaves hot and warm (see module docstring)."""

    name = "reuse"

    def __init__(self, params: PolicyParams, model: ReuseModel = reuse_model) -> None:
        super().__init__(params)
        self.model = model

    def plan(self, view: RoundView, stats: AccessStats, heat: HeatMap | None) -> Plan:
        budget = _Budget(self.params.max_moves(view.caps))
        # one density call over every candidate: its cost is mostly per call, not per row
        tiers = list(view.victims)
        rows = [view.victims[t].rows for t in tiers]
        if not rows:
            return Plan((), self.name)
        dens = reuse_density(stats, np.concatenate(rows) if len(rows) > 1 else rows[0],
                             view.now, reuse_tables(stats), stats.hold_s, model=self.model)
        score, at = {}, 0
        for t, r in zip(tiers, rows):  # each tier's share of `dens`, as views
            score[t], at = dens[at:at + r.size], at + r.size
        moves, runners = _demotions(view, stats, self.params, score, Reason.REUSE, budget,
                                    direct_to_cold=True)
        return Plan(tuple(moves), self.name, _considered(view), runners)


class HeatPolicy(PlacementPolicy):
    """Heat decides what leaves hot and warm, and which warm blocks come up."""

    name = "heat"
    uses_heat = True

    def plan(self, view: RoundView, stats: AccessStats, heat: HeatMap | None) -> Plan:
        p = self.params
        budget = _Budget(p.max_moves(view.caps))
        score = {t: _heat_of(heat, stats, c.rows) for t, c in view.victims.items()}
        r = view.risers
        h = _heat_of(heat, stats, r.rows)
        seen = np.concatenate([h, *score.values()])
        mean = float(seen.mean()) if seen.size else 0.0
        s_warm = score.get(Tier.WARM)
        # below what warm keeps (warm_factor x the mean heat of warm's candidates): cold
        bar = p.warm_factor * float(s_warm.mean()) if s_warm is not None and s_warm.size else None
        moves, runners = _demotions(view, stats, p, score, Reason.HEAT, budget,
                                    direct_to_cold=False, cold_below=bar)
        hot_enough = (h >= p.hot_factor * mean * (1.0 + p.hysteresis)) & (h > 0)
        at = view.wanted.at(stats, r.rows)
        wanted = at >= 0
        reasons = np.full(at.size, _HEAT_CODE, dtype=np.int8)  # risen by heat, to hot ...
        dst = np.full(at.size, CODE_OF[Tier.HOT], dtype=np.int8)
        reasons[wanted] = view.wanted.reason[at[wanted]]  # ... or wished for, as wished
        dst[wanted] = view.wanted.tier[at[wanted]]
        # prefetch wishes rank above heat
        # promotions have a budget of their own: a round that makes room for wished-for
        # blocks also brings them up
        moves += _promotions(view, stats, p, wanted | hot_enough, h + np.where(wanted, 1e9, 0.0),
                             reasons, dst, _Budget(p.max_moves(view.caps)), moves)
        return Plan(tuple(moves), self.name, _considered(view), runners)


class HeatPrefetchPolicy(HeatPolicy):
    """`heat` plus the wants of a Prefetcher: wished blocks rise first, to the wished tier."""

    name = "heat+prefetch"
    uses_prefetch = True


POLICIES = ("lru", "heat", "heat+prefetch", "reuse")


def make_policy(name: str, params: PolicyParams) -> PlacementPolicy:
    """The policy named `name` (one of POLICIES)."""
    kinds: dict[str, type[PlacementPolicy]] = {
        "lru": LRUPolicy, "heat": HeatPolicy, "heat+prefetch": HeatPrefetchPolicy,
        "reuse": ReusePolicy}
    kind = kinds.get(name)
    if kind is None:
        raise ValueError(f"unknown placement policy {name!r}; known: {', '.join(POLICIES)}")
    return kind(params)
