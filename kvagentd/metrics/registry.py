"""The daemon's Prometheus registry and its core metrics.

Every service registers its own metrics on `Daemon.metrics` (a `CollectorRegistry`);
`GET /v1/metrics` renders the whole registry in the Prometheus text format.

No counter or histogram exposes a `_created` series: they doubled the families, and Prometheus
does not use them (`disable_created_metrics()` is process-wide and applies to metrics made
after it, so it runs where the registry is made, before any service registers its own).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               PlatformCollector, ProcessCollector, disable_created_metrics)

from kvagentd import __version__


def new_registry() -> CollectorRegistry:
    """A fresh registry with process metrics (RSS, CPU, fds: watch RSS growth over days)."""
    disable_created_metrics()
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class CoreMetrics:
    """Metrics of the daemon itself: lifecycle, control API, scheduler, reloads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        Info("kvagentd_build", "kvagentd version", registry=registry).info(
            {"version": __version__})
        self.start_time = Gauge("kvagentd_start_time_seconds",
                                "Unix time the daemon started", registry=registry)
        self.ready = Gauge("kvagentd_ready", "1 once the daemon is ready, 0 otherwise",
                           registry=registry)
        self.requests = Counter("kvagentd_control_requests_total",
                                "Control API requests by route pattern, method and status",
                                ["route", "method", "status"], registry=registry)
        self.request_seconds = Histogram("kvagentd_control_request_duration_seconds",
                                         "Time to handle a control API request (streams: to "
                                         "the last byte)", ["route"], registry=registry,
                                         buckets=(.001, .005, .02, .1, .5, 2, 10, 60, 300))
        self.loop_iterations = Counter("kvagentd_main_loop_iterations_total",
                                       "Main loop iterations", registry=registry)
        self.watchdog_pings = Counter("kvagentd_watchdog_pings_total",
                                      "WATCHDOG=1 notifications sent", registry=registry)
        self.reloads = Counter("kvagentd_config_reloads_total",
                               "SIGHUP reloads by result (applied, rejected)", ["result"],
                               registry=registry)
        self.job_runs = Counter("kvagentd_scheduler_job_runs_total",
                                "Scheduled job runs by job id and outcome (ok, error, missed, "
                                "skipped_overlap)", ["job", "outcome"], registry=registry)

        self.tick_seconds = Histogram(
            "kvagentd_agent_tick_duration_seconds",
            "Sensor tick duration per asset, from when it was due to when it was done",
            ["asset"], registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 120))

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method or "-", str(status)).inc()
        self.request_seconds.labels(route).observe(seconds)
