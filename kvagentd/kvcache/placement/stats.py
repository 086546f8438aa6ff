"""What placement remembers of the blocks it has seen used: dense numpy columns by row.

A dict maps block key -> row and a free list recycles rows; everything else is a column, so
recording an access event costs one dict lookup per block plus a few vectorized updates, and a
round reads the columns of the rows it looks at. What a round reads of a candidate is one
32-byte record per row (`ROW`, `records`), the columns of those names views of it: a round's
few thousand rows cost a cache miss each, not one per column (at a million rows the columns
are far larger than the caches). Per row:
- `last_t`, `last_tick`, `count`: when, at which event, and how often it was used;
- `gap_mu`, `gap_var`, `gaps`: an exponentially smoothed mean and variance of the log of the
  time between its uses (seconds), and how many gaps it has seen. A block used for the first
  time inherits them from the deepest block of the same request that was used before, when
  its session created that one (its session's history: a conversation's new blocks come back
  when its older ones do), and counts that block's uses as its own (`base`): a block new in a
  conversation's tenth turn is as likely to come back as the conversation;
- `cat`: its category, the first block of the request that first used it (the system prompt
  of its application); `tier`: where placement believes it is (as of its own last look).

Per category and use count (1, 2, 3 or more, `base` included) the table counts how many
blocks reached that count and how many were used again after it (`reuse_odds`), and per category the mean and
variance of log gaps: a block's reuse is predicted from its own gaps when it has some, from
its category otherwise. Counts are halved every `decay_every` block accesses, so the model
follows a changing workload.

Per session: the time and keys of its last request and a decayed use score (the persisted
summary of the hottest sessions, `summary.py`). Not thread-safe: placement's own thread owns it.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

import numpy as np

from ..base import BlockKey
from .base import HOT, NONE, WARM
from .feed import Access

CLASSES = 3  # use-count classes: 1, 2, 3 or more
ROW = np.dtype([("last_t", np.float64), ("gap_mu", np.float32), ("gap_var", np.float32),
                ("count", np.int32), ("base", np.int32), ("cat", np.int32), ("gaps", np.int32)])
"""A row's record: when it was last used, its smoothed log gaps, uses (its own and its
session's history), category and gaps seen. Where placement believes the row is (`tier`) and
whether it holds a block (`live`) are byte columns of their own: sampling, arrivals and
liveness checks read only them, 1 byte a row where a record's field would cost a cache line."""
OTHER = 0  # the category of blocks whose root did not fit `max_categories`
_GAPS_MAX = 1 << 30
_COUNT_MAX = 1 << 30


def sorted_unique(rows: np.ndarray) -> np.ndarray:
    """`np.unique` of a 1-d integer array: a sort and a neighbour compare (numpy 2's
    hash-based `unique` costs about 8x as much on a round's thousand rows)."""
    if rows.size < 2:
        return rows.copy()
    s = np.sort(rows)
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    out: np.ndarray = s[keep]
    return out


@dataclass(slots=True)
class SessionRecord:
    last_t: float
    score: float  # uses (blocks touched), decayed with `SESSION_TAU_S`
    keys: tuple[BlockKey, ...]  # the blocks of its last request (at most `session_keys`)


SESSION_TAU_S = 3600.0
HOLD_ALPHA = 0.2  # smoothing of `hold_s` per round that moved blocks out of hot


class Recorded(NamedTuple):
    """A batch of recorded access events, flattened: one entry per block access."""

    rows: np.ndarray  # int64 row of each access, in event order
    prev_tier: np.ndarray  # int8 tier code the block had (as placement believed) before it
    ticks: np.ndarray  # int64 tick of the event of each access
    offsets: np.ndarray  # int64: event i's accesses are [offsets[i], offsets[i + 1])


