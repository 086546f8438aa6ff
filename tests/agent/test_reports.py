from __future__ import annotations

import json

import pytest
from matplotlib.image import imread

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


def _png(path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    img = imread(str(path))
    assert img.std() > 0.05  # not a blank canvas
    return img.shape[1], img.shape[0]


def test_weekly_report_leads_with_findings_and_shows_the_evidence(tmp_path, fake_executor,
                                                                   scheduler, clock):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="outer_race",
                                                                   onset_s=300.0)),)),
               fake_executor, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 330)  # 16.5 minutes: 5 healthy, then the defect
    fake_executor.answer = "Outer-race defect: plan a bearing replacement."
    rid = ag.reports.start("weekly", asset="pump-1")
    doc = ag.reports.wait_for(rid, timeout=120)
    assert doc["state"] == "done", doc.get("error")
    assert _png(tmp_path / "reports" / f"{rid}.png") == (1100, 850)
    stats = json.loads((tmp_path / "reports" / f"{rid}.json").read_text())["stats"]
    assert stats["ticks"] == 330 and stats["worst_zone"] == "A"
    assert stats["faults"]["outer_race"] == stats["anomalies"] >= 200
    assert stats["envelope_ratio_max"]["BPFO"] > 10
    md = doc["markdown"]
    findings = md.index("## Findings")
    assert findings < md.index("![") < md.index("## Commentary") < md.index("## Figures")
    first = md[findings:].splitlines()[2]
    assert first.startswith("- **Outer-race defect** (low severity), since ")
    assert "Growth: the BPFO envelope line" in first and "What to do: plan a bearing" in first
    assert "{" not in md[md.index("## Figures"):]  # no JSON in the tables
    assert "> Outer-race defect: plan a bearing replacement." in md
    req = fake_executor.requests[-1]
    assert req.priority == Priority.REPORT and req.session.startswith("report-pump-1-")
    assert "Findings (measured): Outer-race defect" in req.text
    assert [e["fault"] for e in doc["episodes"]] == ["outer_race"]
    assert [r["id"] for r in ag.reports.list()] == [rid]


def test_weekly_report_withholds_a_contradicting_summary(tmp_path, fake_executor, scheduler,
                                                        clock):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="inner_race",
                                                                  onset_s=0.0)),)),
               fake_executor, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 5)
    fake_executor.answer = 'Condition: "Normal". Recommendation: "Condition"'
    doc = ag.reports.wait_for(ag.reports.start("weekly", asset="pump-1"), timeout=60)
    assert doc["commentary"]["withheld"] and "normal" in doc["commentary"]["reason"].lower()
    assert "Recommendation" not in doc["markdown"] and "withheld" in doc["markdown"]


def test_a_healthy_weeks_plot_draws_the_detection_thresholds(tmp_path, scheduler, clock,
                                                             monkeypatch):
    """No anomaly in the period: the envelope panel still shows each line's threshold (from
    the latest diagnosed window), so the plot says how far below them the lines stay."""
    from kvagentd.agent import plots

    seen: list[object] = []
    real = plots.trend_figure

    def spy(*args, **kw):
        seen.append(kw.get("thresholds"))
        return real(*args, **kw)

    monkeypatch.setattr(plots, "trend_figure", spy)
    ag = Agent(agent_config(), None, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 3)
    doc = ag.reports.wait_for(ag.reports.start("weekly", asset="pump-1"), timeout=60)
    assert doc["state"] == "done" and doc["stats"]["anomalies"] == 0
    assert len(seen) == 1 and isinstance(seen[0], dict)
    assert {"BPFO", "BPFI"} <= set(seen[0]) and all(v > 1 for v in seen[0].values())


def test_weekly_report_without_model_uses_deterministic_summary(tmp_path, scheduler, clock):
    ag = Agent(agent_config(), None, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 3)
    doc = ag.reports.wait_for(ag.reports.start("weekly", asset="pump-1"), timeout=60)
    assert doc["state"] == "done" and "No fault pattern in 3 measurements" in doc["summary"]
    assert len(doc["files"]) == 3 and "LLM off" in doc["markdown"]


def test_replay_shows_the_window_spectrum_and_resumes_the_session(tmp_path, fake_executor,
                                                                  scheduler, clock):
    ag = Agent(agent_config(assets=(AssetConfig(fault=FaultConfig(kind="outer_race",
                                                                  onset_s=0)),)),
               fake_executor, scheduler, tmp_path, clock=clock,
               store_stats=lambda: {"cold_loads": 0})
    run_ticks(ag, clock, 3)
    event = ag.events.query(anomalies=True, newest_first=False)[0]  # its window was kept
    fake_executor.answer = "The BPFO line at 107.0 Hz points to the outer race."
    doc = ag.reports.wait_for(ag.reports.start("replay", event=event["id"]), timeout=60)
    assert doc["state"] == "done", doc.get("error")
    req = fake_executor.requests[-1]
    assert req.session == event["session"] and req.priority == Priority.REPORT
    assert req.system is None and f"event {event['id']}" in req.text
    assert "Diagnosis (measured): outer-race defect" in req.text
    assert len(doc["files"]) == 4 and doc["store_before"] == {"cold_loads": 0}
    assert _png(tmp_path / "reports" / doc["spectrum_png"]) == (1100, 480)
    md = doc["markdown"]
    assert md.index("## Finding") < md.index("| BPFO |") < md.index("![envelope spectrum")
    assert doc["commentary"]["text"] == fake_executor.answer
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


def test_report_files_are_confined(tmp_path, scheduler, clock):
    """Ids cannot be guessed ahead (so no name can be planted for them), every file is
    published by rename over the entry (a planted symlink is replaced, never written
    through), and a reports directory that is not the daemon's alone is refused."""
    import os

    from kvagentd.control.dumps import DumpDirUnsafe

    ag = Agent(agent_config(), None, scheduler, tmp_path, clock=clock)
    run_ticks(ag, clock, 3)
    first = ag.reports.start("weekly", asset="pump-1")
    second = ag.reports.start("weekly", asset="pump-1")  # the same second
    assert first != second and first.rsplit("-", 1)[0] == second.rsplit("-", 1)[0]
    for rid in (first, second):
        assert ag.reports.wait_for(rid, timeout=60)["state"] == "done"

    reports = tmp_path / "reports"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (reports / "planted.md").symlink_to(victim)
    ag.reports._write_text("planted.md", "# report")
    assert victim.read_text() == "keep me"
    assert not (reports / "planted.md").is_symlink()
    assert (reports / "planted.md").read_text() == "# report"
    assert not [p for p in reports.iterdir() if p.name.endswith(".tmp")]

    os.chmod(reports, 0o777)  # anybody could plant entries here now
    with pytest.raises(DumpDirUnsafe, match="writable by it alone"):
        ag.reports.start("weekly", asset="pump-1")
    os.chmod(reports, 0o750)
    os.rename(reports, tmp_path / "elsewhere")
    reports.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DumpDirUnsafe, match="not a plain directory"):
        ag.reports.start("weekly", asset="pump-1")
