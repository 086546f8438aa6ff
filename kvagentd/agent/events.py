"""The event log: one SQLite row per tick (or bad-data event) in `<state_dir>/events.sqlite`.

Rows are dicts: id, t (unix s), asset, kind ("tick" | "bad_data"), features (dict or None),
zone (A-D or None), anomaly (bool), assessment (str or None), session (str or None),
latency_s (float or None), note (str: the bad-data reason, an LLM error ...).
Thread-safe (one connection guarded by a lock; WAL journal).
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
"""

_COLUMNS = ("id", "t", "asset", "kind", "features", "zone", "anomaly", "assessment", "session",
            "latency_s", "note")


class EventLog:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def append(self, *, t: float, asset: str, kind: str = "tick",
               features: dict[str, Any] | None = None, zone: str | None = None,
               anomaly: bool = False, session: str | None = None, note: str = "") -> int:
        """Insert a row; returns its id."""
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO events (t, asset, kind, features, zone, anomaly, session, note) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (t, asset, kind, json.dumps(features) if features is not None else None, zone,
                 int(anomaly), session, note))
            return int(cur.lastrowid)

    def complete(self, event_id: int, *, assessment: str | None, latency_s: float,
                 session: str | None = None, note: str | None = None) -> None:
        """Record the tick's outcome on its row."""
        with self._lock:
            self._db.execute(
                "UPDATE events SET assessment = ?, latency_s = ?, session = COALESCE(?, session), "
                "note = COALESCE(?, note) WHERE id = ?",
                (assessment, latency_s, session, note, event_id))

    def get(self, event_id: int) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM events WHERE id = ?",
                                   (event_id,)).fetchone()
        return _row(row) if row else None

    def query(self, *, asset: str | None = None, since: float | None = None,
              until: float | None = None, anomalies: bool = False, kind: str | None = None,
              limit: int = 1000, newest_first: bool = True) -> list[dict[str, Any]]:
        where, args = [], []
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

    def sessions(self, asset: str) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT DISTINCT session FROM events WHERE asset = ? AND session IS NOT NULL",
                (asset,)).fetchall()
        return [r[0] for r in rows]


def _row(r: tuple) -> dict[str, Any]:
    d = dict(zip(_COLUMNS, r))
    d["features"] = json.loads(d["features"]) if d["features"] else None
    d["anomaly"] = bool(d["anomaly"])
    return d
