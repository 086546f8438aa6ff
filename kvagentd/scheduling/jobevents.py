"""The daemon's listener of scheduler job events.

Each APScheduler job event is recorded in the `JobWatch` (what health and metrics read), counted
in the metrics (runs by outcome, tick durations per asset) and, when a run failed (ERROR) or a
due run was skipped or missed (WARNING), logged; the log's repeat limit keeps a tick that keeps
overrunning to one warning per interval.
"""

from __future__ import annotations

from typing import Any

from apscheduler.events import (EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES,
                                EVENT_JOB_MISSED, JobEvent)

from kvagentd.agent.jobs import TICK_PREFIX
from kvagentd.scheduling.jobwatch import JobWatch
from kvagentd.metrics.registry import CoreMetrics

# The events the listener is registered for (`scheduler.add_listener(listener, JOB_EVENTS)`).
JOB_EVENTS = EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES


class JobEventListener:
    """Called on the scheduler's threads with each job event; `log` is the logger its
    warnings go to (the daemon's)."""

    def __init__(self, jobs: JobWatch, metrics: CoreMetrics, log: Any) -> None:
        self.jobs, self.metrics, self.log = jobs, metrics, log

    def __call__(self, event: JobEvent) -> None:
        outcome, duration, coalesced = self.jobs.on_event(event)
        if coalesced:
            self.metrics.job_runs.labels(event.job_id, "missed").inc(coalesced)
            rec = self.jobs.record(event.job_id)
            self.log.warning("job_skipped", job=event.job_id, reason="missed", runs=coalesced,
                             why="the scheduler ran late (a stall) and ran once for them",
                             missed_total=rec.missed if rec else None)
        label = "skipped_overlap" if outcome == "skipped" else outcome
        if duration is not None and event.job_id.startswith(TICK_PREFIX):
            self.metrics.tick_seconds.labels(event.job_id[len(TICK_PREFIX):]).observe(duration)
        self.metrics.job_runs.labels(event.job_id, label).inc()
        if outcome == "error":
            self.log.error("job_failed", job=event.job_id,
                           exc_info=getattr(event, "exception", None))
        elif outcome in ("missed", "skipped"):
            rec = self.jobs.record(event.job_id)
            self.log.warning("job_skipped", job=event.job_id, reason=label,
                             skipped_total=rec.skipped if rec else None,
                             missed_total=rec.missed if rec else None)
