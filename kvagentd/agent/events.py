"""The event log: one SQLite row per tick (or bad-data event) in `<state_dir>/events.sqlite`,
per-minute summaries per asset, and bounded retention.

Rows are dicts: id, t (unix s), asset, kind ("tick" | "bad_data"), features (dict or None),
zone (A-D or None), anomaly (bool: the diagnosis found a fault), fault and severity (the
diagnosis's, or None), diagnosis (its dict, or None), assessment (the model's commentary as
shown, or None), withheld (bool: the model's text contradicted the diagnosis and is not shown),
session (str or None), latency_s (float or None), note (str: the bad-data reason, an LLM error,
why a commentary was withheld, where a replayed window came from ...).

Minutes (`minutes(asset, since, until)`): per asset and minute, the tick count, bad-data count,
anomalies, mean and max RMS and kurtosis, the max envelope ratio of each defect line, the worst
zone and the faults seen. Reports and trends read these, so they survive the pruning of rows.

Retention (`prune(now, raw_s, keep_s)`, run hourly by the agent): every row is kept for `raw_s`;
after that only anomaly rows, thinned to the first of each asset-minute; after `keep_s` rows
and minutes go. A day of 3 s ticks is about 29k rows per asset; with the defaults (2 days raw,
90 days in all) an asset holds at most about 58k + 130k rows.

Thread-safe (one connection guarded by a lock; WAL journal). `meta` keeps small facts that
must outlive pruned rows (the highest session number per asset).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    t REAL NOT NULL,
    asset TEXT NOT NULL,
    kind TEXT NOT NULL,
    features TEXT,
    zone TEXT,
    anomaly INTEGER NOT NULL DEFAULT 0,
    assessment TEXT,
    session TEXT,
    latency_s REAL,
    note TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_asset_t ON events (asset, t);
CREATE INDEX IF NOT EXISTS events_anomaly ON events (anomaly, t);
CREATE TABLE IF NOT EXISTS minutes (
    asset TEXT NOT NULL,
    minute INTEGER NOT NULL,
    doc TEXT NOT NULL,
    PRIMARY KEY (asset, minute)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# Columns added after the first release: (name, declaration).
_ADDED = (("fault", "TEXT"), ("severity", "TEXT"), ("diagnosis", "TEXT"),
          ("withheld", "INTEGER NOT NULL DEFAULT 0"))
_COLUMNS = ("id", "t", "asset", "kind", "features", "zone", "anomaly", "fault", "severity",
            "diagnosis", "assessment", "withheld", "session", "latency_s", "note")
_ZONE_LEVEL = {"A": 0, "B": 1, "C": 2, "D": 3}
_DELETE_BATCH = 20_000


class EventLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        have = {r[1] for r in self._db.execute("PRAGMA table_info(events)")}
        for name, decl in _ADDED:
            if name not in have:
                self._db.execute(f"ALTER TABLE events ADD COLUMN {name} {decl}")
        self._db.execute("CREATE INDEX IF NOT EXISTS events_fault ON events (asset, fault, t)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def append(self, *, t: float, asset: str, kind: str = "tick",
               features: dict[str, Any] | None = None, zone: str | None = None,
               anomaly: bool = False, session: str | None = None, note: str = "",
               diagnosis: dict[str, Any] | None = None) -> int:
        """Insert a row (and fold it into its minute); returns its id."""
        fault = diagnosis.get("fault") if diagnosis else None
        severity = diagnosis.get("severity") if diagnosis else None
        with self._lock:
            self._db.execute("BEGIN")
            try:
                cur = self._db.execute(
                    "INSERT INTO events (t, asset, kind, features, zone, anomaly, session, note, "
                    "fault, severity, diagnosis) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (t, asset, kind, json.dumps(features) if features is not None else None,
                     zone, int(anomaly), session, note, fault, severity,
                     json.dumps(diagnosis) if diagnosis is not None else None))
                self._fold_minute(t, asset, kind, features, diagnosis)
                self._db.execute("COMMIT")
            except BaseException:
                # NOTE: SQLite has already rolled back after some errors (a full disk): a
                # second rollback would raise and hide the cause
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            rowid = cur.lastrowid
        assert rowid is not None
        return int(rowid)

    def _fold_minute(self, t: float, asset: str, kind: str, features: dict[str, Any] | None,
                     diagnosis: dict[str, Any] | None) -> None:
        minute = int(t // 60)
        row = self._db.execute("SELECT doc FROM minutes WHERE asset = ? AND minute = ?",
                               (asset, minute)).fetchone()
        doc: dict[str, Any] = json.loads(row[0]) if row else {
            "ticks": 0, "bad": 0, "anomalies": 0, "rms_sum": 0.0, "rms_max": 0.0,
            "kurt_sum": 0.0, "kurt_max": 0.0, "zone": None, "faults": {}, "ratios": {}}
        if kind != "tick" or not features:
            doc["bad"] += 1
        else:
            rms, kurt = float(features["rms_mm_s"]), float(features["kurtosis"])
            doc["ticks"] += 1
            doc["rms_sum"] += rms
            doc["rms_max"] = max(doc["rms_max"], rms)
            doc["kurt_sum"] += kurt
            doc["kurt_max"] = max(doc["kurt_max"], kurt)
            zone = features.get("zone")
            if zone and (doc["zone"] is None or _ZONE_LEVEL[zone] > _ZONE_LEVEL[doc["zone"]]):
                doc["zone"] = zone
            if diagnosis:
                fault = diagnosis["fault"]
                doc["faults"][fault] = doc["faults"].get(fault, 0) + 1
                doc["anomalies"] += int(fault != "none")
                for k, v in (diagnosis.get("ratios") or {}).items():
                    doc["ratios"][k] = max(doc["ratios"].get(k, 0.0), float(v))
        self._db.execute("INSERT OR REPLACE INTO minutes (asset, minute, doc) VALUES (?, ?, ?)",
                         (asset, minute, json.dumps(doc)))

    def complete(self, event_id: int, *, assessment: str | None, latency_s: float,
                 session: str | None = None, note: str | None = None,
                 withheld: bool = False) -> None:
        """Record the tick's outcome on its row."""
        with self._lock:
            self._db.execute(
                "UPDATE events SET assessment = ?, latency_s = ?, session = COALESCE(?, session), "
                "note = COALESCE(?, note), withheld = ? WHERE id = ?",
                (assessment, latency_s, session, note, int(withheld), event_id))

    def get(self, event_id: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM events WHERE id = ?",
                                   (event_id,)).fetchone()
        return _row(row) if row else None

    def query(self, *, asset: str | None = None, since: float | None = None,
              until: float | None = None, anomalies: bool = False, kind: str | None = None,
              limit: int = 1000, newest_first: bool = True,
              after_id: int | None = None) -> list[dict[str, Any]]:
        where: list[str] = []
        args: list[Any] = []
        if after_id is not None:  # rows written since the one a follower saw last
            where.append("id > ?")
            args.append(int(after_id))
        if asset:
            where.append("asset = ?")
            args.append(asset)
        if since is not None:
            where.append("t >= ?")
            args.append(since)
        if until is not None:
            where.append("t < ?")
            args.append(until)
        if anomalies:
            where.append("anomaly = 1")
        if kind:
            where.append("kind = ?")
            args.append(kind)
        sql = f"SELECT {', '.join(_COLUMNS)} FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY id {'DESC' if newest_first else 'ASC'} LIMIT ?"
        args.append(int(limit))
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [_row(r) for r in rows]

    def recent(self, asset: str, n: int) -> list[dict[str, Any]]:
        """The last `n` tick rows of `asset`, oldest first."""
        return list(reversed(self.query(asset=asset, kind="tick", limit=n)))

    def minutes(self, asset: str, since: float, until: float) -> list[dict[str, Any]]:
        """Per-minute summaries of `asset` in [since, until), oldest first; each has `t` (the
        minute's start) and the fields of the module docstring (`rms_mean`, `kurt_mean` ...)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT minute, doc FROM minutes WHERE asset = ? AND minute >= ? AND minute < ? "
                "ORDER BY minute", (asset, int(since // 60), int(until // 60) + 1)).fetchall()
        out = []
        for minute, text in rows:
            doc = json.loads(text)
            if minute * 60.0 >= until:
                continue
            n = doc["ticks"]
            doc.update(t=minute * 60.0, rms_mean=doc["rms_sum"] / n if n else None,
                       kurt_mean=doc["kurt_sum"] / n if n else None)
            out.append(doc)
        return out

    def sessions(self, asset: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT session FROM events WHERE asset = ? AND session IS NOT NULL",
                (asset,)).fetchall()
        return [r[0] for r in rows]

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return str(row[0]) if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (key, value))

    def prune(self, now: float, raw_s: float, keep_s: float) -> dict[str, int]:
        """Apply the retention of the module docstring; returns rows and minutes deleted."""
        raw_cut, keep_cut = now - raw_s, now - keep_s
        deleted = {"rows": 0, "minutes": 0}
        statements = (
            ("rows", "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE t < ? "
                     "LIMIT ?)", (keep_cut,)),
            ("rows", "DELETE FROM events WHERE id IN (SELECT id FROM events WHERE t < ? AND "
                     "anomaly = 0 LIMIT ?)", (raw_cut,)),
            ("rows", "DELETE FROM events WHERE id IN (SELECT e.id FROM events e WHERE e.t < ? "
                     "AND e.anomaly = 1 AND e.id > (SELECT MIN(f.id) FROM events f WHERE "
                     "f.asset = e.asset AND f.anomaly = 1 AND CAST(f.t / 60 AS INTEGER) = "
                     "CAST(e.t / 60 AS INTEGER)) LIMIT ?)", (raw_cut,)),
            ("minutes", "DELETE FROM minutes WHERE rowid IN (SELECT rowid FROM minutes WHERE "
                        "minute < ? LIMIT ?)", (int(keep_cut // 60),)),
        )
        for what, sql, args in statements:
            while True:
                with self._lock:  # NOTE: batches keep ticks from waiting behind one long delete
                    n = self._db.execute(sql, (*args, _DELETE_BATCH)).rowcount
                deleted[what] += max(0, n)
                if n < _DELETE_BATCH:
                    break
        return deleted

    def count(self, asset: str | None = None) -> int:
        with self._lock:
            if asset is None:
                return int(self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0])
            return int(self._db.execute("SELECT COUNT(*) FROM events WHERE asset = ?",
                                        (asset,)).fetchone()[0])


def _row(r: tuple[Any, ...]) -> dict[str, Any]:
    d = dict(zip(_COLUMNS, r))
    d["features"] = json.loads(d["features"]) if d["features"] else None
    d["diagnosis"] = json.loads(d["diagnosis"]) if d["diagnosis"] else None
    d["anomaly"] = bool(d["anomaly"])
    d["withheld"] = bool(d["withheld"])
    return d
