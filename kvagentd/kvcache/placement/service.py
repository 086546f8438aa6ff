"""The placement service: heat map + trace + prefetcher fed by the store's accesses, a policy
round every `placement.interval_s`, and the one step that applies a plan to the store.

    store.record_access -> feed.record ... ingest -> heat.record, trace.record, prefetcher.observe
    every interval: snapshot -> policy.plan(...) -> apply(plan) (demote, evict, promote)
    on a cold read: the session's following blocks -> store.promote(..., background=True)

A round that raises is logged and counted; the service keeps running (a prefetch thread that
dies on one exception and never restarts is a field failure of peer systems).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvagentd.config import KVConfig, PlacementConfig

from ..base import BlockKey, Tier
from .base import PlacementStore
from .feed import Access, AccessFeed
from .heat import HeatMap, load_summary
from .policy import (COLD, HOT, NONE, WARM, Action, Capacities, Move, Plan, PlacementPolicy,
                     PolicyParams, SnapshotView, make_policy)
from .prefetch import Prefetcher
from .trace_recorder import TraceRecorder

log = structlog.get_logger(__name__)

_CODE_TIER = {HOT: Tier.HOT, WARM: Tier.WARM, COLD: Tier.COLD}
_TIER_CODE = {v: k for k, v in _CODE_TIER.items()}
SUMMARY_FILE = "heat-summary.json"
SUMMARY_EVERY_ROUNDS = 60
GC_EVERY_ROUNDS = 30


def params_of(cfg: PlacementConfig, kv: KVConfig) -> PolicyParams:
    return PolicyParams(hot_factor=cfg.hot_factor, warm_factor=cfg.warm_factor,
                        hysteresis=cfg.hysteresis, window_fraction=cfg.window_fraction,
                        cold_ttl_s=kv.cold_ttl_s, active_s=2.0 * cfg.interval_s)


def make_prefetcher(cfg: PlacementConfig) -> Prefetcher:
    return Prefetcher(lead_s=cfg.prefetch_lead_s, interval_s=cfg.interval_s)


@dataclass(frozen=True, slots=True)
class RoundReport:
    at: float
    policy: str
    blocks: int
    moves: dict[str, int]
    applied: int
    decision_s: float
    apply_s: float
    mean_heat: float

    def as_dict(self) -> dict[str, object]:
        return {"at": self.at, "policy": self.policy, "blocks": self.blocks, "moves": self.moves,
                "applied": self.applied, "decision_s": self.decision_s, "apply_s": self.apply_s,
                "mean_heat": self.mean_heat}


class PlacementService:
    """Decides where blocks live and applies it to `store`.

    `feed` is the access listener `store` reports to. `scheduler` (APScheduler 3) runs the
    rounds as a job when given; otherwise the service's own thread does. Either way that thread
    ingests accesses as they come and issues neighbour prefetches as soon as a cold read is
    seen. `clock` is wall time (tests and the simulator pass their own)."""

    def __init__(self, store: PlacementStore, feed: AccessFeed, config: PlacementConfig,
                 kv_config: KVConfig, scheduler: Any = None, *,
                 clock: Callable[[], float] = time.time, summary_path: str | Path | None = None,
                 registry: CollectorRegistry | None = None, persist_summary: bool = True) -> None:
        self.store = store
        self.feed = feed
        self.config = config
        self.kv_config = kv_config
        self.scheduler = scheduler
        self.clock = clock
        self.summary_path = Path(summary_path) if summary_path is not None else (
            Path(kv_config.cold_dir) / SUMMARY_FILE)
        self.persist_summary = persist_summary
        self.heat = HeatMap(config.heatmap_window)
        self.trace = TraceRecorder(config.trace_capacity)
        self.prefetcher = make_prefetcher(config)
        self.policy: PlacementPolicy = make_policy(config.policy, params_of(config, kv_config),
                                                   self.prefetcher)
        self.rounds = 0
        self.errors = 0
        self.listener_errors = 0
        self.last_round: RoundReport | None = None
        self.last_error: str | None = None
        self.warmed_up = 0
        self._lock = threading.Lock()  # one round / apply at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._job: Any = None
        reg = registry if registry is not None else CollectorRegistry()
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
        self._tier_by_row = np.full(1024, NONE, dtype=np.int8)

    def capacities(self) -> Capacities:
        """Hot / warm capacity in blocks, as the store's pools say."""
        return Capacities(self.store.pool(Tier.HOT).capacity, self.store.pool(Tier.WARM).capacity)

    def _tiers_of(self, keys: Sequence[BlockKey]) -> list[Tier | None]:
        """Where `keys` were at the last round (None: unknown); marks them hot from now on."""
        rows = self.heat.rows_of(keys)
        codes = self._tier_by_row
        out: list[Tier | None] = []
        for r in rows.tolist():
            out.append(_CODE_TIER.get(int(codes[r])) if 0 <= r < codes.shape[0] else None)
        ok = rows[(rows >= 0) & (rows < codes.shape[0])]
        codes[ok] = HOT
        return out

    # ------------------------------------------------------------------ access path
    def ingest(self) -> int:
        """Take every access the feed holds into heat, trace and prefetcher; returns how many
        events. An event that fails is counted and skipped: it must not stop placement."""
        events = self.feed.drain()
        for ev in events:
            try:
                self._ingest_one(ev)
            except Exception:  # noqa: BLE001 - bookkeeping of one event must not stop placement
                self.listener_errors += 1
                log.exception("placement.ingest_failed", session=ev.session)
        return len(events)

    def _ingest_one(self, ev: Access) -> None:
        """One access event: where each block was (as of the last round, the trace column and
        the neighbour prefetch trigger), heat, trace, prefetcher."""
        keys = list(ev.keys)
        tiers = self._tiers_of(keys)
        tick = self.heat.record(keys, ev.session)
        self.trace.record(tick, ev.time, ev.session, keys, tiers)
        cold = [k for k, t in zip(keys, tiers) if t is Tier.COLD]
        self.prefetcher.observe(ev.session, keys, ev.time, cold)

    def flush_prefetch(self) -> int:
        """Ingest pending accesses, then issue queued neighbour prefetches on the store's
        background queue (only under `heat+prefetch`; other policies drop them, so policies
        compare cleanly)."""
        self.ingest()
        n = 0
        urgent = self.prefetcher.take_urgent()
        if self.policy.name != "heat+prefetch":
            return 0
        for u in urgent:
            self._make_room_for(u.keys, u.tier)
            moved = self.store.promote(list(u.keys), u.tier, background=True)
            n += moved
            if moved:
                self._m_moves.labels("promote", u.reason.value).inc(moved)
                self._mark(u.keys, u.tier)
        return n

    def _make_room_for(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        """Demote the coldest blocks of `tier` (by the last round's heat) so a prefetch of
        `keys` finds room; the store only promotes into free slots."""
        codes = self._tier_by_row
        code = _TIER_CODE[tier]
        rows = self.heat.rows_of(list(keys))
        ok = rows[(rows >= 0) & (rows < codes.shape[0])]
        need = int(np.count_nonzero(codes[ok] != code)) + int(np.count_nonzero(rows < 0))
        if tier is Tier.COLD:
            return 0
        members = np.flatnonzero(codes == code)
        free = self.store.pool(tier).num_free
        short = need - free
        if short <= 0:
            return 0
        heat = self.heat.last_heat
        members = members[~np.isin(members, ok)]
        score = np.zeros(members.size, dtype=np.float32)
        inside = members < heat.shape[0]
        score[inside] = heat[members[inside]]
        order = members[np.argsort(score, kind="stable")].tolist()
        lower = Tier.WARM if tier is Tier.HOT else Tier.COLD
        moved = 0
        # the tier view is as of the last round: a candidate that has moved since is skipped
        # by the store and forgotten here, and the next coldest is tried (a few passes)
        for _ in range(4):
            if short <= 0 or not order:
                break
            batch, order = order[:short], order[short:]
            vkeys = [k for k in (self.heat.key_of(r) for r in batch) if k is not None]
            n = self.store.demote(vkeys, lower) if vkeys else 0
            moved += n
            short -= n
            self._tier_by_row[batch] = NONE
            if n:
                self._m_moves.labels("demote", "capacity").inc(n)
        return moved

    def _mark(self, keys: Sequence[BlockKey], tier: Tier) -> None:
        rows = self.heat.rows_of(list(keys))
        ok = rows[(rows >= 0) & (rows < self._tier_by_row.shape[0])]
        self._tier_by_row[ok] = _TIER_CODE[tier]

    # ------------------------------------------------------------------ rounds
    def run_round(self) -> Plan:
        """One placement round: snapshot -> plan -> apply. Raises on failure (see `_safe`)."""
        self.ingest()
        with self._lock:
            now = self.clock()
            t0 = time.perf_counter()
            snap = self.store.snapshot()
            view = SnapshotView.of(snap)
            plan = self.policy.plan(view, self.heat, self.capacities(), now)
            t1 = time.perf_counter()
            self._note_tiers(view, plan)
            applied = self.apply(plan)
            t2 = time.perf_counter()
            self.rounds += 1
            if self.rounds % GC_EVERY_ROUNDS == 0:
                self._forget_gone(snap)
            self.last_round = RoundReport(now, plan.policy, plan.considered, plan.counts(),
                                          applied, t1 - t0, t2 - t1, plan.mean_heat)
            self._m_rounds.inc()
            self._m_decision.set(t1 - t0)
            self._m_blocks.set(plan.considered)
        if self.rounds % SUMMARY_EVERY_ROUNDS == 0:
            self.save_summary()
        return plan

    def apply(self, plan: Plan) -> int:
        """Execute `plan` in order, batching runs of alike moves; returns blocks moved.

        A failing batch is logged and counted; the rest of the plan still runs."""
        moved = 0
        batch: list[Move] = []

        def flush() -> None:
            nonlocal moved
            if not batch:
                return
            m0 = batch[0]
            keys = [m.key for m in batch]
            try:
                if m0.action is Action.EVICT:
                    n = self.store.evict(keys)
                    self.heat.forget(keys)
                elif m0.action is Action.DEMOTE:
                    assert m0.dst is not None
                    n = self.store.demote(keys, m0.dst)
                else:
                    assert m0.dst is not None
                    n = self.store.promote(keys, m0.dst, background=m0.background)
            except Exception as exc:  # noqa: BLE001 - one bad batch must not stop placement
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._m_errors.inc()
                log.warning("placement.apply_failed", action=m0.action.value, blocks=len(keys),
                            error=self.last_error)
                n = 0
            moved += n
            if n:
                self._m_moves.labels(m0.action.value, m0.reason.value).inc(n)
            batch.clear()

        for m in plan:
            if batch and (m.action, m.dst, m.reason, m.background) != (
                    batch[0].action, batch[0].dst, batch[0].reason, batch[0].background):
                flush()
            batch.append(m)
        flush()
        return moved

    def _note_tiers(self, view: SnapshotView, plan: Plan) -> None:
        """Remember each block's tier (by heat row) for the access path."""
        rows = self.heat.rows_of(view.keys)
        size = max(self.heat.high_water, 1)
        if self._tier_by_row.shape[0] < size:
            grown = np.full(size * 2, NONE, dtype=np.int8)
            grown[: self._tier_by_row.shape[0]] = self._tier_by_row
            self._tier_by_row = grown
        ok = rows >= 0
        self._tier_by_row[rows[ok]] = view.tier[ok]
        for m in plan:
            r = self.heat.row_of(m.key)
            if r is not None and r < self._tier_by_row.shape[0]:
                self._tier_by_row[r] = NONE if m.dst is None else _TIER_CODE[m.dst]

    def _forget_gone(self, snap: Sequence[Any]) -> None:
        known = {b.key for b in snap}
        gone = [k for k in self.heat.keys() if k not in known]
        if gone:
            self.heat.forget(gone)

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
        if not self.persist_summary:
            return
        try:
            self.heat.save_summary(self.summary_path,
                                   max_sessions=max(32, 4 * self.config.warmup_sessions))
        except OSError as exc:
            log.warning("placement.summary_save_failed", path=str(self.summary_path),
                        error=str(exc))

    def warmup(self) -> int:
        """Load the hottest sessions of the persisted heat summary (before the first tick)."""
        if not self.persist_summary:
            return 0
        try:
            summary = load_summary(self.summary_path)
        except ValueError as exc:
            log.warning("placement.summary_unreadable", error=str(exc))
            return 0
        if not summary or self.config.warmup_sessions <= 0:
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
        self.warmed_up = n
        log.info("placement.warmed_up", blocks=n, sessions=min(len(summary),
                                                               self.config.warmup_sessions))
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

    def reload(self, config: Any) -> None:
        """Apply a new `placement` section (a Config or a PlacementConfig)."""
        cfg: PlacementConfig = getattr(config, "placement", config)
        kv: KVConfig = getattr(config, "kv", self.kv_config)
        with self._lock:
            old = self.config
            self.config, self.kv_config = cfg, kv
            self.prefetcher.lead_s = cfg.prefetch_lead_s
            self.prefetcher.interval_s = cfg.interval_s
            self.policy = make_policy(cfg.policy, params_of(cfg, kv), self.prefetcher)
        if self._job is not None and cfg.interval_s != old.interval_s:
            self._job.reschedule("interval", seconds=cfg.interval_s)
        log.info("placement.reloaded", policy=cfg.policy, interval_s=cfg.interval_s)

    def health(self) -> dict[str, Any] | None:
        return None

    def status(self) -> dict[str, object]:
        caps = self.capacities()
        return {"policy": self.policy.name, "interval_s": self.config.interval_s,
                "running": self._thread is not None and self._thread.is_alive(),
                "rounds": self.rounds, "errors": self.errors,
                "listener_errors": self.listener_errors, "last_error": self.last_error,
                "capacity_blocks": {"hot": caps.hot, "warm": caps.warm},
                "last_round": self.last_round.as_dict() if self.last_round else None,
                "warmed_up_blocks": self.warmed_up,
                "heat": self.heat.stats(), "prefetch": self.prefetcher.stats(),
                "trace": {"capacity": self.trace.capacity, "events": len(self.trace),
                          "recorded": self.trace.recorded}}
