"""Which published sessions this box holds, with their fencing tokens, across restarts.

A row per session this box published or adopted: `epoch` is the fencing token the remote
store gave it (the session's manifest accepts a write only from its holder box with that
epoch); `fenced_by` names the box that took the session over (then this box never writes it
again). Kept in `<state_dir>/fleet.sqlite3`.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import NamedTuple

import structlog

log = structlog.get_logger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    session    TEXT PRIMARY KEY,
    epoch      INTEGER NOT NULL,
    fenced_by  TEXT,
    updated    REAL NOT NULL
)
"""


class Lease(NamedTuple):
    session: str
    epoch: int
    fenced_by: str | None  # None: this box holds it

    @property
    def held(self) -> bool:
        return self.fenced_by is None


class LeaseBook:
    """Thread-safe table of `Lease` rows."""

    def __init__(self, state_dir: Path) -> None:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(state_dir) / "fleet.sqlite3"
        self._lock = threading.Lock()
        self._closed = False
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def get(self, session: str) -> Lease | None:
        with self._lock:
            row = self._db.execute("SELECT session, epoch, fenced_by FROM leases WHERE session = ?",
                                   (session,)).fetchone()
        return Lease(*row) if row else None

    def hold(self, session: str, epoch: int) -> None:
        """This box holds `session` with fencing token `epoch`."""
        self._put(session, epoch, None)

    def fence(self, session: str, by: str, epoch: int) -> None:
        """`by` holds `session` now (with `epoch`); this box must not write it."""
        self._put(session, epoch, by)

    def _put(self, session: str, epoch: int, by: str | None) -> None:
        with self._lock:
            if self._closed:  # a reply that came after the stop: said, not raised in a thread
                log.warning("lease_not_recorded", session=session, epoch=int(epoch),
                            fenced_by=by, why="the lease book is closed")
                return
            self._db.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?)",
                             (session, int(epoch), by, time.time()))

    def fenced(self) -> list[Lease]:
        with self._lock:
            rows = self._db.execute("SELECT session, epoch, fenced_by FROM leases "
                                    "WHERE fenced_by IS NOT NULL ORDER BY session").fetchall()
        return [Lease(*r) for r in rows]

    def count(self) -> tuple[int, int]:
        """(held, fenced)."""
        with self._lock:
            held, fenced = self._db.execute(
                "SELECT sum(fenced_by IS NULL), sum(fenced_by IS NOT NULL) FROM leases").fetchone()
        return int(held or 0), int(fenced or 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()
