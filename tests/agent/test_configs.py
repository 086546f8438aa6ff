"""The shipped configs drive the agent (features-only here: no model)."""

from __future__ import annotations

from pathlib import Path

from kvagentd.agent.agent import Agent
from kvagentd.config import load_config

from .conftest import ManualClock

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_demo_config_fault_shows_up_after_its_onset(tmp_path, scheduler):
    cfg = load_config(CONFIGS / "demo.toml", env={})
    clock = ManualClock()
    ag = Agent(cfg.agent, None, scheduler, tmp_path, clock=clock)
    a = cfg.agent.assets[0]
    early = ag.tick_once(a.name)
    clock.advance(a.fault.onset_s + 600.0)
    late = ag.tick_once(a.name)
    assert early["kind"] == late["kind"] == "tick"
    assert not early["anomaly"] and late["anomaly"]


def test_industrial_config_without_broker_reports_missing_data(tmp_path, scheduler):
    cfg = load_config(CONFIGS / "kvagentd.toml", env={})
    ag = Agent(cfg.agent, None, scheduler, tmp_path)
    rows = [ag.tick_once(a.name) for a in cfg.agent.assets]
    assert all(r["kind"] == "bad_data" and r["note"].startswith("missing") for r in rows)


def test_agent_fields_are_validated_with_their_path(tmp_path):
    import pytest

    from kvagentd.config import ConfigError

    bad = {
        "[agent]\nevents_raw_retention_s = 86400.0\nevents_retention_s = 7200.0\n":
            "agent.events_retention_s",
        "[[agent.assets]]\nsource = 'replay'\nreplay_path = 'x.mat'\n":
            "agent.assets[0].replay_path",
        "[[agent.assets]]\nreplay_unit = 'furlongs'\n": "agent.assets[0].replay_unit",
        "[[agent.assets]]\nrpm_tolerance = 0.9\n": "agent.assets[0].rpm_tolerance",
        "[[agent.assets]]\n[agent.assets.fault]\nkind = 'gremlins'\n": "agent.assets[0].fault.kind",
    }
    for text, field in bad.items():
        p = tmp_path / "c.toml"
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(p, env={})
        assert e.value.path == field
