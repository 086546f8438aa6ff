"""`kvagentd run` with a remote store (a real redis-server) killed mid-run: ticks go on with the
model, health says the remote is degraded, metrics say it is down; after redis restarts the
daemon finds it again by itself, health recovers and the fleet lists the box again."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from kvctl.main import main as kvctl
from tests.redisd import RedisServer, redis_fixture

from .conftest import DaemonProcess
from .test_full_daemon import _config, _wait_ticks


def _remote_check(p: DaemonProcess) -> dict[str, Any]:
    with p.client() as c:
        checks = c.get("/v1/health").json()["checks"]
    return next(ch for ch in checks if ch["name"] == "service:remote")


def _until(pred: Any, timeout: float, what: str, p: DaemonProcess) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"{what} not within {timeout} s:\n{p.output()[-3000:]}")


def _fleet(p: DaemonProcess, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert kvctl(["--socket", str(p.socket), "--json", "fleet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_redis_killed_mid_run_ticks_continue_health_degrades_and_recovers(
        short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for redis in redis_fixture(short_dir / "redis"):
        _run(short_dir, redis, capsys)


def _run(d: Path, redis: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(d)
    config.write_text(config.read_text() + f"""
[remote]
url = "{redis.url}"
box_id = "edge-7"
read_timeout_s = 0.25
retry_max_s = 1.0
heartbeat_interval_s = 1.0
[health]  # short holds: the link's outage and its end, not the hysteresis, are tested here
raise_after_s = 1.0
clear_after_s = 3.0
""")
    p = DaemonProcess(d, config)
    try:
        p.notify.wait_for("READY=1", timeout=120)
        assert "remote" in p.get("/v1/status")["services"]
        before = _wait_ticks(p, 2)
        assert _remote_check(p)["status"] == "ok"
        boxes = _fleet(p, capsys)["boxes"]
        assert [b["box"] for b in boxes] == ["edge-7"] and boxes[0]["alive"]
        # the asset's rolling session (the tiny model's text may be withheld, which rolls it over)
        assert re.fullmatch(r"pump-1-\d+", boxes[0]["assets"]["pump-1"]["session"])

        redis.kill()
        degraded = _until(lambda: (c := _remote_check(p))["status"] == "degraded" and c, 30,
                          "remote check degraded", p)
        assert "unreachable" in degraded["reason"]
        # ticks go on, with the model, while redis is down. A tick counts when it starts and
        # its model turn when it ends (a commentary, or a turn the tick's deadline cut): wait
        # for three more turns done, not for three more ticks begun
        at_kill = p.get("/v1/status")["agent"]["assets"]["pump-1"]

        def turns_done() -> Any:
            a = p.get("/v1/status")["agent"]["assets"]["pump-1"]
            ran = a["commentaries"] + a["llm_cut"]
            return a if ran >= at_kill["commentaries"] + at_kill["llm_cut"] + 3 else None
        after = _until(turns_done, 60, "three model turns with redis down", p)
        assert after["ticks"] >= at_kill["ticks"] + 2  # one of the turns may be of a tick begun
        assert after["llm_errors"] == before["llm_errors"] == 0
        with p.client() as c:
            metrics = c.get("/v1/metrics").text
            assert "kvagentd_remote_up 0.0" in metrics
            assert c.get("/v1/fleet").status_code == 503  # the fleet cannot be asked now
        capsys.readouterr()
        kvctl(["--socket", str(p.socket), "health"])
        line = next(x for x in capsys.readouterr().out.splitlines()
                    if x.startswith("service:remote"))
        assert "degraded" in line and "unreachable" in line

        redis.restart()
        _until(lambda: _remote_check(p)["status"] == "ok", 30, "remote check ok again", p)
        with redis.client() as r:  # what waited in the queue was written after the restart
            _until(lambda: r.exists("kvagentd:box:edge-7"), 10, "heartbeat again", p)
        status = p.get("/v1/status")["remote"]
        assert status["link"]["state"] == "up" and status["link"]["downs"] >= 1
        assert _fleet(p, capsys)["boxes"][0]["alive"]

        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        with redis.client() as r:
            last = r.get("kvagentd:box:edge-7")
            assert last is not None, p.output()[-4000:]
            assert json.loads(last)["state"] == "stopped"
    finally:
        p.stop()
