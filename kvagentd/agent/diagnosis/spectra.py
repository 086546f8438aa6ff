"""Spectral building blocks of the diagnosis: pure functions of one window (numpy, scipy).

- `envelope_bands(x, fs, lo_min, min_bw)`: candidate demodulation bands, the bands of a
  1/3-binary grid (Antoni's fast-kurtogram layout) whose complex envelope has the largest
  kurtosis (spectral kurtosis; Antoni 2006/2007): bearing impacts ring a structural resonance
  and make that band impulsive, while Gaussian noise has kurtosis 0 in every band. Several are
  kept because a band made impulsive by a few non-repeating transients (a knock, an electrical
  spike) has a high kurtosis but no envelope lines; the diagnosis tests each and pays for the
  extra tests in its false-alarm budget.
- `envelope_spectrum(x, fs, band)`: amplitude spectrum of the squared envelope of `x`
  band-passed to `band` (the squared-envelope spectrum of Randall & Antoni 2011).
- `velocity_spectrum(x, fs, kind)`: Hann-windowed spectrum in mm/s RMS per line (acceleration
  in m/s^2 is integrated in the frequency domain).
- `Spectrum.ratio`: each bin's amplitude over the local noise floor: the median amplitude of
  the `FLOOR_HALF_WIDTH_HZ` (at least `FLOOR_MIN_BINS` bins) on each side, leaving out the bin
  and its two neighbours (a line's own leakage).
- `Spectrum.threshold(bins, alpha)`: the ratio a line must reach to be significant at
  false-alarm probability `alpha` when its peak is searched in `bins` bins. On noise the power
  of a spectral bin is exponential (chi-square with 2 degrees of freedom; Antoni 2007 shows it
  for the squared-envelope spectrum). The floor is itself estimated from M such bins, so the
  test accounts for its error: with the floor the j-th smallest of M exponentials, Renyi's
  representation gives P(P_bin > t * floor) = prod_{i=1..j} (M-i+1) / (M-i+1+t) exactly; the
  maximum of `bins` bins passes with at most `bins` times that (Bonferroni); the threshold is
  the t where that equals `alpha`, as an amplitude ratio sqrt(t). With M = 38 a one-bin test at
  1e-3 needs 3.4x the median amplitude (3.2x if the floor were known exactly).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from scipy.fft import next_fast_len
from scipy.ndimage import rank_filter

FLOOR_HALF_WIDTH_HZ = 10.0
FLOOR_MIN_BINS = 20
BAND_TOP_FRACTION = 0.9  # of Nyquist: above it anti-alias filters leave no signal
MAX_LEVEL = 7


@dataclass(frozen=True, slots=True)
class Spectrum:
    """`amp[i]` at `freqs[i]` (uniform step `df`) and its ratio to the local noise floor,
    estimated as the `floor_rank`-th smallest of `floor_bins` neighbouring bins."""

    freqs: np.ndarray
    amp: np.ndarray
    ratio: np.ndarray
    floor_bins: int = 38
    floor_rank: int = 20

    @property
    def df(self) -> float:
        return float(self.freqs[1] - self.freqs[0]) if self.freqs.size > 1 else 1.0

    def threshold(self, bins: int, alpha: float) -> float:
        """Amplitude ratio a peak searched in `bins` bins needs (see module docstring)."""
        return threshold(bins, alpha, self.floor_bins, self.floor_rank)


class Peak(NamedTuple):
    """The largest bin within a search range: frequency, amplitude, ratio, bins searched."""

    freq_hz: float
    amp: float
    ratio: float
    bins: int


@functools.lru_cache(maxsize=512)
def threshold(bins: int, alpha: float, floor_bins: int = 38, floor_rank: int = 20) -> float:
    """Amplitude ratio to a floor (the `floor_rank`-th smallest of `floor_bins` noise bins) that
    a peak searched in `bins` bins passes with probability `alpha` on noise."""
    m, j = floor_bins, floor_rank
    target = alpha / max(1, bins)

    def tail(t: float) -> float:
        return math.prod((m - i + 1) / (m - i + 1 + t) for i in range(1, j + 1))

    lo, hi = 0.0, 1.0
    while tail(hi) > target:
        hi *= 2.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if tail(mid) > target else (lo, mid)
    return math.sqrt(hi)


def with_floor(freqs: np.ndarray, amp: np.ndarray, native: np.ndarray | None = None) -> Spectrum:
    """`amp` with its ratio to the local floor; the ratio is taken on `native` (the same
    spectrum in the signal's own unit) when given: integrating acceleration tilts the spectrum
    by 1/f, which would bias a floor taken from the neighbours."""
    ref = amp if native is None else native
    df = float(freqs[1] - freqs[0]) if freqs.size > 1 else 1.0
    half = max(FLOOR_MIN_BINS, int(round(FLOOR_HALF_WIDTH_HZ / df)))
    footprint = np.ones(2 * half + 1, dtype=bool)
    footprint[half - 1:half + 2] = False
    m = int(footprint.sum())
    rank = m // 2 + 1
    power = ref * ref
    floor = np.sqrt(rank_filter(power, rank=rank - 1, footprint=footprint, mode="mirror"))
    # NOTE: a floor relative to the spectrum keeps round-off in an empty band (a clean or
    # band-limited signal) from producing huge ratios.
    eps = 1e-9 * float(np.max(ref)) if ref.size else 0.0
    return Spectrum(freqs, amp, ref / np.maximum(floor, max(eps, 1e-300)), m, rank)


def peak_near(spec: Spectrum, f_hz: float, tol_hz: float) -> Peak:
    """The largest bin of `spec` within `f_hz` +- `tol_hz` (at least the nearest bin)."""
    df = spec.df
    lo = max(0, int(math.floor((f_hz - tol_hz) / df)))
    hi = min(spec.freqs.size - 1, int(math.ceil((f_hz + tol_hz) / df)))
    if hi < lo or f_hz <= 0 or f_hz > spec.freqs[-1]:
        return Peak(f_hz, 0.0, 0.0, 1)
    seg = spec.ratio[lo:hi + 1]
    j = lo + int(np.argmax(seg))
    return Peak(float(spec.freqs[j]), float(spec.amp[j]), float(spec.ratio[j]), hi - lo + 1)


def _grid(fs: float, lo_min: float, min_bw: float) -> list[tuple[float, float]]:
    """Bands of the 1/3-binary tree: widths nyq/2^k and nyq/(3*2^(k-1)), half-overlapping."""
    nyq = fs / 2.0
    top = BAND_TOP_FRACTION * nyq
    out: list[tuple[float, float]] = []
    for level in range(1, MAX_LEVEL + 1):
        for bw in (nyq / 2 ** level, nyq / (1.5 * 2 ** level)):
            if bw < min_bw:
                continue
            lo = 0.0
            while lo + bw <= top + 1e-9:
                if lo >= lo_min:
                    out.append((lo, lo + bw))
                lo += bw / 2.0
    return out


def envelope_bands(x: np.ndarray, fs: float, *, lo_min: float, min_bw: float,
                   count: int = 3) -> list[tuple[float, float, float]]:
    """(lo, hi, kurtosis) of the `count` most impulsive distinct bands, best first.

    Bands start at `lo_min` or above (so that no tested defect line itself lies in the band)
    and are at least `min_bw` wide (so the envelope keeps the highest tested line); a band
    that overlaps a better one by more than half of the narrower is left out. Falls back to
    the widest allowed band when the grid is empty (a low sample rate).
    """
    n = x.size
    spec = np.fft.rfft(x - x.mean())
    df = fs / n
    total = float(np.sum(np.abs(spec) ** 2)) or 1.0
    scored: list[tuple[float, float, float]] = []
    for lo, hi in _grid(fs, lo_min, min_bw):
        i0, i1 = int(math.ceil(lo / df)), int(math.floor(hi / df))
        band = spec[i0:i1 + 1]
        energy = float(np.sum(np.abs(band) ** 2))
        # NOTE: a band holding a millionth of the energy is the anti-alias filter's stop band,
        # where quantization noise can look impulsive.
        if band.size < 8 or energy < 1e-6 * total:
            continue
        p = np.abs(np.fft.ifft(band)) ** 2
        mean_p = float(p.mean())
        if mean_p > 0:
            scored.append((lo, hi, float(np.mean(p * p) / (mean_p * mean_p) - 2.0)))
    if not scored:
        lo = min(lo_min, 0.45 * fs)
        return [(lo, 0.45 * fs, 0.0)]
    chosen: list[tuple[float, float, float]] = []
    for lo, hi, k in sorted(scored, key=lambda b: b[2], reverse=True):
        if all(min(hi, c[1]) - max(lo, c[0]) <= 0.5 * min(hi - lo, c[1] - c[0]) for c in chosen):
            chosen.append((lo, hi, k))
        if len(chosen) == count:
            break
    return chosen


def envelope_spectrum(x: np.ndarray, fs: float, band: tuple[float, float]) -> Spectrum:
    """Squared-envelope spectrum (amplitude, per bin, up to the band's width) with its floor."""
    n = x.size
    spec = np.fft.rfft(x - x.mean())
    df = fs / n
    i0, i1 = int(math.ceil(band[0] / df)), int(math.floor(band[1] / df))
    sub = spec[i0:i1 + 1]
    m = next_fast_len(2 * sub.size + 2)  # zero padding: |c|^2 needs twice the band's rate
    padded = np.zeros(m, dtype=complex)
    padded[:sub.size] = sub
    c = np.fft.ifft(padded)
    env2 = np.abs(c) ** 2
    env2 -= env2.mean()
    amp = np.abs(np.fft.rfft(env2)) * 2.0 / m
    freqs = np.arange(amp.size) * df  # the duration is unchanged, so is the bin width
    return with_floor(freqs, amp)


def velocity_spectrum(x: np.ndarray, fs: float,
                      kind: Literal["acceleration", "velocity"]) -> Spectrum:
    """Per-bin RMS velocity (mm/s) of a Hann-windowed window, with its ratio to the floor
    (taken in the signal's own unit).

    A line's RMS is `line_rms` (energy of the bins around it). Bins below 1 Hz are zeroed
    (integration of an offset would blow up).
    """
    n = x.size
    w = np.hanning(n)
    spec = np.fft.rfft((x - x.mean()) * w)
    freqs = np.fft.rfftfreq(n, 1.0 / fs)
    # One-sided RMS per bin with the Hann energy correction (Parseval).
    native = np.abs(spec) * math.sqrt(2.0 / (n * float(np.sum(w * w))))
    if kind == "velocity":
        return with_floor(freqs, native)
    gain = np.zeros(freqs.shape)
    gain[freqs >= 1.0] = 1000.0 / (2 * np.pi * freqs[freqs >= 1.0])  # m/s^2 -> mm/s
    return with_floor(freqs, native * gain, native)


def line_rms(spec: Spectrum, f_hz: float, *, lobe_bins: int = 2) -> float:
    """RMS of the line nearest `f_hz`: root of the summed squares of the bins around its peak
    (a Hann window spreads a line over its main lobe)."""
    if f_hz <= 0 or f_hz > spec.freqs[-1]:
        return 0.0
    j = int(round(f_hz / spec.df))
    lo, hi = max(0, j - lobe_bins), min(spec.amp.size, j + lobe_bins + 1)
    return float(math.sqrt(float(np.sum(spec.amp[lo:hi] ** 2))))
