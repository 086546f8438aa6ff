"""Time-domain and broadband features of one sensor window (numpy only).

Contract of `extract(window, asset)`:
- `rms_mm_s`: broadband RMS velocity over 10-1000 Hz (ISO 10816 / 20816). Acceleration windows
  (m/s^2) are integrated in the frequency domain (divide by j*2*pi*f), velocity windows (mm/s)
  are band-limited as they are. A Hann window with energy correction keeps leakage out of the
  band.
- `peak`, `crest`, `kurtosis`: of the raw window in its own unit (m/s^2 or mm/s); kurtosis is
  the plain fourth standardized moment (Gaussian noise: 3; repeated impacts raise it).
- `zone`: ISO 10816 zone A/B/C/D from the asset's three limits (A/B, B/C, C/D, mm/s); a value
  equal to a limit belongs to the upper zone.
The spectral evidence (envelope lines, running-speed lines) is the diagnosis's
(`kvagentd.agent.diagnosis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvagentd.config import AssetConfig

BAND_HZ = (10.0, 1000.0)
ZONES = ("A", "B", "C", "D")


@dataclass(frozen=True, slots=True)
class Window:
    """One block of sensor samples. `kind` fixes the unit: acceleration m/s^2, velocity mm/s.

    A replayed window also says where it came from: `offset` (first sample's index in the
    file) and `passes` (how many times the replay has wrapped around before it).
    """

    samples: np.ndarray
    sample_rate: float
    kind: Literal["acceleration", "velocity"]
    t0: float
    offset: int | None = None
    passes: int = 0


@dataclass(frozen=True, slots=True)
class Features:
    rms_mm_s: float
    peak: float
    crest: float
    kurtosis: float
    zone: str = "A"

    def as_dict(self) -> dict[str, object]:
        return {"rms_mm_s": round(self.rms_mm_s, 4), "peak": round(self.peak, 4),
                "crest": round(self.crest, 3), "kurtosis": round(self.kurtosis, 3),
                "zone": self.zone}


def iso_zone(rms_mm_s: float, limits: tuple[float, float, float]) -> str:
    """ISO 10816 evaluation zone for a broadband RMS velocity."""
    for zone, limit in zip(ZONES, limits):
        if rms_mm_s < limit:
            return zone
    return "D"


def rms_velocity_mm_s(x: np.ndarray, fs: float, kind: str,
                      band: tuple[float, float] = BAND_HZ) -> float:
    """Band-limited RMS velocity in mm/s (see module docstring)."""
    n = x.size
    w = np.hanning(n)
    spec = np.fft.rfft((x - x.mean()) * w)
    f = np.fft.rfftfreq(n, 1.0 / fs)
    sel = (f >= band[0]) & (f <= band[1])
    gain = 1000.0 / (2.0 * np.pi * f[sel]) if kind == "acceleration" else 1.0  # m/s^2 -> mm/s
    vel = spec[sel] * gain
    # One-sided Parseval with the Hann energy correction: mean(x^2) = 2 sum|X|^2 / (N sum w^2).
    power = 2.0 * float(np.sum(np.abs(vel) ** 2)) / (n * float(np.sum(w * w)))
    return math.sqrt(power)


def extract(window: Window, asset: AssetConfig) -> Features:
    """Features of a validated window (finite samples, non-empty)."""
    x = np.asarray(window.samples, dtype=np.float64)
    fs = float(window.sample_rate)
    rms_v = rms_velocity_mm_s(x, fs, window.kind)
    centred = x - x.mean()
    rms_raw = float(np.sqrt(np.mean(centred ** 2)))
    peak = float(np.max(np.abs(centred)))
    crest = peak / rms_raw if rms_raw > 0 else 0.0
    kurt = float(np.mean(centred ** 4) / rms_raw ** 4) if rms_raw > 0 else 0.0

    return Features(rms_v, peak, crest, kurt, iso_zone(rms_v, asset.zone_limits_mm_s))
