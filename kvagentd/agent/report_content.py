"""What a report says, as pure functions of event rows and per-minute summaries.

- `episodes(rows)`: fault episodes from anomaly rows: consecutive windows with the same fault,
  less than `EPISODE_GAP_S` apart.
- `findings(episodes, minutes, now)`: one plain-words finding per fault seen: what (fault,
  severity, the evidence of its latest window), since when, how fast it grows (the defect
  line's envelope ratio, or the RMS for running-speed faults, fitted over the episode's
  minutes) and what to do.
- `weekly_stats(minutes)`: the period's figures; `stats_table` renders them as readable rows.
- `weekly_markdown` / `replay_markdown`: the reports, leading with the findings; the model's
  text appears only under "Commentary", labelled, and only when it passed the check.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvagentd.agent.diagnosis.result import FAULT_WORDS

EPISODE_GAP_S = 600.0
ZONE_LEVEL = {"A": 0, "B": 1, "C": 2, "D": 3}
SEVERITY_LEVEL = {"none": 0, "low": 1, "medium": 2, "high": 3}
SHAFT_FAULTS = ("imbalance", "misalignment", "looseness", "unknown")


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))


def _hours(s: float) -> str:
    return f"{s / 3600:.1f} h" if s < 2 * 86400 else f"{s / 86400:.1f} days"


def episodes(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fault episodes of anomaly rows (any order): fault, start, end, windows, the last row's
    diagnosis and the worst severity."""
    out: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r.get("fault") not in (None, "none")),
                    key=lambda r: float(r["t"])):
        f, t = str(r["fault"]), float(r["t"])
        ep = open_.get(f)
        if ep is None or t - ep["end"] > EPISODE_GAP_S:
            ep = {"fault": f, "start": t, "end": t, "windows": 0, "severity": "none",
                  "first_event": r["id"]}
            out.append(ep)
            open_[f] = ep
        ep["end"] = t
        ep["windows"] += 1
        ep["last_event"] = r["id"]
        ep["diagnosis"] = r.get("diagnosis") or {}
        sev = str(r.get("severity") or "low")
        if SEVERITY_LEVEL.get(sev, 0) > SEVERITY_LEVEL[ep["severity"]]:
            ep["severity"] = sev
    return out


def _growth(fault: str, diag: Mapping[str, Any], minutes: Sequence[Mapping[str, Any]],
            start: float, end: float) -> str:
    rows = [m for m in minutes if m.get("ticks") and start - 60 <= m["t"] <= end]
    lines = diag.get("lines") or []
    if fault not in SHAFT_FAULTS and lines and "threshold" in lines[0]:
        name = str(lines[0]["line"])
        pts = [(m["t"], (m.get("ratios") or {}).get(name)) for m in rows]
        pts = [(t, float(v)) for t, v in pts if v is not None]
        what, unit, fmt = f"the {name} envelope line", "x the noise floor", "{:.1f}"
    else:
        pts = [(m["t"], float(m["rms_mean"])) for m in rows]
        what, unit, fmt = "the RMS velocity", " mm/s", "{:.2f}"
    if len(pts) < 3 or pts[-1][0] - pts[0][0] < 600:
        return "too short to tell how fast it grows"
    t = np.array([p[0] for p in pts]) / 3600.0
    v = np.array([p[1] for p in pts])
    slope = float(np.polyfit(t - t.mean(), v, 1)[0])
    # First and last quarter-hour means, so one noisy minute does not set the story.
    first = float(np.mean(v[t <= t[0] + 0.25]))
    last = float(np.mean(v[t >= t[-1] - 0.25]))
    span = pts[-1][0] - pts[0][0]
    verb = "grew" if last > first * 1.1 else ("fell" if last < first / 1.1 else "stayed")
    rate = f"{slope:+.2f}{unit.split(' ')[0] if unit.startswith('x') else unit} per hour"
    if verb == "stayed":
        return f"{what} stayed near {fmt.format(last)}{unit} over {_hours(span)}"
    return (f"{what} {verb} from {fmt.format(first)} to {fmt.format(last)}{unit} over "
            f"{_hours(span)} ({rate})")


