"""Recordings with their unit and rate: .npy + sidecar, .csv header, .wav; and the offline
`kvagentd diagnose` command on each."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.io import wavfile

from kvagentd.__main__ import main
from kvagentd.agent.recordings import G, RecordingError, load_recording
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AssetConfig, FaultConfig

FS = 12000


@pytest.fixture(scope="module")
def signal() -> np.ndarray:
    """Four seconds of a simulated outer-race defect, in m/s^2."""
    a = AssetConfig(fault=FaultConfig(kind="outer_race", onset_s=0.0, severity=2.0,
                                      growth_per_hour=0.0))
    src = SimulatedSource(a, 0.0)
    return np.concatenate([src.read_window(10.0 + i).samples for i in range(4)])


def test_npy_with_sidecar_in_g(tmp_path, signal):
    np.save(tmp_path / "r.npy", signal / G)
    (tmp_path / "r.npy.json").write_text(json.dumps({"sample_rate_hz": FS, "unit": "g",
                                                     "rpm": 1797}))
    rec = load_recording(tmp_path / "r.npy")
    assert rec.sample_rate_hz == FS and rec.unit == "g" and rec.kind == "acceleration"
    assert np.allclose(rec.samples, signal) and rec.rpm == 1797
    assert rec.provenance == {"sample_rate_hz": "sidecar", "unit": "sidecar", "rpm": "sidecar"}
    with pytest.raises(RecordingError, match="12000 Hz but 48000"):
        load_recording(tmp_path / "r.npy", sample_rate_hz=48000)
    with pytest.raises(RecordingError, match="unit g"):
        load_recording(tmp_path / "r.npy", unit="mm/s")


def test_npy_without_metadata_needs_rate_and_unit(tmp_path, signal):
    np.save(tmp_path / "bare.npy", signal)
    with pytest.raises(RecordingError, match="sample rate"):
        load_recording(tmp_path / "bare.npy", unit="m/s^2")
    with pytest.raises(RecordingError, match="unit"):
        load_recording(tmp_path / "bare.npy", sample_rate_hz=FS)
    rec = load_recording(tmp_path / "bare.npy", sample_rate_hz=FS, unit="m/s^2")
    assert rec.provenance["unit"] == "given" and rec.duration_s == pytest.approx(4.0)


def test_csv_header_and_time_column(tmp_path, signal):
    t = np.arange(signal.size) / FS
    body = "\n".join(f"{a:.6f},{b:.6f}" for a, b in zip(t, signal / G))
    (tmp_path / "r.csv").write_text(f"# unit: g\n# rpm = 1797\ntime,accel\n{body}\n")
    rec = load_recording(tmp_path / "r.csv")
    assert rec.sample_rate_hz == pytest.approx(FS, rel=1e-3) and rec.unit == "g"
    assert np.allclose(rec.samples, signal, atol=1e-4 * G)
    (tmp_path / "v.csv").write_text("# sample_rate_hz: 2000\nvelocity [mm/s]\n1.0\n2.0\n1.5\n")
    v = load_recording(tmp_path / "v.csv")
    assert v.kind == "velocity" and v.sample_rate_hz == 2000 and v.samples.tolist() == [1, 2, 1.5]
    (tmp_path / "bad.csv").write_text("# sample_rate_hz: 2000\n# unit: g\n1.0\nabc\n")
    with pytest.raises(RecordingError, match="not numeric"):
        load_recording(tmp_path / "bad.csv")


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_wav_carries_its_rate(tmp_path, signal, dtype):
    peak = float(np.max(np.abs(signal)))
    x = signal / peak * 0.9
    data = (x * 32767).astype(np.int16) if dtype == "int16" else x.astype(np.float32)
    wavfile.write(tmp_path / "r.wav", FS, data)
    (tmp_path / "r.json").write_text(json.dumps({"unit": "m/s^2", "scale": peak / 0.9}))
    rec = load_recording(tmp_path / "r.wav")
    assert rec.sample_rate_hz == FS and rec.provenance["sample_rate_hz"] == "file"
    assert np.allclose(rec.samples, signal, atol=peak * 1e-3)


def _cli(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_diagnose_command_on_npy_csv_and_wav(tmp_path, signal, capsys):
    np.save(tmp_path / "r.npy", signal)
    (tmp_path / "r.npy.json").write_text(json.dumps({"sample_rate_hz": FS, "unit": "m/s^2"}))
    (tmp_path / "r.csv").write_text(f"# sample_rate_hz: {FS}\n# unit: m/s^2\nacc\n" +
                                    "\n".join(f"{v:.6f}" for v in signal))
    wavfile.write(tmp_path / "r.wav", FS, signal.astype(np.float32))
    for name, extra in (("r.npy", []), ("r.csv", []), ("r.wav", ["--unit", "m/s^2"])):
        code, out, err = _cli(["diagnose", str(tmp_path / name), "--rpm", "1797", *extra], capsys)
        assert code == 0, err
        assert "outer_race" in out and "4 windows of 1 s" in out and "windows: outer_race 4" in out
        code, out, _ = _cli(["diagnose", str(tmp_path / name), "--rpm", "1797", "--json",
                             "--window-s", "2", *extra], capsys)
        rows = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and [r["window"] for r in rows] == [0, 1]
        assert all(r["fault"] == "outer_race" and r["lines"][0]["line"] == "BPFO" for r in rows)
        assert {"severity", "confidence", "zone", "trend", "offset"} <= set(rows[0])


def test_diagnose_command_errors(tmp_path, signal, capsys):
    np.save(tmp_path / "bare.npy", signal)
    assert _cli(["diagnose", str(tmp_path / "nope.npy"), "--rpm", "1797"], capsys)[0] == 66
    code, _, err = _cli(["diagnose", str(tmp_path / "bare.npy"), "--rpm", "1797"], capsys)
    assert code == 65 and "sample rate" in err
    code, _, err = _cli(["diagnose", str(tmp_path / "bare.npy"), "--sample-rate", "12000",
                         "--unit", "g"], capsys)
    assert code == 64 and "--rpm" in err
    code, _, err = _cli(["diagnose", str(tmp_path / "bare.npy"), "--rpm", "1797",
                         "--sample-rate", "12000", "--unit", "g", "--bearing", "9,7.9"], capsys)
    assert code == 64 and "--bearing" in err
    # Read at a quarter of its rate, every window contradicts the stated speed.
    code, out, _ = _cli(["diagnose", str(tmp_path / "bare.npy"), "--rpm", "1797",
                         "--sample-rate", "3000", "--unit", "m/s^2"], capsys)
    assert code == 0 and "REFUSED" in out
