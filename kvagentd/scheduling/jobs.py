"""Job listing and control over an APScheduler 3.x scheduler: `list_jobs` / `run_job` /
`pause_job` / `resume_job` work on any job of the scheduler (the control API exposes them for
every service's jobs); `job_info` is one job as the API shows it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from apscheduler.jobstores.base import JobLookupError
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger


class UnknownJob(KeyError):
    """No job with this id."""


def job_info(job: Any) -> dict[str, Any]:
    nrt = job.next_run_time
    return {"id": job.id, "name": job.name, "trigger": str(job.trigger),
            "schedule": schedule_text(job.trigger),
            "next_run": nrt.isoformat() if nrt else None, "paused": nrt is None,
            "max_instances": job.max_instances, "coalesce": job.coalesce}


def schedule_text(trigger: Any) -> str:
    """A trigger as a person reads it: "every 3 s", "every 2 h", "cron 0 6 * * mon"."""
    if isinstance(trigger, IntervalTrigger):
        s = trigger.interval.total_seconds()
        for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
            if s >= size and s % size == 0:
                return f"every {s / size:g} {unit}"
        return f"every {s:g} s"
    if isinstance(trigger, CronTrigger):
        by_name = {f.name: str(f) for f in trigger.fields}
        return "cron " + " ".join(by_name.get(n, "*") for n in
                                  ("minute", "hour", "day", "month", "day_of_week"))
    return str(trigger)


def list_jobs(scheduler: Any) -> list[dict[str, Any]]:
    return [job_info(j) for j in sorted(scheduler.get_jobs(), key=lambda j: j.id)]


def _job(scheduler: Any, job_id: str) -> Any:
    job = scheduler.get_job(job_id)
    if job is None:
        raise UnknownJob(job_id)
    return job


def run_job(scheduler: Any, job_id: str) -> dict[str, Any]:
    """Run a job now (its next run moves to now; a paused job runs once and stays scheduled)."""
    job = _job(scheduler, job_id)
    job.modify(next_run_time=dt.datetime.now(dt.UTC))
    return job_info(_job(scheduler, job_id))


def pause_job(scheduler: Any, job_id: str) -> dict[str, Any]:
    return _act(scheduler, job_id, scheduler.pause_job)


def resume_job(scheduler: Any, job_id: str) -> dict[str, Any]:
    return _act(scheduler, job_id, scheduler.resume_job)


def _act(scheduler: Any, job_id: str, action: Callable[[str], Any]) -> dict[str, Any]:
    """`action(job_id)` on a job that exists (UnknownJob otherwise, also when it went away
    meanwhile); the job as it is afterwards."""
    _job(scheduler, job_id)
    try:
        action(job_id)
    except JobLookupError:
        raise UnknownJob(job_id) from None
    return job_info(_job(scheduler, job_id))