class AccessStats:
    def __init__(self, capacity: int = 1024, *, max_sessions: int = 4096,
                 max_categories: int = 256, session_keys: int = 1024, alpha: float = 0.3,
                 min_gap_s: float = 0.25, decay_every: int = 1 << 16,
                 prior_gap_s: float = 300.0, prior_sigma: float = 1.5) -> None:
        cap = max(16, capacity)
        self.alpha = alpha
        self.min_gap_s = min_gap_s
        self.decay_every = decay_every
        self.max_sessions = max_sessions
        self.max_categories = max(2, max_categories)
        self.session_keys = session_keys
        # what a round reads of a candidate, one 32-byte record per row (`ROW`): a round's few
        # thousand rows cost one cache miss each (`take`), not one per column; the attributes
        # of the same names are views of it
        self.rec = np.zeros(cap, dtype=ROW)
        self._bind()
        self.tier = np.zeros(cap, dtype=np.int8)  # NONE: where placement believes it is
        self.live = np.zeros(cap, dtype=bool)  # the row holds a block
        self.last_tick = np.zeros(cap, dtype=np.int64)
        self.owner = np.zeros(cap, dtype=np.int64)  # hash of the session that first used it
        self.raised = np.zeros(cap, dtype=np.int8)  # tier a prefetch raised it to, until used
        self.gen = np.zeros(cap, dtype=np.int32)  # bumped when the row is freed (for memos)
        self._scratch = np.zeros(cap, dtype=np.int64)  # for `distinct` / `common`
        self.keys = np.full(cap, None, dtype=object)  # row -> its block key (None: free)
        self.index: dict[BlockKey, int] = {}
        self._free: list[int] = list(range(cap - 1, -1, -1))
        self.high = 0  # rows [0, high) have been used
        self.tick = 0  # events recorded
        self.accesses = 0  # block accesses recorded
        self._since_decay = 0
        # rows that entered hot (by their use or a promotion) since hot was last looked at for
        # victims, each once (`_pending`)
        self._arrived: list[np.ndarray] = []
        self._arrived_n = 0
        self._pending = np.zeros(cap, dtype=bool)
        # rows believed in hot / in warm, for uniform sampling (entries that left are skipped)
        self._member = {HOT: np.zeros(cap, dtype=bool), WARM: np.zeros(cap, dtype=bool)}
        self._members = {HOT: np.zeros(1024, dtype=np.int64), WARM: np.zeros(1024, dtype=np.int64)}
        self._mlen = {HOT: 0, WARM: 0}
        self._cursor = 0
        self._pool = np.zeros(0, dtype=np.int64)  # random integers for `sample_tier`
        self._pool_at = 0
        self.sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self.categories: dict[BlockKey, int] = {}
        nc = self.max_categories
        self.reached = np.zeros((nc, CLASSES + 1), dtype=np.float64)
        self.reused = np.zeros((nc, CLASSES + 1), dtype=np.float64)
        self._reached_flat = self.reached.reshape(-1)  # views, for add.at
        self._reused_flat = self.reused.reshape(-1)
        self.cat_n = np.zeros(nc, dtype=np.float64)
        self.cat_lg = np.zeros(nc, dtype=np.float64)
        self.cat_lg2 = np.zeros(nc, dtype=np.float64)
        self.prior_mu = math.log(prior_gap_s)
        self.prior_var = prior_sigma * prior_sigma
        # how long a block stays in hot before placement moves it out (seconds since its last
        # use, smoothed over rounds); None until placement has moved one (see `note_left_hot`)
        self.hold_s: float | None = None
        # what became of the blocks prefetches raised: used before placement moved them down
        # (or forgot them), or not
        self.prefetch_raised = 0
        self.prefetch_used = 0
        self.prefetch_wasted = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """About what placement's memory of blocks takes: its arrays, the key -> row dict and
        the 16-byte keys it refers to (objects the store may share: an upper bound)."""
        arrays = [self.rec, self.tier, self.live, self.last_tick, self.owner, self.raised,
                  self.gen, self._scratch, self.keys, self._pending, *self._member.values(),
                  *self._members.values(), self._pool]
        keys = len(self.index) * (sys.getsizeof(b"") + 16)  # 16-byte block keys
        return sum(int(a.nbytes) for a in arrays) + sys.getsizeof(self.index) + keys

    # ------------------------------------------------------------------ recording
    def record(self, events: Sequence[Access]) -> Recorded:
        """Access events in order (one tick each), as one vectorized update.

        A block used several times within the batch learns from the mean of its gaps there (one
        smoothing step); its counts, last use and tier follow every use."""
        ne = len(events)
        lens = np.fromiter((len(e.keys) for e in events), np.int64, ne)
        offsets = np.zeros(ne + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        ticks_ev = self.tick + np.arange(ne, dtype=np.int64)
        self.tick += ne
        n = int(offsets[-1])
        if n == 0:
            return Recorded(np.zeros(0, np.int64), np.zeros(0, np.int8),
                            np.zeros(0, np.int64), offsets)
        keys = [k for e in events for k in e.keys]
        ev = np.repeat(np.arange(ne), lens)
        t = np.fromiter((e.time for e in events), np.float64, ne)[ev]
        rows = np.fromiter(map(self.index.get, keys, repeat(-1)), np.int64, n)
        fresh = np.zeros(n, dtype=bool)  # the access that creates its row
        miss = np.flatnonzero(rows < 0)
        if miss.size:
            mk = [keys[i] for i in miss.tolist()]
            self._new_rows(list(dict.fromkeys(mk)))
            rm = np.fromiter(map(self.index.__getitem__, mk), np.int64, len(mk))
            rows[miss] = rm
            fresh[miss[self.firsts(rm)]] = True
        # accesses grouped by row, in access order within a group
        order = np.lexsort((np.arange(n), rows))
        rs, ts = rows[order], t[order]
        first = np.ones(n, dtype=bool)
        first[1:] = rs[1:] != rs[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        occ = np.arange(n) - start  # earlier uses of the row within the batch
        fresh_s = fresh[order]
        prev_t = np.empty(n)
        prev_t[1:] = ts[:-1]
        prev_t[first] = self.last_t[rs[first]]
        prev_tier_s = np.where(first, self.tier[rs], HOT).astype(np.int8)
        prev_tier_s[fresh_s] = NONE
        cats_ev = np.fromiter((self._category(e.keys[0]) if len(e.keys) else OTHER
                               for e in events), np.int32, ne)
        owners_ev = np.fromiter((hash(e.session) for e in events), np.int64, ne)
        new_rows = rows[fresh]
        self.cat[new_rows] = cats_ev[ev[fresh]]
        self.owner[new_rows] = owners_ev[ev[fresh]]
        self.count[new_rows] = 0
        self.base[new_rows] = 0
        self.gaps[new_rows] = 0
        self.gap_mu[new_rows] = 0.0
        self.gap_var[new_rows] = 0.0
        cnt = self.count[rs] + occ  # uses before this one
        cs = self.cat[rs]
        reused = ~fresh_s
        self._learn_gaps(rs, ts - prev_t, reused, cs)
        self._inherit(rows, fresh, ev, offsets, owners_ev)
        # reuse counts by category and use count; after `_inherit`, so that a block new in a
        # session's k-th turn reaches class k (its session's history) as it is used again in
        # class k, not class 1 (which made class 1 look rarely reused and class 2 more than it is)
        eff = cnt + self.base[rs]  # ... counting its session's history
        cell = cs * (CLASSES + 1)
        np.add.at(self._reused_flat, (cell + np.minimum(eff, CLASSES))[reused], 1.0)
        np.add.at(self._reached_flat, cell + np.minimum(eff + 1, CLASSES), 1.0)
        raised = rs[first][self.raised[rs[first]] != NONE]
        if raised.size:  # raised by a prefetch, and now used
            self.prefetch_used += int(raised.size)
            self.raised[raised] = NONE
        last = np.ones(n, dtype=bool)
        last[:-1] = first[1:]
        self.last_t[rs[last]] = ts[last]
        self.last_tick[rs[last]] = ticks_ev[ev[order[last]]]
        self.count[rs[last]] = np.minimum(cnt[last] + 1, _COUNT_MAX)
        self.believe(rs[last], HOT)  # the store brings every block it serves into hot
        self._arrive(rs[last])
        self.accesses += n
        self._since_decay += n
        if self._since_decay >= self.decay_every:
            self._decay()
        for e in events:
            self._note_session(e.session, e.keys, e.time)
        prev_tier = np.empty(n, dtype=np.int8)
        prev_tier[order] = prev_tier_s
        return Recorded(rows, prev_tier, ticks_ev[ev], offsets)

    def _category(self, root: BlockKey) -> int:
        c = self.categories.get(root)
        if c is None:
            c = len(self.categories) + 1
            if c >= self.max_categories:
                return OTHER
            self.categories[root] = c
        return c

    def _learn_gaps(self, rs: np.ndarray, gap: np.ndarray, reused: np.ndarray,
                    cs: np.ndarray) -> None:
        """One smoothing step per row with the mean log of its gaps in the batch (grouped
        accesses `rs`, `gap` since the previous use; only re-uses past `min_gap_s` count)."""
        ok = reused & (gap >= self.min_gap_s)
        if not ok.any():
            return
        r = rs[ok]
        lg = np.log(gap[ok])
        c = cs[ok]
        np.add.at(self.cat_n, c, 1.0)
        np.add.at(self.cat_lg, c, lg)
        np.add.at(self.cat_lg2, c, lg * lg)
        starts = np.flatnonzero(np.concatenate(([True], r[1:] != r[:-1])))
        if starts.size < r.size:  # a row used more than once: the mean of its gaps
            k = np.diff(np.append(starts, r.size))
            lg = np.add.reduceat(lg, starts) / k
            r = r[starts]
        else:
            k = np.ones(r.size, dtype=np.int64)
        mean = lg.astype(np.float32)
        first = self.gaps[r] == 0
        mu, var = self.gap_mu[r], self.gap_var[r]
        d = mean - mu
        a = np.float32(self.alpha)
        self.gap_mu[r] = np.where(first, mean, mu + a * d)
        self.gap_var[r] = np.where(first, np.float32(0.25), (1 - a) * (var + a * d * d))
        self.gaps[r] = np.minimum(self.gaps[r] + k, _GAPS_MAX)

    def _inherit(self, rows: np.ndarray, fresh: np.ndarray, ev: np.ndarray,
                 offsets: np.ndarray, owners_ev: np.ndarray) -> None:
        """A first-used block takes the gap history of the deepest block of its request used
        before, when the same session created that one (its own history, not a prompt that
        other sessions share)."""
        if not fresh.any():
            return
        n = rows.size
        last_old = np.maximum.accumulate(np.where(~fresh, np.arange(n), -1))
        ctx = np.empty(n, dtype=np.int64)
        ctx[0] = -1
        ctx[1:] = last_old[:-1]
        pos = np.flatnonzero(fresh)
        c = ctx[pos]
        ok = (c >= offsets[ev[pos]])  # within the same request
        src = rows[np.where(ok, c, 0)]
        ok &= self.owner[src] == owners_ev[ev[pos]]
        if ok.any():
            s, d = src[ok], rows[pos[ok]]
            self.gap_mu[d] = self.gap_mu[s]
            self.gap_var[d] = self.gap_var[s]
            self.gaps[d] = self.gaps[s]
            self.base[d] = np.minimum(self.count[s] + self.base[s], _COUNT_MAX)

    def _new_rows(self, keys: list[BlockKey]) -> np.ndarray:
        """Rows for distinct keys placement has no row for (taken from the free list)."""
        n = len(keys)
        while len(self._free) < n:
            self._grow()
        rows = np.asarray(self._free[-n:][::-1], dtype=np.int64)
        del self._free[-n:]
        self.high = max(self.high, int(rows.max()) + 1) if n else self.high
        self.index.update(zip(keys, rows.tolist()))
        kv = np.empty(n, dtype=object)
        kv[:] = keys
        self.keys[rows] = kv
        self.live[rows] = True
        return rows

    def firsts(self, rows: np.ndarray) -> np.ndarray:
        """Positions of the first occurrence of each row in `rows`, in O(len(rows))."""
        idx = np.arange(rows.size)
        self._scratch[rows[::-1]] = idx[::-1]
        return np.flatnonzero(self._scratch[rows] == idx)

    def _bind(self) -> None:
        """The per-row columns of `rec`, as attributes (views: writes go to the records)."""
        rec = self.rec
        self.last_t: np.ndarray = rec["last_t"]
        self.count: np.ndarray = rec["count"]
        self.gap_mu: np.ndarray = rec["gap_mu"]
        self.gap_var: np.ndarray = rec["gap_var"]
        self.gaps: np.ndarray = rec["gaps"]
        self.cat: np.ndarray = rec["cat"]
        self.base: np.ndarray = rec["base"]  # uses of its session's history before it

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The `ROW` records of `rows` (a copy, one gather)."""
        return self.rec.take(rows)

    def _grow(self) -> None:
        old = self.rec.shape[0]
        new = old * 2
        rec = np.zeros(new, dtype=ROW)
        rec[:old] = self.rec
        self.rec = rec
        self._bind()
        for name in ("tier", "live", "last_tick", "owner", "raised", "gen", "_scratch",
                     "_pending"):
            a = getattr(self, name)
            b = np.zeros(new, dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        for code, flag in self._member.items():
            grown = np.zeros(new, dtype=bool)
            grown[:old] = flag
            self._member[code] = grown
        keys = np.full(new, None, dtype=object)
        keys[:old] = self.keys
        self.keys = keys
        self._free[:0] = range(new - 1, old - 1, -1)  # below the free rows: low rows first

    def _decay(self) -> None:
        self._since_decay = 0
        for a in (self.reached, self.reused, self.cat_n, self.cat_lg, self.cat_lg2):
            a *= 0.5

    def _note_session(self, session: str, keys: Sequence[BlockKey], t: float) -> None:
        if not session:
            return
        rec = self.sessions.get(session)
        ks = tuple(keys[-self.session_keys:])
        if rec is None:
            self.sessions[session] = SessionRecord(t, float(len(keys)), ks)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
            return
        self.sessions.move_to_end(session)
        rec.score = rec.score * math.exp(-max(0.0, t - rec.last_t) / SESSION_TAU_S) + len(keys)
        rec.last_t = t
        rec.keys = ks

    # ------------------------------------------------------------------ rows
    def rows_of(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Rows of `keys` (int64); unknown keys get -1."""
        return np.fromiter(map(self.index.get, keys, repeat(-1)), dtype=np.int64,
                           count=len(keys))

    def key_of(self, row: int) -> BlockKey | None:
        k = self.keys[row] if 0 <= row < len(self.keys) else None
        return k if isinstance(k, bytes) else None

    def keys_of(self, rows: np.ndarray) -> list[BlockKey]:
        """The keys of live `rows` (free rows are skipped)."""
        live = self.live[rows]  # a byte column, not a scan of the keys
        out: list[BlockKey] = self.keys[rows if live.all() else rows[live]].tolist()
        return out

    def forget(self, rows: np.ndarray) -> None:
        """Drop rows (their blocks are gone from the store); they go back to the free list."""
        for r in rows.tolist():
            k = self.keys[r]
            if k is None:
                continue
            del self.index[k]
            if self.raised[r] != NONE:
                self.prefetch_wasted += 1
                self.raised[r] = NONE
            self.keys[r] = None
            self.live[r] = False
            self.gen[r] += 1
            self.tier[r] = NONE
            self._free.append(r)

    def ensure_rows(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Rows of `keys`, created (with no history) for keys placement has not seen used."""
        rows = self.rows_of(keys)
        miss = np.flatnonzero(rows < 0)
        if miss.size:
            mk = [keys[i] for i in miss.tolist()]
            new = self._new_rows(list(dict.fromkeys(mk)))
            self.count[new] = 0
            self.base[new] = 0
            self.gaps[new] = 0
            self.cat[new] = OTHER
            self.owner[new] = 0
            self.last_t[new] = 0.0
            rows[miss] = np.fromiter(map(self.index.__getitem__, mk), np.int64, len(mk))
        return rows

    def _arrive(self, rows: np.ndarray) -> None:
        flag = self._pending
        new = rows[~flag[rows]]  # each row once until taken
        flag[new] = True
        self._arrived.append(new)
        self._arrived_n += new.size

    def note_left_hot(self, rows: np.ndarray, now: float) -> None:
        """Placement moved `rows` out of hot at `now`: smooth `hold_s` toward the mean time
        since their last use (HOLD_ALPHA a round)."""
        if rows.size == 0:
            return
        age = float(np.mean(now - self.last_t[rows]))
        self.hold_s = age if self.hold_s is None else self.hold_s + HOLD_ALPHA * (age - self.hold_s)

    def moved(self, rows: np.ndarray, code: int) -> None:
        """`rows` were moved to tier `code` (NONE: evicted) by placement. A block a prefetch
        raised that goes below the tier it was raised to before it was used was raised for
        nothing (`prefetch_wasted`)."""
        was = self.raised[rows]
        down = (was != NONE) & ((code == NONE) | (was < code))
        if down.any():
            self.prefetch_wasted += int(np.count_nonzero(down))
            self.raised[rows[down]] = NONE
        self.believe(rows, code)
        if code == HOT:
            self._arrive(rows)

    def note_raised(self, rows: np.ndarray, code: int) -> None:
        """A prefetch raised `rows` to tier `code` (after `moved`); rows already waiting for
        their use keep the higher of the two tiers."""
        was = self.raised[rows]
        fresh = rows[was == NONE]
        self.prefetch_raised += int(self.distinct(fresh).size) if fresh.size else 0
        self.raised[rows[(was == NONE) | (was > code)]] = code

    def prefetch_outcomes(self) -> dict[str, int]:
        """Blocks prefetches raised: used since, moved down or dropped before any use
        (wasted), and still waiting."""
        return {"raised": self.prefetch_raised, "used": self.prefetch_used,
                "wasted": self.prefetch_wasted,
                "waiting": self.prefetch_raised - self.prefetch_used - self.prefetch_wasted}

    def believe(self, rows: np.ndarray, code: int) -> None:
        """Placement's belief: `rows` are in tier `code` (as of now)."""
        self.tier[rows] = code
        member = self._member.get(code)
        if member is None:
            return
        new = rows[~member[rows]]
        if new.size:
            new = self.distinct(new)
            member[new] = True
            buf, n = self._members[code], self._mlen[code]
            if n + new.size > buf.size:
                grown = np.zeros(max(2 * buf.size, n + new.size), dtype=np.int64)
                grown[:n] = buf[:n]
                self._members[code] = buf = grown
            buf[n:n + new.size] = new
            self._mlen[code] = n + new.size

    def distinct(self, rows: np.ndarray) -> np.ndarray:
        """`rows` without repeats (the last of each), in O(len(rows)): no sort."""
        idx = np.arange(rows.size)
        self._scratch[rows] = idx
        out: np.ndarray = rows[self._scratch[rows] == idx]
        return out

    def positions(self, rows: np.ndarray, among: np.ndarray) -> np.ndarray:
        """For each of `rows`, its index in the distinct rows `among` (-1: not there), in
        O(len(rows) + len(among))."""
        self._scratch[rows] = -1
        self._scratch[among] = np.arange(among.size)
        out: np.ndarray = self._scratch[rows]
        return out

    def common(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The rows of `b` that are also in `a`, in O(len(a) + len(b))."""
        self._scratch[b] = -1
        self._scratch[a] = -2
        out: np.ndarray = b[self._scratch[b] == -2]
        return out

    def absent(self, rows: np.ndarray, drop: np.ndarray) -> np.ndarray:
        """Mask of the entries of `rows` that are not in `drop`, in O(len(rows) + len(drop))."""
        self._scratch[rows] = 0
        self._scratch[drop] = 1
        out: np.ndarray = self._scratch[rows] == 0
        return out

    def sample_tier(self, code: int, n: int, rng: np.random.Generator) -> np.ndarray:
        """About `n` rows placement believes are in hot or warm (`code`), drawn uniformly with
        replacement, in O(n) (the member list is compacted when half of it has left); a row
        may come twice (callers take distinct rows of all their candidates at once)."""
        m = self._mlen[code]
        if m == 0 or n <= 0:
            return np.zeros(0, dtype=np.int64)
        # an index in [0, m) from each 31-bit draw by a multiply and a shift (Lemire's
        # reduction: no division; bias below m / 2**31)
        rows = self._members[code].take((self._draw(rng, 2 * n) * m) >> 31)
        ok = self.tier[rows] == code
        if 2 * int(np.count_nonzero(ok)) < ok.size:
            self._compact(code)
        out: np.ndarray = rows[ok][:n]
        return out

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` uniform integers in [0, 2**31), from a pool drawn 64k at a time: a round's
        draw of a thousand or two is mostly the generator's cost per call. The pool is the
        bit generator's raw 64-bit output, its top 31 bits: a third of `integers`' cost per
        value, which checks a range for every one."""
        if self._pool_at + n > self._pool.size:
            raw = rng.bit_generator.random_raw(max(n, 1 << 16))
            self._pool = (raw >> np.uint64(33)).astype(np.int64)
            self._pool_at = 0
        out = self._pool[self._pool_at:self._pool_at + n]
        self._pool_at += n
        return out

    def _compact(self, code: int) -> None:
        buf, n = self._members[code], self._mlen[code]
        rows = buf[:n]
        keep = self.tier[rows] == code
        self._member[code][rows[~keep]] = False
        kept = rows[keep]
        buf[:kept.size] = kept
        self._mlen[code] = int(kept.size)

    def take_arrived(self, code: int) -> np.ndarray:
        """Distinct live rows that entered hot since the last call (`code`: hot's; warm keeps
        none: the blocks that enter it are hot's victims, `Gatherer._victims`)."""
        parts = self._arrived
        if code != HOT or not parts:
            return np.zeros(0, dtype=np.int64)
        rows = np.concatenate(parts)
        parts.clear()
        self._arrived_n = 0
        self._pending[rows] = False
        out: np.ndarray = rows[self.live[rows]]
        return out

    def trim_arrived(self, limit: int) -> None:
        """Keep at most the last `limit` arrivals for the next `take_arrived`."""
        if self._arrived_n > 2 * limit:
            rows = np.concatenate(self._arrived)
            self._pending[rows[:-limit]] = False
            self._arrived = [rows[-limit:]]
            self._arrived_n = limit

    def sweep(self, n: int) -> np.ndarray:
        """The next `n` rows of a cursor that cycles over every row (live ones returned)."""
        if self.high == 0 or n <= 0:
            return np.zeros(0, dtype=np.int64)
        lo = self._cursor if self._cursor < self.high else 0
        hi = min(self.high, lo + n)
        self._cursor = hi
        rows = np.arange(lo, hi, dtype=np.int64)
        out: np.ndarray = rows[self.live[lo:hi]]
        return out

    def sample(self, code: int, n: int, rng: np.random.Generator, *, draws: int) -> np.ndarray:
        """Up to `n` distinct rows believed in tier `code`, from `draws` random rows."""
        if self.high == 0 or n <= 0:
            return np.zeros(0, dtype=np.int64)
        rows = rng.integers(0, self.high, size=draws)
        rows = rows[self.tier[rows] == code]  # free rows have no tier
        return sorted_unique(rows[:n])
