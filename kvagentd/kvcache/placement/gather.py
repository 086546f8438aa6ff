"""What a placement round looks at: free room per tier and, where a tier is short of its
head-room, the candidates to move (bounded: the blocks that entered it since, a sample, a
few of the store's least recently used ones and, in hot, the last plan's runners-up), never
every stored block."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..base import BlockKey, Tier
from .base import CODE_OF, TIER_OF, Capacities, PlacementStore
from .policy import (NO_CANDIDATES, NO_WANTS, REASONS, Candidates, PlacementPolicy, RoundView,
                     Wanted)
from .prefetch import Prefetcher, Wish
from .stats import AccessStats, sorted_unique

POOL_TIERS = (Tier.HOT, Tier.WARM)
_REASON_CODE = {r: i for i, r in enumerate(REASONS)}


class WishRows:
    """The rows of the prefetcher's wishes, round after round. A session's wish names its last
    request's keys, the same tuple every round until its next request: the rows found for it
    are remembered while the tuple is the same and none of them has been freed since (row
    generations), so a round looks keys up only for wishes that are new."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[tuple[BlockKey, ...], int, np.ndarray, np.ndarray]] = {}
        self._last: tuple[list[Wish], Wanted, np.ndarray] | None = None  # a round's answer
        # the wishes as of the last round that looked, if none of them was left to raise
        self.settled: Wanted | None = NO_WANTS

    def still(self, stats: AccessStats, wishes: Sequence[Wish]) -> bool:
        """`wishes` are those of the last round that looked and found none left to raise,
        naming the same rows (no key is looked up: the accesses since need not be recorded)."""
        if not wishes:
            return self.settled is NO_WANTS
        last = self._repeated(stats, wishes)
        return last is not None and self.settled is last

    def __call__(self, stats: AccessStats, wishes: Sequence[Wish]) -> Wanted:
        if not wishes:
            self._memo, self._last = {}, None
            return NO_WANTS
        last = self._repeated(stats, wishes)
        if last is not None:
            return last  # the wishes of the round before, rows unchanged
        memo: dict[str, tuple[tuple[BlockKey, ...], int, np.ndarray, np.ndarray]] = {}
        for w in wishes:
            m = self._memo.get(w.session)
            if m is None or m[0] is not w.keys or m[1] != w.last \
                    or (stats.gen[m[2]] != m[3]).any():  # a row freed since: look up again
                rows = stats.ensure_rows(w.wished)
                m = (w.keys, w.last, rows, stats.gen[rows])
            memo[w.session] = m
        self._memo = memo  # sessions no longer wished are forgotten
        sizes = [memo[w.session][2].size for w in wishes]
        rows = np.concatenate([memo[w.session][2] for w in wishes])
        tier = np.repeat(np.array([CODE_OF[w.want.tier] for w in wishes], np.int8), sizes)
        why = np.repeat(np.array([_REASON_CODE[w.want.reason] for w in wishes], np.int8), sizes)
        idx = stats.firsts(rows)  # where groups share a block, the first group's wish holds
        out = Wanted(rows[idx], tier[idx], why[idx])
        self._last = (list(wishes), out, stats.gen[out.rows])
        return out

    def _repeated(self, stats: AccessStats, wishes: Sequence[Wish]) -> Wanted | None:
        """The last answer, when `wishes` are the same as then and its rows were not freed."""
        last = self._last
        if last is None or not _same(last[0], wishes) \
                or not (stats.gen[last[1].rows] == last[2]).all():
            return None
        return last[1]


def _same(a: Sequence[Wish], b: Sequence[Wish]) -> bool:
    """The same wishes, naming the same key tuples and wants (objects, not equal contents:
    a cheap test, and a miss only costs a lookup)."""
    return len(a) == len(b) and all(
        x.keys is y.keys and x.want is y.want and x.last == y.last and x.session == y.session
        for x, y in zip(a, b))


