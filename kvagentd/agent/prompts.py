"""Prompt text of the agent. Everything here is a pure function of its inputs (deterministic).

`SYSTEM_PROMPT` is one constant: the same bytes start every asset session, so after chat
templating its full KV blocks have equal keys in every session and are stored once.

A tick's turn (`observation`) is as short as the diagnosis allows: the time, the fault and its
severity, the one line it rests on (or the level alone), RMS and zone, the action. Every
other prompt (reports, replays, questions) carries the full form (`diagnosis_text`): the
confidence, every line with its threshold, kurtosis, the hour and day trends. The model is
asked to comment on the diagnosis, not to make one. Nothing the model wrote is put back into
a prompt: summaries of earlier measurements are built from the event rows' measurements and
diagnoses only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from kvagentd.agent.diagnosis.bearing import bearing_frequencies
from kvagentd.agent.diagnosis.result import FAULT_WORDS
from kvagentd.config import AssetConfig

SYSTEM_PROMPT = (
    "You help a maintenance technician read the vibration monitoring of rotating machines. "
    "Each message gives the time of one measurement, the diagnosis the monitoring system "
    "computed from it (the fault or no fault, its severity and the spectral line it rests on "
    "as a multiple of the noise floor), the RMS vibration with its ISO 10816 zone (A good, B "
    "acceptable, C restricted operation, D damage likely) and the recommended action. The "
    "diagnosis is correct. Reply with one short sentence that restates the diagnosis and the "
    "action in plain words, using only numbers from the message. Never call the machine "
    "normal when a fault is diagnosed, and never name a fault that is not diagnosed. "
    "Examples:\n"
    "10:00:00. No fault; RMS 0.92 mm/s, zone A. Action: no action.\n"
    "No fault: RMS 0.92 mm/s in zone A; no action.\n"
    "10:00:03. Outer-race defect, severity low: BPFO line 8.1x the noise floor; RMS 1.05 "
    "mm/s, zone A. Action: plan a bearing replacement.\n"
    "Outer-race defect: BPFO line 8.1x the noise floor; plan a bearing replacement.\n"
    "10:00:06. Imbalance, severity medium: 1x line 60.2x the noise floor; RMS 4.31 mm/s, "
    "zone C. "
    "Action: act within days; balance the rotor.\n"
    "Imbalance: RMS 4.31 mm/s in zone C; balance the rotor within days."
)


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t))


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


def _signed(v: float, digits: int = 2) -> str:
    return f"{v:+.{digits}f}"


def _trend_text(trend: Mapping[str, Mapping[str, Any]], keys: Iterable[str]) -> str:
    parts = []
    for k in keys:
        tr = trend.get(k)
        if not tr:
            continue
        unit = " mm/s" if k == "rms_mm_s" else ("x" if k not in ("kurtosis",) else "")
        name = {"rms_mm_s": "RMS", "kurtosis": "kurtosis"}.get(k, k)
        bits = []
        if tr.get("1h") is not None:
            bits.append(f"{_signed(tr['1h'])}{unit} in 1 h")
        if tr.get("24h") is not None:
            bits.append(f"{_signed(tr['24h'])}{unit} in 24 h")
        if bits:
            parts.append(f"{name} {', '.join(bits)}")
    return "; ".join(parts)


def diagnosis_text(d: Mapping[str, Any]) -> str:
    """The diagnosis (its dict) in the compact form every prompt carries."""
    fault = str(d["fault"])
    head = (f"Diagnosis (measured): {FAULT_WORDS[fault]}" +
            ("" if fault == "none" else f", severity {d['severity']}") +
            f", confidence {float(d['confidence']):.2f}.")
    if fault == "none":
        ratios = ", ".join(f"{k} {float(v):.1f}x" for k, v in (d.get("ratios") or {}).items())
        evidence = f"Defect lines {ratios} the noise floor, all below threshold."
    elif d.get("lines") and "threshold" in d["lines"][0]:
        lines = [ln for ln in d["lines"] if ln.get("significant")]
        p = d["lines"][0]
        evidence = (f"Evidence: {p['line']} at {float(p['found_hz']):.1f} Hz is "
                    f"{float(p['ratio']):.1f}x the noise floor (threshold "
                    f"{float(p['threshold']):.1f}x)" +
                    "".join(f", {ln['line']} {float(ln['ratio']):.1f}x" for ln in lines[1:]) + ".")
    else:
        evidence = f"Evidence: {d['summary']}."
    level = (f"RMS {float(d['rms_mm_s']):.2f} mm/s, zone {d['zone']}; kurtosis "
             f"{float(d['kurtosis']):.1f}.")
    keys = ["rms_mm_s", "kurtosis"]
    if d.get("lines") and "threshold" in d["lines"][0]:
        keys.append(str(d["lines"][0]["line"]))
    trend = _trend_text(d.get("trend") or {}, keys)
    extra = f" Also seen: {', '.join(d['secondary'])}." if d.get("secondary") else ""
    return (f"{head} {evidence} {level}" + (f" Trend: {trend}." if trend else "") + extra +
            f" Action: {d['action']}.")


def evidence_line(d: Mapping[str, Any]) -> str:
    """The one piece of evidence a tick's turn names: the diagnosis' first line with its
    ratio to the noise floor (a bearing fault's defect line; a shaft fault's strongest
    significant order), else the diagnosis summary's first clause."""
    lines = [ln for ln in d.get("lines") or [] if ln.get("significant", True)
             and ln.get("ratio") is not None]
    if lines:
        p = lines[0] if "threshold" in lines[0] else max(lines, key=lambda ln: ln["ratio"])
        return f"{p['line']} line {float(p['ratio']):.1f}x the noise floor"
    summary = str(d.get("summary") or "")
    head, _, rest = summary.partition(": ")
    return (rest or head).split(";")[0].strip()


