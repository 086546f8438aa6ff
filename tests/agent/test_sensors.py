from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvagentd.agent.diagnosis.analysis import analyze, classify
from kvagentd.agent.features import Window, extract
from kvagentd.agent.replay import ReplaySource
from kvagentd.agent.sensors import BadData, decode_payload, encode_binary, validate
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AssetConfig, FaultConfig


def test_simulated_is_deterministic_for_seed_and_time():
    a = AssetConfig()
    w1 = SimulatedSource(a, 0.0).read_window(100.0)
    w2 = SimulatedSource(a, 0.0).read_window(100.0)
    w3 = SimulatedSource(dataclasses.replace(a, seed=2), 0.0).read_window(100.0)
    assert np.array_equal(w1.samples, w2.samples)
    assert not np.array_equal(w1.samples, w3.samples)
    validate(w1, a)


@pytest.mark.parametrize("kind", ["outer_race", "inner_race", "ball", "cage"])
def test_simulated_bearing_fault_appears_after_onset(kind):
    a = AssetConfig(fault=FaultConfig(kind=kind, onset_s=60.0))
    src = SimulatedSource(a, 1000.0)
    before = analyze(src.read_window(1000.0 + 30.0), a)
    after = analyze(src.read_window(1000.0 + 600.0), a)
    assert classify(before, a).fault == "none"
    assert classify(after, a).fault == kind
    assert after.features.kurtosis > before.features.kurtosis + 1


def test_simulated_imbalance_grows_through_zones():
    a = AssetConfig(fault=FaultConfig(kind="imbalance", onset_s=600.0, growth_per_hour=4.0))
    src = SimulatedSource(a, 0.0)
    r = [extract(src.read_window(t), a).rms_mm_s for t in (1.0, 900.0, 1800.0, 3600.0, 5400.0)]
    assert r == sorted(r) and r[0] < 1.4 and r[-1] > 4.5


def test_replay_csv_and_npy_wrap_around_and_say_so(tmp_path):
    a = AssetConfig(source="replay", sample_rate_hz=1000.0, window_s=0.5)
    x = np.sin(np.arange(1200) * 0.3)
    np.save(tmp_path / "s.npy", x)
    (tmp_path / "s.csv").write_text("accel\n" + "\n".join(f"{v},0" for v in x))
    for name in ("s.npy", "s.csv"):
        src = ReplaySource(dataclasses.replace(a, replay_path=tmp_path / name))
        w1, w2, w3 = (src.read_window(t) for t in (1.0, 2.0, 3.0))
        assert np.allclose(w1.samples, x[:500]) and np.allclose(w2.samples, x[500:1000])
        assert np.allclose(w3.samples, x[:500])  # loops
        assert [(w.offset, w.passes) for w in (w1, w2, w3)] == [(0, 0), (500, 0), (0, 1)]
        validate(w1, src.asset)


def test_replay_takes_unit_and_rate_from_the_file(tmp_path):
    x = np.sin(np.arange(4800) * 0.3)
    np.save(tmp_path / "g.npy", x)
    (tmp_path / "g.npy.json").write_text(json.dumps({"sample_rate_hz": 1000, "unit": "g"}))
    a = AssetConfig(source="replay", sample_rate_hz=1000.0, window_s=0.5,
                    replay_path=tmp_path / "g.npy")
    w = ReplaySource(a).read_window(1.0)
    assert np.allclose(w.samples, x[:500] * 9.80665) and w.kind == "acceleration"
    # The same file stated at 4 kHz: its windows do not fit a 1 kHz asset and are refused.
    (tmp_path / "g.npy.json").write_text(json.dumps({"sample_rate_hz": 4000, "unit": "g"}))
    w4 = ReplaySource(a).read_window(1.0)
    with pytest.raises(BadData) as e:
        validate(w4, a)
    assert e.value.reason == "rate"
    (tmp_path / "g.npy.json").write_text("{not json")
    with pytest.raises(BadData) as e:
        ReplaySource(a).read_window(1.0)
    assert e.value.reason == "io"


def test_replay_missing_file_is_bad_data(tmp_path):
    src = ReplaySource(AssetConfig(source="replay", replay_path=tmp_path / "nope.npy"))
    with pytest.raises(BadData) as e:
        src.read_window(0.0)
    assert e.value.reason == "io"


def _good(a: AssetConfig) -> Window:
    return SimulatedSource(a, 0.0).read_window(10.0)


@pytest.mark.parametrize("mutate,reason", [
    (lambda w: dataclasses.replace(w, samples=np.where(np.arange(w.samples.size) == 5, np.nan,
                                                       w.samples)), "nonfinite"),
    (lambda w: dataclasses.replace(w, samples=np.where(np.arange(w.samples.size) == 5, np.inf,
                                                       w.samples)), "nonfinite"),
    (lambda w: dataclasses.replace(w, samples=w.samples[:100]), "length"),
    (lambda w: dataclasses.replace(w, sample_rate=8000.0), "rate"),
    (lambda w: dataclasses.replace(w, samples=np.full(w.samples.size, 0.25)), "silent"),
])
def test_validate_rejects_bad_windows(mutate, reason):
    a = AssetConfig()
    with pytest.raises(BadData) as e:
        validate(mutate(_good(a)), a)
    assert e.value.reason == reason


def test_payload_formats_round_trip():
    x = np.linspace(-1, 1, 64)
    w = decode_payload(encode_binary(x, 1000.0, "velocity"), 10.0)
    assert (w.kind, w.sample_rate, w.samples.size) == ("velocity", 1000.0, 64)
    assert np.allclose(w.samples, x, atol=1e-6)
    j = decode_payload(json.dumps({"sample_rate": 500, "samples": x.tolist()}).encode(), 10.0)
    assert j.kind == "acceleration" and np.allclose(j.samples, x)
    for bad in (b"KVS1\x00", b"{not json", json.dumps({"samples": [1]}).encode(),
                json.dumps({"sample_rate": 1, "samples": [1], "kind": "x"}).encode()):
        with pytest.raises(BadData) as e:
            decode_payload(bad, 0.0)
        assert e.value.reason == "decode"
