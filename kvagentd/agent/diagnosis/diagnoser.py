"""The per-asset diagnosis service: one window in, one `Diagnosis` out, with the asset's
learned baseline and its hour/day trends.

`Diagnoser.diagnose(window, now)`:
    analyze (pure) -> speed check of the window, and of the recording for replayed windows
    (raises `SpeedRefused`) -> classify against the baseline
    -> trends (this window folded into the per-minute series) -> baseline learns the window
    when it is healthy.
Trend measures: `rms_mm_s`, `kurtosis` and the envelope ratio of each defect line (`BPFO`,
`BPFI`, `2xBSF`, `FTF`). `seed(minutes)` loads stored per-minute summaries after a restart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvagentd.agent.diagnosis.analysis import Analysis, analyze, baseline_sample, classify
from kvagentd.agent.diagnosis.baseline import Baseline
from kvagentd.agent.diagnosis.result import Diagnosis
from kvagentd.agent.diagnosis.shaft import RecordingSpeed
from kvagentd.agent.diagnosis.trend import TrendSeries
from kvagentd.agent.features import Window
from kvagentd.config import AssetConfig


class SpeedRefused(ValueError):
    """The window's spectrum contradicts the stated shaft speed (wrong rate or rpm)."""


class Diagnoser:
    def __init__(self, asset: AssetConfig, baseline_path: Path | None = None) -> None:
        self.asset = asset
        self.baseline = (Baseline.load(baseline_path, asset.baseline_s) if baseline_path
                         else Baseline(asset.baseline_s))
        self.trend = TrendSeries()
        self.last: Analysis | None = None  # the last window's evidence (reports plot it)
        # replayed windows come from one recording: its rate and rpm are judged as a whole
        self.recording = RecordingSpeed()

    def seed(self, minutes: Iterable[Mapping[str, Any]]) -> None:
        """Trends from stored per-minute summaries (`EventLog.minutes`)."""
        rows = []
        for m in minutes:
            if not m.get("ticks"):
                continue
            means = {"rms_mm_s": m["rms_mean"], "kurtosis": m["kurt_mean"],
                     **{k: float(v) for k, v in (m.get("ratios") or {}).items()}}
            rows.append((float(m["t"]), means, int(m["ticks"])))
        self.trend.load(rows)

    def diagnose(self, window: Window, now: float) -> Diagnosis:
        stats = self.baseline.stats
        an = analyze(window, self.asset, stats)
        why = (self.recording.refuses(an.speed) if window.offset is not None
               else None if an.speed.ok else an.speed.reason)
        if why:
            raise SpeedRefused(why)
        self.last = an
        d = classify(an, self.asset, stats, self.baseline.state)
        self.trend.add(now, {"rms_mm_s": d.rms_mm_s, "kurtosis": d.kurtosis, **d.ratios})
        self.baseline.observe(now, baseline_sample(an),
                              healthy=d.fault == "none" and d.zone in ("A", "B"))
        return dataclasses.replace(d, trend=self.trend.trends(now))

    def status(self) -> dict[str, Any]:
        b = self.baseline
        out: dict[str, Any] = {"state": b.state}
        if b.stats is not None:
            out.update(windows=b.stats.windows, since=b.stats.since, until=b.stats.until,
                       rms_median_mm_s=round(b.stats.median.get("rms_mm_s", 0.0), 4))
        elif b.state == "learning":
            out.update(windows=b.count, since=b.first_t)
        return out

    def close(self) -> None:
        self.baseline.save()
