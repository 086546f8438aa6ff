"""Prefetch: decide which blocks should move up before a request asks for them.

Four kinds, all fed by access events (`observe`) and all expressed as `Want`s:
(a) predictive preload: per session an exponentially smoothed interval between accesses (and
    its spread); for sessions with a steady beat (spread <= max_cv x interval), from
    `lead_s + interval_s` before the predicted next access (one round period plus the lead) the
    blocks of the session's last request are wanted hot (cold -> warm -> hot);
(b) co-access: sessions accessed within `coaccess_window_s` of each other build a weighted
    graph (one count per episode, so a periodic session does not pair with everything);
    when a session is active, the recent blocks of neighbours it met in at least
    `coaccess_min_share` of the rarer one's episodes (and `coaccess_min_weight` times) are
    wanted warm;
(c) neighbour: an access that found a block cold queues the session's following blocks
    for an immediate warm prefetch (`take_urgent`);
(d) warm-up: after a restart the most used sessions of the persisted summary are loaded
    before the first tick (`warmup_wants`).
The prefetcher only plans; the placement service issues the moves through the store's
background (low-priority, bounded) queue so a foreground read is never delayed.
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence

from ..base import BlockKey, Tier
from .base import Reason, Want
from .summary import SessionSummary


_PREDICT = Want(Tier.HOT, Reason.PREDICT)
_COACCESS = Want(Tier.WARM, Reason.COACCESS)


@dataclass(slots=True)
class _Session:
    order: list[BlockKey] = field(default_factory=list)  # first-seen order of its blocks
    last_keys: tuple[BlockKey, ...] = ()  # the blocks its last request touched
    pos: dict[BlockKey, int] = field(default_factory=dict)
    last_t: float = 0.0
    interval: float | None = None  # smoothed inter-access interval (s)
    var: float = 0.0  # smoothed variance of the interval
    episodes: int = 0  # runs of accesses separated by more than the co-access window
    accesses: int = 0
    neighbours: dict[str, float] = field(default_factory=dict)  # co-access weights
    top: float = 0.0  # the largest of them (weights only grow; the weakest are dropped)
    paired: dict[str, float] = field(default_factory=dict)  # last time seen with a session

    def add_keys(self, keys: Sequence[BlockKey], limit: int) -> None:
        for k in keys:
            if k not in self.pos:
                self.pos[k] = len(self.order)
                self.order.append(k)
        if len(self.order) > limit:
            self.order = self.order[-limit:]
            self.pos = {k: i for i, k in enumerate(self.order)}

    def recent(self, n: int) -> list[BlockKey]:
        return self.order[-n:] if n > 0 else []


@dataclass(frozen=True, slots=True)
class Wish:
    """A session's blocks wished up: the last `last` (0: all) of `keys`, which is the
    session's record of its last request (the same object until its next request, so a
    consumer may remember what it made of it)."""

    session: str
    keys: tuple[BlockKey, ...]
    want: Want
    last: int = 0

    @property
    def wished(self) -> tuple[BlockKey, ...]:
        return self.keys[-self.last:] if self.last else self.keys


@dataclass(frozen=True, slots=True)
class UrgentPrefetch:
    keys: tuple[BlockKey, ...]
    tier: Tier
    reason: Reason


class Prefetcher:
    """Access-pattern model producing prefetch wants. Thread-safe."""

    def __init__(self, *, lead_s: float = 1.0, interval_s: float = 1.0, alpha: float = 0.3,
                 coaccess_window_s: float = 10.0, coaccess_min_weight: float = 3.0,
                 coaccess_min_share: float = 0.5, max_cv: float = 0.5,
                 coaccess_blocks: int = 32, neighbour_blocks: int = 8, coaccess_fanout: int = 8,
                 max_sessions: int = 4096, max_session_blocks: int = 1024,
                 max_urgent: int = 256) -> None:
        self.lead_s = lead_s
        self.interval_s = interval_s
        self.alpha = alpha
        self.coaccess_window_s = coaccess_window_s
        self.coaccess_min_weight = coaccess_min_weight
        self.coaccess_min_share = coaccess_min_share
        self.max_cv = max_cv
        self.coaccess_blocks = coaccess_blocks
        self.coaccess_fanout = coaccess_fanout
        self.neighbour_blocks = neighbour_blocks
        self.max_sessions = max_sessions
        self.max_session_blocks = max_session_blocks
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._recent: deque[tuple[float, str]] = deque(maxlen=64)
        # (time its predicted next use enters the horizon, session, its last access): the
        # sessions with a steady beat, so a round looks at those due, not at every session
        self._due: list[tuple[float, str, float]] = []
        # the entries whose time has come, by session, until the session is used again or
        # its beat is missed (a round looks at these, not at the heap again)
        self._entered: dict[str, tuple[float, str, float]] = {}
        self._urgent: deque[UrgentPrefetch] = deque(maxlen=max_urgent)
        self.counts = {"predict": 0, "coaccess": 0, "neighbour": 0, "warmup": 0}

    # ------------------------------------------------------------------ input
    def observe(self, session: str, keys: Sequence[BlockKey], now: float,
                cold_keys: Iterable[BlockKey] = ()) -> None:
        """One access event of `session` at wall time `now`; `cold_keys` were read from cold."""
        if not session:
            return
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                s = self._sessions[session] = _Session()
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(session)
                if s.accesses:
                    gap = max(0.0, now - s.last_t)
                    if s.interval is None:
                        s.interval = gap
                    else:
                        diff = gap - s.interval
                        s.interval += self.alpha * diff
                        s.var = (1.0 - self.alpha) * (s.var + self.alpha * diff * diff)
            if not s.accesses or now - s.last_t > self.coaccess_window_s:
                s.episodes += 1
            s.accesses += 1
            s.last_t = now
            if self._regular(s) and s.interval is not None:
                heapq.heappush(self._due, (now + s.interval - self.lead_s - self.interval_s,
                                           session, now))
            s.add_keys(keys, self.max_session_blocks)
            s.last_keys = tuple(keys)
            self._note_coaccess(session, s, now)
            cold = [k for k in cold_keys if k in s.pos]
            if cold:
                after = max(s.pos[k] for k in cold)
                after = max(after, max((s.pos[k] for k in keys if k in s.pos), default=after))
                nxt = tuple(s.order[after + 1: after + 1 + self.neighbour_blocks])
                if nxt:
                    self._urgent.append(UrgentPrefetch(nxt, Tier.WARM, Reason.NEIGHBOUR))
                    self.counts["neighbour"] += 1

    def _note_coaccess(self, session: str, s: _Session, now: float) -> None:
        """Pair `session` with the last `coaccess_fanout` other sessions used within the
        co-access window (bounded work per access, however busy the box)."""
        seen: set[str] = {session}
        for t, other in reversed(self._recent):
            if now - t > self.coaccess_window_s or len(seen) > self.coaccess_fanout:
                break
            if other in seen:
                continue
            seen.add(other)
            o = self._sessions.get(other)
            if o is None:
                continue
            # one count per episode: a pair seen again within the window is the same episode
            if now - s.paired.get(other, -1e18) <= self.coaccess_window_s:
                s.paired[other] = o.paired[session] = now
                continue
            s.paired[other] = o.paired[session] = now
            s.neighbours[other] = s.neighbours.get(other, 0.0) + 1.0
            o.neighbours[session] = o.neighbours.get(session, 0.0) + 1.0
            s.top = max(s.top, s.neighbours[other])
            o.top = max(o.top, o.neighbours[session])
            for node in (s, o):
                if len(node.neighbours) > 16:
                    weakest = min(node.neighbours, key=node.neighbours.__getitem__)
                    del node.neighbours[weakest]
                if len(node.paired) > 64:
                    for name in [n for n, t in node.paired.items()
                                 if now - t > self.coaccess_window_s]:
                        del node.paired[name]
        self._recent.append((now, session))

    def forget_session(self, session: str) -> None:
        with self._lock:
            self._sessions.pop(session, None)

    # ------------------------------------------------------------------ output
    def _regular(self, s: _Session) -> bool:
        """Enough history and a steady beat (interval spread <= max_cv x interval)."""
        return (s.interval is not None and s.accesses >= 3 and s.interval > 0.0
                and s.var ** 0.5 <= self.max_cv * s.interval)

    def predicted_next(self, session: str) -> float | None:
        s = self._sessions.get(session)
        if s is None or s.interval is None:
            return None
        return s.last_t + s.interval

    def next_due(self, now: float) -> float | None:
        """When the next predicted session enters its horizon (at or before `now`: one is in
        it already); None when no session has a steady beat."""
        with self._lock:
            self._drop_stale()
            times = [e[0] for e in self._entered.values() if not self._stale(e)]
            if self._due:
                times.append(self._due[0][0])
            return min(times) if times else None

    def _drop_stale(self) -> None:
        """Caller holds the lock: heap entries of sessions used since (or forgotten) go."""
        due = self._due
        while due and self._stale(due[0]):
            heapq.heappop(due)
        if len(due) > 4 * self.max_sessions:
            self._due = [e for e in due if not self._stale(e)]
            heapq.heapify(self._due)

    def _stale(self, e: tuple[float, str, float]) -> bool:
        s = self._sessions.get(e[1])
        return s is None or s.last_t != e[2]

    def wishes(self, now: float) -> list[Wish]:
        """Blocks to raise this round, a group per session: predicted sessions -> hot (their
        last request), then co-access neighbours -> warm (the last `coaccess_blocks` of
        theirs). A session appears once; where groups share blocks, the first one's wish holds.

        Looks only at the sessions due within the horizon (taken from a heap as their time
        comes, kept until used again or overdue) and those active within the co-access window
        (the most recently used end of the session order)."""
        out: list[Wish] = []
        named: set[str] = set()
        horizon = self.lead_s + self.interval_s
        with self._lock:
            self._drop_stale()
            entered = self._entered
            while self._due and self._due[0][0] <= now:
                e = heapq.heappop(self._due)
                if not self._stale(e):
                    entered[e[1]] = e
            for e in sorted(entered.values()):
                s = self._sessions.get(e[1])
                if s is None or s.interval is None or s.last_t != e[2]:
                    del entered[e[1]]
                    continue
                due = s.last_t + s.interval
                if due < now - s.interval:
                    del entered[e[1]]
                    continue  # long overdue: a missed beat is not a pattern
                if now + horizon >= due and e[1] not in named and s.last_keys:
                    named.add(e[1])
                    out.append(Wish(e[1], s.last_keys, _PREDICT))
                    self.counts["predict"] += 1
            active: list[_Session] = []
            for s in reversed(self._sessions.values()):
                if now - s.last_t > self.interval_s + self.coaccess_window_s:
                    break
                active.append(s)
            for s in active:
                if s.top < self.coaccess_min_weight:
                    continue  # no neighbour met often enough yet
                for other, w in s.neighbours.items():
                    if w < self.coaccess_min_weight or other in named:
                        continue
                    o = self._sessions.get(other)
                    # association, not coincidence: together in most episodes of the rarer one
                    if o is None or w < self.coaccess_min_share * min(s.episodes, o.episodes):
                        continue
                    if o.last_keys:
                        named.add(other)
                        out.append(Wish(other, o.last_keys, _COACCESS, self.coaccess_blocks))
                        self.counts["coaccess"] += 1
        return out

    def wants(self, now: float) -> dict[BlockKey, Want]:
        """`wishes` as one mapping, block -> its wish (the first group's, where they share)."""
        out: dict[BlockKey, Want] = {}
        for w in self.wishes(now):
            for k in w.wished:
                out.setdefault(k, w.want)
        return out

    def take_urgent(self) -> list[UrgentPrefetch]:
        """Queued neighbour prefetches, oldest first; the queue is emptied."""
        with self._lock:
            out = list(self._urgent)
            self._urgent.clear()
            return out

    def warmup_wants(self, summary: Sequence[SessionSummary], sessions: int,
                     hot_blocks: int) -> list[tuple[list[BlockKey], Tier]]:
        """Start-up loads from the top `sessions` of a session summary: first the blocks
        several of them share (their system prompts: the agent starts new sessions after a
        restart, which share only their prompt with the old ones), most shared first; then
        each session's own blocks, most used session first, its latest blocks first. Hot
        while `hot_blocks` lasts, then warm. Returns (keys, tier) groups in load order."""
        top = [sh for sh in list(summary)[:sessions] if sh.keys]
        count = Counter(k for sh in top for k in dict.fromkeys(sh.keys))
        shared = sorted((k for k, c in count.items() if c > 1), key=lambda k: -count[k])
        out: list[tuple[list[BlockKey], Tier]] = []
        left = hot_blocks

        def load(hot: list[BlockKey], warm: list[BlockKey]) -> None:
            nonlocal left
            for keys, tier in ((hot, Tier.HOT), (warm, Tier.WARM)):
                if keys:
                    out.append((keys, tier))
            left -= len(hot)

        if shared:
            load(shared[:left], shared[left:])
        for sh in top:
            own = [k for k in sh.keys if count[k] == 1]
            n_hot = min(left, len(own))
            load(own[len(own) - n_hot:], own[:len(own) - n_hot])
            self.counts["warmup"] += 1
        return out

    def stats(self) -> dict[str, object]:
        with self._lock:
            predicted = sum(1 for s in self._sessions.values() if s.interval is not None)
            return {"sessions": len(self._sessions), "predictable": predicted,
                    "urgent_queued": len(self._urgent), **self.counts}