def observation(t: float, diagnosis: Mapping[str, Any]) -> str:
    """One tick's user turn, compact (see the module docstring; the date is in the first
    turn): `10:00:03. Outer-race defect, severity low: BPFO line 8.1x the noise floor; RMS
    1.05 mm/s, zone A. Action: plan a bearing replacement.`"""
    d = diagnosis
    fault = str(d["fault"])
    words = FAULT_WORDS[fault]
    level = f"RMS {float(d['rms_mm_s']):.2f} mm/s, zone {d['zone']}"
    if fault == "none":
        what = f"No fault; {level}"
    else:
        what = (f"{words[:1].upper()}{words[1:]}, severity {d['severity']}: "
                f"{evidence_line(d)}; {level}")
    return f"{_clock(t)}. {what}. Action: {d['action']}."


def summary(asset: str, rows: Iterable[Mapping[str, Any]]) -> str:
    """Deterministic summary of recent event rows (oldest first) for a rolled-over session:
    measurements and diagnoses only, never the model's text."""
    ticks = [r for r in rows if r.get("kind", "tick") == "tick" and r.get("features")]
    if not ticks:
        return f"Recent state of {asset}: no measurements yet."
    rms = [float(r["features"]["rms_mm_s"]) for r in ticks]
    zones = Counter(str(r["zone"]) for r in ticks)
    faults = Counter(str(r.get("fault") or "none") for r in ticks)
    last = ticks[-1]
    zone_text = ", ".join(f"{z} {zones[z]}" for z in sorted(zones))
    fault_text = ", ".join(f"{FAULT_WORDS[f]} {n}" for f, n in faults.most_common())
    return (f"Recent state of {asset} over {len(ticks)} measurements from "
            f"{_stamp(float(ticks[0]['t']))} to {_stamp(float(last['t']))}: RMS "
            f"{min(rms):.2f}-{max(rms):.2f} mm/s (last {rms[-1]:.2f}); zones {zone_text}; "
            f"diagnoses {fault_text}.")


def tick_profile(asset: AssetConfig) -> str:
    """The asset as a tick session names it: what it is, its speed and zone limits (the
    bearing frequencies are the diagnosis' business, not the commentary's)."""
    a_b, b_c, c_d = asset.zone_limits_mm_s
    return (f"Asset {asset.name}: {asset.description}. Shaft {asset.rpm:g} rpm. Zone limits "
            f"A/B {a_b:g}, B/C {b_c:g}, C/D {c_d:g} mm/s.")


def first_turn(asset: AssetConfig, recent: str, obs: str, t: float) -> str:
    """The first user turn of a new session: profile, date, recent-state summary, observation."""
    return f"{tick_profile(asset)} Date {_stamp(t)[:10]} (UTC).\n{recent}\n{obs}"


def report_prompt(asset: str, findings: str, stats: Mapping[str, Any]) -> str:
    """The weekly report's request: the findings (measured) and readable statistics."""
    ratios = ", ".join(f"{k} {float(v):.1f}x" for k, v in
                       (stats.get("envelope_ratio_max") or {}).items())
    return (f"Weekly vibration report for {asset}. Findings (measured): {findings} "
            f"Statistics: {stats.get('ticks', 0)} measurements, RMS {stats.get('rms_min_mm_s')}"
            f"-{stats.get('rms_max_mm_s')} mm/s (mean {stats.get('rms_mean_mm_s')}), worst zone "
            f"{stats.get('worst_zone')}, {stats.get('anomalies', 0)} windows with a fault "
            f"pattern, largest kurtosis {stats.get('kurtosis_max')}, largest envelope ratios "
            f"{ratios or 'none'}. Write two sentences for the maintenance planner that restate "
            f"the findings and the action in plain words, using only these numbers.")


def replay_prompt(event: Mapping[str, Any]) -> str:
    """Asked in the session that flagged `event`: explain its diagnosis."""
    d = event.get("diagnosis")
    body = diagnosis_text(d) if d else f"zone {event['zone']}"
    return (f"Look again at the measurement of {_stamp(float(event['t']))} (event "
            f"{event['id']}). {body} Explain in two sentences what this diagnosis means for "
            f"the machine and what to inspect, using only these numbers.")


def ask_context(asset: str, t: float, diagnosis: Mapping[str, Any] | None) -> str:
    """The context put before an operator's question about an asset."""
    if diagnosis is None:
        return f"Context: no measurement of {asset} yet."
    return f"Context: {asset} at {_stamp(t)}. {diagnosis_text(diagnosis)}"
