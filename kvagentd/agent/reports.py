"""Weekly reports and anomaly replays, written under `<state_dir>/reports/`.

A report `ID` is `weekly-<asset>-<UTC stamp>` or `replay-<event id>-<UTC stamp>` and consists of
`ID.md`, `ID.json` and `ID.png`. While it is generated `ID.json` holds `"state": "running"`;
afterwards `"done"` or `"failed"` (with `error`). Generation runs in its own thread at REPORT
priority, so it never delays ticks (the executor serves TICK requests first).

- weekly: statistics of the asset's event rows over `agent.report_period_s` (tick count, RMS
  mean/min/max/p95, zone counts, anomalies, bad data, max kurtosis, largest envelope ratios, tick
  latency p50/p99), a trend plot of RMS (with the zone limits) and zone over the period, and a
  summary written by the model in a fresh session `report-<asset>-<stamp>` (a deterministic
  text when there is no LLM).
- replay: resumes the session that flagged the event (its KV comes from whichever tier holds it)
  and asks for a detailed explanation; the JSON records the store's tier loads during the call.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import structlog

from kvagentd.agent import prompts
from kvagentd.agent.events import EventLog
from kvagentd.agent.model_client import Completion
from kvagentd.config import AssetConfig

log = structlog.get_logger(__name__)

_ID_RE = re.compile(r"^(weekly|replay)-[A-Za-z0-9_.-]+$")
ZONE_LEVEL = {"A": 0, "B": 1, "C": 2, "D": 3}


class ReportError(ValueError):
    """The report cannot be made (unknown asset or event, event without a session)."""


def _stamp(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


GenerateFn = Callable[[str, str, "str | None"], Completion]


class ReportWriter:
    """Writes reports from narrow collaborators, never the whole agent:

    `events` (the event log), `assets` (name -> config), `generate(session, text, system)`
    (REPORT-priority generation; None without a model), `clock`, `store_stats` (the KV store's
    `stats()`, recorded around a replay; may be None), `retire_session(session)` (the replay
    hook: the live session about to be resumed rolls over first) and `period_s` (the weekly
    report's span).
    """

    def __init__(self, directory: Path, *, events: EventLog, assets: Mapping[str, AssetConfig],
                 generate: GenerateFn | None, clock: Callable[[], float],
                 store_stats: Callable[[], dict[str, Any]] | None,
                 retire_session: Callable[[str], None], period_s: float) -> None:
        self.events = events
        self.assets = assets
        self.generate = generate
        self.clock = clock
        self.store_stats = store_stats
        self.retire_session = retire_session
        self.period_s = period_s
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ listing

    def list(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
            doc = self._read(p)
            if doc is not None:
                out.append({k: doc.get(k) for k in ("id", "kind", "asset", "event", "state",
                                                     "created", "error")})
        return out

    def get(self, report_id: str) -> dict[str, Any] | None:
        if not _ID_RE.match(report_id):
            return None
        doc = self._read(self.dir / f"{report_id}.json")
        if doc is None:
            return None
        md = self.dir / f"{report_id}.md"
        doc["markdown"] = md.read_text(encoding="utf-8") if md.is_file() else None
        doc["files"] = [str(self.dir / f"{report_id}.{ext}") for ext in ("md", "json", "png")
                        if (self.dir / f"{report_id}.{ext}").is_file()]
        return doc

    def running(self) -> int:
        with self._lock:
            return sum(1 for t in self._threads.values() if t.is_alive())

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            threads = list(self._threads.values())
        for t in threads:
            t.join(timeout)

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _write_json(self, report_id: str, doc: dict[str, Any]) -> None:
        path = self.dir / f"{report_id}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    # ------------------------------------------------------------------ starting

    def start(self, kind: str, *, asset: str | None = None, event: int | None = None) -> str:
        """Validate, write the `running` stub and generate in a thread; returns the id."""
        now = self.clock()
        if kind == "weekly":
            if asset not in self.assets:
                raise ReportError(f"unknown asset {asset!r}")
            rid = f"weekly-{asset}-{_stamp(now)}"
            job: Callable[[], None] = functools.partial(self._weekly, rid, asset, now)
        elif kind == "replay":
            row = self.events.get(int(event)) if event is not None else None
            if row is None:
                raise ReportError(f"unknown event {event!r}")
            if not row.get("session"):
                raise ReportError(f"event {event} has no session (features-only tick)")
            rid = f"replay-{row['id']}-{_stamp(now)}"
            job = functools.partial(self._replay, rid, row, now)
            asset = row["asset"]
        else:
            raise ReportError(f"unknown report kind {kind!r} (weekly or replay)")
        with self._lock:
            if rid in self._threads and self._threads[rid].is_alive():
                return rid
            self._write_json(rid, {"id": rid, "kind": kind, "asset": asset, "event": event,
                                   "state": "running", "created": now})
            th = threading.Thread(target=self._guarded, args=(job, rid),
                                  name=f"report-{rid}", daemon=True)
            self._threads[rid] = th
        th.start()
        return rid

    def run_weekly(self, asset: str) -> str:
        """Scheduler entry (cron): generate synchronously in the scheduler's worker thread."""
        rid = self.start("weekly", asset=asset)
        self.wait_for(rid)
        return rid

    def wait_for(self, report_id: str, timeout: float | None = None) -> dict[str, Any] | None:
        with self._lock:
            th = self._threads.get(report_id)
        if th is not None:
            th.join(timeout)
        return self.get(report_id)

    def _guarded(self, job: Callable[[], None], rid: str) -> None:
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - the failure is recorded in the report
            log.warning("report.failed", report=rid, error=repr(exc))
            doc = self._read(self.dir / f"{rid}.json") or {"id": rid}
            doc.update(state="failed", error=f"{type(exc).__name__}: {exc}")
            self._write_json(rid, doc)

    # ------------------------------------------------------------------ weekly

    def _weekly(self, rid: str, asset: str, now: float) -> None:
        since = now - self.period_s
        rows = self.events.query(asset=asset, since=since, until=now + 1e-6,
                                       limit=10_000_000, newest_first=False)
        stats = weekly_stats(rows)
        stats.update(asset=asset, period_start=since, period_end=now)
        png = self.dir / f"{rid}.png"
        plot_trend(png, rows, self.assets[asset].zone_limits_mm_s,
                   title=f"{asset}: RMS velocity and ISO 10816 zone")
        summary, gen = self._generate(f"report-{asset}-{_stamp(now)}",
                                      prompts.report_prompt(asset, stats), asset, stats)
        doc = {"id": rid, "kind": "weekly", "asset": asset, "event": None, "state": "done",
               "created": now, "finished": self.clock(), "stats": stats,
               "summary": summary, "generation": gen, "png": png.name}
        (self.dir / f"{rid}.md").write_text(weekly_markdown(doc), encoding="utf-8")
        self._write_json(rid, doc)
        log.info("report.weekly_done", report=rid, ticks=stats["ticks"])

    def _generate(self, session: str, text: str, asset: str,
                  stats: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        if self.generate is None or not self.assets[asset].llm:
            return deterministic_summary(asset, stats), None
        res = self._submit(session, text, prompts.SYSTEM_PROMPT)
        return res["text"], res

    def _submit(self, session: str, text: str, system: str | None) -> dict[str, Any]:
        assert self.generate is not None
        done = self.generate(session, text, system)
        res = done.result
        out: dict[str, Any] = {"text": done.text or "", "session": session}
        if res is not None:
            out.update(prompt_tokens=res.prompt_tokens, reused_tokens=res.reused_tokens,
                       recomputed_tokens=res.recomputed_tokens, new_tokens=res.new_tokens,
                       ttft_s=res.ttft_s, total_s=res.total_s, queue_wait_s=res.queue_wait_s)
        return out

    # ------------------------------------------------------------------ replay

    def _replay(self, rid: str, row: dict[str, Any], now: float) -> None:
        if self.generate is None:
            raise ReportError("no model: anomaly replay needs the LLM")
        session = row["session"]
        self.retire_session(session)
        before = self.store_stats() if self.store_stats else None
        res = self._submit(session, prompts.replay_prompt(row), None)
        after = self.store_stats() if self.store_stats else None
        t = float(row["t"])
        around = self.events.query(asset=row["asset"], since=t - 600, until=t + 600,
                                         kind="tick", limit=100_000, newest_first=False)
        png = self.dir / f"{rid}.png"
        plot_trend(png, around, self.assets[row["asset"]].zone_limits_mm_s
                   if row["asset"] in self.assets else (1.4, 2.8, 4.5),
                   title=f"{row['asset']}: around event {row['id']}", mark=t)
        doc = {"id": rid, "kind": "replay", "asset": row["asset"], "event": row["id"],
               "state": "done", "created": now, "finished": self.clock(),
               "event_row": row, "explanation": res["text"], "generation": res,
               "store_before": before, "store_after": after, "png": png.name}
        (self.dir / f"{rid}.md").write_text(replay_markdown(doc), encoding="utf-8")
        self._write_json(rid, doc)
        log.info("report.replay_done", report=rid, session=session)


# ---------------------------------------------------------------------- pure parts

def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def weekly_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ticks = [r for r in rows if r["kind"] == "tick" and r["features"]]
    rms = [float(r["features"]["rms_mm_s"]) for r in ticks]
    zones = {z: sum(1 for r in ticks if r["zone"] == z) for z in ZONE_LEVEL}
    anomalies = [r for r in ticks if r["anomaly"]]
    lat = [float(r["latency_s"]) for r in ticks if r["latency_s"] is not None]
    env_max: dict[str, float] = {}
    for r in ticks:
        for k, v in (r["features"].get("envelope_ratio") or {}).items():
            env_max[k] = max(env_max.get(k, 0.0), float(v))
    return {
        "ticks": len(ticks),
        "bad_data": sum(1 for r in rows if r["kind"] == "bad_data"),
        "rms_mean_mm_s": round(float(np.mean(rms)), 4) if rms else None,
        "rms_min_mm_s": round(min(rms), 4) if rms else None,
        "rms_max_mm_s": round(max(rms), 4) if rms else None,
        "rms_p95_mm_s": _pct(rms, 95),
        "zones": zones,
        "worst_zone": max((r["zone"] for r in ticks), key=ZONE_LEVEL.__getitem__, default=None),
        "last_zone": ticks[-1]["zone"] if ticks else None,
        "anomalies": len(anomalies),
        "first_anomaly_event": anomalies[0]["id"] if anomalies else None,
        "last_anomaly_event": anomalies[-1]["id"] if anomalies else None,
        "kurtosis_max": round(max(float(r["features"]["kurtosis"]) for r in ticks), 3)
        if ticks else None,
        "envelope_ratio_max": {k: round(v, 2) for k, v in env_max.items()},
        "tick_latency_p50_s": _pct(lat, 50),
        "tick_latency_p99_s": _pct(lat, 99),
    }


def deterministic_summary(asset: str, stats: dict[str, Any]) -> str:
    if not stats["ticks"]:
        return f"No measurements of {asset} in this period."
    env = stats["envelope_ratio_max"]
    top = max(env.items(), key=lambda kv: kv[1]) if env else ("-", 0.0)
    return (f"{asset}: {stats['ticks']} measurements, RMS {stats['rms_min_mm_s']}-"
            f"{stats['rms_max_mm_s']} mm/s (mean {stats['rms_mean_mm_s']}), worst zone "
            f"{stats['worst_zone']}, last zone {stats['last_zone']}, {stats['anomalies']} "
            f"anomalies, largest envelope peak {top[0]} {top[1]}x. (No model summary: LLM off.)")


def plot_trend(path: Path, rows: list[dict[str, Any]], limits: tuple[float, float, float], *,
               title: str, mark: float | None = None) -> None:
    """PNG with RMS velocity (zone limits dashed) above the zone as a step line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    ticks = [r for r in rows if r["kind"] == "tick" and r["features"]]
    t0 = float(ticks[0]["t"]) if ticks else 0.0
    hours = [(float(r["t"]) - t0) / 3600.0 for r in ticks]
    rms = [float(r["features"]["rms_mm_s"]) for r in ticks]
    zone = [ZONE_LEVEL.get(r["zone"], 0) for r in ticks]
    fig = Figure(figsize=(9, 5), dpi=100)
    ax1, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax1.plot(hours, rms, lw=0.8, color="tab:blue", label="RMS 10-1000 Hz")
    for lim, name in zip(limits, ("A/B", "B/C", "C/D")):
        ax1.axhline(lim, ls="--", lw=0.7, color="grey")
        ax1.text(0, lim, f" {name}", va="bottom", fontsize=7, color="grey")
    ax1.set_ylabel("mm/s")
    ax1.set_title(title)
    ax2.step(hours, zone, where="post", color="tab:red", lw=0.8)
    ax2.set_yticks([0, 1, 2, 3], ["A", "B", "C", "D"])
    ax2.set_ylim(-0.3, 3.3)
    ax2.set_xlabel(f"hours since {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}")
    if mark is not None and ticks:
        for ax in (ax1, ax2):
            ax.axvline((mark - t0) / 3600.0, color="black", lw=0.8)
    fig.tight_layout()
    fig.savefig(str(path), format="png")


def weekly_markdown(doc: dict[str, Any]) -> str:
    s = doc["stats"]
    when = lambda t: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t))  # noqa: E731
    lines = [
        f"# Weekly vibration report: {doc['asset']}",
        "",
        f"Period {when(s['period_start'])} to {when(s['period_end'])}.",
        "",
        "## Summary",
        "",
        doc["summary"] or "(empty)",
        "",
        "## Statistics",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for k, v in s.items():
        if k in ("asset", "period_start", "period_end"):
            continue
        lines.append(f"| {k} | {json.dumps(v) if isinstance(v, dict) else v} |")
    lines += ["", f"![trend]({doc['png']})", ""]
    return "\n".join(lines)


def replay_markdown(doc: dict[str, Any]) -> str:
    r = doc["event_row"]
    f = r.get("features") or {}
    return "\n".join([
        f"# Anomaly replay: event {r['id']} ({doc['asset']})",
        "",
        f"Time {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(float(r['t'])))}, zone "
        f"{r['zone']}, session `{r['session']}`.",
        "",
        f"Features: `{json.dumps(f)}`",
        "",
        f"Assessment at the time: {r.get('assessment') or '(none)'}",
        "",
        "## Explanation",
        "",
        doc["explanation"] or "(empty)",
        "",
        f"![around the event]({doc['png']})",
        "",
    ])
