"""Offline diagnosis of a recording: the live agent's analysis on every window of a file.

`diagnose_recording(recording, asset, window_s)` yields one `WindowResult` per consecutive
window (no overlap; a tail shorter than a window is left out): its offset, the diagnosis, or
the reason the window was refused (a spectrum that contradicts the stated shaft speed, or a
recording most of whose windows so far do (`shaft.RecordingSpeed`), a window that is constant
or not finite). The asset gives rpm, bearing and zone limits; the
recording gives the samples, the rate and the unit. `kvagentd diagnose` prints these as a table
or as JSON lines; the CWRU benchmark (`bench.diagnosis`) scores them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvagentd.agent.diagnosis.analysis import analyze, classify
from kvagentd.agent.diagnosis.result import Diagnosis
from kvagentd.agent.diagnosis.shaft import RecordingSpeed
from kvagentd.agent.features import Window
from kvagentd.agent.recordings import Recording
from kvagentd.config import AssetConfig


@dataclass(frozen=True, slots=True)
class WindowResult:
    index: int
    offset: int  # first sample of the window in the file
    t_s: float  # its start in seconds from the file's start
    diagnosis: Diagnosis | None
    refused: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"window": self.index, "offset": self.offset,
                               "t_s": round(self.t_s, 3)}
        if self.diagnosis is None:
            out["refused"] = self.refused
        else:
            out.update(self.diagnosis.as_dict())
        return out


def asset_for(recording: Recording, *, rpm: float, bearing: Any = None,
              zone_limits_mm_s: tuple[float, float, float] | None = None,
              window_s: float = 1.0, rpm_tolerance: float | None = None) -> AssetConfig:
    """An asset description for an offline recording (defaults: the config's asset defaults)."""
    a = AssetConfig(name="recording", rpm=rpm, sample_rate_hz=recording.sample_rate_hz,
                    window_s=window_s, signal=recording.kind, baseline_s=0.0)
    changes: dict[str, Any] = {}
    if bearing is not None:
        changes["bearing"] = bearing
    if zone_limits_mm_s is not None:
        changes["zone_limits_mm_s"] = zone_limits_mm_s
    if rpm_tolerance is not None:
        changes["rpm_tolerance"] = rpm_tolerance
    return dataclasses.replace(a, **changes)


def diagnose_recording(recording: Recording, asset: AssetConfig,
                       hop_s: float | None = None) -> Iterator[WindowResult]:
    """Diagnose each window of `asset.window_s` (every `hop_s`, default: back to back)."""
    fs = recording.sample_rate_hz
    n = int(round(asset.window_s * fs))
    hop = max(1, int(round((hop_s or asset.window_s) * fs)))
    x = recording.samples
    speed = RecordingSpeed()
    for i, start in enumerate(range(0, x.size - n + 1, hop)):
        seg = x[start:start + n]
        if float(np.ptp(seg)) <= 1e-9 * max(1.0, float(np.max(np.abs(seg)))):
            yield WindowResult(i, start, start / fs, None, "constant signal")
            continue
        an = analyze(Window(seg, fs, recording.kind, start / fs, offset=start), asset)
        refused = speed.refuses(an.speed)
        if refused:
            yield WindowResult(i, start, start / fs, None, refused)
            continue
        yield WindowResult(i, start, start / fs, classify(an, asset))
