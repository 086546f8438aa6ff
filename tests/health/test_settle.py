"""Health's hysteresis (`Settled`) on a fake clock: holds, at-once evidence, logging."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import structlog

from kvagentd.config import HealthConfig
from kvagentd.health import Check, Commentary, Level, Report, Settled

OK, DEGRADED, FAILING = Level.OK, Level.DEGRADED, Level.FAILING
H = HealthConfig(raise_after_s=15.0, clear_after_s=60.0)
TICK = 3.0  # the agent's cadence; the daemon settles at least every 5 s


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _report(*checks: Check) -> Report:
    return Report(tuple(checks))


def _run(s: Settled, clock: Clock, levels: list[Level], name: str = "skip-rate:pump-1",
         at_once: bool = False, step: float = TICK) -> list[Level]:
    """Settle one check reading `levels` one per `step`; the settled level after each."""
    out = []
    for lv in levels:
        clock.t += step
        r = s.settle(_report(Check(name, lv, f"reads {lv.value}", at_once=at_once)), H)
        out.append(r.checks[0].level)
    return out


def test_a_steady_state_never_changes() -> None:
    clock = Clock()
    s = Settled(clock)
    with structlog.testing.capture_logs() as logs:
        assert set(_run(s, clock, [OK] * 600)) == {OK}  # 30 min of ticks
    assert logs == []


def test_a_figure_wandering_around_its_threshold_does_not_flap() -> None:
    """The demo's pattern: degraded for a tick or two, ok for a few; never held 15 s, so
    health stays ok. Once it settles degraded, the gaps of ok never hold 60 s: one episode."""
    clock = Clock()
    s = Settled(clock)
    blips = ([DEGRADED, DEGRADED, OK, OK, OK]) * 40
    assert set(_run(s, clock, blips)) == {OK}
    held = [DEGRADED] * 6  # 18 s
    got = _run(s, clock, held)
    assert got[:4] == [OK] * 4 and got[-1] is DEGRADED  # counts once it held 15 s
    wander = ([OK] * 10 + [DEGRADED]) * 20  # ok for 30 s at a time: never 60
    assert set(_run(s, clock, wander)) == {DEGRADED}
    settled = _run(s, clock, [OK] * 25)  # 75 s of ok
    assert settled[19] is DEGRADED and settled[20] is OK  # after 60 s, not before


def test_unambiguous_failing_counts_at_once_and_recovery_waits() -> None:
    clock = Clock()
    s = Settled(clock)
    assert _run(s, clock, [OK] * 5, name="sensor:pump-1") == [OK] * 5
    # the sensor's stale limit passed: failing on the first report that sees it
    assert _run(s, clock, [FAILING], name="sensor:pump-1", at_once=True) == [FAILING]
    back = _run(s, clock, [OK] * 21, name="sensor:pump-1")
    assert back[:19] == [FAILING] * 19 and back[20] is OK  # clears after 60 s of ok


def test_a_rise_takes_the_worst_level_that_held() -> None:
    """degraded for 9 s then failing for 9 s: degraded has held 18 s, failing not 15 s yet."""
    clock = Clock()
    s = Settled(clock)
    got = _run(s, clock, [DEGRADED] * 3 + [FAILING] * 3)
    assert got[-1] is DEGRADED
    got = _run(s, clock, [FAILING] * 3)
    assert got[-1] is FAILING
    # failing -> degraded clears to degraded after the clear hold, not to ok
    got = _run(s, clock, [DEGRADED] * 21)
    assert got[18] is FAILING and got[20] is DEGRADED


def test_a_pending_change_is_shown_with_its_hold() -> None:
    clock = Clock()
    s = Settled(clock)
    clock.t += 1
    s.settle(_report(Check("memory", DEGRADED, "900 MiB available")), H)
    clock.t += 6
    c = s.settle(_report(Check("memory", DEGRADED, "900 MiB available")), H).checks[0]
    assert c.level is OK and c.pending is DEGRADED and c.pending_s == 6.0
    assert c.reason == "900 MiB available (degraded for 6 s; counts after 15 s)"
    assert c.as_dict()["pending"] == "degraded"
    clock.t += 10
    c = s.settle(_report(Check("memory", DEGRADED, "900 MiB available")), H).checks[0]
    assert c.level is DEGRADED and c.pending is None and "pending" not in c.as_dict()
    clock.t += 5
    c = s.settle(_report(Check("memory", OK, "9 GiB available")), H).checks[0]
    assert c.level is DEGRADED and c.pending is OK
    assert c.reason == "9 GiB available (ok for 0 s; stays degraded until 60 s)"


def test_changes_are_logged_once_each_worse_at_warning_better_at_info() -> None:
    clock = Clock()
    s = Settled(clock)
    with structlog.testing.capture_logs() as logs:
        _run(s, clock, [OK, FAILING, FAILING, OK], name="main-loop", at_once=True)
        _run(s, clock, [OK] * 25, name="main-loop")
    changes = [(e["event"], e["log_level"], e.get("check"), e["old"], e["new"]) for e in logs]
    assert changes == [
        ("health_check_changed", "warning", "main-loop", "ok", "failing"),
        ("health_changed", "warning", None, "ok", "failing"),
        ("health_check_changed", "info", "main-loop", "failing", "ok"),
        ("health_changed", "info", None, "failing", "ok"),
    ]
    assert logs[0]["reason"] == "reads failing"
    assert logs[1]["checks"] == {"main-loop": "reads failing"}


def test_the_overall_level_follows_the_settled_checks_and_commentary_rides_along() -> None:
    clock = Clock()
    s = Settled(clock)
    notes = (Commentary("pump-1", "missing", "the last 3 model turns gave no commentary",
                        withheld=3),)
    r = Report((Check("daemon", OK, "running", at_once=True),
                Check("tick-p99:pump-1", FAILING, "p99 12 s")), None, notes)
    clock.t += 1
    got = s.settle(r, H)
    assert got.level is OK and s.level is OK and got.commentary == notes
    assert got.as_dict()["status"] == "ok"
    clock.t += 15
    got = s.settle(r, H)
    assert got.level is FAILING and s.level is FAILING
    assert got.summary().startswith("failing: tick-p99:pump-1: p99 12 s")


def test_forget_lets_an_acknowledged_check_clear_at_once() -> None:
    clock = Clock()
    s = Settled(clock)
    _run(s, clock, [DEGRADED] * 6, name="lost-blocks")
    assert _run(s, clock, [OK], name="lost-blocks") == [DEGRADED]
    s.forget(["lost-blocks"])
    assert _run(s, clock, [OK], name="lost-blocks") == [OK]
    _run(s, clock, [DEGRADED] * 6, name="lost-blocks")
    s.forget([])
    assert _run(s, clock, [OK], name="lost-blocks") == [OK]


def test_a_check_that_is_gone_is_forgotten() -> None:
    clock = Clock()
    s = Settled(clock)
    _run(s, clock, [DEGRADED] * 6, name="jobs")
    clock.t += TICK
    assert s.settle(_report(), H).level is OK
    assert _run(s, clock, [DEGRADED], name="jobs") == [OK]  # starts again from ok


@pytest.mark.parametrize("raise_after,clear_after", [(0.0, 0.0), (3.0, 9.0)])
def test_the_holds_come_from_the_config(raise_after: float, clear_after: float) -> None:
    clock = Clock()
    s = Settled(clock)
    h = dataclasses.replace(H, raise_after_s=raise_after, clear_after_s=clear_after)
    seen: list[Any] = []
    for lv in [DEGRADED] * 3 + [OK] * 5:
        clock.t += TICK
        seen.append(s.settle(_report(Check("memory", lv, "x")), h).checks[0].level)
    if raise_after == 0.0:
        assert seen == [DEGRADED] * 3 + [OK] * 5
    else:  # raised after 3 s, cleared after 9 s of ok
        assert seen == [OK, DEGRADED, DEGRADED, DEGRADED, DEGRADED, DEGRADED, OK, OK]


def test_the_holds_load_from_the_health_section_and_bad_ones_name_the_field(
        tmp_path: Path) -> None:
    from kvagentd.config import ConfigError, load_config

    assert (HealthConfig().raise_after_s, HealthConfig().clear_after_s) == (15.0, 60.0)
    f = tmp_path / "k.toml"
    f.write_text("[health]\nraise_after_s = 6.0\nclear_after_s = 120.0\n")
    h = load_config(f, env={}).health
    assert (h.raise_after_s, h.clear_after_s) == (6.0, 120.0)
    f.write_text("[health]\nclear_after_s = -1.0\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f, env={})
    assert exc.value.path == "health.clear_after_s"
