"""SIGHUP end to end: a running daemon re-reads its file, every service gets the whole Config,
the agent applies its section: the tick interval changes and a weekly report still runs."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from .conftest import DaemonProcess, write_config

AGENT = '''[agent]
enabled = true
tick_interval_s = {tick}
weekly_report_cron = "{cron}"

[[agent.assets]]
name = "pump-1"
seed = 3'''


def _config(d: Path, tick: float, cron: str) -> Path:
    path = write_config(d)
    path.write_text(path.read_text().replace("[agent]\nenabled = false",
                                             AGENT.format(tick=tick, cron=cron)))
    return path


def _jobs(p: DaemonProcess) -> dict[str, dict[str, Any]]:
    return {j["id"]: j for j in p.get("/v1/jobs")["jobs"]}


def _wait(pred: Any, what: str, p: DaemonProcess, timeout: float = 60.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s:\n{p.output()[-3000:]}")


def test_sighup_changes_the_tick_interval_and_reports_still_run(spawn, short_dir: Path) -> None:
    config = _config(short_dir, 1.0, "0 6 * * 1")
    p = spawn(config)
    p.notify.wait_for("READY=1")
    assert p.get("/v1/status")["agent"]["tick_interval_s"] == 1.0
    jobs = _jobs(p)
    assert "interval[0:00:01]" in jobs["agent.tick.pump-1"]["trigger"]
    assert "day_of_week='mon'" in jobs["agent.weekly.pump-1"]["trigger"]

    _config(short_dir, 2.0, "30 5 * * 2")
    p.send_signal(signal.SIGHUP)
    p.notify.wait_for("RELOADING=1")
    _wait(lambda: p.get("/v1/status")["agent"]["tick_interval_s"] == 2.0, "new interval", p)
    jobs = _jobs(p)
    assert "interval[0:00:02]" in jobs["agent.tick.pump-1"]["trigger"]
    assert "day_of_week='tue'" in jobs["agent.weekly.pump-1"]["trigger"]
    assert "hour='5'" in jobs["agent.weekly.pump-1"]["trigger"]

    ticks = p.get("/v1/status")["agent"]["assets"]["pump-1"]["ticks"]
    _wait(lambda: p.get("/v1/status")["agent"]["assets"]["pump-1"]["ticks"] > ticks,
          "a tick after the reload", p)
    with p.client() as c:
        assert c.post("/v1/jobs/agent.weekly.pump-1/run").status_code == 200
    done = _wait(lambda: [r for r in p.get("/v1/reports")["reports"]
                          if r["kind"] == "weekly" and r["state"] != "running"],
                 "a weekly report after the reload", p)
    assert done[0]["state"] == "done", p.get(f"/v1/reports/{done[0]['id']}")
    assert "AttributeError" not in p.output()
    assert "service_reload_failed" not in p.output()

    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
