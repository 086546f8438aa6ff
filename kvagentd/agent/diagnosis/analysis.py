"""One window, top-down: features -> spectra -> speed check -> evidence -> verdict.

`analyze(window, asset)` is pure: it computes the features, the velocity spectrum (shaft speed
and running-speed lines) and the squared-envelope spectrum in the most impulsive band (bearing
lines), and tests every signature. `classify(analysis, asset, baseline)` turns the evidence
into a `Diagnosis` (rules in the module docstrings of `bearing` and `shaft`, severities and
confidence in `result`). The live agent and `kvagentd diagnose` run exactly these two.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvagentd.agent.diagnosis.baseline import BaselineStats
from kvagentd.agent.diagnosis.bearing import (BEARING_FAULTS, BearingFrequencies, FamilyEvidence,
                                              bearing_frequencies, highest_line_hz,
                                              test_families)
from kvagentd.agent.diagnosis.result import FAULT_WORDS, Diagnosis
from kvagentd.agent.diagnosis.shaft import (ShaftEvidence, SpeedCheck, check_speed,
                                            classify_shaft, shaft_evidence)
from kvagentd.agent.diagnosis.spectra import (Spectrum, envelope_bands, envelope_spectrum,
                                              velocity_spectrum)
from kvagentd.agent.features import Features, Window, extract
from kvagentd.config import AssetConfig

# ISO 10816-3 / 20816-1: a change of 25 % of the zone B/C limit is significant even inside a
# zone.
ISO_CHANGE_FRACTION = 0.25
BANDS = 3  # demodulation bands tested per window (spectra.envelope_bands)


@dataclass(frozen=True, slots=True)
class Analysis:
    features: Features
    speed: SpeedCheck
    band: tuple[float, float]
    band_kurtosis: float
    envelope: Spectrum
    velocity: Spectrum
    bearing: BearingFrequencies  # at the measured shaft speed
    families: dict[str, FamilyEvidence]
    shaft: ShaftEvidence


def analyze(window: Window, asset: AssetConfig,
            baseline: BaselineStats | None = None) -> Analysis:
    """The evidence in one validated window (finite, of the asset's rate and length)."""
    feats = extract(window, asset)
    fs = float(window.sample_rate)
    vel = velocity_spectrum(window.samples, fs, window.kind)
    speed = check_speed(vel, asset.rpm / 60.0, asset.rpm_tolerance)
    fr = speed.measured_hz
    bf = bearing_frequencies(asset.bearing, fr * 60.0)
    top = highest_line_hz(bf, fr)
    bands = envelope_bands(window.samples, fs, lo_min=top, min_bw=1.1 * top, count=BANDS)
    best: tuple[float, tuple[float, float, float], Spectrum, dict[str, FamilyEvidence]] | None
    best = None
    for band in bands:
        env = envelope_spectrum(window.samples, fs, (band[0], band[1]))
        fams = test_families(env, bf, fr, baseline.ratio_p95() if baseline else None,
                             tests=len(bands))
        score = max((f.score for f in fams.values() if f.detected), default=0.0)
        if best is None or score > best[0]:
            best = (score, band, env, fams)
    assert best is not None
    _, (lo, hi, kurt), env, families = best
    return Analysis(feats, speed, (lo, hi), kurt, env, vel, bf, families,
                    shaft_evidence(vel, fr))


def elevation(feats: Features, asset: AssetConfig, baseline: BaselineStats | None) -> str | None:
    """Why the overall vibration counts as elevated (zone C/D, or the ISO change criterion
    against the learned baseline), or None."""
    if feats.zone in ("C", "D"):
        return f"ISO zone {feats.zone} ({feats.rms_mm_s:.2f} mm/s)"
    if baseline is not None and "rms_mm_s" in baseline.median:
        normal = baseline.median["rms_mm_s"]
        step = ISO_CHANGE_FRACTION * asset.zone_limits_mm_s[1]
        if feats.rms_mm_s >= normal + step:
            return (f"RMS {feats.rms_mm_s:.2f} mm/s is {feats.rms_mm_s - normal:.2f} mm/s above "
                    f"this machine's normal {normal:.2f} mm/s (limit +{step:.2f})")
    return None


def classify(an: Analysis, asset: AssetConfig, baseline: BaselineStats | None = None,
             baseline_state: str = "off") -> Diagnosis:
    f = an.features
    elevated = elevation(f, asset, baseline)
    detected = sorted((fam for fam in an.families.values() if fam.detected),
                      key=lambda fam: fam.score, reverse=True)
    if len(detected) > 1:
        # NOTE: cage lines alone are weak evidence; next to a race or ball family they are
        # intermodulation products (e.g. 4x shaft - BPFO lies within a bin of FTF).
        detected = [fam for fam in detected if fam.fault != "cage"]
    secondary: list[str] = []
    if detected:
        top = detected[0]
        fault = top.fault
        secondary = [fam.fault for fam in detected[1:]]
        lines = [ln for ln in top.lines[1:] if ln.significant]
        p = top.primary
        summary = (f"{FAULT_WORDS[fault].capitalize()}: {p.name} line at {p.found_hz:.1f} Hz is "
                   f"{p.ratio:.1f}x the envelope noise floor (threshold {p.threshold:.1f}x), with "
                   f"{', '.join(f'{ln.name} {ln.ratio:.1f}x' for ln in lines)}")
        completeness = (1 + top.confirming) / len(top.lines)
        rival = detected[1].score if len(detected) > 1 else 0.0
        confidence = (0.5 + 0.5 * completeness) * top.score / (top.score + rival)
        if elevated:
            shaft_fault, _ = classify_shaft(an.shaft, f.rms_mm_s)
            if shaft_fault != "unknown":
                secondary.append(shaft_fault)
        if elevated:
            summary += f"; {elevated}"
    elif elevated:
        fault, reason = classify_shaft(an.shaft, f.rms_mm_s)
        summary = f"{FAULT_WORDS[fault].capitalize()}: {reason}; {elevated}"
        confidence = 0.5 if fault == "unknown" else 0.8
    else:
        fault = "none"
        closest = max(fam.primary.ratio / fam.primary.threshold for fam in an.families.values())
        summary = (f"No fault pattern; RMS {f.rms_mm_s:.2f} mm/s (zone {f.zone}), kurtosis "
                   f"{f.kurtosis:.1f}")
        confidence = 0.9 if closest < 0.8 else 0.6
    severity = "none" if fault == "none" else {"D": "high", "C": "medium"}.get(f.zone, "low")
    return Diagnosis(
        fault=fault, severity=severity, confidence=round(min(0.99, confidence), 2),
        summary=summary, zone=f.zone, rms_mm_s=f.rms_mm_s, kurtosis=f.kurtosis, crest=f.crest,
        shaft_hz=an.speed.measured_hz, speed_measured=an.speed.measured, band_hz=an.band,
        band_kurtosis=an.band_kurtosis, families=an.families, shaft=an.shaft, elevated=elevated,
        secondary=tuple(secondary), baseline=baseline_state)


def baseline_sample(an: Analysis) -> dict[str, float]:
    """The measures a baseline learns from one window."""
    out = {"rms_mm_s": an.features.rms_mm_s, "kurtosis": an.features.kurtosis,
           "1x_mm_s": an.shaft.line("1x").rms_mm_s, "2x_mm_s": an.shaft.line("2x").rms_mm_s}
    for fault in BEARING_FAULTS:
        p = an.families[fault].primary
        out[f"ratio:{p.name}"] = p.ratio
    return out