class Gatherer:
    """Builds a round's `RoundView` for `policy` (a few questions to the store, the rest from
    placement's own `AccessStats`). One serves round after round while the policy and the
    capacities stay the same: `begin` starts a round."""

    def __init__(self, store: PlacementStore, stats: AccessStats, policy: PlacementPolicy,
                 prefetcher: Prefetcher, rng: np.random.Generator, caps: Capacities,
                 wish_rows: WishRows | None = None) -> None:
        self.store, self.stats, self.policy = store, stats, policy
        self.prefetcher, self.rng, self.caps = prefetcher, rng, caps
        self.wish_rows = wish_rows if wish_rows is not None else WishRows()
        self._wishes: list[Wish] | None = None  # this round's, once asked for
        self._room: dict[Tier, int] | None = None  # free room per tier, as `roomy` found it
        self._runners_up = np.zeros(0, np.int64)  # hot's, from the last plan that ranked it
        p = policy.params
        self._head = (p.headroom(caps.hot), p.headroom(caps.warm))  # fixed for a gatherer

    def begin(self) -> None:
        """A new round: forget the last one's wishes and free room."""
        self._wishes = None
        self._room = None

    def carry(self, rows: np.ndarray | None) -> None:
        """Hot's runners-up of the plan just made (`Plan.runners_up`): candidates again the
        next time hot is short (None: the plan did not rank hot; the last ones wait)."""
        if rows is not None:
            self._runners_up = rows

    def roomy(self, now: float) -> bool:
        """True when hot and warm have their head-room and no prefetch wish waits to be looked
        at (the wishes are those of a round that found none of them left to raise): the common
        round, decided with a few questions to the store. (`heat` promotes its risers in the
        rounds that make room, into the room they make.)"""
        if self.policy.uses_prefetch:
            self._wishes = self.prefetcher.wishes(now)
            if not self.wish_rows.still(self.stats, self._wishes):
                return False
        self._room = room = {t: self.store.pool(t).num_free for t in POOL_TIERS}
        return room[Tier.HOT] >= self._head[0] and room[Tier.WARM] >= self._head[1]

    def view(self, now: float) -> RoundView:
        """Free room per tier and, where it is short of its head-room (counting the room that
        wished-for prefetches need), the candidates."""
        p = self.policy.params
        caps = self.caps
        free = self._room if self._room is not None else {t: self.store.pool(t).num_free
                                                          for t in POOL_TIERS}
        risers = NO_CANDIDATES
        wanted = NO_WANTS
        incoming = {Tier.HOT: 0, Tier.WARM: 0}
        if self.policy.uses_heat:
            rows = self.stats.sample(CODE_OF[Tier.WARM], p.sample, self.rng, draws=4 * p.sample)
            if self.policy.uses_prefetch:
                if self._wishes is None:
                    self._wishes = self.prefetcher.wishes(now)
                wanted = self.wish_rows(self.stats, self._wishes)
            risers = self._risers(np.concatenate([rows, wanted.rows]))
            at = wanted.at(self.stats, risers.rows)
            up = at >= 0
            self.wish_rows.settled = None if up.any() else wanted
            code = wanted.tier[at[up]]
            code = code[code < risers.tier[up]]  # wished above where it is
            for t in POOL_TIERS:
                incoming[t] = int(np.count_nonzero(code == CODE_OF[t]))
            # room is made for at most a batch of wishes a round: a prediction is a guess
            incoming = {t: min(n, p.batch(caps.of(t))) for t, n in incoming.items()}
        short = {t: p.headroom(caps.of(t)) - free[t] + incoming[t] for t in POOL_TIERS}
        victims: dict[Tier, Candidates] = {}
        for t in POOL_TIERS:
            # warm is looked at as well when hot is short: hot's victims need its room
            if short[t] <= 0 and not (t is Tier.WARM and short[Tier.HOT] > 0):
                continue
            own = max(0, short[t]) + p.batch(caps.of(t))
            need = own + (short[Tier.HOT] + p.batch(caps.hot)
                          if t is Tier.WARM and short[Tier.HOT] > 0 else 0)
            victims[t] = self._victims(t, need, own)
        if len(victims) == 2 and self.policy.wants_sample:
            # a block placement believes in hot that the store has in warm is nobody's this round
            both = self.stats.common(victims[Tier.HOT].rows, victims[Tier.WARM].rows)
            if both.size:
                victims = {t: c.without(both, self.stats) for t, c in victims.items()}
        # not candidates: risers (the store's word over placement's belief) and blocks wished
        # for, while the wish lasts (else the next round raises them again: a loop that moves
        # bytes for nothing)
        keep_up = np.concatenate([risers.rows, wanted.rows])
        if keep_up.size:
            victims = {t: c.without(keep_up, self.stats) for t, c in victims.items()}
        self.stats.trim_arrived(4 * (caps.hot + caps.warm))
        return RoundView(now, caps, free, victims, risers, wanted, incoming)

    def _victims(self, tier: Tier, need: int, own: int) -> Candidates:
        """Blocks of `tier` that may go down. `lru`: the store's `need` least recently used
        idle ones, in that order. Scoring policies, all numpy, no key looked up but the store's
        `lru_candidates` least recently used ones: those, a uniform sample of the blocks
        placement believes are in `tier` and, in hot, the blocks that entered it since it was
        last short (brought in by their use) and the last plan's runners-up (`carry`) that
        placement still believes are there. Hot's sample is `sample_per_victim` per block of
        its own shortfall `own` (for hot, its `need`); warm's `warm_sample_per_victim`. The
        blocks that enter warm are hot's victims, already ranked low: scoring them again as
        warm candidates (the earlier design) found no better victims, the same hits for more
        bytes moved (BENCHMARKS.md); a hot victim that finds no room in warm goes to cold.
        A block that has moved since placement last looked costs a planned move that the store
        skips (it moves only idle blocks of the tier they are in)."""
        p = self.policy.params
        code = CODE_OF[tier]
        if not self.policy.wants_sample:
            keys = self.store.least_recent_idle(tier, need)
            return Candidates(np.zeros(0, np.int64), np.full(len(keys), code, np.int8), keys)
        lru = self.stats.ensure_rows(self.store.least_recent_idle(tier, p.lru_candidates))
        self.stats.believe(lru, code)
        per = p.sample_per_victim if tier is Tier.HOT else p.warm_sample_per_victim
        parts = [lru, self.stats.sample_tier(code, max(p.sample, int(per * own)), self.rng)]
        if tier is Tier.HOT:
            arrived = self.stats.take_arrived(code)
            runners, self._runners_up = self._runners_up, np.zeros(0, np.int64)
            both = np.concatenate([arrived, runners])  # a freed row's tier is NONE
            parts.append(both[self.stats.tier[both] == code])
        rows = self.stats.distinct(np.concatenate(parts))
        return Candidates(rows, np.full(rows.size, code, np.int8))

    def _risers(self, rows: np.ndarray) -> Candidates:
        """The idle warm or cold ones of `rows`, as the store says (bounded: a sample and the
        prefetch wishes)."""
        rows = sorted_unique(rows)
        rows = rows[self.stats.live[rows]]  # the rows of blocks placement still knows
        st = self.store.block_states(self.stats.keys_of(rows))
        present = np.bincount(st.tier[st.known], minlength=len(TIER_OF) + 1)
        for code in np.flatnonzero(present).tolist():
            self.stats.believe(rows[st.known & (st.tier == code)], code)
        ok = st.idle & ((st.tier == CODE_OF[Tier.WARM]) | (st.tier == CODE_OF[Tier.COLD]))
        return Candidates(rows[ok], st.tier[ok])
