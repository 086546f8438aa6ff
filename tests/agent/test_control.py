"""Agent routes over a real control socket, driven through kvctl."""

from __future__ import annotations

import json
import shutil
import tempfile
import types
from pathlib import Path

import pytest

from kvagentd.agent.agent import Agent
from kvagentd.config import AssetConfig, Config, ControlConfig, FaultConfig
from kvagentd.control.handlers import agent as agent_handlers
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer

from .conftest import agent_config


@pytest.fixture
def served(fake_executor, scheduler, clock, tmp_path):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="outer_race",
                                                                  onset_s=6.0)),)),
               fake_executor, scheduler, tmp_path, clock=clock)
    ag.start()
    for _ in range(5):
        ag.tick_once("pump-1")
        clock.advance(3)
    sockdir = Path(tempfile.mkdtemp(prefix="kva-", dir="/tmp"))
    router = Router()
    agent_handlers.register(router, types.SimpleNamespace(services=types.SimpleNamespace(agent=ag),
                                                          scheduler=scheduler,
                                                          config=Config()))
    server = ControlServer(ControlConfig(socket=sockdir / "s.sock", socket_group="",
                                         operator_group=""), router)
    server.start()
    yield ag, sockdir / "s.sock"
    server.stop(1.0)
    ag.stop()
    shutil.rmtree(sockdir, ignore_errors=True)


def _app():
    import typer

    from kvctl import cmd_agent, cmd_sessions
    from kvctl.main import root

    app = typer.Typer(no_args_is_help=True, add_completion=False,
                      pretty_exceptions_enable=False)
    app.callback()(root)
    cmd_agent.register(app)
    cmd_sessions.register(app)
    return app


def kvctl(sock: Path, *args: str, capsys) -> tuple[int, str]:
    import structlog

    capsys.readouterr()
    with structlog.testing.capture_logs():  # the server's request log would mix into stdout
        try:
            _app()(args=["--socket", str(sock), *args], prog_name="kvctl")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 0
    return (64 if code == 2 else code), capsys.readouterr().out


