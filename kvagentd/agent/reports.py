"""Weekly reports and anomaly replays, written under `<state_dir>/reports/`.

A report `ID` is `weekly-<asset>-<UTC stamp>-<random>` or `replay-<event id>-<UTC
stamp>-<random>` (not guessable ahead, so nobody can plant a name it will take) and consists of
`ID.md`, `ID.json`, `ID.png` and, for a replay, `ID-spectrum.png`, each written through
`control.dumps.DumpDir` (never through a symlink, never into a directory that is not the
daemon's alone). While it is generated
`ID.json` holds `"state": "running"`; afterwards `"done"` or `"failed"` (with `error`).
Generation runs in its own thread at REPORT priority, so it never delays ticks (the executor
serves TICK requests first).

- weekly: over `agent.report_period_s`, from the per-minute summaries and the anomaly rows:
  the findings in plain words (what, since when, how fast it grows, what to do), the figures of
  the period, a trend figure (RMS over zone bands, kurtosis, envelope lines, fault episodes
  marked) and, with a model, its commentary in a fresh session `report-<asset>-<stamp>`.
- replay: resumes the session that flagged the event (its KV comes from whichever tier holds
  it) and asks it to explain the event's diagnosis; the JSON records the store's tier loads
  during the call. Figures: the envelope spectrum of the event's raw window (when the window
  store kept it) with the defect lines marked, beside a normal window of the same asset, and
  the hour around the event.
Model text is commentary: it is checked against the diagnosis it was given
(`grounding.check`) and shown only when it passes; the report says when it was withheld.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Mapping

import structlog

from kvagentd.agent import grounding, plots, prompts
from kvagentd.agent.diagnosis.analysis import analyze, classify
from kvagentd.agent.diagnosis.bearing import bearing_frequencies
from kvagentd.agent.events import EventLog
from kvagentd.agent.model_client import Completion
from kvagentd.agent.report_content import (deterministic_summary, episodes, findings,
                                           replay_markdown, weekly_markdown, weekly_stats)
from kvagentd.agent.windows import WindowStore
from kvagentd.config import AssetConfig
from kvagentd.control.dumps import DumpDir

log = structlog.get_logger(__name__)

_ID_RE = re.compile(r"^(weekly|replay)-[A-Za-z0-9_.-]+$")
ZONE_LEVEL = {"A": 0, "B": 1, "C": 2, "D": 3}


NEAREST_WINDOW_S = 300.0  # a replay may show a kept window this close to its event


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
    hook: the live session about to be resumed rolls over first), `period_s` (the weekly
    report's span) and `windows` (the raw windows kept for spectra; may be None).
    """

    def __init__(self, directory: Path, *, events: EventLog, assets: Mapping[str, AssetConfig],
                 generate: GenerateFn | None, clock: Callable[[], float],
                 store_stats: Callable[[], dict[str, Any]] | None,
                 retire_session: Callable[[str], None], period_s: float,
                 windows: WindowStore | None = None) -> None:
        self.windows = windows
        self.events = events
        self.assets = assets
        self.generate = generate
        self.clock = clock
        self.store_stats = store_stats
        self.retire_session = retire_session
        self.period_s = period_s
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        # NOTE: every file goes through the confined writer (the directory must be the daemon's
        # alone; O_EXCL|O_NOFOLLOW temporary names, published by rename), so an entry planted in
        # the directory is never written through.
        self.files = DumpDir(self.dir)
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
        doc["files"] = [str(p) for p in (self.dir / f"{report_id}{suffix}" for suffix in (
            ".md", ".json", ".png", "-spectrum.png")) if p.is_file()]
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
        data = (json.dumps(doc, indent=2, default=str) + "\n").encode("utf-8")
        self.files.replace(f"{report_id}.json", lambda f: f.write(data))

    def _write_text(self, name: str, text: str) -> None:
        data = text.encode("utf-8")
        self.files.replace(name, lambda f: f.write(data))

    # ------------------------------------------------------------------ starting

    def start(self, kind: str, *, asset: str | None = None, event: int | None = None) -> str:
        """Validate, write the `running` stub and generate in a thread; returns the id."""
        now = self.clock()
        if kind == "weekly":
            if asset is None or asset not in self.assets:
                raise ReportError(f"unknown asset {asset!r}")
            rid = f"weekly-{asset}-{_stamp(now)}-{secrets.token_hex(4)}"
            job: Callable[[], None] = functools.partial(self._weekly, rid, asset, now)
        elif kind == "replay":
            row = self.events.get(int(event)) if event is not None else None
            if row is None:
                raise ReportError(f"unknown event {event!r}")
            if not row.get("session"):
                raise ReportError(f"event {event} has no session (features-only tick)")
            rid = f"replay-{row['id']}-{_stamp(now)}-{secrets.token_hex(4)}"
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

    def _latest_thresholds(self, asset: str, since: float, until: float
                           ) -> dict[str, float] | None:
        """The detection thresholds of the period's latest diagnosed window (any window, not
        only an anomaly's: a healthy week's plot shows how far below them its lines stay)."""
        for row in self.events.query(asset=asset, since=since, until=until, limit=50):
            thr = (row.get("diagnosis") or {}).get("thresholds")
            if thr:
                return dict(thr)
        return None

    def _weekly(self, rid: str, asset: str, now: float) -> None:
        since = now - self.period_s
        minutes = self.events.minutes(asset, since, now + 1e-6)
        rows = self.events.query(asset=asset, since=since, until=now + 1e-6, anomalies=True,
                                 limit=10_000_000, newest_first=False)
        eps = episodes(rows)
        found = findings(eps, minutes, since)
        stats = weekly_stats(minutes)
        stats.update(asset=asset, period_start=since, period_end=now)
        cfg = self.assets[asset]
        thresholds = self._latest_thresholds(asset, since, now + 1e-6)
        png = self.files.replace(f"{rid}.png", lambda f: plots.trend_figure(
            f, minutes, eps, cfg.zone_limits_mm_s, thresholds=thresholds,
            title=f"{asset}: vibration from {_day(since)} to {_day(now)}"))
        summary = deterministic_summary(asset, found, stats)
        latest = eps[-1]["diagnosis"] if eps else {"fault": "none", "zone": stats["last_zone"]}
        commentary: dict[str, Any] = {"reason": "No model commentary (LLM off)."}
        gen = None
        if self.generate is not None and cfg.llm:
            text = prompts.report_prompt(asset, summary, stats)
            gen = self._submit(f"report-{asset}-{_stamp(now)}", text, prompts.SYSTEM_PROMPT)
            commentary = _checked(gen["text"], latest, text)
        doc = {"id": rid, "kind": "weekly", "asset": asset, "event": None, "state": "done",
               "created": now, "finished": self.clock(), "stats": stats, "findings": found,
               "episodes": [{k: v for k, v in e.items() if k != "diagnosis"} for e in eps],
               "summary": summary, "commentary": commentary, "generation": gen,
               "png": png.name, "period_start": since, "period_end": now}
        self._write_text(f"{rid}.md", weekly_markdown(doc))
        self._write_json(rid, doc)
        log.info("report.weekly_done", report=rid, ticks=stats["ticks"])

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
        text = prompts.replay_prompt(row)
        res = self._submit(session, text, None)
        after = self.store_stats() if self.store_stats else None
        t = float(row["t"])
        asset = row["asset"]
        cfg = self.assets.get(asset)
        d = row.get("diagnosis") or {"fault": "none", "zone": row.get("zone")}
        around = self.events.query(asset=asset, since=t - 3600, until=t + 3600,
                                   anomalies=True, limit=100_000, newest_first=False)
        minutes = self.events.minutes(asset, t - 3600, t + 3600)
        png = self.files.replace(f"{rid}.png", lambda f: plots.trend_figure(
            f, minutes, episodes(around), cfg.zone_limits_mm_s if cfg else (1.4, 2.8, 4.5),
            thresholds=d.get("thresholds"), title=f"{asset}: the hour around event {row['id']}",
            mark=(t, f"event {row['id']}: {str(d['fault']).replace('_', ' ')}")))
        spectrum = self._spectrum(rid, row, cfg, d)
        doc = {"id": rid, "kind": "replay", "asset": asset, "event": row["id"],
               "state": "done", "created": now, "finished": self.clock(),
               "event_row": row, "commentary": _checked(res["text"], d, text),
               "generation": res, "store_before": before, "store_after": after,
               "png": png.name, "spectrum_png": spectrum}
        self._write_text(f"{rid}.md", replay_markdown(doc))
        self._write_json(rid, doc)
        log.info("report.replay_done", report=rid, session=session)

    def _spectrum(self, rid: str, row: dict[str, Any], cfg: AssetConfig | None,
                  d: dict[str, Any]) -> str | None:
        """The envelope spectrum of the event's kept window, or None when it was not kept."""
        if self.windows is None or cfg is None:
            return None
        window, source = self.windows.get(int(row["id"])), None
        if window is None:
            # NOTE: anomaly windows are kept at most once a minute: show the nearest kept
            # window with the same fault, and say so.
            t = float(row["t"])
            for eid in sorted(self.windows.events(row["asset"]),
                              key=lambda e: abs(e - int(row["id"]))):
                other = self.events.get(eid)
                if other is not None and other.get("fault") == row.get("fault") and \
                        abs(float(other["t"]) - t) <= NEAREST_WINDOW_S:
                    window, source = self.windows.get(eid), other
                    break
        if window is None:
            return None
        an = analyze(window, cfg)
        normal = None
        for eid in reversed(self.windows.events(row["asset"])):
            other = self.events.get(eid)
            if other is not None and not other["anomaly"] and eid != row["id"]:
                w = self.windows.get(eid)
                if w is not None:
                    ref = analyze(w, cfg)
                    normal = (ref.envelope.freqs, ref.envelope.ratio)
                    break
        bf = bearing_frequencies(cfg.bearing, an.speed.measured_hz * 60.0)
        which = (f"event {row['id']}" if source is None else
                 f"event {source['id']} (the kept window nearest to event {row['id']})")
        thr = (d.get("thresholds") or {}).get(str((d.get("lines") or [{}])[0].get("line")))
        shown = classify(an, cfg).as_dict() if source is not None else d
        path = self.files.replace(f"{rid}-spectrum.png", lambda f: plots.spectrum_figure(
            f, an.envelope.freqs, an.envelope.ratio,
            {"BPFO": bf.bpfo, "BPFI": bf.bpfi, "2xBSF": 2 * bf.bsf, "FTF": bf.ftf},
            shown.get("lines") or [], threshold=thr, normal=normal,
            title=f"{row['asset']}, {which}: envelope spectrum "
                  f"({an.band[0]:.0f}-{an.band[1]:.0f} Hz band) - "
                  f"{str(d.get('fault', 'none')).replace('_', ' ')}"))
        return path.name


def _day(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t))


def _checked(text: str | None, diagnosis: Mapping[str, Any], evidence: str) -> dict[str, Any]:
    """The model's text as a report shows it: the text, or why it was withheld."""
    verdict = grounding.check(text, diagnosis, evidence)
    if verdict.ok:
        return {"text": text, "withheld": False, "reason": None}
    return {"text": None, "withheld": True, "reason": verdict.reason}
