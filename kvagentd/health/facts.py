"""The facts the health checks judge, gathered in one pass from the daemon and its services.

`gather(...)` only reads: services' `health()`, `Agent.asset_views()`,
`FailoverColdStore.view()`, the store's lost-block counter, the SSD monitor's last report,
the scheduler and the `JobWatch`. A probe that raises becomes a fact (the service's check
fails with the error), never an exception out of here. The checks themselves are pure
functions of `Facts` (`checks.assess`), so tests build `Facts` directly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import structlog

from kvagentd.agent.jobs import TICK_PREFIX
from kvagentd.scheduling.jobwatch import JobWatch, JobWindow
from kvagentd.daemon.status import host_status

if TYPE_CHECKING:
    from apscheduler.schedulers.base import BaseScheduler

    from kvagentd.agent.view import AssetView
    from kvagentd.config import Config
    from kvagentd.kvcache.cold import ColdView
    from kvagentd.maintenance.platform import PlatformFacts, PlatformWatch
    from kvagentd.maintenance.service import Maintenance
    from kvagentd.services import Services

log = structlog.get_logger(__name__)

# Scheduler job ids -> the service that owns them (a failing job puts its service in error).
JOB_OWNERS = (("agent.", "agent"), ("maintenance.", "maintenance"), ("placement", "placement"),
              ("remote.", "remote"))
T = TypeVar("T")


class JobFailure(NamedTuple):
    job_id: str
    errors: int  # total since start
    last_error: str | None
    last_error_age_s: float | None


class ServiceFacts(NamedTuple):
    name: str
    started: bool
    health: dict[str, Any] | None  # the service's own `health()` (None: it has no check)
    probe_error: str | None  # `health()` raised this
    failed_jobs: tuple[JobFailure, ...]  # its jobs that have failed since start


class TickFacts(NamedTuple):
    asset: str
    interval_s: float
    last_done_age_s: float | None  # since the last completed tick (None: none yet)
    waiting_s: float  # since the ticks were scheduled (how long "none yet" has lasted)
    paused: bool  # an operator paused the job
    window: JobWindow  # the last `health.window_s`


class WearFacts(NamedTuple):
    state: str  # ok | worn | failed | unknown | not checked
    percent: float | None
    error: str | None  # why the SMART status file gave no state (missing, garbled)
    file_age_s: float | None  # since the root oneshot wrote the status file
    stale_after_s: float  # the monitor's limit for a status file that stopped being rewritten


class DiskFacts(NamedTuple):
    path: str
    free_bytes: int | None
    error: str | None


@dataclass(frozen=True, slots=True)
class DaemonFacts:
    phase: str  # starting | running | stopping | stopped
    uptime_s: float
    main_loop_age_s: float | None  # since the main loop last made progress (None: not running)
    main_loop_limit_s: float
    scheduler_running: bool
    scheduler_jobs: int
    metrics_error: str | None = None  # the configured metrics listener could not listen
    config_rejected: str | None = None  # the file failed to load at the last reload
    config_pending: tuple[str, ...] = ()  # settings changed in the file that need a restart


@dataclass(frozen=True, slots=True)
class Facts:
    daemon: DaemonFacts
    services: tuple[ServiceFacts, ...] = ()
    ticks: tuple[TickFacts, ...] = ()
    assets: tuple[AssetView, ...] = ()
    cold: ColdView | None = None
    lost_blocks: int | None = None  # store counter since start (None: no store)
    wear: WearFacts | None = None
    memory_available: int = 0
    memory_total: int = 0
    disks: tuple[DiskFacts, ...] = ()
    free_space_floor: int = 0
    disk_full_below: int = 0  # less free than this is a full disk (one cold I/O unit)
    other_failed_jobs: tuple[JobFailure, ...] = field(default=())  # jobs of no service
    platform: PlatformFacts | None = None  # memory errors, throttling, links, the cold fs

    def counters(self) -> dict[str, int]:
        """What `kvctl health ack` can acknowledge, by check name: totals since start."""
        out: dict[str, int] = {}
        if self.cold is not None:
            out["checksum-failures"] = sum(c.get("corrupt", 0) for c in self.cold.counters.values())
            out["cold-full"] = sum(c.get("refused_full", 0) for c in self.cold.counters.values())
            out["cold-index"] = sum(1 for why in self.cold.index_discarded.values() if why)
        if self.lost_blocks is not None:
            out["lost-blocks"] = self.lost_blocks
        for s in self.services:
            for f in s.failed_jobs:
                out[f"job:{f.job_id}"] = f.errors
        for f in self.other_failed_jobs:
            out[f"job:{f.job_id}"] = f.errors
        if self.platform is not None:
            out["memory-errors"] = self.platform.edac_corrected
            out["thermal"] = self.platform.throttled
        return out


def gather(cfg: Config, services: Services, *, started: Collection[str], daemon: DaemonFacts,
           jobs: JobWatch, scheduler: BaseScheduler | None, now: float,
           platform: PlatformWatch | None = None) -> Facts:
    """Every fact the checks need, now (unix seconds); `platform`: the daemon's watch of the
    box (memory errors, throttling, links, the cold directory's filesystem)."""
    probe_errors: dict[str, str] = {}

    def probe(service: str, what: str, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except Exception as exc:  # a broken probe is its service's failing check, not a crash
            log.error("health_probe_failed", service=service, probe=what, exc_info=exc)
            probe_errors.setdefault(service, f"{what}: {type(exc).__name__}: {exc}")
            return default

    failures = _job_failures(jobs, now)
    owned: dict[str, list[JobFailure]] = {}
    other: list[JobFailure] = []
    for f in failures:
        owner = next((svc for prefix, svc in JOB_OWNERS if f.job_id.startswith(prefix)), None)
        (owned.setdefault(owner, []) if owner else other).append(f)
    views: Sequence[AssetView] = ()
    ticks: list[TickFacts] = []
    agent = services.agent
    if agent is not None and "agent" in started:
        views = probe("agent", "asset views", agent.asset_views, [])
        if cfg.agent.enabled:
            ticks = [_ticks(cfg, a.name, jobs, scheduler, now, agent.started_at)
                     for a in cfg.agent.assets]
    cold, store, maint = services.cold, services.store, services.maintenance
    cold_view = probe("store", "cold tier view", cold.view, None) if cold is not None else None
    lost = probe("store", "lost blocks", lambda: int(store.counters["lost"]), None) \
        if store is not None else None
    wear = probe("maintenance", "SSD monitor", lambda: _wear(cfg, maint, now), None) \
        if maint is not None else None
    plat = probe("maintenance", "platform", platform.read, None) \
        if platform is not None else None
    service_facts = []
    for name, svc in services.in_order():
        sf = _service(name, svc, name in started, tuple(owned.get(name, ())))
        if sf.probe_error is None and name in probe_errors:
            sf = sf._replace(probe_error=probe_errors[name])
        service_facts.append(sf)
    host = host_status([cfg.daemon.state_dir, cfg.kv.cold_dir])
    mem = host["memory"]
    disks = tuple(DiskFacts(d["path"], d.get("free_bytes"), d.get("error"))
                  for d in host["disks"])
    return Facts(daemon=daemon, services=tuple(service_facts), ticks=tuple(ticks),
                 assets=tuple(views), cold=cold_view, lost_blocks=lost, wear=wear,
                 memory_available=int(mem["available_bytes"]),
                 memory_total=int(mem["total_bytes"]), disks=disks,
                 free_space_floor=int(cfg.maintenance.free_space_floor_bytes),
                 disk_full_below=int(cfg.kv.io_unit_bytes),
                 other_failed_jobs=tuple(other), platform=plat)


def _service(name: str, svc: Any, started: bool, failed: tuple[JobFailure, ...]) -> ServiceFacts:
    try:
        h = svc.health() if started else None
    except Exception as exc:  # a failing probe is itself a failing check
        log.error("service_health_failed", service=name, exc_info=exc)
        return ServiceFacts(name, started, None, f"{type(exc).__name__}: {exc}", failed)
    return ServiceFacts(name, started, h, None, failed)


def _job_failures(jobs: JobWatch, now: float) -> list[JobFailure]:
    out = []
    for job_id in jobs.job_ids():
        rec = jobs.record(job_id)
        if rec is not None and rec.errors:
            out.append(JobFailure(job_id, rec.errors, rec.last_error,
                                  None if rec.last_error_t is None else now - rec.last_error_t))
    return out


def _ticks(cfg: Config, asset: str, jobs: JobWatch, scheduler: BaseScheduler | None, now: float,
           agent_started_at: float | None) -> TickFacts:
    job_id = TICK_PREFIX + asset
    rec = jobs.record(job_id)
    job = scheduler.get_job(job_id) if scheduler is not None else None
    return TickFacts(
        asset=asset, interval_s=cfg.agent.tick_interval_s,
        last_done_age_s=None if rec is None or rec.last_done is None else now - rec.last_done,
        waiting_s=0.0 if agent_started_at is None else max(0.0, now - agent_started_at),
        paused=job is not None and job.next_run_time is None,
        window=jobs.window(job_id, now - cfg.health.window_s))


def _wear(cfg: Config, m: Maintenance, now: float) -> WearFacts:
    stale = max(3 * cfg.maintenance.health_interval_s, 3600.0)  # as the monitor judges it
    last = m.monitor.last
    if last is None:
        return WearFacts("not checked", None, None, None, stale)
    written = last.status_file.get("written_at")
    return WearFacts(last.state, last.wear_percent, last.status_file.get("error"),
                     None if written is None else now - float(written), stale)
