"""Vibration features of one sensor window (numpy only).

Contract of `extract(window, asset)`:
- `rms_mm_s`: broadband RMS velocity over 10-1000 Hz (ISO 10816). Acceleration windows (m/s^2)
  are integrated in the frequency domain (divide by j*2*pi*f), velocity windows (mm/s) are
  band-limited as they are. A Hann window with energy correction keeps leakage out of the band.
- `peak`, `crest`, `kurtosis`: of the raw window in its own unit (m/s^2 or mm/s); kurtosis is
  the plain fourth standardized moment (Gaussian noise: 3).
- `envelope`: for each bearing frequency (BPFO, BPFI, BSF, FTF from geometry and speed) the
  envelope-spectrum amplitude near it and its ratio to the envelope-spectrum median. The envelope
  is the magnitude of the analytic signal (FFT Hilbert transform) of the window band-passed around
  the structural resonance band.
- `zone`: ISO 10816 zone A/B/C/D from the asset's three limits (A/B, B/C, C/D, mm/s); a value
  equal to a limit belongs to the upper zone.
- `anomaly`: zone C or D, or a bearing-frequency envelope peak at least `ENVELOPE_RATIO_ALARM`
  times the envelope-spectrum median.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvagentd.config import AssetConfig, BearingConfig

BAND_HZ = (10.0, 1000.0)
RESONANCE_BAND_HZ = (2000.0, 5000.0)
ENVELOPE_RATIO_ALARM = 6.0
ENVELOPE_SEARCH_HZ = (2.0, 500.0)  # the envelope spectrum median is taken over this range
ZONES = ("A", "B", "C", "D")


@dataclass(frozen=True, slots=True)
class Window:
    """One block of sensor samples. `kind` fixes the unit: acceleration m/s^2, velocity mm/s."""

    samples: np.ndarray
    sample_rate: float
    kind: Literal["acceleration", "velocity"]
    t0: float


@dataclass(frozen=True, slots=True)
class BearingFrequencies:
    bpfo: float
    bpfi: float
    bsf: float
    ftf: float

    def as_dict(self) -> dict[str, float]:
        return {"BPFO": self.bpfo, "BPFI": self.bpfi, "BSF": self.bsf, "FTF": self.ftf}


@dataclass(frozen=True, slots=True)
class Features:
    rms_mm_s: float
    peak: float
    crest: float
    kurtosis: float
    envelope: dict[str, float] = field(default_factory=dict)  # name -> amplitude
    envelope_ratio: dict[str, float] = field(default_factory=dict)  # name -> amplitude / median
    zone: str = "A"
    anomaly: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"rms_mm_s": round(self.rms_mm_s, 4), "peak": round(self.peak, 4),
                "crest": round(self.crest, 3), "kurtosis": round(self.kurtosis, 3),
                "envelope": {k: round(v, 5) for k, v in self.envelope.items()},
                "envelope_ratio": {k: round(v, 2) for k, v in self.envelope_ratio.items()},
                "zone": self.zone, "anomaly": self.anomaly}


def bearing_frequencies(bearing: BearingConfig, rpm: float) -> BearingFrequencies:
    """Defect frequencies (Hz) of a rolling-element bearing at shaft speed `rpm`."""
    fr = rpm / 60.0
    n = bearing.balls
    r = bearing.ball_diameter_mm / bearing.pitch_diameter_mm * math.cos(
        math.radians(bearing.contact_angle_deg))
    return BearingFrequencies(
        bpfo=n / 2.0 * fr * (1.0 - r),
        bpfi=n / 2.0 * fr * (1.0 + r),
        bsf=bearing.pitch_diameter_mm / (2.0 * bearing.ball_diameter_mm) * fr * (1.0 - r * r),
        ftf=fr / 2.0 * (1.0 - r),
    )


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
    if kind == "acceleration":
        vel = spec[sel] / (2.0 * np.pi * f[sel]) * 1000.0  # m/s^2 -> mm/s
    else:
        vel = spec[sel]
    # One-sided Parseval with the Hann energy correction: mean(x^2) = 2 sum|X|^2 / (N sum w^2).
    power = 2.0 * float(np.sum(np.abs(vel) ** 2)) / (n * float(np.sum(w * w)))
    return math.sqrt(power)


def envelope_spectrum(x: np.ndarray, fs: float,
                      band: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(frequencies, amplitudes) of the envelope of `x` band-passed to `band` (Hz)."""
    lo, hi = band or resonance_band(fs)
    n = x.size
    spec = np.fft.fft(x - x.mean())
    f = np.fft.fftfreq(n, 1.0 / fs)
    # Analytic signal of the band-passed window: keep positive frequencies in band, doubled.
    keep = (f >= lo) & (f <= hi)
    analytic = np.fft.ifft(np.where(keep, 2.0 * spec, 0.0))
    env = np.abs(analytic)
    env = env - env.mean()
    amp = np.abs(np.fft.rfft(env)) * 2.0 / n
    return np.fft.rfftfreq(n, 1.0 / fs), amp


def resonance_band(fs: float) -> tuple[float, float]:
    """The band searched for bearing-impact resonances, clipped below Nyquist."""
    hi = min(RESONANCE_BAND_HZ[1], 0.45 * fs)
    lo = min(RESONANCE_BAND_HZ[0], 0.5 * hi)
    return lo, hi


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

    freqs, amp = envelope_spectrum(x, fs)
    search = (freqs >= ENVELOPE_SEARCH_HZ[0]) & (freqs <= ENVELOPE_SEARCH_HZ[1])
    median = float(np.median(amp[search])) if search.any() else 0.0
    # NOTE: a floor relative to the signal keeps FFT round-off of an empty band from
    # producing huge ratios (a clean or band-limited signal has no envelope to speak of).
    median = max(median, 1e-6 * max(peak, 1e-12))
    df = freqs[1] - freqs[0] if freqs.size > 1 else fs
    envelope: dict[str, float] = {}
    ratio: dict[str, float] = {}
    for name, fb in bearing_frequencies(asset.bearing, asset.rpm).as_dict().items():
        # NOTE: +-1 % of the frequency (at least one bin) absorbs slip and speed drift.
        tol = max(df, 0.01 * fb)
        near = (freqs >= fb - tol) & (freqs <= fb + tol)
        a = float(amp[near].max()) if near.any() else 0.0
        envelope[name] = a
        ratio[name] = a / median
    zone = iso_zone(rms_v, asset.zone_limits_mm_s)
    anomaly = zone in ("C", "D") or max(ratio.values(), default=0.0) >= ENVELOPE_RATIO_ALARM
    return Features(rms_v, peak, crest, kurt, envelope, ratio, zone, anomaly)