def findings(eps: Sequence[Mapping[str, Any]], minutes: Sequence[Mapping[str, Any]],
             period_start: float) -> list[str]:
    """One plain-words finding per fault seen (see module docstring), worst first."""
    by_fault: dict[str, list[Mapping[str, Any]]] = {}
    for ep in eps:
        by_fault.setdefault(str(ep["fault"]), []).append(ep)
    order = sorted(by_fault, key=lambda f: (-max(SEVERITY_LEVEL.get(e["severity"], 0)
                                                 for e in by_fault[f]),
                                            -sum(e["windows"] for e in by_fault[f])))
    out = []
    for fault in order:
        group = by_fault[fault]
        last = group[-1]
        d = last.get("diagnosis") or {}
        start = group[0]["start"]
        since = (f"since before {when(period_start)}" if start - period_start < 120
                 else f"since {when(start)}")
        windows = sum(e["windows"] for e in group)
        ongoing = f"last seen {when(last['end'])}"
        growth = _growth(fault, d, minutes, start, last["end"])
        out.append(f"**{FAULT_WORDS[fault].capitalize()}** ({last['severity']} severity), {since}, "
                   f"{ongoing}, in {windows} windows. {d.get('summary', '')}. Growth: {growth}. "
                   f"What to do: {d.get('action', 'inspect the machine')}.")
    return out


