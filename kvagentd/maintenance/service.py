"""The maintenance service: defrag, SSD health, failover and scrub on the daemon's scheduler.

    m = Maintenance(config, store, cold, scheduler, is_idle=executor_idle)
    m.start() ... m.stop()

`cold` is the store's cold tier (a `FailoverColdStore` in the daemon, built by the composition
root); failover operations need that pair, the rest any `ColdTier`.

`is_idle(expected_s)` (or a zero-argument callable) says whether the daemon may pause for about
`expected_s` seconds now: no request running and no agent tick due within that time. The timed
defrag runs only then, and stops between chunks when it turns False; so does the rewrite of
mostly dead cold segments (`compact_dead`, from the health timer).
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any
from collections.abc import Callable

import structlog
import torch

from kvagentd.config import Config
from kvagentd.kvcache.base import ColdTier, Tier
from kvagentd.kvcache.cold.causes import Cause
from kvagentd.kvcache.cold.failover import FailoverColdStore
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.maintenance import defrag as dfr
from kvagentd.maintenance.health import HealthMonitor
from kvagentd.maintenance.scrub import Scrubber
from kvagentd.maintenance import tune as tn

log = structlog.get_logger(__name__)

JOB_IDS = ("maintenance.defrag", "maintenance.health", "maintenance.scrub")


class DefragBusy(RuntimeError):
    """A defrag is already running."""


def _as_idle(fn: Callable[..., bool]) -> Callable[[float], bool]:
    try:
        takes = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes = False
    return fn if takes else (lambda _s: fn())


COMPACT_IDLE_S = 1.0  # a rewriting compaction waits for this long a gap before the next tick
# A daemon that is never idle still rewrites this many live bytes per health check (every
# minute), deadest segments first, once dead bytes pass twice `dead_limit`: at an NVMe's
# 1-2 GB/s that holds the cold tier's locks well under 100 ms a minute, and a segment 90 %
# dead gives back nine bytes per byte copied.
BUSY_COPY_BYTES = 64 << 20


def dead_limit(cfg: Config) -> int:
    """Dead bytes the SSD may hold before compaction: a quarter of the cold capacity (so the
    tier's files stay within about 1.25x what it holds; a rewrite of segments at least half
    dead copies at most one byte per byte it frees), and never less than four segments, so a
    small tier does not compact on every check."""
    return max(4 * int(cfg.kv.segment_bytes), int(cfg.kv.cold_capacity_bytes) // 4)


def _dead_bytes(cold: ColdTier) -> int:
    st = cold.stats()
    return int(st.get("dead_bytes", 0) or 0) if isinstance(st, dict) else 0


class Maintenance:
    """start/stop/status/reload plus the operations behind kvctl defrag/tune/failover/scrub."""

    def __init__(self, config: Config, store: TieredKVStore | None, cold: ColdTier | None,
                 scheduler: Any, is_idle: Callable[..., bool] = lambda: True) -> None:
        self.config = config
        self.store, self.cold, self.scheduler = store, cold, scheduler
        self.is_idle = _as_idle(is_idle)
        self.failover = cold if isinstance(cold, FailoverColdStore) else None
        self.monitor = HealthMonitor(
            config, store=store, cold=cold,
            on_failure=self.failover.activate if self.failover else None,
            on_probe=self.failover.probe if self.failover else None,
            space_wanted=self.failover.space_wanted if self.failover else None)
        self.scrubber = Scrubber(cold, int(config.maintenance.scrub_rate_bytes_per_s)) \
            if cold is not None else None
        self._defrag_lock = threading.Lock()
        self._scrub_thread: threading.Thread | None = None
        # Seconds per block move: a pessimistic 1 GB/s copy until a run has measured it.
        self._per_move_s = (store.geometry.block_bytes / 1e9) if store is not None else 1e-3
        self.defrag_runs = 0
        self.defrag_skipped_busy = 0
        self.last_defrag: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []  # (time, ratio) per tier after each defrag
        self.started = False

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        m = self.config.maintenance
        if self.scheduler is not None:
            self._add("maintenance.defrag", self._defrag_job, m.defrag_interval_s)
            self._add("maintenance.health", self._health_job, m.health_interval_s)
            if self.scrubber is not None:
                self._add("maintenance.scrub", self._scrub_job, m.scrub_interval_s)
        self.started = True
        # act on the status file right away (read-only, failed SSD)
        self._health_job(startup=True)

    def _add(self, job_id: str, fn: Callable[[], Any], every_s: float) -> None:
        self.scheduler.add_job(fn, "interval", seconds=every_s, id=job_id, name=job_id,
                               replace_existing=True, coalesce=True, max_instances=1,
                               misfire_grace_time=max(1, int(every_s)))

    def stop(self) -> None:
        if self.scrubber is not None:
            self.scrubber.stop()
        if self.scheduler is not None:
            for job_id in JOB_IDS:
                if self.scheduler.get_job(job_id) is not None:
                    self.scheduler.remove_job(job_id)
        self.started = False

    def reload(self, config: Config) -> None:
        """Apply new timer intervals (the reloadable maintenance fields)."""
        self.config = config
        self.monitor.cfg = config
        if self.started and self.scheduler is not None:
            m = config.maintenance
            for job_id, every in (("maintenance.defrag", m.defrag_interval_s),
                                  ("maintenance.health", m.health_interval_s),
                                  ("maintenance.scrub", m.scrub_interval_s)):
                if self.scheduler.get_job(job_id) is not None:
                    self.scheduler.reschedule_job(job_id, trigger="interval", seconds=every)

    def status(self) -> dict[str, Any]:
        return {"fragmentation": self.fragmentation(),
                "defrag": {"runs": self.defrag_runs, "skipped_busy": self.defrag_skipped_busy,
                           "last": self.last_defrag},
                "health": self.monitor.status(),
                "failover": self.failover_status(),
                "scrub": self.scrubber.status() if self.scrubber else None}

    def health(self) -> dict[str, Any]:
        """The service itself: its timers scheduled. The cold tier's state (shadow, read-only,
        wear) is judged by the daemon's health checks from `failover.view()` and
        `monitor.last`."""
        if not self.started:
            return {"status": "failing", "detail": "maintenance timers are not running"}
        last = self.monitor.last
        checked = "SSD health not checked yet" if last is None else f"SSD health {last.state}"
        return {"status": "ok", "detail": f"timers scheduled; {checked}"}

    # ---- jobs ----------------------------------------------------------------------------
    def _defrag_job(self) -> None:
        for tier in (Tier.HOT, Tier.WARM):
            plan = self.plan(tier)
            if plan is None or not plan.moves or plan.before.ratio == 0.0:
                continue
            expected = len(plan.moves) * self._per_move_s
            if not self.is_idle(expected):
                self.defrag_skipped_busy += 1
                log.info("defrag_deferred", tier=tier.value, reason="busy", expected_s=expected)
                return
            try:
                self.defrag(tier.value, should_continue=lambda: self.is_idle(0.0))
            except DefragBusy:
                return

    def _health_job(self, *, startup: bool = False) -> None:
        self.monitor.check()
        if self.store is not None:
            expired = self.store.expire_cold()  # cold TTL (refreshed on access)
            if expired:
                log.info("cold_ttl_expired", blocks=expired)
        if not startup:  # a backlog of dead segments must not hold up the start
            self.compact_dead()

    def compact_dead(self) -> int:
        """Reclaim the SSD space of dead cold records (replaced, evicted or dropped: they stay
        in their segment files until compaction) once it passes `dead_limit`: segments with
        nothing live go at once (no copying: a short pause of cold I/O), and segments at least
        half dead are rewritten when the daemon is idle (compaction holds the cold tier's
        locks while it copies). A daemon never idle long enough still rewrites the deadest
        of them, `BUSY_COPY_BYTES` a check, once dead bytes pass twice the limit, so its
        files stay bounded however busy it is. Returns bytes reclaimed."""
        if self.cold is None:
            return 0
        limit = dead_limit(self.config)
        dead = _dead_bytes(self.cold)
        if dead <= limit:
            return 0
        reclaimed = int(self.cold.compact(1.0) or 0)
        busy = False
        if dead - reclaimed > limit:
            if self.is_idle(COMPACT_IDLE_S):
                reclaimed += int(self.cold.compact(0.5) or 0)
            elif dead - reclaimed > 2 * limit:
                busy = True
                reclaimed += int(self.cold.compact(0.5, max_copy_bytes=BUSY_COPY_BYTES) or 0)
        log.info("cold_compacted", reason="dead bytes past the limit", dead_bytes=dead,
                 limit=limit, reclaimed_bytes=reclaimed, busy=busy)
        return reclaimed

    def _scrub_job(self) -> None:
        if self.scrubber is not None:
            self.scrubber.run()

    # ---- defrag --------------------------------------------------------------------------
    def _pool(self, tier: Tier) -> BlockPool:
        assert self.store is not None
        return self.store.pool(tier)

    def measure(self, tier: Tier) -> dfr.FragStats | None:
        if self.store is None:
            return None
        pool = self._pool(tier)
        used, free, run, ratio = dfr.measure_bitmap(self.store.occupancy(tier))
        return dfr.FragStats(tier.value, pool.capacity, used, free, run, ratio,
                             cuda=dfr.cuda_memory(pool.device) if tier is Tier.HOT else None)

    def fragmentation(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.store is not None:
            for tier in (Tier.HOT, Tier.WARM):
                s = self.measure(tier)
                out[tier.value] = s.as_dict() if s else None
        if self.cold is not None:
            st = self.cold.stats()
            prim = st.get("primary", st) if isinstance(st, dict) else {}
            out["cold"] = {k: prim.get(k) for k in ("segments", "live_bytes", "dead_bytes",
                                                    "bytes", "capacity_bytes") if k in prim}
        return out

    def plan(self, tier: Tier) -> dfr.DefragPlan | None:
        if self.store is None:
            return None
        pool = self._pool(tier)
        return dfr.plan_compaction(tier.value, self.store.occupancy(tier), self.store.busy_slots(tier),
                                   cuda=dfr.cuda_memory(pool.device) if tier is Tier.HOT else None)

    def defrag(self, tier: str = "all", *, dry_run: bool = False,
               progress: Callable[[str, int, int], None] | None = None,
               should_continue: Callable[[], bool] = lambda: True) -> dict[str, Any]:
        """Plan (and unless `dry_run`, apply) compaction of `tier` ("hot"|"warm"|"cold"|"all")."""
        tiers = ("hot", "warm", "cold") if tier == "all" else (tier,)
        if not self._defrag_lock.acquire(blocking=False):
            raise DefragBusy("a defrag is already running")
        try:
            results = [self._defrag_one(t, dry_run, progress, should_continue) for t in tiers]
        finally:
            self._defrag_lock.release()
        if not dry_run:
            self.defrag_runs += 1
            self.last_defrag = results
        return {"dry_run": dry_run, "results": results}

    def _defrag_one(self, tier: str, dry_run: bool,
                    progress: Callable[[str, int, int], None] | None,
                    should_continue: Callable[[], bool]) -> dict[str, Any]:
        if tier == "cold":
            if self.cold is None:
                return {"tier": "cold", "note": "no cold tier"}
            if dry_run:
                return {"tier": "cold", "dry_run": True, "before": self.fragmentation().get("cold")}
            before = self.fragmentation().get("cold")
            out = self.cold.compact()
            return {"tier": "cold", "before": before, "after": self.fragmentation().get("cold"),
                    "compaction": out}
        t = Tier(tier)
        plan = self.plan(t)
        if plan is None:
            return {"tier": tier, "note": "no store"}
        if dry_run:
            res = dfr.DefragResult(tier, len(plan.moves), dry_run=True,
                                   before=plan.before.as_dict(), plan=plan.as_dict())
            return res.as_dict()
        pool = self._pool(t)
        res = dfr.apply_plan(self.store, t, plan,
                             max_pause_s=self.config.maintenance.defrag_max_pause_s,
                             progress=(lambda d, n: progress(tier, d, n)) if progress else None,
                             should_continue=should_continue,
                             first_chunk=max(1, int(0.5 * self.config.maintenance.defrag_max_pause_s
                                                    / self._per_move_s)))
        if pool.device.type == "cuda":
            torch.cuda.empty_cache()
        if res.moved:
            self._per_move_s = max(1e-6, sum(res.pauses_s) / max(1, res.moved + res.skipped))
        after = self.measure(t)
        res.before, res.after = plan.before.as_dict(), after.as_dict() if after else None
        res.plan = plan.as_dict(max_moves=16)
        self.history.append({"t": time.time(), "tier": tier,
                             "ratio_before": plan.before.ratio,
                             "ratio_after": after.ratio if after else None})
        del self.history[:-256]
        log.info("defrag_done", tier=tier, moved=res.moved, skipped=res.skipped,
                 max_pause_s=round(res.max_pause_s, 4), ratio_before=round(plan.before.ratio, 4),
                 ratio_after=round(after.ratio, 4) if after else None)
        return res.as_dict()

    # ---- tune / failover / scrub ---------------------------------------------------------
    def tune(self, apply: bool = False) -> dict[str, Any]:
        """Current vs recommended; `apply` raises `TunePermissionError` unless root."""
        report = tn.inspect(self.config.kv.cold_dir, self.config.maintenance)
        changed: list[str] = []
        if apply:
            changed = tn.apply(report)
            report = tn.inspect(self.config.kv.cold_dir, self.config.maintenance)
        return {**report.as_dict(), "applied": changed}

    def failover_status(self) -> dict[str, Any]:
        if self.failover is None:
            return {"serving": "ssd" if self.cold is not None else "none", "shadow": None}
        return self.failover.status()

    def failover_activate(self, reason: str = "operator request") -> dict[str, Any]:
        if self.failover is None:
            return {"activated": False, "note": "no shadow configured"}
        changed = self.failover.activate(reason, Cause.OPERATOR)
        return {"activated": changed, **self.failover.status()}

    def failover_restore(self, reason: str = "operator request") -> dict[str, Any]:
        if self.failover is None:
            return {"restored": 0, "note": "no shadow configured"}
        out = self.failover.restore(reason)
        return {**out, **self.failover.status()}

    def scrub(self, rate_bytes_per_s: float | None = None) -> dict[str, Any]:
        """One scrub pass now, in this thread; returns its report."""
        if self.scrubber is None:
            return {"note": "no cold tier"}
        return self.scrubber.run(rate_bytes_per_s).as_dict()

    def scrub_in_background(self) -> dict[str, Any]:
        """Start a scrub pass on its own thread (a pass at the bounded rate can take long)."""
        if self.scrubber is None:
            return {"started": False, "note": "no cold tier"}
        t = self._scrub_thread
        if t is not None and t.is_alive():
            return {"started": False, "note": "a scrub is already running", **self.scrubber.status()}
        self._scrub_thread = threading.Thread(target=self.scrubber.run, name="kv-scrub", daemon=True)
        self._scrub_thread.start()
        return {"started": True, **self.scrubber.status()}

    def scrub_status(self) -> dict[str, Any]:
        running = self._scrub_thread is not None and self._scrub_thread.is_alive()
        return {"running": running, **(self.scrubber.status() if self.scrubber else {})}


__all__ = ["DefragBusy", "Maintenance"]
