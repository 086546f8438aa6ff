"""An asset's fault appearing, changing and clearing, and its sensor going silent and coming
back, are logged once each (at warning, clearing and coming back at info), so that
`journalctl -p warning` holds them and nothing repeats each tick."""

from __future__ import annotations

import structlog

from kvagentd.agent.state import FAULT_CONFIRM_TICKS, AssetState
from kvagentd.config import AssetConfig


def _state() -> AssetState:
    return AssetState(asset=AssetConfig(name="pump-1"), source=None,  # type: ignore[arg-type]
                      diagnoser=None, session_index=1)  # type: ignore[arg-type]


def _d(fault: str, severity: str) -> dict[str, str]:
    return {"fault": fault, "severity": severity, "zone": "B", "summary": f"{fault} {severity}"}


def test_fault_transitions_are_logged_once_each_after_they_hold() -> None:
    st = _state()
    seq = ([_d("none", "none")] * 5 + [_d("outer_race", "low"), _d("none", "none")] * 3
           + [_d("outer_race", "low")] * 6 + [_d("outer_race", "medium")] * 4
           + [_d("none", "none")] * 4)
    with structlog.testing.capture_logs() as logs:
        for d in seq:
            st.track_diagnosis(d)
    events = [(e["event"], e["log_level"], e.get("fault"), e.get("severity")) for e in logs]
    assert events == [("agent.fault_appeared", "warning", "outer_race", "low"),
                      ("agent.fault_changed", "warning", "outer_race", "medium"),
                      ("agent.fault_cleared", "info", "none", "none")]
    assert logs[0]["asset"] == "pump-1" and logs[1]["was_severity"] == "low"
    assert FAULT_CONFIRM_TICKS == 3  # the wavering onset above (alternate ticks) never held


def test_sensor_down_and_back_once_each() -> None:
    st = _state()
    with structlog.testing.capture_logs() as logs:
        st.track_sensor("decode")  # one malformed window: the sensor is not down
        for _ in range(5):
            st.track_sensor("stale")
        st.track_sensor(None)
        st.track_sensor(None)
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("agent.sensor_down", "warning"), ("agent.sensor_back", "info")]
    assert logs[0]["reason"] == "stale" and logs[1]["was"] == "stale"
