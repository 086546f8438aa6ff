"""The diagnosis on the real CWRU development recordings (shared/data/cwru-dev)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from bench.cwru import cwru_dir, load_manifest, recording
from kvagentd.agent.offline import asset_for, diagnose_recording

BEARING = {"outer_race", "inner_race", "ball", "cage"}


@pytest.fixture(scope="module")
def cwru():
    d = cwru_dir()
    if d is None:
        pytest.fail("the CWRU recordings are missing: set KVAGENTD_CWRU_DIR to the directory "
                    "holding manifest.json (shared/data/cwru-dev)")
    bearing, files = load_manifest(d)
    out = {}
    for entry in files:
        rec = recording(d, entry)
        asset = asset_for(rec, rpm=float(entry["rpm"]), bearing=bearing)
        out[entry["file"]] = (entry, rec, asset, list(diagnose_recording(rec, asset)))
    return out


def _by_class(cwru, fault):
    got = Counter()
    for entry, _, _, results in cwru.values():
        if entry["fault"] == fault:
            got.update(r.diagnosis.fault if r.diagnosis else "refused" for r in results)
    return got


@pytest.mark.parametrize("fault", ["outer_race", "inner_race"])
def test_race_faults_are_recalled_in_most_windows(cwru, fault):
    got = _by_class(cwru, fault)
    assert got[fault] / sum(got.values()) >= 0.9, dict(got)


def test_no_false_anomaly_on_the_healthy_recording(cwru):
    got = _by_class(cwru, "none")
    assert sum(got.values()) >= 2 and set(got) == {"none"}, dict(got)
    # The healthy record is 2.5 s long: every quarter-second start, too.
    _, rec, asset, _ = cwru["normal_load0hp_first_half.npy"]
    dense = [r.diagnosis.fault for r in diagnose_recording(rec, asset, hop_s=0.25)
             if r.diagnosis is not None]
    assert len(dense) == 7 and set(dense) == {"none"}, dense


def test_ball_fault_recordings_are_never_called_a_running_speed_fault(cwru):
    """These ball-fault records show no 2xBSF/FTF signature (see BENCHMARKS.md); what the
    diagnosis may say of them is 'none' or another bearing fault, never imbalance & co."""
    got = _by_class(cwru, "ball")
    assert set(got) <= BEARING | {"none"}, dict(got)


def test_every_window_carries_its_evidence(cwru):
    entry, _, _, results = cwru["inner_race_007in_load1hp.npy"]
    d = results[0].diagnosis
    assert d is not None
    doc = d.as_dict()
    names = [ln["line"] for ln in doc["lines"]]
    assert names[0] == "BPFI" and "BPFI-1x" in names and "BPFI+1x" in names
    assert doc["zone"] == "A" and doc["severity"] == "low"
    assert abs(doc["shaft_hz"] - entry["rpm"] / 60) < 0.3


@pytest.mark.parametrize("factor", [0.25, 0.5, 4.0])
def test_a_wrong_sample_rate_is_refused(cwru, factor):
    refused = total = 0
    for name in ("outer_race_007in_load1hp.npy", "inner_race_007in_load2hp.npy"):
        entry, rec, asset, _ = cwru[name]
        wrong = dataclasses.replace(rec, sample_rate_hz=rec.sample_rate_hz * factor)
        results = list(diagnose_recording(wrong, dataclasses.replace(
            asset, sample_rate_hz=wrong.sample_rate_hz)))
        total += len(results)
        refused += sum(r.diagnosis is None for r in results)
    assert refused / total >= 0.8


def test_the_right_sample_rate_is_never_refused(cwru):
    assert all(r.diagnosis is not None for _, _, _, res in cwru.values() for r in res)


def test_a_recording_most_of_whose_windows_contradict_its_speed_is_refused_whole(cwru):
    """At a quarter of the true rate some windows pass the check alone; once more than half
    of at least 8 windows were refused, the recording's later windows are refused too, with
    the recording's reason."""
    for _name, (_entry, rec, asset, _) in sorted(cwru.items()):
        wrong = dataclasses.replace(rec, sample_rate_hz=rec.sample_rate_hz / 4)
        results = list(diagnose_recording(wrong, dataclasses.replace(
            asset, sample_rate_hz=wrong.sample_rate_hz)))
        whole = [i for i, r in enumerate(results) if "of this recording" in (r.refused or "")]
        if not whole:
            continue
        first = whole[0]
        assert first >= 7  # never before 8 windows were checked
        own = sum(r.diagnosis is None for r in results[:first])
        assert own > first / 2  # a majority of windows had been refused on their own
        assert all(r.diagnosis is None for r in results[first:])
        return
    pytest.fail("no recording read at a quarter of its rate was refused as a whole")
