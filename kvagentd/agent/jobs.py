"""The agent's scheduler jobs: their ids and the weekly report's cron text.

Agent job ids: `agent.tick.<asset>` (interval, max_instances=1, coalesce),
`agent.weekly.<asset>` (cron) and `agent.prune` (hourly: the event log's retention). Listing
and control of any job are `kvagentd.scheduling.jobs`.
"""

from __future__ import annotations

from apscheduler.triggers.cron import CronTrigger

from kvagentd.scheduling import cron

TICK_PREFIX = "agent.tick."
WEEKLY_PREFIX = "agent.weekly."
PRUNE_JOB_ID = "agent.prune"  # the event log's retention, hourly
PRUNE_INTERVAL_S = 3600.0


def tick_job_id(asset: str) -> str:
    return TICK_PREFIX + asset


def weekly_job_id(asset: str) -> str:
    return WEEKLY_PREFIX + asset


def weekly_trigger(text: str) -> CronTrigger:
    """`agent.weekly_report_cron`: a crontab expression ("0 6 * * 1") or "<day-of-week> HH:MM"
    ("mon 06:00"), local time (`kvagentd.scheduling.cron`); raises `cron.CronError` (a ValueError)."""
    return cron.trigger(text)
