"""What the scheduler's jobs did, per job id: runs, skips, misses, failures and how long runs
took, for the health checks, the metrics and the daemon's (rate-limited) job warnings.

    watch = JobWatch()
    scheduler.add_listener(watch.on_event, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR
                           | EVENT_JOB_MISSED | EVENT_JOB_MAX_INSTANCES)
    watch.window("agent.tick.pump-1", since=time.time() - 600)

A run's duration is measured from when it was due (`scheduled_run_time`) to its completion
event, so the time a run waited for a worker thread counts: for a sensor tick, that is the
delay an operator sees. A skip is a due run dropped because the previous one still ran
(APScheduler's max instances); a miss one that was due longer ago than its grace time, or one
that APScheduler coalesced away without an event: after a stall (the process stopped, a
suspended VM, a blocked scheduler thread) a coalescing job runs once for all its missed due
times and reports only the last, so for jobs with a fixed period (`period_of`) the due times
between two reported ones are counted as missed. Counters are totals since start; `window`
looks at the recent events kept per job.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apscheduler.events import (EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, EVENT_JOB_MAX_INSTANCES,
                                EVENT_JOB_MISSED)

KEEP_EVENTS = 4096  # per job; at a 1 s tick: over an hour of history

OUTCOMES = {EVENT_JOB_EXECUTED: "ok", EVENT_JOB_ERROR: "error", EVENT_JOB_MISSED: "missed",
            EVENT_JOB_MAX_INSTANCES: "skipped"}


@dataclass(slots=True)
class JobRecord:
    """Totals since start for one job id."""

    runs: int = 0  # completed, with or without an error
    errors: int = 0
    skipped: int = 0
    missed: int = 0
    last_done: float | None = None  # unix seconds of the last completion
    last_error: str | None = None
    last_error_t: float | None = None
    last_due: float | None = None  # the latest due time an event reported (unix seconds)
    recent: collections.deque[tuple[float, str, float | None]] = field(
        default_factory=lambda: collections.deque(maxlen=KEEP_EVENTS))


class JobOutcome(NamedTuple):
    outcome: str  # ok | error | missed | skipped | other
    duration_s: float | None  # completed runs: from due to done
    coalesced: int = 0  # due runs before this one that never ran and were never reported


class JobWindow(NamedTuple):
    """What one job did since a moment."""

    runs: int
    errors: int
    skipped: int
    missed: int
    durations: list[float]  # seconds, of the completed runs

    @property
    def due(self) -> int:
        """Runs that were due: completed, skipped or missed."""
        return self.runs + self.skipped + self.missed


class JobWatch:
    """Scheduler event sink; thread-safe (events arrive on the scheduler's threads)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 period_of: Callable[[str], float | None] | None = None) -> None:
        """`period_of(job_id)`: the job's fixed period in seconds (interval jobs), else None."""
        self.clock = clock
        self.period_of = period_of
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}

    def on_event(self, event: Any) -> JobOutcome:
        """Record one APScheduler job event; returns its outcome (ok, error, missed, skipped)
        and, for a completed run, its duration from due to done."""
        outcome = OUTCOMES.get(event.code, "other")
        now = self.clock()
        duration: float | None = None
        period = self.period_of(event.job_id) if self.period_of is not None else None
        dues = [t.timestamp() for t in (getattr(event, "scheduled_run_times", None)
                                        or [getattr(event, "scheduled_run_time", None)])
                if t is not None]
        with self._lock:
            rec = self._jobs.setdefault(event.job_id, JobRecord())
            coalesced = 0
            if dues:
                due = max(dues)
                if rec.last_due is not None and period and due > rec.last_due:
                    coalesced = max(0, round((due - rec.last_due) / period) - 1)
                    rec.missed += coalesced
                    rec.recent.extend([(now, "missed", None)] * coalesced)
                rec.last_due = due if rec.last_due is None else max(rec.last_due, due)
            if outcome in ("ok", "error"):
                due = event.scheduled_run_time
                duration = max(0.0, now - due.timestamp()) if due is not None else None
                rec.runs += 1
                rec.last_done = now
                rec.recent.append((now, outcome, duration))
                if outcome == "error":
                    rec.errors += 1
                    exc = getattr(event, "exception", None)
                    rec.last_error = f"{type(exc).__name__}: {exc}" if exc else "failed"
                    rec.last_error_t = now
            elif outcome == "skipped":
                n = max(1, len(getattr(event, "scheduled_run_times", None) or ()))
                rec.skipped += n
                for _ in range(n):
                    rec.recent.append((now, outcome, None))
            elif outcome == "missed":
                rec.missed += 1
                rec.recent.append((now, outcome, None))
        return JobOutcome(outcome, duration, coalesced)

    def record(self, job_id: str) -> JobRecord | None:
        """A copy of the totals of `job_id` (None when it never reported)."""
        with self._lock:
            rec = self._jobs.get(job_id)
            if rec is None:
                return None
            return JobRecord(rec.runs, rec.errors, rec.skipped, rec.missed, rec.last_done,
                             rec.last_error, rec.last_error_t, rec.last_due,
                             collections.deque(maxlen=0))

    def window(self, job_id: str, since: float) -> JobWindow:
        """What `job_id` did from `since` (unix seconds) on."""
        with self._lock:
            rec = self._jobs.get(job_id)
            events = [e for e in rec.recent if e[0] >= since] if rec is not None else []
        return JobWindow(runs=sum(1 for _, o, _ in events if o in ("ok", "error")),
                         errors=sum(1 for _, o, _ in events if o == "error"),
                         skipped=sum(1 for _, o, _ in events if o == "skipped"),
                         missed=sum(1 for _, o, _ in events if o == "missed"),
                         durations=[d for _, o, d in events if d is not None])

    def job_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._jobs)
