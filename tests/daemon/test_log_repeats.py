"""Repeated warnings are rate-limited with counts: an overrunning tick says so once (not three
times), the next one after the window carries how many were held back, and a burst that
stops is still counted by the flush."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from kvagentd.daemon import log as logsetup
from kvagentd.config import Config, load_config
from kvagentd.daemon.core import Daemon
from kvagentd.daemon.repeats import RepeatLimiter
from kvagentd.services import BuildContext, Services, build_services
from kvagentd.daemon.systemd import Notifier
from tests.control.conftest import make_config


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _record(event: str, **kw: Any) -> logging.LogRecord:
    rec = logging.LogRecord("kvagentd.daemon.core", logging.WARNING, __file__, 1,
                            {"event": event, **kw}, None, None)
    return rec


def test_limiter_counts_what_it_holds_back() -> None:
    clock = Clock()
    lim = RepeatLimiter(60.0, clock=clock)
    assert lim.filter(_record("job_skipped", job="agent.tick.a"))
    assert not lim.filter(_record("job_skipped", job="agent.tick.a"))
    assert not lim.filter(_record("job_skipped", job="agent.tick.a"))
    assert lim.filter(_record("job_skipped", job="agent.tick.b"))  # another subject
    assert lim.filter(_record("other_event", job="agent.tick.a"))
    info = logging.LogRecord("x", logging.INFO, __file__, 1, {"event": "e"}, None, None)
    assert lim.filter(info) and lim.filter(info)  # only warnings are limited
    clock.t += 61
    later = _record("job_skipped", job="agent.tick.a")
    assert lim.filter(later) and later.msg["repeated"] == 2
    assert not lim.filter(_record("job_skipped", job="agent.tick.a"))
    assert lim.flush() == []  # that window has not ended yet
    clock.t += 61
    summaries = lim.flush()
    assert len(summaries) == 1 and summaries[0].msg["repeated"] == 1
    assert lim.filter(summaries[0])  # a summary is never held back itself
    lib = logging.LogRecord("lib", logging.WARNING, __file__, 1, "disk %s slow", ("sda",), None)
    assert lim.filter(lib)
    assert not lim.filter(logging.LogRecord("lib", logging.WARNING, __file__, 1,
                                            "disk %s slow", ("sdb",), None))
    clock.t += 61
    again = logging.LogRecord("lib", logging.WARNING, __file__, 1, "disk %s slow", ("sdc",),
                              None)
    assert lim.filter(again) and again.getMessage() == \
        "disk sdc slow (repeated 1 more times in 60 s)"


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logsetup.configure("info", "json", stream=stream, repeat_interval_s=3600.0)
    yield stream
    root = logging.getLogger()
    for h in list(root.handlers):
        if h.get_name() == "kvagentd":
            root.removeHandler(h)
    structlog.reset_defaults()


def test_an_overrunning_tick_logs_one_warning_not_three(short_dir: Path,
                                                        log_stream: io.StringIO) -> None:
    def build(cfg: Config, ctx: BuildContext) -> Services:
        services = build_services(cfg, ctx)
        assert services.agent is not None
        src = services.agent.assets["pump-1"].source
        read = src.read_window

        def slow(now: float) -> Any:
            time.sleep(1.0)
            return read(now)

        src.read_window = slow  # type: ignore[method-assign]
        return services

    cfg = make_config(short_dir)
    base = load_config(None, env={})
    cfg = dataclasses.replace(
        cfg, daemon=dataclasses.replace(cfg.daemon, state_dir=short_dir / "state",
                                        cache_dir=short_dir / "cache",
                                        main_loop_interval_s=0.1),
        agent=dataclasses.replace(base.agent, tick_interval_s=0.2))
    d = Daemon(cfg, None, notifier=Notifier(env={}), build=build)
    d.startup()
    threading.Thread(target=d.main_loop, daemon=True).start()
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            rec = d.jobs.record("agent.tick.pump-1")
            if rec is not None and rec.skipped >= 10:
                break
            time.sleep(0.2)
        assert rec is not None and rec.skipped >= 10
    finally:
        d.request_shutdown("test")
        d.shutdown()
    lines = [json.loads(x) for x in log_stream.getvalue().splitlines()]  # all of it JSON
    warnings = [x for x in lines if x["level"] == "warning"]
    skips = [x for x in warnings if "skipped" in x["event"] or "skip" in str(x.get("reason"))]
    assert len(skips) == 1, skips  # the first one; the rest are counted, not written
    assert skips[0]["event"] == "job_skipped" and skips[0]["job"] == "agent.tick.pump-1"
    assert not [x for x in lines if x["logger"].startswith("apscheduler")
                and "maximum number of running instances" in x["event"]]
    assert not [x for x in lines if x["event"] in ("agent.tick_skipped", "agent.tick_missed")]
