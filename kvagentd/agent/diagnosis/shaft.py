"""Shaft speed and the running-speed faults, from the velocity spectrum (pure functions).

- `measure_speed`: the shaft rate within `rpm_tolerance` of the stated one, from the
  interpolated 1x, 2x and 3x lines. Falls back to the stated rate when fewer than two of them
  are significant.
- `check_speed`: refuses a window whose spectrum contradicts the stated speed by a clear
  margin (a wrong sample rate or rpm shifts every line by the same factor): either a family of
  at least `FAMILY_MIN` significant harmonics (of 6) exists while the stated speed explains at
  most one line, or a family at an integer fraction 1/k (k >= 3) of the stated speed has at
  least `FAMILY_MIN` significant harmonics, `SUBHARMONIC_MIN` of them at frequencies the stated
  speed cannot produce (a 48 kHz file read as 12 kHz puts the true 1x at a quarter of it).
  k = 2 is left out on purpose: mechanical looseness makes genuine half harmonics. Families at
  mains frequency and twice it (50, 60, 100, 120 Hz) are electrical, not a
  speed. A window with too few lines to judge passes.
- `RecordingSpeed`: the same question for a recording as a whole. A file has one sample
  rate and one stated speed, so once at least `RECORDING_MIN_WINDOWS` of its windows were
  checked and more than `RECORDING_SHARE` of them contradicted the stated speed, every later
  window of it is refused, also those whose own spectrum happens not to show the
  contradiction (a 48 kHz file read as 12 kHz: about one window in five passes the check
  alone).
- `shaft_evidence` / `classify_shaft`: 0.5x..10x line levels and, when the vibration is
  elevated (ISO zone C/D, or the baseline's change criterion), the running-speed fault they
  point to, by the practitioners' rules (Scheffer & Girdhar 2004, "Practical Machinery
  Vibration Analysis", ch. 6; the same rules appear on the common diagnostic charts):
  looseness = a train of harmonics (>= `LOOSE_HARMONICS` of 3x..10x significant carrying
  >= 25 % of the 1x energy) or >= 2 half harmonics; misalignment = 2x at least half of 1x;
  imbalance = 1x carrying at least half of the broadband energy; anything else is `unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvagentd.agent.diagnosis.spectra import Spectrum, line_rms

ALPHA = 1e-3
SPEED_HARMONICS = 3
CHECK_HARMONICS = 6
FAMILY_MIN = 4
TOP_LINE_MARGIN = 2.0
MAINS_HZ = (50.0, 60.0, 100.0, 120.0)
MAINS_TOLERANCE = 0.01
LOOSE_HARMONICS = 4
# A recording's verdict: at the right rate and rpm the per-window check refused 0 of 122 CWRU
# windows and 1 of 1000 windows of Gaussian noise (p <= 0.01); more than half of 8 or more
# windows refused then has a chance below 1e-8 (binomial), and a wrong rate refused 80-100 %
RECORDING_MIN_WINDOWS = 8
RECORDING_SHARE = 0.5
SHAFT_LINES = (("0.5x", 0.5), ("1x", 1.0), ("1.5x", 1.5), ("2x", 2.0), ("2.5x", 2.5),
               ("3x", 3.0), ("4x", 4.0), ("5x", 5.0), ("6x", 6.0), ("7x", 7.0), ("8x", 8.0),
               ("9x", 9.0), ("10x", 10.0))


@dataclass(frozen=True, slots=True)
class SpeedCheck:
    ok: bool
    stated_hz: float
    measured_hz: float  # the stated rate when it could not be measured
    measured: bool
    reason: str = ""


def _ratios_at(spec: Spectrum, freqs: np.ndarray) -> np.ndarray:
    """Largest ratio within +-1 bin of each frequency (0 outside the spectrum)."""
    j = np.rint(freqs / spec.df).astype(int)
    out = np.zeros(freqs.shape)
    n = spec.ratio.size
    for d in (-1, 0, 1):
        k = j + d
        ok = (k >= 1) & (k < n) & (freqs > 0)
        vals = np.where(ok, spec.ratio[np.clip(k, 0, n - 1)], 0.0)
        out = np.maximum(out, vals)
    return out


def _significant(spec: Spectrum, f0: np.ndarray, harmonics: int) -> np.ndarray:
    """(len(f0), harmonics) booleans: is h*f0 a significant line?"""
    h = np.arange(1, harmonics + 1)
    return _ratios_at(spec, f0[:, None] * h[None, :]) >= spec.threshold(3, ALPHA)


def _interpolated_peak(spec: Spectrum, f_hz: float, tol_hz: float) -> tuple[float, float]:
    """(frequency, ratio) of the largest bin within +-tol, refined by a parabola through the
    log amplitudes of the peak and its neighbours (about 0.05 bin for a Hann-windowed line)."""
    df = spec.df
    lo = max(1, int(np.floor((f_hz - tol_hz) / df)))
    hi = min(spec.amp.size - 2, int(np.ceil((f_hz + tol_hz) / df)))
    if hi < lo:
        return f_hz, 0.0
    j = lo + int(np.argmax(spec.ratio[lo:hi + 1]))
    a, b, c = np.log(np.maximum(spec.amp[j - 1:j + 2], 1e-300))
    denom = a - 2 * b + c
    delta = 0.5 * (a - c) / denom if denom < 0 else 0.0
    return (j + float(np.clip(delta, -0.5, 0.5))) * df, float(spec.ratio[j])


def measure_speed(spec: Spectrum, stated_hz: float, tolerance: float) -> tuple[float, bool]:
    """(shaft rate in Hz, measured?) within `tolerance` of `stated_hz` (see module docstring).

    Each of the 1x, 2x and 3x lines that is significant gives an estimate (its interpolated
    frequency / h) weighted by h^2 (the error of f/h shrinks with h). Higher harmonics are not
    used: on induction motors electrical lines (slot and pole-pass sidebands, twice the mains
    frequency) sit within a few percent of them.
    """
    thr = spec.threshold(3, ALPHA)
    est: list[tuple[float, float]] = []
    for h in range(1, SPEED_HARMONICS + 1):
        f, ratio = _interpolated_peak(spec, h * stated_hz, h * stated_hz * tolerance)
        if ratio >= thr:
            est.append((f / h, float(h * h)))
    if len(est) < 2:
        return stated_hz, False
    vals = np.array([e[0] for e in est])
    w = np.array([e[1] for e in est])
    return float(np.sum(vals * w) / np.sum(w)), True


def _mains(f: np.ndarray) -> np.ndarray:
    out = np.zeros(f.shape, dtype=bool)
    for m in MAINS_HZ:
        out |= np.abs(f / m - 1.0) <= MAINS_TOLERANCE
    return out


def check_speed(spec: Spectrum, stated_hz: float, tolerance: float) -> SpeedCheck:
    """Is the stated shaft speed consistent with the spectrum? (see module docstring)."""
    measured_hz, measured = measure_speed(spec, stated_hz, tolerance)
    ok = SpeedCheck(True, stated_hz, measured_hz, measured)
    df = spec.df
    h = np.arange(1, 4)
    near_harmonic = lambda f: np.any(np.abs(f / (h * stated_hz) - 1.0) <= tolerance) or \
        abs(f - round(f / stated_hz) * stated_hz) <= df  # noqa: E731
    # (1) the strongest low-frequency line must be a running-speed harmonic (or electrical).
    # NOTE: below 0.2x the integrated acceleration is dominated by sensor drift and the
    # spectrum's edge, not by lines.
    lo = max(3, int(np.ceil(0.2 * stated_hz / df)))
    hi = int(min(spec.amp.size - 1, np.floor(3.5 * stated_hz / df)))
    if hi > lo:
        seg = spec.amp[lo:hi + 1]
        j = lo + int(np.argmax(seg))
        f_top = float(spec.freqs[j])
        one_x = max(_ratios_at(spec, np.array([stated_hz * (1 + d) for d in
                                               np.linspace(-tolerance, tolerance, 9)])))
        one_x_amp = max(spec.amp[max(0, int(round(stated_hz * (1 + d) / df)))]
                        for d in np.linspace(-tolerance, tolerance, 9))
        # NOTE: the line is the largest of hi - lo + 1 bins: its test pays for all of them.
        if (spec.ratio[j] >= spec.threshold(hi - lo + 1, ALPHA) and not near_harmonic(f_top)
                and not _mains(np.array([f_top]))[0]
                and spec.amp[j] >= TOP_LINE_MARGIN * one_x_amp):
            return SpeedCheck(False, stated_hz, measured_hz, measured,
                              f"the strongest low-frequency line is at {f_top:.1f} Hz, "
                              f"{f_top / stated_hz:.2f}x the stated shaft speed "
                              f"{stated_hz:.2f} Hz (1x line {one_x:.1f}x the floor): check the "
                              f"sample rate and rpm")
    # (2) no running-speed line at all, but a harmonic family elsewhere.
    stated_lines = int(_significant(spec, np.array([measured_hz]), 3).sum())
    if stated_lines:
        return ok
    grid = stated_hz * np.exp(np.linspace(np.log(1 / 8), np.log(8), 600))
    grid = grid[(grid >= 3 * df) & (np.abs(grid / stated_hz - 1.0) > 2 * tolerance)]
    grid = grid[~_mains(grid)]
    if grid.size == 0:
        return ok
    counts = _significant(spec, grid, CHECK_HARMONICS).sum(axis=1)
    best = int(np.argmax(counts))
    if counts[best] >= FAMILY_MIN:
        return SpeedCheck(False, stated_hz, measured_hz, measured,
                          f"no line at the stated shaft speed {stated_hz:.2f} Hz or its 2x and "
                          f"3x, but {int(counts[best])} harmonics of {grid[best]:.2f} Hz: check "
                          f"the sample rate and rpm")
    return ok


class RecordingSpeed:
    """The speed check of one recording, over its windows so far (see the module docstring).
    `observe` each window's own check; `verdict` is why the whole recording is refused, or
    None while it is not (or too few windows were checked to say). The verdict stands once
    reached: a file's rate and rpm do not change between its windows."""

    def __init__(self, min_windows: int = RECORDING_MIN_WINDOWS,
                 share: float = RECORDING_SHARE) -> None:
        self.min_windows, self.share = min_windows, share
        self.checked = 0
        self.refused = 0
        self._why: str | None = None

    def observe(self, check: SpeedCheck) -> None:
        self.checked += 1
        self.refused += not check.ok
        if (self._why is None and self.checked >= self.min_windows
                and self.refused > self.share * self.checked):
            self._why = (f"{self.refused} of the first {self.checked} windows of this "
                         f"recording contradict the stated shaft speed: its sample rate or "
                         f"rpm is wrong")

    def verdict(self) -> str | None:
        return self._why

    def refuses(self, check: SpeedCheck) -> str | None:
        """`observe` the window's check; why the window is refused (its own check, else the
        recording's verdict), or None."""
        self.observe(check)
        return check.reason if not check.ok else self._why


