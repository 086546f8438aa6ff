"""Bearing-defect signatures in the squared-envelope spectrum (pure functions).

A localized defect makes an impact each time a rolling element meets it; the impacts ring a
structural resonance, so the envelope of the resonance band repeats at the defect frequency.
Each fault has a signature, a family of envelope lines (Randall & Antoni 2011, "Rolling element
bearing diagnostics - A tutorial", MSSP 25):

- outer_race: BPFO, confirmed by 2xBPFO and 3xBPFO (the defect is fixed in the load zone: no
  modulation);
- inner_race: BPFI, confirmed by 2xBPFI, BPFI-1x and BPFI+1x (the defect turns with the shaft
  through the load zone: sidebands at shaft speed);
- ball: 2xBSF, confirmed by BSF, 2xBSF-FTF, 2xBSF+FTF and 4xBSF (a ball defect strikes both
  races once per spin, and the ball goes round the load zone with the cage: cage-rate
  sidebands);
- cage: FTF, confirmed by 2xFTF and 3xFTF.

Search tolerance: kinematic frequencies assume rolling without slip; real bearings slip by
1-2 % (Randall & Antoni), so each line is searched within +-`SLIP` of its kinematic value
(scaled with the harmonic number) plus one bin. The shaft speed used is the one measured from
the spectrum (`shaft.measure_speed`), so the stated speed's uncertainty does not widen it.

A family is detected when its primary line is significant at `ALPHA_PRIMARY` and at least one
confirming line at `ALPHA_CONFIRM` (`spectra.threshold`: a false-alarm probability on
Gaussian noise, Bonferroni over the bins searched). Under noise that is about 4e-5 per family
per window. A peak that lies nearer to another explanation than to its own line (a shaft
harmonic, a line of another family, a race line +-k x shaft speed) within one bin is not
counted: the 6205's 2xBSF lies 2.7 % above BPFO+1x, inside the slip tolerance.
A learned baseline (`baseline_ratio`) raises the primary's bar to twice the machine's normal
95th-percentile ratio (a 6 dB rise, the usual trend-alert step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvagentd.agent.diagnosis.spectra import Spectrum, peak_near
from kvagentd.config import BearingConfig

SLIP = 0.02
ALPHA_PRIMARY = 1e-3
ALPHA_CONFIRM = 1e-2
BASELINE_FACTOR = 2.0
SHAFT_HARMONICS = 20
BEARING_FAULTS = ("outer_race", "inner_race", "ball", "cage")
PRIMARY_LINE = {"outer_race": "BPFO", "inner_race": "BPFI", "ball": "2xBSF", "cage": "FTF"}


@dataclass(frozen=True, slots=True)
class BearingFrequencies:
    bpfo: float
    bpfi: float
    bsf: float
    ftf: float

    def as_dict(self) -> dict[str, float]:
        return {"BPFO": self.bpfo, "BPFI": self.bpfi, "BSF": self.bsf, "FTF": self.ftf}


def bearing_frequencies(bearing: BearingConfig, rpm: float) -> BearingFrequencies:
    """Kinematic defect frequencies (Hz) of a rolling-element bearing at shaft speed `rpm`."""
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


@dataclass(frozen=True, slots=True)
class LineEvidence:
    """One tested line: expected and found frequency, ratio to the floor, its threshold."""

    name: str
    expected_hz: float
    found_hz: float
    ratio: float
    threshold: float
    significant: bool
    primary: bool = False
    explained_by: str | None = None  # a nearer competing line that took the peak

    def as_dict(self) -> dict[str, object]:
        return {"line": self.name, "expected_hz": round(self.expected_hz, 2),
                "found_hz": round(self.found_hz, 2), "ratio": round(self.ratio, 2),
                "threshold": round(self.threshold, 2), "significant": self.significant,
                "primary": self.primary, "explained_by": self.explained_by}


@dataclass(frozen=True, slots=True)
class FamilyEvidence:
    fault: str
    lines: tuple[LineEvidence, ...]
    detected: bool
    score: float  # sum of squared ratios of the significant lines (a log-likelihood scale)

    @property
    def primary(self) -> LineEvidence:
        return self.lines[0]

    @property
    def confirming(self) -> int:
        return sum(1 for ln in self.lines[1:] if ln.significant)

    def as_dict(self) -> dict[str, object]:
        return {"fault": self.fault, "detected": self.detected, "score": round(self.score, 1),
                "lines": [ln.as_dict() for ln in self.lines]}


def signature(bf: BearingFrequencies, fr: float) -> dict[str, list[tuple[str, float]]]:
    """Each bearing fault's lines (primary first), name -> frequency in Hz."""
    return {
        "outer_race": [("BPFO", bf.bpfo), ("2xBPFO", 2 * bf.bpfo), ("3xBPFO", 3 * bf.bpfo)],
        "inner_race": [("BPFI", bf.bpfi), ("2xBPFI", 2 * bf.bpfi), ("BPFI-1x", bf.bpfi - fr),
                       ("BPFI+1x", bf.bpfi + fr)],
        "ball": [("2xBSF", 2 * bf.bsf), ("BSF", bf.bsf), ("2xBSF-FTF", 2 * bf.bsf - bf.ftf),
                 ("2xBSF+FTF", 2 * bf.bsf + bf.ftf), ("4xBSF", 4 * bf.bsf)],
        "cage": [("FTF", bf.ftf), ("2xFTF", 2 * bf.ftf), ("3xFTF", 3 * bf.ftf)],
    }


