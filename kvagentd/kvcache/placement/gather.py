"""What a placement round looks at: free room per tier and, where a tier is short of its
head-room, the candidates to move (bounded: the blocks that entered it since, a sample and a
few of the store's least recently used ones), never every stored block."""

from __future__ import annotations

import numpy as np

from ..base import Tier
from .base import CODE_OF, TIER_OF, Capacities, PlacementStore, Want
from .policy import NO_CANDIDATES, Candidates, PlacementPolicy, RoundView, wants_by_row
from .prefetch import Prefetcher
from .stats import AccessStats, sorted_unique

POOL_TIERS = (Tier.HOT, Tier.WARM)


class Gatherer:
    """Builds one round's `RoundView` for `policy` (a few questions to the store, the rest
    from placement's own `AccessStats`)."""

    def __init__(self, store: PlacementStore, stats: AccessStats, policy: PlacementPolicy,
                 prefetcher: Prefetcher, rng: np.random.Generator, caps: Capacities) -> None:
        self.store, self.stats, self.policy = store, stats, policy
        self.prefetcher, self.rng, self.caps = prefetcher, rng, caps

    def roomy(self) -> bool:
        """True when hot and warm have their head-room and no prefetch wishes wait to be
        looked at: the common round, decided with two questions to the store. (`heat`
        promotes its risers in the rounds that make room, into the room they make.)"""
        if self.policy.uses_prefetch:
            return False
        caps = self.caps
        p = self.policy.params
        return (self.store.pool(Tier.HOT).num_free >= p.headroom(caps.hot)
                and self.store.pool(Tier.WARM).num_free >= p.headroom(caps.warm))

    def view(self, now: float) -> RoundView:
        """Free room per tier and, where it is short of its head-room (counting the room that
        wished-for prefetches need), the candidates."""
        p = self.policy.params
        caps = self.caps
        free = {t: self.store.pool(t).num_free for t in POOL_TIERS}
        risers = NO_CANDIDATES
        wants: dict[int, Want] = {}
        wanted = np.zeros(0, dtype=np.int64)  # their rows
        incoming = {Tier.HOT: 0, Tier.WARM: 0}
        if self.policy.uses_heat:
            rows = self.stats.sample(CODE_OF[Tier.WARM], p.sample, self.rng, draws=4 * p.sample)
            if self.policy.uses_prefetch:
                wants = wants_by_row(self.stats, self.prefetcher.wants(now))
            wanted = np.fromiter(wants, np.int64, len(wants))
            risers = self._risers(np.concatenate([rows, wanted]))
            for r, code in zip(risers.rows.tolist(), risers.tier.tolist()):
                w = wants.get(r)
                if w is not None and CODE_OF[w.tier] < code:
                    incoming[w.tier] += 1
            # room is made for at most a batch of wishes a round: a prediction is a guess
            incoming = {t: min(n, p.batch(caps.of(t))) for t, n in incoming.items()}
        short = {t: p.headroom(caps.of(t)) - free[t] + incoming[t] for t in POOL_TIERS}
        victims: dict[Tier, Candidates] = {}
        for t in POOL_TIERS:
            # warm is looked at as well when hot is short: hot's victims need its room
            if short[t] <= 0 and not (t is Tier.WARM and short[Tier.HOT] > 0):
                continue
            need = max(0, short[t]) + p.batch(caps.of(t))
            if t is Tier.WARM and short[Tier.HOT] > 0:
                need += short[Tier.HOT] + p.batch(caps.hot)
            victims[t] = self._victims(t, need)
        if len(victims) == 2 and self.policy.wants_sample:
            # a block placement believes in hot that the store has in warm is nobody's this round
            both = self.stats.common(victims[Tier.HOT].rows, victims[Tier.WARM].rows)
            if both.size:
                victims = {t: c.without(both, self.stats) for t, c in victims.items()}
        # not candidates: risers (the store's word over placement's belief) and blocks wished
        # for, while the wish lasts (else the next round raises them again: a loop that moves
        # bytes for nothing)
        keep_up = np.concatenate([risers.rows, wanted])
        if keep_up.size:
            victims = {t: c.without(keep_up, self.stats) for t, c in victims.items()}
        self.stats.trim_arrived(4 * (caps.hot + caps.warm))
        return RoundView(now, caps, free, victims, risers, wants, incoming)

    def _victims(self, tier: Tier, need: int) -> Candidates:
        """Blocks of `tier` that may go down. `lru`: the store's `need` least recently used
        idle ones, in that order. Scoring policies: the blocks that entered the tier since it
        was last short (hot: brought in by their use; warm: demoted there by placement), a
        uniform sample of the blocks placement believes are there (in proportion to `need`)
        and a few of the store's least recently used ones; all numpy, no key is looked up. A
        block that has moved since placement last looked costs a planned move that the store
        skips (it moves only idle blocks of the tier they are in)."""
        p = self.policy.params
        code = CODE_OF[tier]
        if not self.policy.wants_sample:
            keys = self.store.least_recent_idle(tier, need)
            return Candidates(np.zeros(0, np.int64), np.full(len(keys), code, np.int8), keys)
        lru = self.stats.ensure_rows(self.store.least_recent_idle(tier, p.lru_candidates))
        self.stats.believe(lru, code)
        sample = self.stats.sample_tier(code, max(p.sample, int(p.sample_per_victim * need)),
                                        self.rng)
        arrived = self.stats.take_arrived(code)
        rows = self.stats.distinct(
            np.concatenate([lru, sample, arrived[self.stats.tier[arrived] == code]]))
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