@dataclass(frozen=True, slots=True)
class ShaftLine:
    name: str
    freq_hz: float
    rms_mm_s: float
    ratio: float
    significant: bool

    def as_dict(self) -> dict[str, object]:
        return {"line": self.name, "freq_hz": round(self.freq_hz, 2),
                "rms_mm_s": round(self.rms_mm_s, 4), "ratio": round(self.ratio, 2),
                "significant": self.significant}


@dataclass(frozen=True, slots=True)
class ShaftEvidence:
    fr_hz: float
    lines: tuple[ShaftLine, ...]

    def line(self, name: str) -> ShaftLine:
        return next(ln for ln in self.lines if ln.name == name)

    def as_dict(self) -> dict[str, object]:
        return {"fr_hz": round(self.fr_hz, 3), "lines": [ln.as_dict() for ln in self.lines]}


def shaft_evidence(spec: Spectrum, fr_hz: float) -> ShaftEvidence:
    thr = spec.threshold(3, ALPHA)
    lines = []
    for name, mult in SHAFT_LINES:
        f = mult * fr_hz
        ratio = float(_ratios_at(spec, np.array([f]))[0])
        lines.append(ShaftLine(name, f, line_rms(spec, f), ratio, ratio >= thr))
    return ShaftEvidence(fr_hz, tuple(lines))