def highest_line_hz(bf: BearingFrequencies, fr: float) -> float:
    return max(f for lines in signature(bf, fr).values() for _, f in lines)


def test_families(spec: Spectrum, bf: BearingFrequencies, fr: float,
                  baseline_ratio: dict[str, float] | None = None,
                  tests: int = 1) -> dict[str, FamilyEvidence]:
    """Each bearing fault's evidence in the squared-envelope spectrum `spec`.

    Two passes. First each family's primary line is searched on its own (only a shaft harmonic
    can take its peak). Then every line is searched again, centred where the family's primary
    was found (slip moves all of a family's lines by the same factor), and a peak nearer than
    its own line to a line of another family whose primary is present (or to that primary +-k
    x shaft speed, or to a shaft harmonic) is not counted. On the 6205, 3xBPFO and 2xBPFI lie
    0.7 % apart: such a line is evidence only for the family that is really there.
    `baseline_ratio`: the machine's normal 95th-percentile ratio of each primary line (by line
    name), once a baseline is learned. `tests`: how many spectra of the same window are tested
    (the false-alarm probabilities are divided by it: Bonferroni).
    """
    sig = signature(bf, fr)
    df = spec.df
    top = highest_line_hz(bf, fr)
    comp = [("shaft", f"{h}x", h * fr) for h in range(1, SHAFT_HARMONICS + 1)]
    first: list[tuple[float, str, float]] = []  # (ratio, fault, found Hz) of passing primaries
    for fault, lines in sig.items():
        name, f = lines[0]
        pk = peak_near(spec, f, SLIP * f + df)
        if pk.ratio >= _primary_threshold(spec, pk.bins, name, baseline_ratio, tests) and \
                _explained_by(pk.freq_hz, f, fault, comp, df) is None:
            first.append((pk.ratio, fault, pk.freq_hz))
    scale: dict[str, float] = {}
    for _, fault, found in sorted(first, reverse=True):  # strongest first claims its lines
        name, f = sig[fault][0]
        if _explained_by(found, f, fault, comp, df) is not None:
            continue
        k = scale[fault] = found / f
        comp += [(fault, n, fl * k) for n, fl in sig[fault]]
        comp += [(fault, f"{h}x{name}", h * found) for h in range(2, int(top / found) + 2)]
        if fault in ("outer_race", "inner_race"):
            comp += [(f"{fault}:modulation", f"{name}{'+' if m > 0 else '-'}{abs(m)}x",
                      abs(found + m * fr)) for m in (-4, -3, -2, -1, 1, 2, 3, 4)]
    out: dict[str, FamilyEvidence] = {}
    for fault, lines in sig.items():
        k = scale.get(fault, 1.0)
        evid: list[LineEvidence] = []
        score = 0.0
        for i, (name, f) in enumerate(lines):
            pk = peak_near(spec, f * k, SLIP * f + df)
            thr = (_primary_threshold(spec, pk.bins, name, baseline_ratio, tests) if i == 0
                   else spec.threshold(pk.bins, ALPHA_CONFIRM / tests))
            explained = _explained_by(pk.freq_hz, f * k, fault, comp, df)
            ok = pk.ratio >= thr and explained is None
            evid.append(LineEvidence(name, f, pk.freq_hz, pk.ratio, thr, ok, i == 0, explained))
            # NOTE: a line another present family also claims (within a bin) cannot rank one
            # family above the other; the primary always counts.
            if ok and (i == 0 or not _shared(pk.freq_hz, fault, comp, df)):
                score += pk.ratio ** 2
        detected = evid[0].significant and any(e.significant for e in evid[1:])
        out[fault] = FamilyEvidence(fault, tuple(evid), detected, score)
    return out


def _shared(found: float, fault: str, comp: list[tuple[str, str, float]], df: float) -> bool:
    return any(owner.split(":")[0] not in (fault, "shaft") and abs(found - f) <= df
               for owner, _, f in comp)


def _primary_threshold(spec: Spectrum, bins: int, name: str,
                       baseline_ratio: dict[str, float] | None, tests: int) -> float:
    thr = spec.threshold(bins, ALPHA_PRIMARY / tests)
    if baseline_ratio and name in baseline_ratio:
        thr = max(thr, BASELINE_FACTOR * baseline_ratio[name])
    return thr


def _explained_by(found: float, expected: float, fault: str,
                  comp: list[tuple[str, str, float]], df: float) -> str | None:
    own = abs(found - expected)
    best: tuple[float, str] | None = None
    for owner, cname, f in comp:
        if owner.split(":")[0] == fault or f <= 0:
            continue
        d = abs(found - f)
        if d <= df and d < own and (best is None or d < best[0]):
            best = (d, cname if ":" in owner or owner == "shaft" else f"{cname} ({owner})")
    return best[1] if best else None
