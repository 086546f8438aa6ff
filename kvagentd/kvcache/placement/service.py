"""The placement service: accesses from the store's feed, a policy round every
`placement.interval_s`, and the one step that applies a plan to the store.

    store.record_access -> feed.record ... ingest -> stats, heat, trace, prefetcher
    every interval: gather candidates (where room is short) -> policy.plan -> apply
    on a cold read (heat+prefetch): the session's following blocks -> store.promote(background)

A round costs O(blocks accessed since the last round + bounded samples): it asks the store
about the blocks it looks at (`PlacementStore`), never for every block. A bounded sweep per
round forgets what placement remembers of blocks the store no longer has. A round that raises is
logged and counted; the service keeps running (a prefetch thread that dies on one exception and
never restarts is a field failure of peer systems).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..base import BlockKey, Tier
from .base import CODE_OF, Action, Capacities, Plan, PlacementStore
from .feed import Access, AccessFeed
from .heat import HeatMap
from .gather import Gatherer, WishRows
from .policy import PlacementPolicy, PolicyParams, make_policy
from .prefetch import Prefetcher, UrgentPrefetch
from .stats import AccessStats
from .summary import load_summary, save_summary
from .trace_recorder import BlockSize, TraceRecorder

log = structlog.get_logger(__name__)

SUMMARY_EVERY_ROUNDS = 60
SWEEP_ROWS = 64  # rows per round checked against the store (forgetting blocks it dropped)


class PlacementOptions(Protocol):
    """The `[placement]` settings placement reads (`kvagentd.config.PlacementConfig`)."""

    @property
    def policy(self) -> str: ...
    @property
    def heatmap_window(self) -> int: ...
    @property
    def hot_factor(self) -> float: ...
    @property
    def warm_factor(self) -> float: ...
    @property
    def window_fraction(self) -> float: ...
    @property
    def hysteresis(self) -> float: ...
    @property
    def headroom_fraction(self) -> float: ...
    @property
    def interval_s(self) -> float: ...
    @property
    def prefetch_lead_s(self) -> float: ...
    @property
    def trace_capacity(self) -> int: ...
    @property
    def warmup_sessions(self) -> int: ...


class HasPlacementOptions(Protocol):
    """A whole configuration, as the daemon hands it to every service on reload."""

    @property
    def placement(self) -> PlacementOptions: ...


def params_of(o: PlacementOptions) -> PolicyParams:
    return PolicyParams(hot_factor=o.hot_factor, warm_factor=o.warm_factor,
                        hysteresis=o.hysteresis, window_fraction=o.window_fraction,
                        headroom_fraction=o.headroom_fraction)


@dataclass(frozen=True, slots=True)
class RoundReport:
    at: float
    policy: str
    blocks: int  # candidates looked at
    accessed: int  # block accesses since the previous round
    moves: dict[str, int]
    applied: int
    decision_s: float
    apply_s: float

    def as_dict(self) -> dict[str, object]:
        return {"at": self.at, "policy": self.policy, "blocks": self.blocks,
                "accessed": self.accessed, "moves": self.moves, "applied": self.applied,
                "decision_s": self.decision_s, "apply_s": self.apply_s}


class PlacementService:
    """Decides where blocks live and applies it to `store`.

    `feed` is the access listener `store` reports to. `scheduler` (APScheduler 3) runs the
    rounds as a job when given; otherwise the service's own thread does. Either way that thread
    ingests accesses as they come and issues neighbour prefetches as soon as a cold read is
    seen. `clock` is wall time (tests and the simulator pass their own). Without
    `summary_path` no session summary is persisted or loaded. `block_size` (the store's block,
    where known) goes into trace dumps."""

    def __init__(self, store: PlacementStore, feed: AccessFeed, options: PlacementOptions,
                 scheduler: Any = None, *, clock: Callable[[], float] = time.time,
                 summary_path: str | Path | None = None,
                 registry: CollectorRegistry | None = None, seed: int | None = None,
                 block_size: BlockSize | None = None) -> None:
        self.store = store
        self.feed = feed
        self.config = options
        self.scheduler = scheduler
        self.clock = clock
        self.summary_path = Path(summary_path) if summary_path is not None else None
        self.stats = AccessStats()
        self.trace = TraceRecorder(options.trace_capacity, block_size=block_size)
        self.prefetcher = Prefetcher(lead_s=options.prefetch_lead_s,
                                     interval_s=options.interval_s)
        self._wish_rows = WishRows()  # the rows of the prefetcher's wishes, across rounds
        self._gather: Gatherer | None = None  # kept while the policy and capacities stay
        self.policy: PlacementPolicy = make_policy(options.policy, params_of(options))
        self.heat: HeatMap | None = self._heat_for(self.policy, None)
        self._rng = np.random.default_rng(seed)
        self._caps: Capacities | None = None  # as of the last round (status reads this)
        self.rounds = 0
        self.errors = 0
        self.listener_errors = 0
        self.last_round: RoundReport | None = None
        self.last_error: str | None = None
        self.warmed_up = 0
        self.decision_s = 0.0  # total planning CPU time (gathering candidates + policy)
        self.decided_accesses = 0  # block accesses those rounds covered
        self._accesses_seen = 0
        self._early: list[Access] = []  # drained and seen by the prefetcher, not yet recorded
        self._early_keys: set[BlockKey] = set()  # the blocks they used
        self._lock = threading.RLock()  # one owner of stats, heat and prefetcher at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job: Any = None
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self._m_rounds = Counter("kvagentd_placement_rounds", "Placement rounds run",
                                 registry=reg)
        self._m_errors = Counter("kvagentd_placement_errors", "Placement rounds or prefetches "
                                 "that raised", registry=reg)
        self._m_moves = Counter("kvagentd_placement_moves", "Blocks moved by placement",
                                ["action", "reason"], registry=reg)
        self._m_decision = Gauge("kvagentd_placement_decision_seconds",
                                 "Time to plan the last round", registry=reg)
        self._m_blocks = Gauge("kvagentd_placement_blocks", "Blocks considered last round",
                               registry=reg)
        self._m_prefetched = Gauge("kvagentd_placement_prefetched_blocks",
                                   "Blocks raised by prefetches, by what became of them "
                                   "(used, wasted: moved down or dropped unused, waiting)",
                                   ["outcome"], registry=reg)

    def _heat_for(self, policy: PlacementPolicy, current: HeatMap | None) -> HeatMap | None:
        """The heat map `policy` needs: `current` when it fits, a fresh one, or none."""
        if not policy.uses_heat:
            return None
        if current is not None and current.window == self.config.heatmap_window:
            return current
        return HeatMap(self.config.heatmap_window, capacity=len(self.stats.live))

    def capacities(self) -> Capacities:
        """Hot / warm capacity in blocks, as the store's pools say."""
        self._caps = Capacities(self.store.pool(Tier.HOT).capacity,
                                self.store.pool(Tier.WARM).capacity)
        return self._caps

    # ------------------------------------------------------------------ access path
    def ingest(self) -> int:
        """Take every access the feed holds into stats, heat, trace and prefetcher, as one
        batch (with those the prefetcher has already seen); returns how many events. A batch
        that fails is logged and counted."""
        with self._lock:
            early, self._early, self._early_keys = self._early, [], set()
            events = early + self.feed.drain()
            if not events:
                return 0
            try:
                self._ingest(events, seen=len(early))
            except Exception:  # noqa: BLE001 - bookkeeping must not stop placement
                self.listener_errors += 1
                log.exception("placement.ingest_failed", events=len(events))
            return len(events)

    def _ingest(self, events: list[Access], seen: int = 0) -> None:
        """Record `events`; the prefetcher observes those after the first `seen`."""
        rec = self.stats.record(events)
        if self.heat is not None:
            self.heat.record(rec.rows, rec.ticks)
        off = rec.offsets.tolist()
        cold = CODE_OF[Tier.COLD]
        for i, ev in enumerate(events):
            tiers = rec.prev_tier[off[i]:off[i + 1]]
            if self.trace.capacity > 0:
                self.trace.record(int(rec.ticks[off[i]]) if off[i + 1] > off[i] else 0,
                                  ev.time, ev.session, ev.keys, tiers)
            if self.policy.uses_prefetch and i >= seen:
                was_cold = [ev.keys[j] for j in np.flatnonzero(tiers == cold).tolist()]
                self.prefetcher.observe(ev.session, ev.keys, ev.time, was_cold)

    def flush_prefetch(self) -> int:
        """Let the prefetcher see pending accesses, then issue queued neighbour prefetches into
        warm through the store's background queue (only under a prefetching policy; others
        ingest and drop them, so policies compare cleanly). Returns how many blocks were
        queued. The accesses are recorded in stats and heat later, as one batch (by the next
        round that decides, the summary's save or a trace read): what a neighbour prefetch
        needs is the prefetcher's, and recording costs per batch more than per access."""
        with self._lock:
            if not self.policy.uses_prefetch:
                self.ingest()
                self.prefetcher.take_urgent()
                return 0
            self._observe_early()
            return self._prefetch(self.prefetcher.take_urgent())

    def _observe_early(self) -> None:
        """The prefetcher observes the feed's events now; stats and heat record them later.
        A block is taken as read from cold when placement believes it cold and no event
        waiting to be recorded used it."""
        if len(self._early) >= self.feed.capacity:  # rounds are not running: record now
            self.ingest()
        events = self.feed.drain()
        cold = CODE_OF[Tier.COLD]
        try:
            for ev in events:
                rows = self.stats.rows_of(ev.keys)
                tiers = self.stats.tier[np.maximum(rows, 0)]
                was_cold = [k for k, r, t in zip(ev.keys, rows.tolist(), tiers.tolist())
                            if r >= 0 and t == cold and k not in self._early_keys]
                self.prefetcher.observe(ev.session, ev.keys, ev.time, was_cold)
                self._early_keys.update(ev.keys)
        except Exception:  # noqa: BLE001 - bookkeeping must not stop placement
            self.listener_errors += 1
            log.exception("placement.observe_failed", events=len(events))
        self._early.extend(events)

    def _prefetch(self, urgent: Sequence[UrgentPrefetch]) -> int:
        n = 0
        for u in urgent:
            self._make_room(u.tier, len(u.keys))
            moved = self.store.promote(list(u.keys), u.tier, background=True)
            n += moved
            if moved:
                self._m_moves.labels("promote", u.reason.value).inc(moved)
                rows = self._believe(list(u.keys), u.tier)
                self.stats.note_raised(rows, CODE_OF[u.tier])
        return n

    def _make_room(self, tier: Tier, n: int) -> int:
        """Demote the least recently used idle blocks of `tier` so `n` blocks fit (the store
        promotes into free slots only)."""
        if tier is Tier.COLD:
            return 0
        short = n - self.store.pool(tier).num_free
        if short <= 0:
            return 0
        lower = Tier.WARM if tier is Tier.HOT else Tier.COLD
        victims = self.store.least_recent_idle(tier, short)
        moved = self.store.demote(victims, lower) if victims else 0
        if moved:
            self._m_moves.labels("demote", "capacity").inc(moved)
            self._believe(victims, lower)
        return moved

    def _believe(self, keys: Sequence[BlockKey], tier: Tier | None) -> np.ndarray:
        """Placement's belief of where `keys` are, after moving them (prefetch, room); returns
        the rows of those it knows."""
        rows = self.stats.rows_of(keys)
        rows = rows[rows >= 0]
        self.stats.moved(rows, CODE_OF[tier])
        return rows

    # ------------------------------------------------------------------ rounds
    def run_round(self) -> Plan:
        """One round: ingest -> gather -> plan -> apply. Raises on failure (see `_safe`).
        Under a prefetching policy the prefetcher observes the accesses first and stats and
        heat record them only when the round decides (or the summary is saved): a round with
        room and its wishes met needs neither."""
        with self._lock:
            prefetching = self.policy.uses_prefetch
            if prefetching:  # the prefetcher sees every access; stats wait for a deciding round
                self._observe_early()
            else:
                self.ingest()
            now = self.clock()
            t0 = time.thread_time()
            gather = self._gatherer(self._caps if self._caps is not None
                                    else self.capacities())
            if gather.roomy(now):  # nothing is short of room and nothing rises: nothing to decide
                plan = Plan((), self.policy.name)
            else:
                if prefetching:  # recorded as one batch, outside the decision's time
                    t_in = time.thread_time()
                    self.ingest()
                    t0 += time.thread_time() - t_in
                view = gather.view(now)
                plan = self.policy.plan(view, self.stats, self.heat) \
                    if view.victims or self.policy.uses_heat else Plan((), self.policy.name)
                gather.carry(plan.runners_up)
            t1 = time.thread_time()
            accessed = self.stats.accesses - self._accesses_seen
            self._accesses_seen = self.stats.accesses
            applied = self.apply(plan)
            left = [b.rows for b in plan.batches if b.src is Tier.HOT and b.rows is not None]
            if left:  # how long blocks stay in hot (the reuse policy's `hold_s`)
                self.stats.note_left_hot(np.concatenate(left), now)
            t2 = time.thread_time()
            self._sweep()
            self.rounds += 1
            self.decision_s += t1 - t0
            self.decided_accesses += accessed
            self.last_round = RoundReport(now, plan.policy, plan.considered, accessed,
                                          plan.counts(), applied, t1 - t0, t2 - t1)
            self._m_rounds.inc()
            self._m_decision.set(t1 - t0)
            self._m_blocks.set(plan.considered)
            for outcome, n in self.stats.prefetch_outcomes().items():
                if outcome != "raised":
                    self._m_prefetched.labels(outcome).set(n)
        if self.rounds % SUMMARY_EVERY_ROUNDS == 0:
            self.save_summary()
        return plan

    def _gatherer(self, caps: Capacities) -> Gatherer:
        """The round's `Gatherer`: the last one while the policy and capacities are the same."""
        g = self._gather
        if g is None or g.policy is not self.policy or g.caps != caps:
            g = self._gather = Gatherer(self.store, self.stats, self.policy, self.prefetcher,
                                        self._rng, caps, self._wish_rows)
        g.begin()
        return g

    def apply(self, plan: Plan) -> int:
        """Execute `plan`'s batches in order; returns blocks moved. A failing batch is logged
        and counted; the rest of the plan still runs."""
        moved = 0
        for b in plan.batches:
            keys = list(b.keys)
            try:
                if b.dst is None:
                    n = self.store.evict(keys)
                elif b.action is Action.DEMOTE:
                    n = self.store.demote(keys, b.dst)
                else:
                    n = self.store.promote(keys, b.dst, background=b.background)
            except Exception as exc:  # noqa: BLE001 - one bad batch must not stop placement
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._m_errors.inc()
                log.warning("placement.apply_failed", action=b.action.value, blocks=len(keys),
                            error=self.last_error)
                n = 0
            moved += n
            if n:
                self._m_moves.labels(b.action.value, b.reason.value).inc(n)
            if b.rows is not None:
                self.stats.moved(b.rows, CODE_OF[b.dst])
                if b.reason.is_prefetch and b.action is Action.PROMOTE and b.dst is not None:
                    self.stats.note_raised(b.rows, CODE_OF[b.dst])
        return moved

    def _sweep(self) -> None:
        """Check the next few rows against the store: forget blocks it no longer has."""
        rows = self.stats.sweep(SWEEP_ROWS)
        if rows.size == 0:
            return
        keys = self.stats.keys_of(rows)
        st = self.store.block_states(keys)
        gone = [keys[i] for i in np.flatnonzero(~st.known).tolist()]
        if gone:
            g = self.stats.rows_of(gone)
            if self.heat is not None:
                self.heat.clear(g)
            self.stats.forget(g)

    def _safe(self, fn: Callable[[], object], what: str) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - log, count, keep the service alive
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._m_errors.inc()
            log.exception("placement.failed", what=what)

    # ------------------------------------------------------------------ warm-up / summary
    def save_summary(self) -> None:
        if self.summary_path is None:
            return
        self.ingest()  # the sessions of accesses the prefetcher has seen are recorded first
        try:
            save_summary(self.summary_path, self.stats.sessions,
                         max_sessions=max(32, 4 * self.config.warmup_sessions))
        except OSError as exc:
            log.warning("placement.summary_save_failed", path=str(self.summary_path),
                        error=str(exc))

    def warmup(self) -> int:
        """Load the most used sessions of the persisted summary (before the first tick)."""
        if self.summary_path is None or self.config.warmup_sessions <= 0:
            return 0
        try:
            summary = load_summary(self.summary_path)
        except ValueError as exc:
            log.warning("placement.summary_unreadable", error=str(exc))
            return 0
        if not summary:
            return 0
        caps = self.capacities()
        n = 0
        for keys, tier in self.prefetcher.warmup_wants(summary, self.config.warmup_sessions,
                                                       caps.hot // 2):
            try:
                moved = self.store.promote(keys, tier)
            except Exception as exc:  # noqa: BLE001 - warm-up is best effort
                self.errors += 1
                log.warning("placement.warmup_failed", error=str(exc))
                continue
            n += moved
            if moved:
                self._m_moves.labels("promote", "warmup").inc(moved)
                self.stats.note_raised(self.stats.ensure_rows(keys), CODE_OF[tier])
        self.warmed_up = n
        log.info("placement.warmed_up", blocks=n,
                 sessions=min(len(summary), self.config.warmup_sessions))
        return n

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.warmup()
        self._stop.clear()
        if self.scheduler is not None:
            self._job = self.scheduler.add_job(
                self._safe, "interval", args=(self.run_round, "round"),
                seconds=self.config.interval_s, id="placement-round", replace_existing=True,
                max_instances=1, coalesce=True)
        self._thread = threading.Thread(target=self._loop, name="kvagentd-placement",
                                        daemon=True)
        self._thread.start()
        log.info("placement.started", policy=self.policy.name, interval_s=self.config.interval_s)

    def stop(self) -> None:
        self._stop.set()
        self.feed.wake()
        if self._job is not None:
            try:
                self._job.remove()
            except LookupError:  # the scheduler already shut down and dropped its jobs
                pass
            self._job = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self.save_summary()

    def _loop(self) -> None:
        own_rounds = self.scheduler is None
        next_round = time.monotonic() + self.config.interval_s
        while not self._stop.is_set():
            timeout = max(0.0, next_round - time.monotonic()) if own_rounds else 1.0
            self.feed.wait(timeout)
            if self._stop.is_set():
                break
            self._safe(self.flush_prefetch, "prefetch")
            if own_rounds and time.monotonic() >= next_round:
                self._safe(self.run_round, "round")
                next_round = time.monotonic() + self.config.interval_s

    def reload(self, config: HasPlacementOptions) -> None:
        """Apply a new `placement` section (policy, factors, intervals)."""
        o = config.placement
        with self._lock:
            old = self.config
            self.config = o
            self.prefetcher.lead_s = o.prefetch_lead_s
            self.prefetcher.interval_s = o.interval_s
            self.policy = make_policy(o.policy, params_of(o))
            self.heat = self._heat_for(self.policy, self.heat)
        if self._job is not None and o.interval_s != old.interval_s:
            self._job.reschedule("interval", seconds=o.interval_s)
        log.info("placement.reloaded", policy=o.policy, interval_s=o.interval_s)

    def health(self) -> dict[str, Any] | None:
        return None

    def status(self) -> dict[str, object]:
        caps = self._caps
        per_access = (1e6 * self.decision_s / self.decided_accesses
                      if self.decided_accesses else None)
        return {"policy": self.policy.name, "interval_s": self.config.interval_s,
                "running": self._thread is not None and self._thread.is_alive(),
                "rounds": self.rounds, "errors": self.errors,
                "listener_errors": self.listener_errors, "last_error": self.last_error,
                "capacity_blocks": {"hot": caps.hot, "warm": caps.warm} if caps else None,
                "last_round": self.last_round.as_dict() if self.last_round else None,
                "decision_us_per_accessed_block": per_access,
                "warmed_up_blocks": self.warmed_up,
                "blocks": len(self.stats), "sessions": len(self.stats.sessions),
                "memory_bytes": {"stats": self.stats.nbytes,
                                 "heat": self.heat.nbytes if self.heat is not None else 0},
                "feed": {"recorded": self.feed.recorded, "dropped": self.feed.dropped,
                         "pending": len(self.feed) + len(self._early)},
                "prefetch": self.prefetcher.stats() if self.policy.uses_prefetch else None,
                "prefetched_blocks": self.stats.prefetch_outcomes(),
                "trace": {"capacity": self.trace.capacity, "events": len(self.trace),
                          "recorded": self.trace.recorded}}
