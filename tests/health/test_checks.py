"""The health checks as pure functions of facts: each threshold, each reason, acknowledgements."""

from __future__ import annotations

import dataclasses

import pytest

from kvagentd.agent.view import AssetView
from kvagentd.config import HealthConfig, load_config
from kvagentd.health import Acknowledgements, DaemonFacts, Facts, Level, assess
from kvagentd.health import checks
from kvagentd.health.facts import DiskFacts, JobFailure, ServiceFacts, TickFacts, WearFacts
from kvagentd.scheduling.jobwatch import JobWindow
from kvagentd.kvcache.cold import ColdView

H = HealthConfig()
OK, DEGRADED, FAILING = Level.OK, Level.DEGRADED, Level.FAILING


def _tick(*, last: float | None = 1.0, waiting: float = 100.0, paused: bool = False,
          runs: int = 30, skipped: int = 0, missed: int = 0, durations: list[float] | None = None,
          interval: float = 3.0) -> TickFacts:
    return TickFacts("pump-1", interval, last, waiting, paused,
                     JobWindow(runs, 0, skipped, missed,
                               [1.0] * runs if durations is None else durations))


def test_ticks_late_paused_and_first() -> None:
    assert checks.ticks(_tick(last=2.0), H).level is OK
    late = checks.ticks(_tick(last=27.0), H)
    assert late.level is FAILING and "no tick done for 27 s" in late.reason
    assert "failing after 3 intervals" in late.reason
    assert checks.ticks(_tick(last=None, waiting=2.0), H).level is OK
    never = checks.ticks(_tick(last=None, waiting=60.0), H)
    assert never.level is FAILING and "since start" in never.reason
    paused = checks.ticks(_tick(paused=True), H)
    assert paused.level is DEGRADED and "kvctl jobs resume agent.tick.pump-1" in paused.reason


def test_skip_rate_thresholds_and_too_few_to_judge() -> None:
    # The field report: 73 of 83 ticks skipped was "ok".
    bad = checks.skip_rate(_tick(runs=10, skipped=73), H)
    assert bad.level is FAILING and "73 of 83 due ticks skipped" in bad.reason and "88 %" in bad.reason
    assert checks.skip_rate(_tick(runs=90, skipped=10), H).level is DEGRADED
    assert checks.skip_rate(_tick(runs=200, skipped=2, missed=1), H).level is OK
    few = checks.skip_rate(_tick(runs=1, skipped=2), H)
    assert few.level is OK and "too few to judge" in few.reason
    strict = dataclasses.replace(H, skip_rate_degraded=0.0, min_due_ticks=1)
    assert checks.skip_rate(_tick(runs=200, skipped=1), strict).level is DEGRADED


def test_tick_p99_against_the_interval() -> None:
    slow = checks.tick_p99(_tick(durations=[26.0] * 10), H)  # p50 26 s at a 3 s interval
    assert slow.level is FAILING and "8.67x the 3.0 s interval" in slow.reason
    assert checks.tick_p99(_tick(durations=[1.0] * 97 + [4.0] * 3), H).level is DEGRADED
    assert checks.tick_p99(_tick(durations=[1.0] * 200 + [50.0]), H).level is OK  # one outlier
    assert checks.tick_p99(_tick(runs=0, durations=[]), H).level is OK
    # just above the limit never reads as equal to it
    edge = checks.tick_p99(_tick(durations=[3.0003] * 10), H)
    assert edge.level is DEGRADED and "1.01x the" in edge.reason
    assert "1.00x the" in checks.tick_p99(_tick(durations=[3.0] * 10), H).reason


def _view(**kw: object) -> AssetView:
    base = dict(name="pump-1", source="mqtt", link="mqtt 127.0.0.1:1883 plant/pump-1",
                connected=True, data_age_s=1.0, running_s=300.0, stale_after_s=8.0,
                last_zone="C", last_rms_mm_s=3.1, last_anomaly=True, bad_samples={},
                message_age_s=1.0, last_refused=None)
    base.update(kw)
    return AssetView(**base)  # type: ignore[arg-type]