def weekly_stats(minutes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    rows = [m for m in minutes if m.get("ticks")]
    ticks = sum(int(m["ticks"]) for m in rows)
    zones: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    ratios: dict[str, float] = {}
    for m in rows:
        if m.get("zone"):
            zones[str(m["zone"])] += int(m["ticks"])
        faults.update(m.get("faults") or {})
        for k, v in (m.get("ratios") or {}).items():
            ratios[k] = max(ratios.get(k, 0.0), float(v))
    rms_sum = sum(float(m["rms_sum"]) for m in rows)
    return {
        "ticks": ticks,
        "bad_data": sum(int(m.get("bad", 0)) for m in minutes),
        "rms_mean_mm_s": round(rms_sum / ticks, 4) if ticks else None,
        "rms_min_mm_s": round(min(float(m["rms_mean"]) for m in rows), 4) if rows else None,
        "rms_max_mm_s": round(max(float(m["rms_max"]) for m in rows), 4) if rows else None,
        "zones": {z: zones.get(z, 0) for z in ZONE_LEVEL},
        "worst_zone": max(zones, key=ZONE_LEVEL.__getitem__) if zones else None,
        "last_zone": rows[-1].get("zone") if rows else None,
        "anomalies": sum(int(m.get("anomalies", 0)) for m in rows),
        "faults": dict(faults),
        "kurtosis_max": round(max(float(m["kurt_max"]) for m in rows), 2) if rows else None,
        "envelope_ratio_max": {k: round(v, 1) for k, v in ratios.items()},
    }


def stats_table(s: Mapping[str, Any]) -> list[str]:
    """Markdown rows (figure, value) of `weekly_stats`; no JSON in any cell."""
    if not s["ticks"]:
        return ["| figure | value |", "|---|---|", "| measurements | 0 |",
                f"| bad windows | {s['bad_data']} |"]
    share = 100.0 * s["anomalies"] / s["ticks"]
    rows = [
        ("measurements (windows)", f"{s['ticks']:,}"),
        ("bad windows (not diagnosed)", f"{s['bad_data']:,}"),
        ("RMS velocity mean / max", f"{s['rms_mean_mm_s']:.2f} / {s['rms_max_mm_s']:.2f} mm/s"),
        ("worst ISO zone / last", f"{s['worst_zone']} / {s['last_zone']}"),
        ("windows per zone", ", ".join(f"{z} {n:,}" for z, n in s["zones"].items() if n)),
        ("windows with a fault pattern", f"{s['anomalies']:,} ({share:.1f} %)"),
        ("diagnoses", ", ".join(f"{FAULT_WORDS.get(f, f)} {n:,}" for f, n in
                                sorted(s["faults"].items(), key=lambda kv: -kv[1]))),
        ("largest kurtosis", f"{s['kurtosis_max']:.1f} (3 = no impacts)"),
    ]
    rows += [(f"largest envelope ratio, {k}", f"{v:.1f}x the noise floor")
             for k, v in s["envelope_ratio_max"].items()]
    return ["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]


def deterministic_summary(asset: str, found: Sequence[str], stats: Mapping[str, Any]) -> str:
    if not stats["ticks"]:
        return f"No measurements of {asset} in this period."
    if not found:
        return (f"No fault pattern in {stats['ticks']:,} measurements of {asset}; RMS "
                f"{stats['rms_mean_mm_s']:.2f} mm/s on average, worst zone "
                f"{stats['worst_zone']}. No action.")
    return " ".join(f.replace("**", "") for f in found)


def _commentary(doc: Mapping[str, Any], key: str) -> list[str]:
    c = doc.get(key) or {}
    lines = ["## Commentary (language model, checked against the measurements)", ""]
    if c.get("text"):
        lines.append(f"> {c['text']}")
    elif c.get("withheld"):
        lines.append(f"_The model's text was withheld: {c['reason']}._")
    else:
        lines.append(f"_{c.get('reason') or 'No model commentary.'}_")
    return [*lines, ""]


def weekly_markdown(doc: Mapping[str, Any]) -> str:
    s = doc["stats"]
    lines = [f"# Weekly vibration report: {doc['asset']}", "",
             f"Period {when(doc['period_start'])} to {when(doc['period_end'])}.", "",
             "## Findings", ""]
    if doc["findings"]:
        lines += [f"- {f}" for f in doc["findings"]]
    else:
        lines.append(f"- {doc['summary']}")
    lines += ["", f"![RMS, kurtosis and envelope lines over the period]({doc['png']})", "",
              *_commentary(doc, "commentary"), "## Figures of the period", "",
              *stats_table(s), ""]
    return "\n".join(lines)


def replay_markdown(doc: Mapping[str, Any]) -> str:
    r = doc["event_row"]
    d = r.get("diagnosis") or {}
    t = float(r["t"])
    lines = [f"# Anomaly replay: event {r['id']} ({doc['asset']})", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(t))}.", "",
             "## Finding", ""]
    if d:
        lines += [f"**{FAULT_WORDS.get(d['fault'], d['fault']).capitalize()}**, severity "
                  f"{d['severity']}, confidence {float(d['confidence']):.2f}. {d['summary']}.",
                  "", f"What to do: {d['action']}.", ""]
        lines += ["| line | expected Hz | found Hz | ratio to floor | threshold | counted |",
                  "|---|---|---|---|---|---|"]
        for ln in d.get("lines") or []:
            if "threshold" in ln:
                lines.append(f"| {ln['line']} | {ln['expected_hz']:.1f} | {ln['found_hz']:.1f} | "
                             f"{ln['ratio']:.1f}x | {ln['threshold']:.1f}x | "
                             f"{'yes' if ln['significant'] else 'no'} |")
            else:
                lines.append(f"| {ln['line']} | {ln['freq_hz']:.1f} | {ln['freq_hz']:.1f} | "
                             f"{ln['ratio']:.1f}x ({ln['rms_mm_s']:.2f} mm/s) | - | "
                             f"{'yes' if ln['significant'] else 'no'} |")
        lines.append("")
        lines.append(f"RMS {float(d['rms_mm_s']):.2f} mm/s (zone {d['zone']}), kurtosis "
                     f"{float(d['kurtosis']):.1f}, shaft {float(d['shaft_hz']):.2f} Hz, "
                     f"demodulation band {d['band_hz'][0]}-{d['band_hz'][1]} Hz.")
    else:
        lines.append(f"Zone {r['zone']} (no diagnosis recorded for this event).")
    lines += [""]
    if doc.get("spectrum_png"):
        lines += [f"![envelope spectrum of the event's window]({doc['spectrum_png']})", ""]
    else:
        lines += ["_The raw window of this event was not kept, so its spectrum cannot be "
                  "shown._", ""]
    lines += [f"![the hour around the event]({doc['png']})", "",
              *_commentary(doc, "commentary"),
              f"Session `{r['session']}`; the model's text at the time: "
              f"{'withheld' if r.get('withheld') else (r.get('assessment') or '(none)')}.", ""]
    return "\n".join(lines)
