"""The cold tier's SQLite index: which record of which segment holds a block, and the segments.

The index is authoritative: a record without a row is garbage (a torn tail), never served.
It lives on the same disk as the segments, so a full or failing disk surfaces here as
`sqlite3.Error`; methods that change rows run in one transaction and roll it back on error
(the error propagates, nothing half-written stays). Last-access updates of reads are deferred
and batched (`defer_touch`), and dropped (counted) when they cannot be written, so they never
fail a read of a record that verified.

Opening (`indexfile.py`): a damaged index is set aside for a new, empty one and reported
(`discarded_at_open`); one that merely cannot be written (a read-only directory or file, a
full disk) is opened read-only, its records stay readable, and `unwritable` says why until
`reopen` succeeds.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import structlog

from kvagentd.kvcache.base import BlockKey, ColdEntry
from kvagentd.kvcache.cold.causes import Cause, cause_in
from kvagentd.kvcache.cold.indexfile import open_index
from kvagentd.kvcache.cold.record import RecordRow
from kvagentd.kvcache.fileio import FileOps

log = structlog.get_logger(__name__)

TOUCH_BATCH = 4096            # deferred last-access updates written together ...
TOUCH_EVERY_S = 1.0           # ... or after this long
_IN_CHUNK = 500               # keys per "IN (...)" query

_ROW_COLS = "key, segment, offset, length, payload_len, checksum"

# One row of `blocks` as written: key, namespace, segment, offset, length, payload_len,
# checksum (signed), codec, version, session, tokens, created, last_access.
IndexRow = tuple[bytes, bytes, int, int, int, int, int, str, int, str, int, float, float]


class SegmentUse(NamedTuple):
    segment: int
    state: str     # "active" | "sealed" | "retired"
    size: int      # bytes written
    live: int      # bytes of indexed records


def _row(r: Sequence[Any]) -> RecordRow:
    return RecordRow(r[0], r[1], r[2], r[3], r[4], r[5] & ((1 << 64) - 1))


class ColdIndex:
    """The index of one cold directory. `lock` (re-entrant) guards the connection and
    `bytes_used`; callers may hold it across several calls to make them atomic."""

    def __init__(self, directory: Path, namespace: bytes, io: FileOps) -> None:
        self.directory = directory
        self.namespace = namespace
        self.io = io
        self.lock = threading.RLock()
        self.errors = 0
        self.touch_dropped = 0
        self.discarded_at_open: str | None = None  # why an unreadable index was set aside
        # why the index takes no writes (a read-only directory, a full disk), and the cause
        self.unwritable: str | None = None
        self.unwritable_cause: Cause | None = None
        self._touch_pending: dict[bytes, float] = {}
        self._touch_flushed = time.monotonic()
        self._last_segment = 0
        self._bytes_used = 0
        self._refs: set[tuple[str, BlockKey]] | None = None  # as stored, once read
        self._refs_by_key: dict[BlockKey, set[str]] = {}
        self.db = self._open()
        self._seal_and_count()

    # -- opening -----------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        """The index database (see `indexfile.open_index`); records why it was set aside or
        cannot be written."""
        opened = open_index(self.directory, self.io)
        if opened.discarded is not None:
            self.discarded_at_open = opened.discarded
        self.unwritable, self.unwritable_cause = opened.unwritable, opened.cause
        return opened.db

    def _seal_and_count(self) -> None:
        """Seal what the last process left active and count the live bytes; an index that
        refuses the update is left as it is, unwritable."""
        with self.lock:
            if self.unwritable is None:
                try:
                    self.db.execute("UPDATE segments SET state='sealed' WHERE state='active'")
                except sqlite3.Error as exc:
                    self.unwritable = str(exc)
                    self.unwritable_cause = cause_in(exc, self.directory)
                    log.error("cold_index_unwritable", directory=str(self.directory),
                              error=str(exc), cause=self.unwritable_cause.value)
            self._bytes_used = int(self.db.execute(
                "SELECT COALESCE(SUM(length), 0) FROM blocks").fetchone()[0])
            self._last_segment = max(self._last_segment, int(self.db.execute(
                "SELECT COALESCE(MAX(id), 0) FROM segments").fetchone()[0]))

    def reopen(self) -> str | None:
        """Open the index for writing again (after the directory was made writable or space
        was freed); returns why it still cannot be written, or None."""
        with self.lock:
            self.flush_touches()
            try:
                self.db.close()
            except sqlite3.Error as exc:
                log.warning("cold_index_close_failed", error=str(exc))
            self.unwritable = self.unwritable_cause = None
            self._refs, self._refs_by_key = None, {}
            self.db = self._open()
            self._seal_and_count()
            return self.unwritable

    # -- transactions and failures -----------------------------------------------------------
    @contextlib.contextmanager
    def txn(self) -> Iterator[None]:
        """One transaction: committed, or rolled back when a statement fails (re-raised)."""
        with self.lock:
            self.db.execute("BEGIN")
            try:
                yield
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    try:
                        self.db.execute("ROLLBACK")
                    except sqlite3.Error as exc:
                        log.error("cold_index_rollback_failed", error=str(exc))
                raise

    def failed(self, what: str, exc: sqlite3.Error) -> None:
        """Count and log an index operation the disk refused."""
        self.errors += 1
        log.error("cold_index_failed", op=what, error=str(exc), directory=str(self.directory))

    @property
    def bytes_used(self) -> int:
        with self.lock:
            return self._bytes_used

    # -- block rows --------------------------------------------------------------------------
    def rows(self, keys: Sequence[BlockKey]) -> dict[bytes, RecordRow]:
        """Rows of this namespace's `keys` that exist."""
        out: dict[bytes, RecordRow] = {}
        with self.lock:
            for i in range(0, len(keys), _IN_CHUNK):
                part = list(keys[i:i + _IN_CHUNK])
                for r in self.db.execute(
                        f"SELECT {_ROW_COLS} FROM blocks "
                        f"WHERE namespace=? AND key IN ({','.join('?' * len(part))})",
                        [self.namespace, *part]):
                    out[r[0]] = _row(r)
        return out

    def present(self, keys: Sequence[BlockKey]) -> set[bytes]:
        """Which `keys` have a row (any namespace)."""
        found: set[bytes] = set()
        with self.lock:
            for i in range(0, len(keys), _IN_CHUNK):
                part = list(keys[i:i + _IN_CHUNK])
                found.update(r[0] for r in self.db.execute(
                    f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(part))})", part))
        return found

    def segment_rows(self, segment: int | None = None) -> list[RecordRow]:
        """Rows of one segment (any namespace), or of this namespace when `segment` is None,
        in disk order."""
        with self.lock:
            if segment is None:
                cur = self.db.execute(f"SELECT {_ROW_COLS} FROM blocks WHERE namespace=? "
                                      "ORDER BY segment, offset", (self.namespace,))
            else:
                cur = self.db.execute(f"SELECT {_ROW_COLS} FROM blocks WHERE segment=? "
                                      "ORDER BY offset", (segment,))
            return [_row(r) for r in cur]

    def commit_rows(self, rows: Sequence[IndexRow], segment: int, size: int) -> None:
        """Publish rows of records already durable in `segment` (now `size` bytes long)."""
        with self.txn():
            self.db.executemany(
                "INSERT OR REPLACE INTO blocks (key, namespace, segment, offset, length, "
                "payload_len, checksum, codec, version, session, tokens, created, last_access) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            self.db.execute("UPDATE segments SET size=? WHERE id=?", (size, segment))
        with self.lock:
            self._bytes_used += sum(r[4] for r in rows)

    def move_row(self, key: BlockKey, segment: int, offset: int, size: int) -> None:
        """A record copied (compaction) to `segment` at `offset`; the segment is `size` long."""
        with self.txn():
            self.db.execute("UPDATE blocks SET segment=?, offset=? WHERE key=?",
                            (segment, offset, key))
            self.db.execute("UPDATE segments SET size=? WHERE id=?", (size, segment))

    def delete_rows(self, keys: Sequence[BlockKey], *, if_at: dict[bytes, RecordRow] | None = None
                    ) -> int:
        """Drop rows (and their refs). With `if_at`, a key's row goes only while it still
        points where `if_at[key]` says (a record compaction moved meanwhile is kept).
        Raises sqlite3.Error (rolled back, nothing deleted)."""
        n = freed = 0
        with self.txn():
            for k in keys:
                row = self.db.execute("SELECT length, segment, offset FROM blocks WHERE key=?",
                                      (k,)).fetchone()
                if row is None:
                    continue
                if if_at is not None and k in if_at \
                        and (row[1], row[2]) != (if_at[k].segment, if_at[k].offset):
                    continue
                self.db.execute("DELETE FROM blocks WHERE key=?", (k,))
                self.db.execute("DELETE FROM refs WHERE key=?", (k,))
                freed += row[0]
                n += 1
        with self.lock:
            self._bytes_used -= freed
            for k in keys:
                self._touch_pending.pop(k, None)
            if n and self._refs is not None:
                for k in keys:
                    for sess in self._refs_by_key.pop(k, ()):
                        self._refs.discard((sess, k))
        return n

    def contains(self, key: BlockKey) -> bool:
        with self.lock:
            return self.db.execute("SELECT 1 FROM blocks WHERE key=? AND namespace=?",
                                   (key, self.namespace)).fetchone() is not None

    def keys(self) -> list[BlockKey]:
        with self.lock:
            return [r[0] for r in self.db.execute(
                "SELECT key FROM blocks WHERE namespace=? ORDER BY segment, offset",
                (self.namespace,))]

    def count(self) -> int:
        with self.lock:
            return int(self.db.execute("SELECT COUNT(*) FROM blocks WHERE namespace=?",
                                       (self.namespace,)).fetchone()[0])

    def entries(self) -> list[ColdEntry]:
        """(key, last_access, session) of this namespace's records, in disk order."""
        with self.lock:
            self.flush_touches()
            return [ColdEntry(*r) for r in self.db.execute(
                "SELECT key, last_access, session FROM blocks WHERE namespace=? "
                "ORDER BY segment, offset", (self.namespace,))]

    def usage(self) -> list[tuple[BlockKey, float, int]]:
        """(key, last_access, length) of this namespace's records."""
        with self.lock:
            self.flush_touches()
            return list(self.db.execute(
                "SELECT key, last_access, length FROM blocks WHERE namespace=?",
                (self.namespace,)))

    def expired(self, ttl_s: float, now: float) -> list[BlockKey]:
        with self.lock:
            self.flush_touches()
            return [r[0] for r in self.db.execute(
                "SELECT key FROM blocks WHERE namespace=? AND last_access + ? < ?",
                (self.namespace, ttl_s, now))]

    def eviction_order(self, ttl_s: float, now: float) -> Iterator[tuple[bytes, int]]:
        """(key, length) of every record, best victim first: other namespaces, then expired,
        then least recently accessed. Caller holds `lock` while iterating."""
        self.flush_touches()
        yield from ((k, n) for k, n, _ in self.db.execute(
            "SELECT key, length, namespace FROM blocks ORDER BY (namespace != ?) DESC, "
            "(last_access + ? < ?) DESC, last_access ASC", (self.namespace, ttl_s, now)))

    # -- last access (TTL refresh) -----------------------------------------------------------
    def defer_touch(self, keys: Iterable[BlockKey], now: float, *, flush: bool = False) -> None:
        """Queue last-access updates; written in one transaction per TOUCH_BATCH keys or
        TOUCH_EVERY_S, and before anything that reads last_access (expiry, eviction)."""
        with self.lock:
            for k in keys:
                self._touch_pending[k] = now
            if flush or len(self._touch_pending) >= TOUCH_BATCH \
                    or time.monotonic() - self._touch_flushed >= TOUCH_EVERY_S:
                self.flush_touches()

    def flush_touches(self) -> None:
        """Write the queued updates. A refused write drops them (counted in `touch_dropped`):
        the cost is an earlier TTL expiry, never a failed read."""
        with self.lock:
            pending, self._touch_pending = self._touch_pending, {}
            self._touch_flushed = time.monotonic()
            if not pending:
                return
            if self.unwritable is not None:  # known: no log line per read
                self.touch_dropped += len(pending)
                return
            try:
                with self.txn():
                    self.db.executemany("UPDATE blocks SET last_access=? WHERE key=?",
                                        [(t, k) for k, t in pending.items()])
            except sqlite3.Error as exc:
                self.touch_dropped += len(pending)
                log.warning("cold_touch_dropped", blocks=len(pending), error=str(exc))

    # -- session references --------------------------------------------------------------------
    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        """Replace the session -> keys map (only keys that have a record are kept), writing
        only what changed since the last save, then sync the index (a checkpoint): rows
        committed so far survive a power cut."""
        want = {(s, k) for s, ks in refs.items() for k in ks}
        with self.lock:
            have = self._saved_refs()
            gone, new = have - want, want - have
            if gone or new:
                with self.txn():
                    self.db.executemany("DELETE FROM refs WHERE session=? AND key=?", gone)
                    self.db.executemany(
                        "INSERT OR IGNORE INTO refs (session, key) SELECT ?, key FROM blocks "
                        "WHERE key=?", new)
                stored = self.present([k for _, k in new]) if new else set()
                for s, k in gone:
                    self._drop_ref(s, k)
                for s, k in new:
                    if k in stored:
                        have.add((s, k))
                        self._refs_by_key.setdefault(k, set()).add(s)
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _saved_refs(self) -> set[tuple[str, BlockKey]]:
        """The stored (session, key) pairs (read once, then kept in step); caller holds the
        lock."""
        if self._refs is None:
            self._refs = set(self.db.execute("SELECT session, key FROM refs"))
            self._refs_by_key = {}
            for s, k in self._refs:
                self._refs_by_key.setdefault(k, set()).add(s)
        return self._refs

    def _drop_ref(self, session: str, key: BlockKey) -> None:
        assert self._refs is not None
        self._refs.discard((session, key))
        sessions = self._refs_by_key.get(key)
        if sessions is not None:
            sessions.discard(session)
            if not sessions:
                del self._refs_by_key[key]

    def load_refs(self) -> dict[str, list[BlockKey]]:
        out: dict[str, list[BlockKey]] = {}
        with self.lock:
            for s, k in self.db.execute(
                    "SELECT r.session, r.key FROM refs r JOIN blocks b ON b.key = r.key "
                    "WHERE b.namespace=?", (self.namespace,)):
                out.setdefault(s, []).append(k)
        return out

    # -- segments ----------------------------------------------------------------------------
    def new_segment(self) -> int:
        """Register the next segment id as active. Ids are never reused while the index is
        open, so (segment, offset) names one record for as long as anyone remembers it."""
        with self.lock:
            seg = max(self._last_segment + 1, int(self.db.execute(
                "SELECT COALESCE(MAX(id), 0) + 1 FROM segments").fetchone()[0]))
            self._last_segment = seg
            self.db.execute("INSERT INTO segments (id, state, size) VALUES (?, 'active', 0)",
                            (seg,))
        return seg

    def seal(self, segment: int) -> None:
        with self.lock:
            self.db.execute("UPDATE segments SET state='sealed' WHERE id=? AND state='active'",
                            (segment,))

    def retire(self, segment: int) -> bool:
        """Mark `segment` never to be written again; True when it was not retired before."""
        with self.lock:
            cur = self.db.execute(
                "UPDATE segments SET state='retired' WHERE id=? AND state!='retired'", (segment,))
            return cur.rowcount > 0

    def segment_use(self) -> list[SegmentUse]:
        """Every non-active segment with its live bytes."""
        with self.lock:
            return [SegmentUse(*r) for r in self.db.execute(
                "SELECT s.id, s.state, s.size, COALESCE(SUM(b.length), 0) FROM segments s "
                "LEFT JOIN blocks b ON b.segment = s.id WHERE s.state != 'active' "
                "GROUP BY s.id")]

    def drop_segment(self, segment: int) -> None:
        with self.lock:
            self.db.execute("DELETE FROM segments WHERE id=?", (segment,))

    def segment_counts(self) -> tuple[dict[str, int], int]:
        """Segments per state, and bytes written to segments on disk."""
        with self.lock:
            segs = dict(self.db.execute(
                "SELECT state, COUNT(*) FROM segments GROUP BY state").fetchall())
            disk = int(self.db.execute(
                "SELECT COALESCE(SUM(size), 0) FROM segments").fetchone()[0])
        return segs, disk

    # -- closing -----------------------------------------------------------------------------
    def close(self) -> None:
        """Flush, seal and checkpoint; a failing disk is logged, never raised."""
        with self.lock:
            try:  # the next open re-seals anyway; a full disk must not stop the close
                self.flush_touches()
                if self.unwritable is None:
                    self.db.execute("UPDATE segments SET state='sealed' WHERE state='active'")
                    self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                self.failed("close", exc)
            try:
                self.db.close()
            except sqlite3.Error as exc:
                self.failed("close", exc)