def test_sensor_fresh_disconnected_and_stale() -> None:
    assert checks.sensor(_view(message_age_s=1.0), H).level is OK
    down = checks.sensor(_view(connected=False, message_age_s=2.0), H)
    assert down.level is DEGRADED and "disconnected" in down.reason
    # The field report: an MQTT outage with zone C from 60 s old data was "ok".
    stale = checks.sensor(_view(connected=False, data_age_s=60.0, message_age_s=60.0,
                                last_refused="stale: last message 60.0 s ago",
                                bad_samples={"stale": 18}), H)
    assert stale.level is FAILING
    assert "no message for 60 s (stale after 8.0 s)" in stale.reason
    assert "still shows zone C from 60 s ago" in stale.reason and "stale 18" in stale.reason
    never = checks.sensor(_view(data_age_s=None, message_age_s=None, running_s=30.0,
                                last_zone=None), H)
    assert never.level is FAILING and "no message in 30 s since start" in never.reason
    assert checks.sensor(_view(data_age_s=None, message_age_s=None, running_s=1.0),
                         H).level is OK
    own = dataclasses.replace(H, sensor_stale_s=120.0)
    assert checks.sensor(_view(data_age_s=60.0, message_age_s=60.0), own).level is OK


def test_sensor_refused_windows_and_late_ticks() -> None:
    sim = dict(source="simulated", link="simulated", connected=None, message_age_s=None)
    # Ticks that run late make the shown zone old; that is the ticks' check, not the sensor's.
    late = checks.sensor(_view(data_age_s=25.0, **sim), H)
    assert late.level is OK and "last window read 25 s ago" in late.reason
    once = checks.sensor(_view(data_age_s=3.0, last_refused="nonfinite: 12 samples", **sim), H)
    assert once.level is DEGRADED and "refused (nonfinite: 12 samples)" in once.reason
    dead = checks.sensor(_view(data_age_s=40.0, last_refused="silent: constant signal",
                               bad_samples={"silent": 13}, **sim), H)
    assert dead.level is FAILING and "no usable one for 40 s" in dead.reason
    assert "silent 13" in dead.reason


def test_shadow_fill_and_wear() -> None:
    assert checks.shadow_fill(10, 100, H).level is OK
    assert checks.shadow_fill(85, 100, H).level is DEGRADED
    assert checks.shadow_fill(96, 100, H).level is FAILING
    w = WearFacts("ok", 12.0, None, 60.0, 3600.0)
    assert checks.ssd_wear(w, H, 80.0).level is OK and "12 % used" in checks.ssd_wear(w, H, 80.0).reason
    assert checks.ssd_wear(w._replace(percent=75.0), H, 80.0).level is DEGRADED
    assert checks.ssd_wear(w._replace(state="worn", percent=85.0), H, 80.0).level is DEGRADED
    assert checks.ssd_wear(w._replace(state="failed"), H, 80.0).level is FAILING
    stale = checks.ssd_wear(w._replace(file_age_s=9000.0), H, 80.0)
    assert stale.level is DEGRADED and "kvagentd-health.timer" in stale.reason
    unknown = w._replace(state="unknown", error="no status file /x", percent=None)
    assert checks.ssd_wear(unknown, H, 80.0).level is OK
    assert "unknown: no status file /x" in checks.ssd_wear(unknown, H, 80.0).reason
    strict = dataclasses.replace(H, wear_unknown="degraded")
    assert checks.ssd_wear(unknown, strict, 80.0).level is DEGRADED


def _cold(**kw: object) -> ColdView:
    base = dict(serving="ssd", since=0.0, reason="start", read_only=False, ssd_bytes=0,
                ssd_capacity_bytes=1 << 30, shadow_bytes=0, shadow_capacity_bytes=1 << 20,
                counters={"ssd": {"corrupt": 0}, "shadow": {"corrupt": 0}},
                index_discarded={"ssd": None, "shadow": None}, failovers=0, failbacks=0)
    base.update(kw)
    return ColdView(**base)  # type: ignore[arg-type]


def _facts(**kw: object) -> Facts:
    d = DaemonFacts("running", 100.0, 0.1, 5.3, True, 3)
    base: dict[str, object] = dict(daemon=d, memory_available=8 << 30, memory_total=16 << 30)
    base.update(kw)
    return Facts(**base)  # type: ignore[arg-type]


