"""The measured diagnosis: significance test, signatures on the simulator, speed check,
baseline and trends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvagentd.agent.diagnosis.analysis import analyze, classify
from kvagentd.agent.diagnosis.baseline import Baseline
from kvagentd.agent.diagnosis.bearing import bearing_frequencies
from kvagentd.agent.diagnosis.diagnoser import Diagnoser, SpeedRefused
from kvagentd.agent.diagnosis.result import FAULTS
from kvagentd.agent.diagnosis.spectra import threshold, with_floor
from kvagentd.agent.diagnosis.trend import TrendSeries
from kvagentd.agent.features import Window
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AssetConfig, BearingConfig, FaultConfig

FS = 12000.0


def test_bearing_frequencies_6205_at_1797_rpm():
    bf = bearing_frequencies(BearingConfig(), 1797.0)
    assert bf.bpfo == pytest.approx(107.36, abs=0.01)
    assert bf.bpfi == pytest.approx(162.19, abs=0.01)
    assert bf.bsf == pytest.approx(70.58, abs=0.01)
    assert bf.ftf == pytest.approx(11.93, abs=0.01)


def test_threshold_holds_its_false_alarm_rate_on_noise():
    """Rayleigh-amplitude spectra: a line test at alpha passes about alpha of noise bins."""
    rng = np.random.default_rng(3)
    hits = tested = 0
    for _ in range(400):
        amp = np.abs(rng.normal(size=600) + 1j * rng.normal(size=600))
        spec = with_floor(np.arange(600.0), amp)
        thr = spec.threshold(1, 0.01)
        hits += int(np.count_nonzero(spec.ratio[40:-40] >= thr))
        tested += 520
    assert 0.005 <= hits / tested <= 0.015
    assert threshold(9, 1e-3) > threshold(1, 1e-3) > threshold(1, 1e-2)


def _sim(kind: str, level: float, **kw) -> tuple[AssetConfig, SimulatedSource]:
    a = AssetConfig(fault=FaultConfig(kind=kind, onset_s=0.0, severity=level,  # type: ignore[arg-type]
                                      growth_per_hour=0.0), baseline_s=0.0, **kw)
    return a, SimulatedSource(a, 0.0)


@pytest.mark.parametrize("kind,level", [
    ("none", 0.0), ("outer_race", 1.0), ("inner_race", 1.0), ("ball", 1.0), ("cage", 1.5),
    ("imbalance", 3.0), ("misalignment", 4.0), ("looseness", 6.0)])
def test_simulated_fault_kinds_are_diagnosed(kind, level):
    a, src = _sim(kind, level)
    got = [classify(analyze(src.read_window(10.0 + 3 * i), a), a) for i in range(6)]
    assert sum(d.fault == kind for d in got) >= 5, [d.fault for d in got]
    d = next(d for d in got if d.fault == kind)
    assert d.fault in FAULTS and 0 < d.confidence <= 1
    assert (d.severity == "none") == (kind == "none")
    doc = d.as_dict()
    assert doc["fault"] == kind and doc["action"] and (bool(doc["lines"]) == (kind != "none"))
    if kind in ("outer_race", "inner_race", "ball"):
        primary = doc["lines"][0]
        assert primary["significant"] and primary["ratio"] >= primary["threshold"]
        assert doc["zone"] == "A"  # the envelope finds it long before the overall level
    if kind == "inner_race":
        assert any(ln["line"].startswith("BPFI") and "1x" in ln["line"] and ln["significant"]
                   for ln in doc["lines"])  # shaft-rate sidebands


def test_a_velocity_sensor_still_finds_running_speed_faults():
    a, src = _sim("imbalance", 3.0, signal="velocity")
    d = classify(analyze(src.read_window(10.0), a), a)
    assert d.fault == "imbalance" and d.zone in ("C", "D")


def test_window_at_a_wrong_sample_rate_is_refused_and_the_right_one_is_not():
    a, src = _sim("outer_race", 2.0)
    w = src.read_window(50.0)
    assert analyze(w, a).speed.ok
    # The same samples read at a quarter of their rate: every line moves to a quarter.
    slow = dataclasses.replace(a, sample_rate_hz=FS / 4, window_s=4.0)
    check = analyze(Window(w.samples[:12000], FS / 4, "acceleration", 0.0), slow).speed
    assert not check.ok and "sample rate" in check.reason
    # NOTE: read 4x too fast, this simulator's 1x and 2x land on the stated 4x and 8x, which a
    # four-vane machine could show: no clear contradiction. Real recordings (richer spectra)
    # are refused at x4: test_diagnosis_cwru.


def test_gaussian_noise_has_no_fault():
    a = AssetConfig(baseline_s=0.0)
    rng = np.random.default_rng(11)
    for _ in range(40):
        an = analyze(Window(rng.normal(size=int(FS)), FS, "acceleration", 0.0), a)
        assert classify(an, a).fault == "none"


def test_diagnoser_refuses_contradicting_speed(tmp_path):
    a, src = _sim("none", 0.0)
    wrong = dataclasses.replace(a, rpm=a.rpm * 2.6)
    with pytest.raises(SpeedRefused):
        Diagnoser(wrong).diagnose(src.read_window(10.0), 10.0)


def test_baseline_learns_healthy_windows_and_flags_a_change(tmp_path):
    a = AssetConfig(baseline_s=60.0, fault=FaultConfig(kind="imbalance", onset_s=120.0,
                                                       severity=0.6, growth_per_hour=0.0))
    src = SimulatedSource(a, 0.0)
    path = tmp_path / "b.json"
    diag = Diagnoser(a, path)
    for i in range(40):
        d = diag.diagnose(src.read_window(3.0 * i + 1), 3.0 * i + 1)
        assert d.fault == "none"
    assert diag.baseline.state == "learned" and path.is_file()
    # 0.6 fault levels of imbalance: zone B, but well above this machine's normal.
    later = diag.diagnose(src.read_window(400.0), 400.0)
    assert later.zone in ("A", "B") and later.elevated and later.fault == "imbalance"
    assert later.baseline == "learned"
    # A fresh diagnoser over the same file continues with the learned baseline.
    assert Diagnoser(a, path).baseline.state == "learned"


def test_baseline_never_learns_a_fault():
    b = Baseline(baseline_s=10.0)
    for i in range(80):
        healthy = i % 2 == 0
        b.observe(float(i), {"rms_mm_s": 1.0 if healthy else 9.0}, healthy=healthy)
    assert b.stats is not None and b.stats.windows == 30  # learned at 30 healthy windows
    assert b.stats.p95["rms_mm_s"] == 1.0


def test_trend_series_hour_and_day_changes():
    tr = TrendSeries()
    t0 = 1_800_000_000.0
    for m in range(0, 26 * 60, 1):  # one value a minute, growing 0.5 per hour
        tr.add(t0 + 60 * m, {"BPFO": 2.0 + 0.5 * m / 60.0})
    now = t0 + 60 * (26 * 60 - 1)
    got = tr.trends(now)["BPFO"]
    assert got.hour == pytest.approx(0.5, abs=0.05)
    assert got.day == pytest.approx(12.0, abs=0.2)
    assert got.per_hour == pytest.approx(0.5, abs=0.01)
    assert TrendSeries().trends(now) == {}


def test_a_recording_is_judged_on_its_windows_so_far():
    from kvagentd.agent.diagnosis.shaft import RecordingSpeed, SpeedCheck

    ok, bad = SpeedCheck(True, 30.0, 30.0, True), SpeedCheck(False, 30.0, 30.0, False, "x")
    r = RecordingSpeed()
    for _ in range(7):
        r.observe(bad)
    assert r.verdict() is None  # too few windows to judge a recording
    r.observe(ok)
    assert r.verdict() is not None and "7 of the first 8 windows" in r.verdict()
    for _ in range(20):
        r.observe(ok)
    assert r.verdict() is not None and "7 of the first 8" in r.verdict()  # it stands
    r = RecordingSpeed()
    for check in [bad, ok] * 4 + [bad]:  # 4 of 8, then 5 of 9
        r.observe(check)
        assert (r.verdict() is None) == (r.checked < 9)


def test_replayed_windows_are_refused_once_their_recording_is(tmp_path):
    """The live agent's diagnoser judges a replay (windows that carry a file offset) as one
    recording; windows of a live sensor are judged one by one."""
    import dataclasses

    from kvagentd.agent.diagnosis.diagnoser import Diagnoser, SpeedRefused
    from kvagentd.agent.diagnosis.shaft import SpeedCheck

    asset = AssetConfig(baseline_s=0.0)
    src = SimulatedSource(asset, 0.0)
    diag = Diagnoser(asset)
    for _ in range(8):  # a replay whose windows were refused (here: told so)
        diag.recording.observe(SpeedCheck(False, 29.5, 29.5, False, "wrong"))
    live = src.read_window(10.0)
    assert live.offset is None and diag.diagnose(live, 10.0) is not None
    replayed = dataclasses.replace(src.read_window(13.0), offset=36000)
    with pytest.raises(SpeedRefused, match="windows of this recording"):
        diag.diagnose(replayed, 13.0)