def test_events_reports_and_jobs_through_kvctl(served, capsys):
    ag, sock = served
    code, out = kvctl(sock, "--json", "events", "--asset", "pump-1", capsys=capsys)
    assert code == 0 and json.loads(out)["count"] == 5
    code, out = kvctl(sock, "--json", "events", "--anomalies", capsys=capsys)
    flagged = json.loads(out)["events"]
    assert code == 0 and flagged and all(e["anomaly"] for e in flagged)
    code, out = kvctl(sock, "events", "--since", "1h", capsys=capsys)
    assert code == 0 and "outer_race (low)" in out and "BPFO" in out
    code, _ = kvctl(sock, "events", "--asset", "nope", capsys=capsys)
    assert code == 1
    code, _ = kvctl(sock, "events", "--since", "yesterday", capsys=capsys)
    assert code == 64

    code, out = kvctl(sock, "--json", "report", "run", "weekly", "--asset", "pump-1", "--wait",
                      capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["state"] == "done" and len(doc["files"]) == 3
    code, out = kvctl(sock, "report", "run", "replay", "--event", str(flagged[-1]["id"]),
                      "--wait", capsys=capsys)
    assert code == 0 and "Anomaly replay" in out
    code, out = kvctl(sock, "--json", "report", "list", capsys=capsys)
    assert sorted(r["kind"] for r in json.loads(out)["reports"]) == ["replay", "weekly"]
    code, out = kvctl(sock, "report", "show", doc["id"], capsys=capsys)
    assert code == 0 and "Weekly vibration report" in out
    assert kvctl(sock, "report", "show", "weekly-nope", capsys=capsys)[0] == 1
    assert kvctl(sock, "report", "run", "replay", "--event", "999", capsys=capsys)[0] == 1

    code, out = kvctl(sock, "jobs", "list", capsys=capsys)
    assert code == 0 and "agent.tick.pump-1" in out and "agent.weekly.pump-1" in out
    code, out = kvctl(sock, "--json", "jobs", "pause", "agent.tick.pump-1", capsys=capsys)
    assert code == 0 and json.loads(out)["job"]["paused"] is True
    code, out = kvctl(sock, "--json", "jobs", "resume", "agent.tick.pump-1", capsys=capsys)
    assert code == 0 and json.loads(out)["job"]["paused"] is False
    assert kvctl(sock, "jobs", "run", "agent.weekly.pump-1", capsys=capsys)[0] == 0
    assert kvctl(sock, "jobs", "pause", "nope", capsys=capsys)[0] == 1


def test_ask_about_an_asset_through_kvctl(served, fake_executor, capsys):
    ag, sock = served
    fake_executor.answer = "Outer-race defect: plan a bearing replacement."
    code, out = kvctl(sock, "ask", "--asset", "pump-1", "What is wrong?", capsys=capsys)
    assert code == 0 and "pump-1: Outer-race defect: BPFO line" in out
    assert "commentary (model): Outer-race defect: plan a bearing replacement." in out
    fake_executor.answer = "All good, the pump is fine."
    code, out = kvctl(sock, "--json", "ask", "-a", "pump-1", "And now?", capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["withheld"] and doc["commentary"] is None
    assert doc["diagnosis"]["fault"] == "outer_race"
    assert kvctl(sock, "ask", "--asset", "nope", "?", capsys=capsys)[0] == 1


def test_since_parsing():
    assert agent_handlers.parse_since("15m", 1000.0) == 100.0
    assert agent_handlers.parse_since("123.5", 0.0) == 123.5
    assert agent_handlers.parse_since(None, 0.0) is None


def test_a_failed_report_exits_non_zero(served, capsys, monkeypatch):
    ag, sock = served

    def broken(rid, asset, now):
        raise AttributeError("'Config' object has no attribute 'assets'")

    monkeypatch.setattr(ag.reports, "_weekly", broken)
    code, out = kvctl(sock, "report", "run", "weekly", "--asset", "pump-1", "--wait",
                      capsys=capsys)
    assert code == 1 and "failed: AttributeError" in out
    rid = ag.reports.list()[0]["id"]
    assert ag.reports.get(rid)["state"] == "failed"
    code, out = kvctl(sock, "report", "show", rid, capsys=capsys)
    assert code == 1 and "failed" in out
    code, out = kvctl(sock, "--json", "report", "show", rid, capsys=capsys)
    assert code == 1 and json.loads(out)["state"] == "failed"


def test_report_run_refuses_event_ids_outside_sqlite_integers(served):
    import httpx

    _, sock = served
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://k") as c:
        for event in (2**63, -1, 0, True, "7", 1.5):
            r = c.post("/v1/reports/run", json={"kind": "replay", "event": event})
            assert r.status_code == 400, (event, r.text)
            assert "integer in [1, 9223372036854775807]" in r.json()["error"]["message"]
        r = c.post("/v1/reports/run", json={"kind": "replay", "event": 2**63 - 1})
        assert r.status_code == 404  # a valid id that no event has


def test_a_report_that_cannot_be_written_is_507_naming_the_path(served, capsys, monkeypatch):
    import errno

    import httpx

    ag, sock = served
    path = ag.reports.dir / "x.json"

    def full(rid, doc):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ag.reports, "_write_json", full)
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://k") as c:
        r = c.post("/v1/reports/run", json={"kind": "weekly", "asset": "pump-1"})
    assert r.status_code == 507 and r.json()["error"]["kind"] == "insufficient_storage"
    assert "No space left on device" in r.json()["error"]["message"]
    assert str(path) in r.json()["error"]["message"]
    code, out = kvctl(sock, "report", "run", "weekly", "--asset", "pump-1", capsys=capsys)
    assert code != 0


def test_events_show_kind_and_follow(served, capsys, monkeypatch, clock):
    ag, sock = served
    code, out = kvctl(sock, "--json", "events", "--kind", "tick", capsys=capsys)
    rows = json.loads(out)["events"]
    assert code == 0 and len(rows) == 5 and all(e["kind"] == "tick" for e in rows)
    assert kvctl(sock, "events", "--kind", "nope", capsys=capsys)[0] == 64
    # one row whole, nothing cut
    code, out = kvctl(sock, "--json", "events", "show", str(rows[0]["id"]), capsys=capsys)
    assert code == 0 and json.loads(out)["event"] == rows[0]
    code, out = kvctl(sock, "events", "show", str(rows[0]["id"]), capsys=capsys)
    assert code == 0 and "diagnosis:" in out and "features:" in out
    assert kvctl(sock, "events", "show", "999999", capsys=capsys)[0] == 1
    # --follow: the rows so far oldest first, then each new one as it is written
    from kvctl import cmd_agent

    naps = []

    def nap(_s: float) -> None:
        naps.append(1)
        if len(naps) == 1:
            ag.tick_once("pump-1")
            clock.advance(3)
            return
        raise KeyboardInterrupt

    monkeypatch.setattr(cmd_agent.time, "sleep", nap)
    code, out = kvctl(sock, "--json", "events", "--follow", "--asset", "pump-1", capsys=capsys)
    lines = [json.loads(x) for x in out.splitlines()]
    ids = [e["id"] for e in lines]
    assert code == 0 and len(ids) == 6 and ids == sorted(ids)
    assert ids[:5] == sorted(e["id"] for e in rows)