def _by_name(report: object) -> dict[str, object]:
    return {c.name: c for c in report.checks}  # type: ignore[attr-defined]


def test_cold_checks_and_acknowledgement() -> None:
    cfg = load_config(None, env={})
    acks = Acknowledgements()
    f = _facts(cold=_cold(counters={"ssd": {"corrupt": 3}, "shadow": {"corrupt": 1}},
                          index_discarded={"ssd": "file is not a database; set aside as "
                                                  "index.sqlite3.corrupt-1", "shadow": None}),
               lost_blocks=11)
    r = assess(cfg, f, acks)
    c = _by_name(r)
    assert r.level is DEGRADED
    assert c["checksum-failures"].level is DEGRADED and c["checksum-failures"].reason.startswith(
        "4 since start")
    assert c["lost-blocks"].level is DEGRADED and "11 since start" in c["lost-blocks"].reason
    assert c["cold-index"].level is DEGRADED and "not a database" in c["cold-index"].reason
    assert c["cold-tier"].level is OK and c["read-only"].level is OK
    seen = acks.ack(f.counters(), 1000.0, ["lost-blocks"])
    assert seen == {"lost-blocks": 11}
    c = _by_name(assess(cfg, f, acks))
    assert c["lost-blocks"].level is OK and "since the acknowledgement" in c["lost-blocks"].reason
    assert c["checksum-failures"].level is DEGRADED  # not acknowledged
    acks.ack(f.counters(), 1001.0)
    assert assess(cfg, f, acks).level is OK
    worse = _facts(cold=f.cold, lost_blocks=12)
    c = _by_name(assess(cfg, worse, acks))
    assert c["lost-blocks"].level is DEGRADED and c["lost-blocks"].reason.startswith("1 since")


def test_shadow_and_read_only_are_degraded() -> None:
    cfg = load_config(None, env={})
    c = _by_name(assess(cfg, _facts(cold=_cold(serving="shadow", reason="3 new cold I/O errors",
                                               read_only=True)), Acknowledgements()))
    assert c["cold-tier"].level is DEGRADED and "3 new cold I/O errors" in c["cold-tier"].reason
    assert c["read-only"].level is DEGRADED


def test_services_not_started_failing_or_with_failed_jobs() -> None:
    cfg = load_config(None, env={})
    acks = Acknowledgements()
    failed = JobFailure("agent.weekly.pump-1", 2, "AttributeError: 'Config' object has no "
                                                   "attribute 'assets'", 30.0)
    f = _facts(services=(
        ServiceFacts("store", True, None, None, ()),
        ServiceFacts("engine", False, None, None, ()),
        ServiceFacts("maintenance", True, None, "RuntimeError: boom", ()),
        ServiceFacts("agent", True, {"status": "ok", "detail": "assets: pump-1"}, None, (failed,))))
    c = _by_name(assess(cfg, f, acks))
    assert c["service:store"].level is OK
    assert c["service:engine"].level is FAILING and c["service:engine"].reason == "not started"
    assert c["service:maintenance"].level is FAILING and "boom" in c["service:maintenance"].reason
    agent = c["service:agent"]
    assert agent.level is DEGRADED and "agent.weekly.pump-1 failed 2x" in agent.reason
    assert "AttributeError" in agent.reason
    acks.ack(f.counters(), 5.0, ["service:agent"])
    assert _by_name(assess(cfg, f, acks))["service:agent"].level is OK
    stopped = _facts(services=(ServiceFacts("agent", True, {"status": "failing",
                                                            "detail": "the agent is not running"},
                                            None, ()),))
    assert _by_name(assess(cfg, stopped, acks))["service:agent"].level is FAILING


@pytest.mark.parametrize("phase,level", [("running", OK), ("starting", DEGRADED),
                                         ("stopping", FAILING)])
def test_daemon_phase(phase: str, level: Level) -> None:
    cfg = load_config(None, env={})
    f = _facts(daemon=DaemonFacts(phase, 1.0, None, 5.0, True, 0))
    assert _by_name(assess(cfg, f, Acknowledgements()))["daemon"].level is level


