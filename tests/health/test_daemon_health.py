"""Health of a running daemon (in process, no model, a simulated asset): overrunning ticks
are failing, readyz and the STATUS line follow, kvctl health exits 2; a failing job puts its
service in error until `kvctl health ack`; the daemon's one hysteresis feeds every reader."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvagentd.agent import jobs
from kvagentd.config import Config, load_config
from kvagentd.daemon.core import Daemon
from kvagentd.scheduling import jobs as schedjobs
from kvagentd.scheduling.jobwatch import JobWatch
from kvagentd.services import BuildContext, Services, build_services
from kvagentd.daemon.systemd import Notifier
from kvctl.main import main as kvctl
from tests.control.conftest import make_config


def _config(d: Path, tick: float) -> Config:
    cfg = make_config(d, read_timeout_s=10.0)
    base = load_config(None, env={})
    return dataclasses.replace(
        cfg, daemon=dataclasses.replace(cfg.daemon, state_dir=d / "state", cache_dir=d / "cache",
                                        main_loop_interval_s=0.1),
        agent=dataclasses.replace(base.agent, tick_interval_s=tick),
        health=dataclasses.replace(base.health, window_s=60.0, min_due_ticks=4))


class Notes(Notifier):
    def __init__(self) -> None:
        super().__init__(env={})
        self.lines: list[str] = []

    def status(self, text: str) -> None:
        self.lines.append(text)


def _start(d: Path, tick: float, slow_s: float = 0.0) -> Daemon:
    def build(cfg: Config, ctx: BuildContext) -> Services:
        services = build_services(cfg, ctx)
        if slow_s:
            assert services.agent is not None
            src = services.agent.assets["pump-1"].source
            read = src.read_window

            def slow(now: float) -> Any:
                time.sleep(slow_s)  # a tick that overruns its interval, as a busy CPU makes it
                return read(now)

            src.read_window = slow  # type: ignore[method-assign]
        return services

    daemon = Daemon(_config(d, tick), None, notifier=Notes(), build=build)
    daemon.startup()
    threading.Thread(target=daemon.main_loop, daemon=True).start()
    return daemon


@pytest.fixture
def started(short_dir: Path) -> Iterator[list[Daemon]]:
    daemons: list[Daemon] = []
    yield daemons
    for d in daemons:
        d.request_shutdown("test")
        d.shutdown()


def _checks(d: Daemon) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in d.health()["checks"]}


def _until(pred: Any, timeout: float = 30.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if v := pred():
            return v
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s")


def test_overrunning_ticks_are_failing(short_dir: Path, started: list[Daemon],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    d = _start(short_dir, tick=0.3, slow_s=1.2)
    started.append(d)
    _until(lambda: _checks(d)["skip-rate:pump-1"]["status"] == "failing")
    c = _checks(d)
    assert "due ticks skipped" in c["skip-rate:pump-1"]["reason"]
    _until(lambda: _checks(d)["tick-p99:pump-1"]["status"] == "failing")
    assert d.health()["status"] == "failing"
    sock = str(d.config.control.socket)
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://k") as client:
        r = client.get("/v1/readyz")
        assert r.status_code == 503 and r.json()["error"]["kind"] == "unhealthy"
        assert "skip-rate:pump-1" in r.json()["error"]["message"]
        assert client.get("/v1/health").status_code == 503
    capsys.readouterr()
    assert kvctl(["--socket", sock, "health"]) == 2  # failing, as a Nagios check
    out = capsys.readouterr().out
    assert out.startswith("health: failing") and "skip-rate:pump-1" in out
    line = _until(lambda: next((x for x in reversed(d.notifier.lines)  # type: ignore[attr-defined]
                                if "health failing" in x), None))
    assert line.startswith("running; health failing: ")
    rec = d.jobs.record(jobs.tick_job_id("pump-1"))
    assert rec is not None and rec.skipped > rec.runs > 0


def test_a_failing_job_is_a_service_in_error_until_acknowledged(
        short_dir: Path, started: list[Daemon], capsys: pytest.CaptureFixture[str]) -> None:
    d = _start(short_dir, tick=1.0)
    started.append(d)
    _until(lambda: _checks(d)["ticks:pump-1"]["reason"].startswith("last tick"))
    assert d.health()["status"] == "ok"
    sock = str(d.config.control.socket)
    capsys.readouterr()
    assert kvctl(["--socket", sock, "health"]) == 0
    assert d.services.agent is not None

    def broken(asset: str) -> str:
        raise AttributeError("'Config' object has no attribute 'assets'")

    d.services.agent.reports.run_weekly = broken  # type: ignore[method-assign]
    d.scheduler.modify_job(jobs.weekly_job_id("pump-1"), func=broken)
    schedjobs.run_job(d.scheduler, jobs.weekly_job_id("pump-1"))
    agent = _until(lambda: (c := _checks(d)["service:agent"])["status"] == "degraded" and c)
    assert "agent.weekly.pump-1 failed 1x" in agent["reason"] and "AttributeError" in agent["reason"]
    capsys.readouterr()
    assert kvctl(["--socket", sock, "health"]) == 1
    assert kvctl(["--socket", sock, "health", "ack", "no-such-check"]) == 64
    capsys.readouterr()
    assert kvctl(["--socket", sock, "health", "ack", "service:agent"]) == 0
    out = capsys.readouterr().out
    assert "job:agent.weekly.pump-1 (1)" in out
    assert _checks(d)["service:agent"]["status"] == "ok"
    assert kvctl(["--socket", sock, "health"]) == 0

    d.services.agent.stop()  # the service stops: failing, ticks stop
    assert _checks(d)["service:agent"]["status"] == "failing"


def test_jobwatch_counts_skips_errors_and_durations() -> None:
    from apscheduler.events import (EVENT_JOB_ERROR, EVENT_JOB_EXECUTED,
                                    EVENT_JOB_MAX_INSTANCES)
    from apscheduler.schedulers.background import BackgroundScheduler

    watch = JobWatch()
    sched = BackgroundScheduler()
    sched.add_listener(watch.on_event, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR
                       | EVENT_JOB_MAX_INSTANCES)
    sched.start()
    try:
        sched.add_job(lambda: time.sleep(0.35), "interval", seconds=0.1, id="slow",
                      max_instances=1, coalesce=True)

        def fail() -> None:
            raise ValueError("bad")

        sched.add_job(fail, "interval", seconds=0.2, id="fails")
        _until(lambda: (r := watch.record("slow")) and r.runs >= 2 and r.skipped >= 2)
        _until(lambda: (r := watch.record("fails")) and r.errors >= 1)
    finally:
        sched.shutdown(wait=True)
    slow = watch.window("slow", 0.0)
    assert slow.skipped >= 2 and slow.runs >= 2 and slow.due == slow.runs + slow.skipped
    assert all(x >= 0.3 for x in slow.durations)  # due to done: the sleep at least
    fails = watch.record("fails")
    assert fails is not None and fails.last_error == "ValueError: bad"
    assert watch.window("slow", time.time() + 10).due == 0


def test_jobwatch_counts_the_runs_a_stall_coalesced_away() -> None:
    """A coalescing interval job that could not run for a while (here: the scheduler paused,
    as a stopped process or a blocked thread) runs once and reports only its last due time;
    the due times before it are counted as missed, so the skip rate tells the truth."""
    from apscheduler.events import EVENT_JOB_EXECUTED, EVENT_JOB_MISSED
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    sched = BackgroundScheduler()

    def period(job_id: str) -> float | None:
        job = sched.get_job(job_id)
        return job.trigger.interval.total_seconds() \
            if job is not None and isinstance(job.trigger, IntervalTrigger) else None

    watch = JobWatch(period_of=period)
    sched.add_listener(watch.on_event, EVENT_JOB_EXECUTED | EVENT_JOB_MISSED)
    sched.start()
    try:
        sched.add_job(lambda: None, "interval", seconds=0.1, id="tick", coalesce=True,
                      max_instances=1, misfire_grace_time=10)
        _until(lambda: (r := watch.record("tick")) and r.runs >= 3)
        before = watch.record("tick")
        assert before is not None and before.missed == 0  # on time: nothing counted
        sched.pause()
        time.sleep(1.0)  # about 10 due runs pass
        sched.resume()
        runs = before.runs
        _until(lambda: (r := watch.record("tick")) and r.runs >= runs + 2)
    finally:
        sched.shutdown(wait=True)
    after = watch.record("tick")
    assert after is not None and 7 <= after.missed <= 12
    w = watch.window("tick", 0.0)
    assert w.due == w.runs + w.missed and w.missed == after.missed


def test_jobwatch_without_a_period_counts_only_reported_runs() -> None:
    """A job without a fixed period (cron) is counted from its events alone."""
    from datetime import UTC, datetime

    from apscheduler.events import EVENT_JOB_EXECUTED, JobExecutionEvent

    watch = JobWatch(period_of=lambda job_id: 3.0 if job_id == "tick" else None)
    for job in ("tick", "weekly"):
        for t in (0.0, 3.0, 24.0):  # a 21 s stall after the second run
            watch.on_event(JobExecutionEvent(EVENT_JOB_EXECUTED, job, "default",
                                             datetime.fromtimestamp(1e9 + t, UTC)))
    tick, weekly = watch.record("tick"), watch.record("weekly")
    assert tick is not None and (tick.runs, tick.missed) == (3, 6)
    assert weekly is not None and (weekly.runs, weekly.missed) == (3, 0)


def test_the_daemon_settles_health_once_for_every_reader_and_commentary_stays_apart(
        short_dir: Path, started: list[Daemon]) -> None:
    """A sensor link that drops while its data is still fresh (degraded, a figure that may
    come back) counts only after `raise_after_s`; /v1/health, the metric and the STATUS line
    read the same settled state, while every commentary withheld never degrades the box."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvagentd.health import Settled

    d = _start(short_dir, tick=1.0)
    started.append(d)
    _until(lambda: _checks(d)["ticks:pump-1"]["reason"].startswith("last tick"))
    assert d.services.agent is not None
    t = [1000.0]
    d.settled = Settled(lambda: t[0])  # the daemon's one hysteresis, on a fake clock
    views = d.services.agent.asset_views

    def withheld_and_down() -> Any:
        return [v._replace(source="mqtt", connected=False, message_age_s=0.5, data_age_s=0.5,
                           llm_failing=3, llm_withheld=40,
                           llm_error="commentary withheld: raises an alarm ('faulty') while "
                                     "no fault is diagnosed") for v in views()]

    d.services.agent.asset_views = withheld_and_down  # type: ignore[method-assign]

    def metric(name: str, **labels: str) -> float:
        for fam in text_string_to_metric_families(generate_latest(d.metrics).decode()):
            for s in fam.samples:
                if s.name == name and s.labels == labels:
                    return float(s.value)
        raise AssertionError(f"no sample {name} {labels}")

    h = d.health()
    sensor = {c["name"]: c for c in h["checks"]}["sensor:pump-1"]
    assert h["status"] == "ok" and sensor["status"] == "ok" and sensor["pending"] == "degraded"
    assert not [c for c in h["checks"] if c["name"].startswith("llm:")]
    assert h["commentary"][0]["state"] == "missing" and h["commentary"][0]["withheld"] == 40
    assert metric("kvagentd_health_status") == 0
    assert metric("kvagentd_commentary_status", asset="pump-1") == 1
    assert metric("kvagentd_commentary_missing_total", asset="pump-1", reason="withheld") == 40
    assert d.status()["commentary"]["pump-1"]["state"] == "missing"
    assert d._status_line().startswith("running; health ok")
    t[0] += 16.0  # held longer than raise_after_s (15 s)
    assert d.health()["status"] == "degraded"
    assert metric("kvagentd_health_status") == 1
    line = d._status_line()
    assert line.startswith("running; health degraded: sensor:pump-1: ") and "llm" not in line
    d.services.agent.asset_views = views  # type: ignore[method-assign]
    assert d.health()["status"] == "degraded"  # back: recovery waits clear_after_s (60 s)
    t[0] += 30.0
    assert d.health()["status"] == "degraded"
    t[0] += 31.0
    assert d.health()["status"] == "ok"
    assert metric("kvagentd_health_status") == 0


def test_a_report_read_while_starting_is_not_held_once_running(
        short_dir: Path, started: list[Daemon]) -> None:
    """`kvctl health` during a slow start sees services not started (failing); that is the
    phase, so once running the health is ok at once, not after `clear_after_s`."""
    seen: list[dict[str, Any]] = []

    class Watching(Notes):
        def status(self, text: str) -> None:
            super().status(text)
            if text == "starting agent":  # the services before it started, the agent not
                seen.append(daemon.health())

    daemon = Daemon(_config(short_dir, 1.0), None, notifier=Watching())
    started.append(daemon)
    daemon.startup()
    assert seen[0]["status"] == "failing"
    assert {c["name"]: c["status"] for c in seen[0]["checks"]}["service:agent"] == "failing"
    h = daemon.health()
    assert h["status"] == "ok", [c for c in h["checks"] if c["status"] != "ok"]
