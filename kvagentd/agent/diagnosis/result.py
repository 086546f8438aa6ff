"""The measured diagnosis of one window: fault, severity, confidence and the evidence.

`fault` is one of `FAULTS`; `severity` one of `SEVERITIES`:
- `none`: no fault pattern and the vibration is acceptable (ISO zone A/B, no baseline change);
- `low`: a pattern in zone A/B (bearing defects show in the envelope long before the overall
  level moves: plan, do not stop);
- `medium`: zone C (ISO 10816/20816: unsatisfactory for long-term operation);
- `high`: zone D (vibration severe enough to cause damage).
`confidence` (0-1) says how much of the textbook signature is present and whether another
signature competes; it is a grade of the evidence, not a probability.

`as_dict()` is what events, the API and `kvagentd diagnose --json` carry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvagentd.agent.diagnosis.bearing import FamilyEvidence
from kvagentd.agent.diagnosis.shaft import ShaftEvidence

FAULTS = ("none", "outer_race", "inner_race", "ball", "cage", "imbalance", "misalignment",
          "looseness", "unknown")
SEVERITIES = ("none", "low", "medium", "high")
FAULT_WORDS = {
    "none": "no fault", "outer_race": "outer-race defect", "inner_race": "inner-race defect",
    "ball": "rolling-element (ball) defect", "cage": "cage defect", "imbalance": "imbalance",
    "misalignment": "misalignment", "looseness": "mechanical looseness",
    "unknown": "abnormal vibration of unknown cause"}
ACTIONS = {
    "none": "no action",
    "outer_race": "plan a bearing replacement; check lubrication; watch the BPFO trend",
    "inner_race": "plan a bearing replacement soon (inner-race defects progress quickly); check "
                  "lubrication and fits",
    "ball": "plan a bearing replacement; check lubrication and contamination",
    "cage": "plan a bearing replacement soon (a cage can break suddenly); check lubrication",
    "imbalance": "balance the rotor; check for deposits or a lost balance weight",
    "misalignment": "check and correct the shaft alignment and the coupling",
    "looseness": "check the foundation bolts, the bearing housing and fits",
    "unknown": "inspect the machine; take a detailed measurement",
}
SEVERITY_ACTIONS = {"high": "stop the machine at the next opportunity; ",
                    "medium": "act within days; ", "low": "", "none": ""}


@dataclass(frozen=True, slots=True)
class Trend:
    """Change of one measure: over the last hour and day (None: not enough history)."""

    now: float
    hour: float | None = None
    day: float | None = None
    per_hour: float | None = None  # least-squares slope over the last hour

    def as_dict(self) -> dict[str, float | None]:
        r = lambda v: None if v is None else round(v, 3)  # noqa: E731
        return {"now": r(self.now), "1h": r(self.hour), "24h": r(self.day),
                "per_h": r(self.per_hour)}


@dataclass(frozen=True, slots=True)
class Diagnosis:
    fault: str
    severity: str
    confidence: float
    summary: str  # plain words: what and why
    zone: str
    rms_mm_s: float
    kurtosis: float
    crest: float
    shaft_hz: float
    speed_measured: bool
    band_hz: tuple[float, float]
    band_kurtosis: float
    families: dict[str, FamilyEvidence]
    shaft: ShaftEvidence
    elevated: str | None = None  # why the overall vibration counts as elevated, if it does
    secondary: tuple[str, ...] = ()  # other patterns present in the same window
    baseline: str = "off"  # off | learning | learned
    trend: dict[str, Trend] = field(default_factory=dict)

    @property
    def anomaly(self) -> bool:
        return self.fault != "none"

    @property
    def ratios(self) -> dict[str, float]:
        """Envelope ratio to the noise floor of each bearing fault's primary line."""
        return {f.primary.name: f.primary.ratio for f in self.families.values()}

    @property
    def action(self) -> str:
        return SEVERITY_ACTIONS[self.severity] + ACTIONS[self.fault]

    def cited_lines(self) -> list[dict[str, Any]]:
        """The lines the verdict rests on: the diagnosed family's, or the running-speed ones."""
        fam = self.families.get(self.fault)
        if fam is not None:
            return [ln.as_dict() for ln in fam.lines]
        if self.fault == "none":
            return []  # `ratios` and `thresholds` say how far each line is from counting
        names = ("0.5x", "1x", "1.5x", "2x", "3x") if self.fault != "looseness" else \
            tuple(ln.name for ln in self.shaft.lines)
        return [ln.as_dict() for ln in self.shaft.lines if ln.name in names]

    def as_dict(self) -> dict[str, Any]:
        return {
            "fault": self.fault, "severity": self.severity,
            "confidence": round(self.confidence, 2), "summary": self.summary,
            "action": self.action, "zone": self.zone, "rms_mm_s": round(self.rms_mm_s, 4),
            "kurtosis": round(self.kurtosis, 2), "crest": round(self.crest, 2),
            "shaft_hz": round(self.shaft_hz, 3), "speed_measured": self.speed_measured,
            "band_hz": [round(self.band_hz[0]), round(self.band_hz[1])],
            "band_kurtosis": round(self.band_kurtosis, 2),
            "ratios": {k: round(v, 2) for k, v in self.ratios.items()},
            "thresholds": {f.primary.name: round(f.primary.threshold, 2)
                           for f in self.families.values()},
            "lines": self.cited_lines(),
            "shaft_lines": {ln.name: round(ln.rms_mm_s, 3) for ln in self.shaft.lines
                            if ln.name in ("1x", "2x", "3x")},
            "elevated": self.elevated, "secondary": list(self.secondary),
            "baseline": self.baseline,
            "trend": {k: v.as_dict() for k, v in self.trend.items()},
        }