def test_report_summary_names_the_worst_first() -> None:
    cfg = load_config(None, env={})
    f = _facts(cold=_cold(serving="shadow", reason="ENOSPC"),
               ticks=(_tick(last=40.0),), lost_blocks=0)
    r = assess(cfg, f, Acknowledgements())
    assert r.level is FAILING
    assert r.summary().startswith("failing: ticks:pump-1: no tick done for 40 s")
    assert "cold-tier" in r.summary()
    assert r.as_dict()["status"] == "failing"


def test_withheld_commentary_is_its_own_status_and_never_degrades_health() -> None:
    """The model answers every tick but the check withholds every text: the asset's
    commentary is `missing`, while the box stays ok (no `llm:` check at all)."""
    cfg = load_config(None, env={})
    why = "commentary withheld: copies what it was given ('recent state of pump 1 over 20')"
    view = _view(llm_failing=3, llm_error=why, llm_withheld=3)
    r = assess(cfg, _facts(assets=(view,)), Acknowledgements())
    assert not [c for c in r.checks if c.name.startswith("llm:")]
    assert r.level is OK
    (c,) = r.commentary
    assert (c.asset, c.state, c.withheld) == ("pump-1", "missing", 3)
    assert "copies what it was given" in c.reason and "a larger model" in c.reason
    assert "3 commentaries withheld since start" in c.reason
    assert r.as_dict()["commentary"][0]["state"] == "missing"
    fine = _view(llm_failing=0, llm_withheld=3)
    (c,) = assess(cfg, _facts(assets=(fine,)), Acknowledgements()).commentary
    assert c.state == "ok" and "3 commentaries withheld" in c.reason
    (c,) = assess(cfg, _facts(assets=(_view(),)), Acknowledgements()).commentary
    assert (c.state, c.failed, c.cut, c.withheld) == ("ok", 0, 0, 0)


def test_commentary_is_missing_after_three_failed_turns_in_a_row() -> None:
    err = "llm: HotPoolFull: session 'pump-1-1' needs 75 hot blocks"
    one = checks.commentary(_view(llm_failing=1, llm_error=err, llm_errors=4))
    assert one.state == "ok" and "needs 75 hot blocks" in one.reason  # a moment, said
    three = checks.commentary(_view(llm_failing=3, llm_error=err, llm_errors=6))
    assert three.state == "missing" and three.asset == "pump-1" and three.failed == 6
    assert "last 3 model turns gave no commentary" in three.reason
    assert "75 hot blocks" in three.reason and "6 turns failed since start" in three.reason
    cut = checks.commentary(_view(llm_failing=3, llm_error="commentary cut at the tick's "
                                  "deadline", llm_cut=3))
    assert cut.state == "missing" and "0 turns failed and 3 were cut" in cut.reason
    assert checks.commentary(_view(llm_failing=0, llm_errors=6)).state == "ok"


def test_a_full_disk_is_failing_at_once_a_low_one_degraded() -> None:
    cfg = load_config(None, env={})
    floor, unit = 1 << 30, 128 << 10
    disks = (DiskFacts("/cold", unit - 1, None), DiskFacts("/state", floor - 1, None),
             DiskFacts("/ok", floor, None), DiskFacts("/gone", None, "EIO"))
    r = {c.name: c for c in assess(cfg, _facts(disks=disks, free_space_floor=floor,
                                               disk_full_below=unit), Acknowledgements()).checks}
    full = r["disk:/cold"]
    assert full.level is FAILING and full.at_once and full.reason.startswith("full: ")
    low = r["disk:/state"]
    assert low.level is DEGRADED and not low.at_once and "below the floor" in low.reason
    assert r["disk:/ok"].level is OK
    assert r["disk:/gone"].level is FAILING and r["disk:/gone"].at_once


def test_commentaries_for_status_and_a_broken_probe() -> None:
    views = [_view(llm_failing=3, llm_error="llm: timeout", llm_errors=3), _view(name="fan-2")]
    got = checks.commentaries(lambda: views)
    assert got["pump-1"]["state"] == "missing" and got["pump-1"]["failed"] == 3
    assert got["fan-2"]["state"] == "ok"

    def broken() -> list[AssetView]:
        raise RuntimeError("view exploded")
    assert checks.commentaries(broken) == {"error": "RuntimeError: view exploded"}
