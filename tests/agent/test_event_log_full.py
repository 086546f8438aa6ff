"""A full state disk: the event log refuses writes (SQLite's "database or disk is full"). Ticks
still run and measure, their figures stay in status, health says what is not recorded and
where, and recording resumes by itself once there is room."""

from __future__ import annotations

import sqlite3

import pytest

from kvagentd.agent.agent import Agent
from kvagentd.agent.events import EventLog

from .conftest import agent_config


def _fill(log: EventLog) -> None:
    """No page beyond those the database has: the next insert fails with SQLITE_FULL, as on a
    full disk."""
    pages = log._db.execute("PRAGMA page_count").fetchone()[0]
    log._db.execute(f"PRAGMA max_page_count = {pages}")


def _room(log: EventLog) -> None:
    log._db.execute("PRAGMA max_page_count = 1073741823")


def test_a_full_event_log_raises_its_own_error_not_a_rollback_error(tmp_path):
    log = EventLog(tmp_path / "events.sqlite3")
    _fill(log)
    with pytest.raises(sqlite3.OperationalError, match="database or disk is full"):
        for i in range(200):  # the first insert may still fit in the last page
            log.append(t=float(i), asset="a", features={"rms_mm_s": 1.0, "kurtosis": 3.0,
                                                        "pad": "x" * 2000})
    _room(log)
    assert log.append(t=1e6, asset="a", features={"rms_mm_s": 1.0, "kurtosis": 3.0}) > 0


def test_ticks_go_on_and_health_says_what_was_not_recorded(tmp_path, fake_executor,
                                                           scheduler, clock):
    ag = Agent(agent_config(), fake_executor, scheduler, tmp_path, clock=clock)
    ag.start()
    try:
        ag.tick_once("pump-1")
        clock.advance(3)
        assert ag.health()["status"] == "ok"
        turns = len(fake_executor.requests)
        _fill(ag.events)
        rows = []
        for _ in range(40):
            rows.append(ag.tick_once("pump-1"))
            clock.advance(3)
        st = ag.assets["pump-1"]
        assert st.unrecorded > 0 and "database or disk is full" in str(st.unrecorded_error)
        lost = rows[-1]
        assert lost["zone"] in "ABCD" and lost["features"]["rms_mm_s"] > 0  # measured
        assert "not recorded in the event log" in lost["note"]
        assert len(fake_executor.requests) - turns < 40  # no model turn for an unrecorded tick
        h = ag.health()
        assert h["status"] == "degraded"
        assert "not recorded in the event log" in h["detail"] and "events.sqlite" in h["detail"]
        assert st.last_diagnosis is not None and st.last_t == pytest.approx(clock() - 3)

        _room(ag.events)  # room again: recorded again, health clears
        row = ag.tick_once("pump-1")
        assert row.get("id") and st.unrecorded == 0
        assert ag.health()["status"] == "ok"
    finally:
        ag.stop()
