"""The daemon's lifecycle: `run()` -> `startup()` -> `main_loop()` -> `shutdown()`.

Startup: logging, state directories, the job scheduler, the control socket, the services (built
by the composition root `kvagentd.services`, then started in order), then READY=1. The main
loop pings the systemd watchdog only while it runs and the control and scheduler threads are
alive, and publishes a STATUS line.
First SIGTERM/SIGINT (or POST /v1/shutdown): STOPPING=1, stop accepting, drain in-flight
requests for `daemon.drain_timeout_s`, stop services in reverse start order (they flush), remove
the socket, exit 0. A second SIGTERM/SIGINT exits at once. SIGHUP reloads the config file and
applies the fields in `config.RELOADABLE`; a bad file is reported and the running config kept.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Callable
from typing import Any

import structlog
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from kvagentd import __version__
from kvagentd.daemon import log as logsetup
from kvagentd.config import Config, ConfigError, load_config
from kvagentd.control.handlers import register_all
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.control.socketfile import ControlSocketInUse
from kvagentd.daemon.exitcodes import EX_OK, startup_exit_code
from kvagentd.health import (Acknowledgements, DaemonFacts, Facts, Report, Settled, assess,
                             commentaries, gather)
from kvagentd.agent.jobs import TICK_PREFIX
from kvagentd.scheduling.jobevents import JOB_EVENTS, JobEventListener
from kvagentd.scheduling.jobwatch import JobWatch
from kvagentd.kvcache.transitions import check_transition
from kvagentd.daemon.loop_requests import LoopRequests
from kvagentd.maintenance.platform import PlatformWatch
from kvagentd.metrics.registry import CoreMetrics, new_registry
from kvagentd.metrics.http import MetricsListener, start_listener
from kvagentd.daemon.reload import merge_reloadable
from kvagentd.metrics.scrape import Scrape, ScrapeCollector
from kvagentd.services import BuildContext, Service, Services, build_services
from kvagentd.daemon.status import GpuProbe, host_status
from kvagentd.daemon.systemd import Notifier

log = structlog.get_logger(__name__)

# Seconds of EXTEND_TIMEOUT_USEC requested before each service starts or stops.
SERVICE_START_ALLOWANCE_S = 300.0
SERVICE_STOP_ALLOWANCE_S = 120.0


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.STOPPING}),
    Phase.RUNNING: frozenset({Phase.STOPPING}),
    Phase.STOPPING: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}

STATUS_EVERY_S = 5.0  # the systemd STATUS line (and health transitions) are refreshed this often


class Daemon:
    """Owns the configuration, scheduler, metrics, services and the control server."""

    def __init__(self, config: Config, config_path: Path | None = None, *,
                 notifier: Notifier | None = None,
                 build: Callable[[Config, BuildContext], Services] = build_services) -> None:
        self.config = config
        self.config_path = config_path
        self.notifier = notifier or Notifier()
        self.metrics = new_registry()
        self.core_metrics = CoreMetrics(self.metrics)
        self.scheduler = BackgroundScheduler()
        self.jobs = JobWatch(period_of=self._job_period)
        self.scheduler.add_listener(JobEventListener(self.jobs, self.core_metrics, log),
                                    JOB_EVENTS)
        self.acks = Acknowledgements()
        m = config.maintenance  # the box's counters count from here (maintenance/platform.py)
        self.platform = PlatformWatch(m.sysfs_root, m.proc_root, config.kv.cold_dir)
        self.metrics.register(ScrapeCollector(self.scrape))
        self.settled = Settled()  # health's hysteresis: every report passes through it
        self.config_rejected: str | None = None  # the last reload's error (health: config)
        self.config_pending: tuple[str, ...] = ()  # fields a restart would change
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self._build = build
        self.services = Services()  # none until `startup` builds them
        self._started: list[tuple[str, Service]] = []
        self.router = Router()
        self.server: ControlServer | None = None
        self.metrics_listener: MetricsListener | None = None
        self.metrics_error: str | None = None  # why the metrics listener is not listening
        self.gpu = GpuProbe()
        self._phase = Phase.STARTING
        self._phase_lock = threading.Lock()
        self.requests = LoopRequests()
        self._last_progress = time.monotonic()
        self._last_status_line = ""

    # -- state -----------------------------------------------------------------------------

    def _job_period(self, job_id: str) -> float | None:
        """The fixed period of an interval job (for the runs a stall coalesced away)."""
        job = self.scheduler.get_job(job_id)
        trigger = job.trigger if job is not None else None
        return trigger.interval.total_seconds() if isinstance(trigger, IntervalTrigger) \
            else None

    @property
    def phase(self) -> str:
        return self._phase.value

    @property
    def ready(self) -> bool:
        return self._phase is Phase.RUNNING

    def _set_phase(self, new: Phase) -> None:
        with self._phase_lock:
            check_transition(_TRANSITIONS, self._phase, new, "daemon phase")
            log.debug("daemon_phase", old=self._phase.value, new=new.value)
            self._phase = new
        self.core_metrics.ready.set(1 if new is Phase.RUNNING else 0)

    def uptime_s(self) -> float:
        return time.monotonic() - self._t0

    # -- run -------------------------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until asked to stop, shut down. Returns the process exit code."""
        self.requests.install_signals()
        try:
            self.startup()
        except Exception as exc:  # any startup failure: stop what started, exit non-zero
            if self._stop_asked() and _qualname(exc) == "kvagentd.engine.model.LoadCancelled":
                log.info("startup_interrupted", reason=self.requests.stop_reason,
                         during="model load")
                self.shutdown()
                return EX_OK
            code = startup_exit_code(exc)
            if isinstance(exc, ConfigError | ControlSocketInUse | PermissionError):
                log.error("startup_failed", error=str(exc), exit_code=code)
            else:
                log.error("startup_failed", error=str(exc), exit_code=code, exc_info=exc)
            self.notifier.status(f"failed to start: {exc}")
            self.shutdown()
            return code
        if self.requests.stop_reason is None:
            self.main_loop()
        self.shutdown()
        return EX_OK

    def startup(self) -> None:
        cfg = self.config
        self.notifier.status("starting")
        log.info("daemon_starting", version=__version__, pid=os.getpid(),
                 config=str(self.config_path) if self.config_path else None)
        self.core_metrics.start_time.set(self.started_at)
        for d in (cfg.daemon.state_dir, cfg.daemon.cache_dir):
            _ensure_dir(Path(d))
        self.scheduler.start()
        register_all(self.router, self)
        # NOTE: listening before the services start lets operators watch a slow start
        # (status, readyz); every other route answers 503 not_ready until READY.
        self.server = ControlServer(cfg.control, self.router,
                                    observe=self.core_metrics.observe_request,
                                    is_ready=lambda: self.ready)
        self.server.start()
        self._start_metrics_listener()
        self.notifier.extend_timeout(SERVICE_START_ALLOWANCE_S)
        self.notifier.status("building services")
        self.services = self._build(cfg, BuildContext(self.scheduler, self.metrics,
                                                      on_phase=self._on_build_phase,
                                                      health=self.health,
                                                      job_record=self.jobs.record,
                                                      cancelled=self._stop_asked))
        for name, service in self.services.in_order():
            if self.requests.stop_reason is not None:
                log.info("startup_interrupted", reason=self.requests.stop_reason, before=name)
                return
            started = time.monotonic()
            self.notifier.extend_timeout(SERVICE_START_ALLOWANCE_S)
            self.notifier.status(f"starting {name}")
            service.start()
            self._started.append((name, service))
            log.info("service_started", service=name,
                     seconds=round(time.monotonic() - started, 3))
        self._set_phase(Phase.RUNNING)
        self._last_progress = time.monotonic()
        line = self._status_line()
        self.notifier.ready(line)
        self._last_status_line = line
        log.info("daemon_ready", socket=str(cfg.control.socket), services=self._started_names(),
                 startup_s=round(self.uptime_s(), 3))

    def _start_metrics_listener(self) -> None:
        if self.config.metrics.listen:
            self.metrics_listener, self.metrics_error = start_listener(
                self.config.metrics.listen, self.metrics)

    def _stop_asked(self) -> bool:
        return self.requests.stop_reason is not None

    def _on_build_phase(self, text: str) -> None:
        self.notifier.extend_timeout(SERVICE_START_ALLOWANCE_S)
        self.notifier.status(text)

    def _started_names(self) -> list[str]:
        return [name for name, _ in self._started]

    def main_loop(self) -> None:
        interval = self.config.daemon.main_loop_interval_s
        wd = self.notifier.watchdog_interval_s
        now = time.monotonic()
        next_watchdog = now
        next_status = now + STATUS_EVERY_S
        while self.requests.stop_reason is None:
            now = time.monotonic()
            timeout = interval if wd is None else max(0.0, min(interval, next_watchdog - now))
            self.requests.wait(timeout)
            if self.requests.take_reload():
                self.reload()
            if self.requests.stop_reason is not None:
                break
            self._last_progress = now = time.monotonic()
            self.core_metrics.loop_iterations.inc()
            if wd is not None and now >= next_watchdog:
                if self._threads_alive():
                    self.notifier.watchdog()
                    self.core_metrics.watchdog_pings.inc()
                else:
                    log.error("watchdog_withheld", reason="control or scheduler thread died")
                next_watchdog = now + wd
            if now >= next_status:
                next_status = now + STATUS_EVERY_S
                logsetup.flush_repeats()
                line = self._status_line()
                if line != self._last_status_line:
                    self.notifier.status(line)
                    self._last_status_line = line
        log.info("daemon_stopping", reason=self.requests.stop_reason)

    def shutdown(self) -> None:
        if self._phase is Phase.STOPPED:
            return
        if self._phase is not Phase.STOPPING:
            self._set_phase(Phase.STOPPING)
        self.notifier.stopping("stopping: draining requests")
        if self.server is not None:
            self.server.stop(self.config.daemon.drain_timeout_s)
        if self.metrics_listener is not None:
            self.metrics_listener.stop()
            self.metrics_listener = None
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        for name, service in reversed(self._started):
            self.notifier.extend_timeout(SERVICE_STOP_ALLOWANCE_S)
            self.notifier.status(f"stopping {name}")
            try:
                service.stop()
            except Exception as exc:  # one failing service must not keep the others running
                log.error("service_stop_failed", service=name, exc_info=exc)
            else:
                log.info("service_stopped", service=name)
        self._started.clear()
        self.gpu.close()
        self._set_phase(Phase.STOPPED)
        log.info("daemon_stopped", uptime_s=round(self.uptime_s(), 3))
        self.notifier.close()
        self.requests.close()

    # -- requests from signals and the API ---------------------------------------------------

    def request_shutdown(self, reason: str) -> None:
        """Ask the main loop to stop (thread-safe, async-signal-safe)."""
        self.requests.stop(reason)

    def request_reload(self) -> None:
        self.requests.reload()

    # -- reload ------------------------------------------------------------------------------

    def reload(self) -> dict[str, Any]:
        """Re-read the config file; apply reloadable changes; report the rest.

        Returns {"applied": {...}, "restart_required": [...], "error": str | None}.
        """
        self.notifier.reloading()
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload_rejected", error=str(exc), field=exc.path,
                      effect="running configuration kept")
            self.core_metrics.reloads.labels("rejected").inc()
            self.notifier.ready(f"reload rejected: {exc}")
            self.config_rejected = str(exc)
            return {"applied": {}, "restart_required": [], "error": str(exc)}
        merged, live, restart = merge_reloadable(self.config, new)
        self.config = merged
        self.config_rejected, self.config_pending = None, tuple(restart)
        if "daemon.log_level" in live:
            logsetup.set_level(merged.daemon.log_level)
        if "daemon.log_repeat_interval_s" in live:
            logsetup.set_repeat_interval(merged.daemon.log_repeat_interval_s)
        for name, service in self._started:
            try:
                service.reload(merged)
            except Exception as exc:  # a service refusing its new settings keeps running
                log.error("service_reload_failed", service=name, exc_info=exc)
        self.core_metrics.reloads.labels("applied").inc()
        log.info("config_reloaded", applied={k: list(v) for k, v in live.items()},
                 restart_required=restart)
        self.notifier.ready(self._status_line())
        return {"applied": {k: list(v) for k, v in live.items()},
                "restart_required": restart, "error": None}

    # -- status and health -------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        cfg = self.config
        gpus, reason = self.gpu.sample()
        out: dict[str, Any] = {
            "version": __version__,
            "pid": os.getpid(),
            "phase": self.phase,
            "ready": self.ready,
            "started_at": datetime.fromtimestamp(self.started_at, UTC).isoformat(),
            "uptime_s": round(self.uptime_s(), 3),
            "config_path": str(self.config_path) if self.config_path else None,
            "host": host_status([cfg.daemon.state_dir, cfg.daemon.cache_dir, cfg.kv.cold_dir,
                                 cfg.maintenance.shadow_dir]),
            "gpu": gpus,
        }
        if gpus is None:
            out["gpu_reason"] = reason
        if self.server is not None:
            out["control"] = {"socket": str(self.server.path),
                              "connections": self.server.connections,
                              "in_flight": self.server.in_flight,
                              "rejected_connections": self.server.rejected_connections,
                              "admission": self.server.admission.status()}
        if self.metrics_listener is not None:
            host, port = self.metrics_listener.address
            out["metrics_listener"] = f"http://{host}:{port}/metrics"
        elif self.metrics_error is not None:
            out["metrics_listener"] = self.metrics_error
        out["scheduler"] = {"running": self.scheduler.running, "jobs": [
            {"id": j.id, "name": j.name, "next_run": j.next_run_time.isoformat()
             if j.next_run_time else None} for j in self.scheduler.get_jobs()]}
        out["services"] = self._started_names()
        agent = self.services.agent  # the model's commentary per asset, not part of health
        out["commentary"] = commentaries(agent.asset_views) \
            if agent is not None and "agent" in out["services"] else {}
        for name, service in self.services.in_order():
            try:
                out[name] = service.status()
            except Exception as exc:  # one broken status provider must not hide the others
                log.error("service_status_failed", service=name, exc_info=exc)
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def health_report(self) -> Report:
        """Every named check (`kvagentd.health`), judged now and settled (hysteresis)."""
        return self._settle(assess(self.config, self._health_facts(), self.acks))

    def health(self) -> dict[str, Any]:
        """`{"status": ok|degraded|failing, "checks": [{name, status, reason}], ...}`."""
        return self.health_report().as_dict()

    def ack_health(self, names: list[str]) -> dict[str, Any]:
        """Acknowledge the counters behind the named checks (all ackable ones when empty);
        raises KeyError naming a check that counts nothing to acknowledge."""
        facts = self._health_facts()
        ackable = {c.name for c in assess(self.config, facts, self.acks).checks if c.ackable}
        unknown = [n for n in names if n not in ackable and n != "jobs"]
        if unknown:
            raise KeyError(f"{unknown[0]!r} counts nothing to acknowledge; ackable: "
                           + ", ".join(sorted(ackable)))
        seen = self.acks.ack(facts.counters(), time.time(), names)
        self.settled.forget([n for n in ackable if not names or n in names])
        log.info("health_acknowledged", counters=seen)
        report = self._settle(assess(self.config, facts, self.acks))
        return {"acknowledged": seen, "health": report.as_dict()}

    def scrape(self) -> Scrape | None:
        """What `/v1/metrics` reads of the services at scrape time (None until running)."""
        if self._phase is not Phase.RUNNING:
            return None
        facts = self._health_facts()
        store = self.services.store
        agent_on = self.services.agent is not None and self.config.agent.enabled
        return Scrape(facts, self._settle(assess(self.config, facts, self.acks)),
                      store.stats() if store is not None else None,
                      {a.name: self.jobs.record(TICK_PREFIX + a.name)
                       for a in self.config.agent.assets} if agent_on else {})

    def _settle(self, report: Report) -> Report:
        """`report` through the hysteresis while running; as judged while starting or stopping
        (services not started yet are the phase, not a condition that must hold or clear)."""
        if self._phase is not Phase.RUNNING:
            return report
        return self.settled.settle(report, self.config.health)

    def _health_facts(self) -> Facts:
        running = self._phase is Phase.RUNNING
        return gather(
            self.config, self.services, started=set(self._started_names()),
            daemon=DaemonFacts(
                phase=self.phase, uptime_s=self.uptime_s(),
                main_loop_age_s=time.monotonic() - self._last_progress if running else None,
                main_loop_limit_s=3 * self.config.daemon.main_loop_interval_s + 5.0,
                scheduler_running=self.scheduler.running,
                scheduler_jobs=len(self.scheduler.get_jobs()) if self.scheduler.running else 0,
                metrics_error=self.metrics_error, config_rejected=self.config_rejected,
                config_pending=self.config_pending),
            jobs=self.jobs, scheduler=self.scheduler if self.scheduler.running else None,
            now=time.time(), platform=self.platform)

    # -- internals ---------------------------------------------------------------------------

    def _status_line(self) -> str:
        """The systemd STATUS line: the phase, then the settled health (its worst checks)
        while running; `Settled` logs each change of health level once."""
        if self._phase is not Phase.RUNNING:
            return f"{self.phase}; services: " + (", ".join(self._started_names()) or "none")
        try:
            report = self.health_report()
        except Exception as exc:  # the status line must never stop the main loop
            log.error("health_report_failed", exc_info=exc)
            return f"{self.phase}; health unknown: {type(exc).__name__}"
        line = f"{self.phase}; health {report.summary(limit=2)}"
        if self.server is not None:
            line += f"; {self.server.in_flight} requests in flight"
        return line[:400]

    def _threads_alive(self) -> bool:
        server_ok = self.server is None or self.server.serving
        return server_ok and self.scheduler.running


def _ensure_dir(path: Path) -> None:
    if not path.exists():
        path.mkdir(parents=True, mode=0o750)


def _qualname(exc: BaseException) -> str:
    """NOTE: by name, so that the daemon does not import the engine (torch) to recognise it."""
    return f"{type(exc).__module__}.{type(exc).__qualname__}"