def classify_shaft(ev: ShaftEvidence, rms_mm_s: float) -> tuple[str, str]:
    """(fault, reason) for an elevated vibration (see module docstring)."""
    one = ev.line("1x")
    e1 = one.rms_mm_s ** 2
    upper = [ev.line(f"{h}x") for h in range(3, 11)]
    upper_sig = [ln for ln in upper if ln.significant]
    halves = [ev.line(n) for n in ("0.5x", "1.5x", "2.5x") if ev.line(n).significant]
    upper_energy = sum(ln.rms_mm_s ** 2 for ln in upper_sig)
    if len(halves) >= 2:
        return "looseness", f"half harmonics {', '.join(ln.name for ln in halves)}"
    if len(upper_sig) >= LOOSE_HARMONICS and upper_energy >= 0.25 * e1:
        return "looseness", (f"{len(upper_sig)} running-speed harmonics from 3x to 10x carry "
                             f"{100 * upper_energy / max(e1, 1e-12):.0f} % of the 1x energy")
    two = ev.line("2x")
    if two.significant and two.rms_mm_s >= 0.5 * one.rms_mm_s:
        share = 100 * two.rms_mm_s / max(one.rms_mm_s, 1e-12)
        return "misalignment", (f"2x {two.rms_mm_s:.2f} mm/s is {share:.0f} % of 1x "
                                f"{one.rms_mm_s:.2f} mm/s")
    if one.significant and e1 >= 0.5 * rms_mm_s ** 2:
        return "imbalance", (f"1x {one.rms_mm_s:.2f} mm/s carries "
                             f"{100 * e1 / max(rms_mm_s ** 2, 1e-12):.0f} % of the vibration energy")
    return "unknown", "elevated vibration without a running-speed or bearing pattern"
