from __future__ import annotations

import json

import pytest

from kvagentd.agent.agent import Agent
from kvagentd.agent.reports import ReportError
from kvagentd.config import AssetConfig, FaultConfig
from kvagentd.engine.executor import Priority

from .conftest import agent_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_ticks(ag: Agent, clock, n: int, asset: str = "pump-1") -> None:
    for _ in range(n):
        ag.tick_once(asset)
        clock.advance(3)


def test_weekly_report_writes_markdown_json_png(tmp_path, fake_executor, scheduler, clock):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="imbalance", onset_s=30,
                                                                   severity=3.0)),)),
               fake_executor, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 25)
    rid = ag.reports.start("weekly", asset="pump-1")
    doc = ag.reports.wait_for(rid, timeout=60)
    assert doc["state"] == "done", doc.get("error")
    for ext in ("md", "json", "png"):
        assert (tmp_path / "reports" / f"{rid}.{ext}").stat().st_size > 0
    assert (tmp_path / "reports" / f"{rid}.png").read_bytes()[:8] == PNG_MAGIC
    stats = json.loads((tmp_path / "reports" / f"{rid}.json").read_text())["stats"]
    assert stats["ticks"] == 25 and stats["anomalies"] > 0 and stats["worst_zone"] == "D"
    assert stats["zones"]["A"] + stats["zones"]["B"] + stats["zones"]["C"] + \
        stats["zones"]["D"] == 25
    req = fake_executor.requests[-1]
    assert req.priority == Priority.REPORT and req.session.startswith("report-pump-1-")
    assert doc["summary"] in doc["markdown"]
    assert [r["id"] for r in ag.reports.list()] == [rid]


def test_weekly_report_without_model_uses_deterministic_summary(tmp_path, scheduler, clock):
    ag = Agent(agent_config(), None, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 3)
    doc = ag.reports.wait_for(ag.reports.start("weekly", asset="pump-1"), timeout=60)
    assert doc["state"] == "done" and "3 measurements" in doc["summary"]
    assert len(doc["files"]) == 3


def test_replay_resumes_the_flagging_session_and_retires_it(tmp_path, fake_executor, scheduler,
                                                            clock):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="outer_race",
                                                                  onset_s=0)),)),
               fake_executor, scheduler, tmp_path, clock=clock,
               store_stats=lambda: {"cold_loads": 0})
    run_ticks(ag, clock, 3)
    event = ag.events.query(anomalies=True)[0]
    doc = ag.reports.wait_for(ag.reports.start("replay", event=event["id"]), timeout=60)
    assert doc["state"] == "done", doc.get("error")
    req = fake_executor.requests[-1]
    assert req.session == event["session"] and req.priority == Priority.REPORT
    assert req.system is None and f"event {event['id']}" in req.text
    assert len(doc["files"]) == 3 and doc["store_before"] == {"cold_loads": 0}
    assert ag.tick_once("pump-1")["session"] != event["session"]  # live session rolled over


def test_report_errors(tmp_path, fake_executor, scheduler, clock):
    ag = Agent(agent_config(assets=(AssetConfig(llm=False),)), fake_executor, scheduler,
               tmp_path, clock=clock)
    row = ag.tick_once("pump-1")
    with pytest.raises(ReportError):
        ag.reports.start("weekly", asset="nope")
    with pytest.raises(ReportError):
        ag.reports.start("replay", event=9999)
    with pytest.raises(ReportError):
        ag.reports.start("replay", event=row["id"])  # no session: features only
    with pytest.raises(ReportError):
        ag.reports.start("monthly", asset="pump-1")
    assert ag.reports.get("../etc/passwd") is None
