"""Opening the cold index's SQLite file.

`open_index` opens it for writing. A damaged file (SQLite says corrupt, or not a database) is
set aside (renamed `index.sqlite3.corrupt-<time>`), never trusted: a new one starts empty and
the old segment files are removed as unindexed garbage (recomputation, never wrong KV). A file
that merely cannot be written (a read-only directory or file, a full disk) is opened
read-only instead, so its records stay readable; `unwritable` and `cause` say why.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import NamedTuple

import structlog

from kvagentd.kvcache.cold.causes import Cause, cause_in, is_corrupt
from kvagentd.kvcache.fileio import FileOps

log = structlog.get_logger(__name__)

INDEX_NAME = "index.sqlite3"

SCHEMA = """
CREATE TABLE IF NOT EXISTS blocks (
    key BLOB PRIMARY KEY, namespace BLOB NOT NULL, segment INTEGER NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL, payload_len INTEGER NOT NULL,
    checksum INTEGER NOT NULL, codec TEXT NOT NULL, version INTEGER NOT NULL,
    session TEXT NOT NULL, tokens INTEGER NOT NULL, created REAL NOT NULL,
    last_access REAL NOT NULL);
CREATE INDEX IF NOT EXISTS blocks_seg ON blocks (segment, offset);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY, state TEXT NOT NULL, size INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS refs (
    session TEXT NOT NULL, key BLOB NOT NULL, PRIMARY KEY (session, key));
"""


class OpenedIndex(NamedTuple):
    db: sqlite3.Connection
    discarded: str | None    # why a damaged file was set aside
    unwritable: str | None   # why it is open read-only
    cause: Cause | None      # ... and the cause


def open_index(directory: Path, io: FileOps) -> OpenedIndex:
    """The index of `directory` (see the module docstring)."""
    path = directory / INDEX_NAME
    discarded = None
    for attempt in range(2):
        try:
            db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            return _read_only(directory, path, exc, discarded)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # NOTE: FULL: a committed row survives a power cut (the store commits a row only
            # after its record is synced; tests/kvcache/test_power_cut.py holds it to that).
            # 0.25 ms a commit on the development VM's disk against 0.05 ms for NORMAL.
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
            db.execute("SELECT COUNT(*) FROM blocks").fetchone()
            if attempt:
                _discard_old_segments(directory, io)
            return OpenedIndex(db, discarded, None, None)
        except sqlite3.DatabaseError as exc:
            db.close()
            if attempt or not is_corrupt(exc):
                return _read_only(directory, path, exc, discarded)
            try:
                discarded = _set_aside(path, exc, io)
            except OSError as err:
                return _read_only(directory, path, err, discarded)
    raise AssertionError("unreachable")


def _set_aside(path: Path, exc: sqlite3.Error, io: FileOps) -> str:
    aside = path.with_name(f"{INDEX_NAME}.corrupt-{int(time.time())}")
    log.error("cold_index_unreadable", path=str(path), error=str(exc), moved_to=str(aside))
    for suffix in ("", "-wal", "-shm"):
        src = Path(str(path) + suffix)
        if src.exists():
            io.rename(str(src), str(aside) + suffix)
    return f"{exc}; set aside as {aside.name}"


def _read_only(directory: Path, path: Path, why: BaseException,
               discarded: str | None) -> OpenedIndex:
    """The index as it is, for reading only (or an empty one in memory when even that
    fails)."""
    reason = str(why) or type(why).__name__
    cause = cause_in(why, directory)
    log.error("cold_index_unwritable", path=str(path), error=reason, cause=cause.value)
    for query in ("mode=ro", "immutable=1"):
        try:
            db = sqlite3.connect(f"{path.as_uri()}?{query}", uri=True,
                                 check_same_thread=False, isolation_level=None)
        except sqlite3.Error:
            continue
        try:
            db.execute("SELECT COUNT(*) FROM blocks").fetchone()
            db.execute("SELECT COUNT(*) FROM segments").fetchone()
            return OpenedIndex(db, discarded, reason, cause)
        except sqlite3.Error:
            db.close()
    db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
    db.executescript(SCHEMA)
    return OpenedIndex(db, discarded, reason, cause)


def _discard_old_segments(directory: Path, io: FileOps) -> None:
    """After starting a new index: old segment files are unindexed garbage; remove them."""
    for p in directory.glob("seg-*.kvs"):
        try:
            io.unlink(str(p))
        except OSError as exc:
            log.warning("cold_unlink_failed", path=str(p), error=str(exc))
