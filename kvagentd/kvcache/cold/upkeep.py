"""Upkeep of one cold directory: compaction and the scrub.

Compaction rewrites the live records of mostly-dead segments to the write position and
deletes the old files; segments with nothing live go first, so a full disk gets space back
before anything has to be written. The scrub (`verify`) reads and checks every record; one
that fails where it was listed is checked again where the index points now, because
compaction may have moved it meanwhile, and a repair drops a record only while its row still
points where it was found bad.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable

import structlog

from kvagentd.kvcache.base import VerifyProgress
from kvagentd.kvcache.cold.index import ColdIndex
from kvagentd.kvcache.cold.reader import SegmentReader
from kvagentd.kvcache.cold.record import RecordRow
from kvagentd.kvcache.cold.segments import SegmentFiles
from kvagentd.kvcache.cold.writer import SegmentWriter

log = structlog.get_logger(__name__)

PROGRESS_EVERY = 64  # records between two progress reports of a scrub


class Upkeep:
    """Compaction and the scrub over the parts of one `ColdStore` (sharing its counters)."""

    def __init__(self, files: SegmentFiles, index: ColdIndex, reader: SegmentReader,
                 writer: SegmentWriter, counters: dict[str, int],
                 on_read_only: Callable[[], None]) -> None:
        self.files, self.index, self.reader, self.writer = files, index, reader, writer
        self.io = files.io
        self.counters = counters
        self.on_read_only = on_read_only

    # -- compaction ----------------------------------------------------------------------------
    def compact(self, min_dead_ratio: float, *, rewrite: bool,
                max_copy_bytes: int | None = None) -> int:
        """Delete non-active segments whose dead share is at least `min_dead_ratio` (and
        retired ones) after rewriting their live records to the write position; without
        `rewrite`, only segments with nothing live go. Segments with nothing live go first,
        then the deadest (the most space for the least copying); with `max_copy_bytes`, no
        further segment is rewritten once that many live bytes were copied (at least one is).
        Returns bytes reclaimed. Unreadable records are dropped and counted. Raises
        sqlite3.Error from the index (what was moved stays consistent)."""
        reclaimed = copied = 0
        with self.writer.lock, self.files.read_lock:
            segs = sorted(self.index.segment_use(),
                          key=lambda u: (u.live > 0, u.live / max(u.size, 1), u.segment))
            for seg, state, size, live in segs:
                if state != "retired" and size and (size - live) / size < min_dead_ratio:
                    continue
                if live and max_copy_bytes is not None and copied >= max_copy_bytes:
                    break
                if live and (not rewrite or not self._move_live(seg)):
                    continue
                copied += live
                self.files.close_read_fd(seg)
                try:
                    reclaimed += self.io.size(self.files.path(seg))
                    self.io.unlink(self.files.path(seg))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("cold_unlink_failed", segment=seg, error=str(exc))
                    continue
                self.index.drop_segment(seg)
        self.counters["compacted_bytes"] += reclaimed
        return reclaimed

    def _move_live(self, seg: int) -> bool:
        """Copy the verified live records of `seg` to the write position; caller holds the
        writer lock and the read lock."""
        for r in self.index.segment_rows(seg):
            if r.length > self.writer.max_copy_bytes:
                return False
            got, buf = self.reader.read_one(r)
            if isinstance(got, OSError) or got < r.length \
                    or isinstance(self.reader.check(buf, 0, r), str):
                self.counters["corrupt"] += 1
                self.index.delete_rows([r.key])
                continue
            try:
                self.writer.copy(r.key, memoryview(buf)[:r.length])
            except OSError as exc:
                log.error("cold_compact_write_failed", error=str(exc))
                self.writer.failed(exc, on_read_only=self.on_read_only)
                return False
        return True

    # -- the scrub -----------------------------------------------------------------------------
    def verify(self, repair: bool, rate_bytes_per_s: float | None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """Read and check every record of the namespace; see the module docstring.
        `progress(done, total)` hears how many records were read, every `PROGRESS_EVERY`."""
        checked = nbytes = rechecked = 0
        bad: dict[bytes, tuple[RecordRow, str]] = {}
        t0 = time.monotonic()
        rows = self.index.segment_rows(None)
        for i, r in enumerate(rows):
            if progress is not None and i % PROGRESS_EVERY == 0:
                progress(i, len(rows))
            verdict = self._check_row(r)
            checked += verdict != "missing_file"
            if verdict != "ok":
                bad[r.key] = (r, verdict)
            nbytes += r.length
            if rate_bytes_per_s:
                ahead = nbytes / rate_bytes_per_s - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        for _ in range(3):  # moved again while being rechecked: look once more
            moved = self._moved_since(bad)
            if not moved:
                break
            rechecked += len(moved)
            for r in moved:
                verdict = self._check_row(r)
                checked += verdict != "missing_file"
                if verdict == "ok":
                    del bad[r.key]
                else:
                    bad[r.key] = (r, verdict)
        corrupt = sum(1 for _, v in bad.values() if v == "corrupt")
        missing = len(bad) - corrupt
        repaired = 0
        if repair and bad:
            at = {k: r for k, (r, _) in bad.items()}
            try:
                repaired = self.index.delete_rows(list(at), if_at=at)
            except sqlite3.Error as exc:
                self.index.failed("verify", exc)
        self.counters["corrupt"] += corrupt
        if progress is not None:
            progress(len(rows), len(rows))
        return {"checked": checked, "corrupt": corrupt, "missing": missing, "repaired": repaired,
                "bytes": nbytes, "moved": rechecked}

    def _check_row(self, r: RecordRow) -> str:
        """The verdict on one record: ok, corrupt, missing (a short segment) or missing_file."""
        with self.files.read_lock:
            if not os.path.exists(self.files.path(r.segment)):
                return "missing_file"
            got, buf = self.reader.read_one(r)
            if isinstance(got, OSError):
                return "corrupt"
            if got < r.length:
                return "missing"
            if isinstance(self.reader.check(buf, 0, r), str):
                log.error("cold_checksum_failed", key=r.key.hex(), segment=r.segment,
                          reason="scrub")
                return "corrupt"
        return "ok"

    def _moved_since(self, bad: dict[bytes, tuple[RecordRow, str]]) -> list[RecordRow]:
        """Current rows of `bad` records that now point elsewhere than where they failed;
        records deleted meanwhile leave `bad` (nothing to report or repair)."""
        now = self.index.rows(list(bad))
        for k in [k for k in bad if k not in now]:
            del bad[k]
        return [r for k, r in now.items()
                if (r.segment, r.offset) != (bad[k][0].segment, bad[k][0].offset)]
