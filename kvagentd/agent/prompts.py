"""Prompt text of the agent. Everything here is a pure function of its inputs (deterministic).

`SYSTEM_PROMPT` is one constant: the same bytes start every asset session, so after chat
templating its full KV blocks have equal keys in every session and are stored once.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Iterable, Mapping

from kvagentd.agent.features import Features, bearing_frequencies
from kvagentd.config import AssetConfig

SYSTEM_PROMPT = (
    "You monitor the vibration of rotating machines. Each message is one measurement: RMS "
    "velocity (mm/s, 10-1000 Hz) with its ISO 10816 zone (A good, B acceptable, C restricted "
    "operation, D damage likely), crest factor, kurtosis (about 3 when healthy; higher means "
    "bearing impacts) and envelope-spectrum peaks at the bearing defect frequencies BPFO (outer "
    "race), BPFI (inner race), BSF (ball spin) and FTF (cage) as multiples of the spectrum "
    "median (above 6 means a defect). Rising 1x vibration points to imbalance, 2x to "
    "misalignment. Reply with one short sentence in the form <status>: <finding>; <action>. "
    "Examples: \"Normal: no fault signs; no action.\" \"Alert: outer race defect, BPFO peak; "
    "plan a bearing change.\" \"Alert: zone C vibration, likely imbalance; balance the rotor.\""
)


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def asset_profile(asset: AssetConfig) -> str:
    """The asset's description, speed, bearing frequencies and zone limits (first user turn)."""
    bf = bearing_frequencies(asset.bearing, asset.rpm)
    a_b, b_c, c_d = asset.zone_limits_mm_s
    return (
        f"Asset {asset.name}: {asset.description}. Shaft {asset.rpm:g} rpm "
        f"({asset.rpm / 60:.2f} Hz). Bearing defect frequencies: BPFO {bf.bpfo:.2f} Hz, "
        f"BPFI {bf.bpfi:.2f} Hz, BSF {bf.bsf:.2f} Hz, FTF {bf.ftf:.2f} Hz. "
        f"Zone limits A/B {a_b:g}, B/C {b_c:g}, C/D {c_d:g} mm/s."
    )


def observation(t: float, f: Features) -> str:
    """One compact line of features (one user turn per tick; the date is in the profile)."""
    env = " ".join(f"{k} {v:.1f}x" for k, v in f.envelope_ratio.items())
    return (f"Measurement {time.strftime('%H:%M:%S', time.gmtime(t))} rms {f.rms_mm_s:.2f} mm/s "
            f"zone {f.zone}, crest {f.crest:.1f}, kurtosis {f.kurtosis:.1f}, {env}"
            f"{' ANOMALY' if f.anomaly else ''}. Status?")


def summary(asset: str, rows: Iterable[Mapping[str, object]]) -> str:
    """Deterministic summary of recent event rows (oldest first) for a rolled-over session.

    Rows are event-log dicts with `t`, `zone`, `anomaly`, `features` (dict) and `assessment`.
    """
    rows = [r for r in rows if r.get("kind", "tick") == "tick"]
    if not rows:
        return f"Recent state of {asset}: no measurements yet."
    rms = [float(r["features"]["rms_mm_s"]) for r in rows]  # type: ignore[index]
    zones = Counter(str(r["zone"]) for r in rows)
    anomalies = sum(1 for r in rows if r["anomaly"])
    last = rows[-1]
    kurt = float(last["features"]["kurtosis"])  # type: ignore[index]
    ratios: Mapping[str, float] = last["features"].get("envelope_ratio", {})  # type: ignore[union-attr]
    top = max(ratios.items(), key=lambda kv: kv[1]) if ratios else ("-", 0.0)
    trend = rms[-1] - rms[0]
    zone_text = ", ".join(f"{z} {zones[z]}" for z in sorted(zones))
    text = (
        f"Recent state of {asset} over {len(rows)} measurements from {_stamp(float(rows[0]['t']))} "
        f"to {_stamp(float(last['t']))}: rms {min(rms):.2f}-{max(rms):.2f} mm/s "
        f"(last {rms[-1]:.2f}, change {trend:+.2f}); zones {zone_text}; anomalies {anomalies}; "
        f"last zone {last['zone']}, kurtosis {kurt:.1f}, largest envelope peak "
        f"{top[0]} {float(top[1]):.1f}x."
    )
    assessment = last.get("assessment")
    if assessment:
        text += f" Last assessment: {str(assessment).strip()[:200]}"
    return text


def first_turn(asset: AssetConfig, recent: str, obs: str, t: float) -> str:
    """The first user turn of a new session: profile, date, recent-state summary, observation."""
    return f"{asset_profile(asset)} Date {_stamp(t)[:10]} (UTC).\n{recent}\n{obs}"


def report_prompt(asset: str, stats: Mapping[str, object]) -> str:
    lines = ", ".join(f"{k}={v}" for k, v in stats.items() if not isinstance(v, dict | list))
    return (f"Weekly vibration report for {asset}. Statistics: {lines}. Write a short summary "
            f"for the maintenance planner: condition, trend, likely cause, recommended action.")


def replay_prompt(event: Mapping[str, object]) -> str:
    return (f"Look again at the measurement of {_stamp(float(event['t']))} (event {event['id']}, "  # type: ignore[arg-type]
            f"zone {event['zone']}, flagged as an anomaly). Explain in detail what the features "
            f"indicate, the most likely fault, how confident you are, and what to inspect.")
