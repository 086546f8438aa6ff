"""Appending records to the active segment.

Crash consistency has one owner here: records are written sequentially in `io_unit` chunks,
the segment is synced, and only then are their index rows committed (`_publish`). Whatever a
crash leaves between the write and the commit is an unindexed tail: garbage, never served.

Two ways in: raw blocks whose memory is suitably aligned are written straight from it (a
header from the staging buffer, then the payload), everything else is encoded into one half
of a double staging buffer while the other half is being written. Compaction copies verified
records with `copy`, which republishes rows in place (an UPDATE: a row deleted meanwhile stays
deleted).
"""

from __future__ import annotations

import errno
import mmap
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import torch

from kvagentd.kvcache.base import BlockKey, KVGeometry
from kvagentd.kvcache.codec import Codec, CodecId
from kvagentd.kvcache.cold.index import ColdIndex, IndexRow
from kvagentd.kvcache.cold.record import (ALIGN, FORMAT_VERSION, pack_header, record_bytes,
                                          signed64)
from kvagentd.kvcache.cold.segments import SegmentFiles

log = structlog.get_logger(__name__)

Blocks = Sequence[torch.Tensor] | torch.Tensor


class SegmentWriter:
    """The write side of one cold directory. `lock` serializes writers (and compaction)."""

    def __init__(self, files: SegmentFiles, index: ColdIndex, geometry: KVGeometry,
                 namespace: bytes, codec: Codec, *, segment_bytes: int, io_unit_bytes: int,
                 buffer_bytes: int, counters: dict[str, int]) -> None:
        self.files, self.index = files, index
        self.geometry, self.namespace, self.codec = geometry, namespace, codec
        self.segment_bytes = int(segment_bytes)
        self.io_unit = max(ALIGN, (int(io_unit_bytes) + ALIGN - 1) // ALIGN * ALIGN)
        self.counters = counters
        self.lock = threading.Lock()
        self.rec = record_bytes(codec)
        # two halves: one is written while the next batch is encoded into the other
        self._half = max(self.io_unit, self.rec * max(1, buffer_bytes // self.rec))
        self._buf = mmap.mmap(-1, 2 * self._half)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-cold-write")
        self._fd: int | None = None
        self._seg: int | None = None
        self._tail = 0
        self._retired: set[int] = set()
        self._new: list[IndexRow] = []          # written, not yet published
        self._moved: list[tuple[BlockKey, int]] = []

    # -- segments ------------------------------------------------------------------------------
    def _roll(self) -> None:
        """Seal the active segment and start a new one."""
        if self._fd is not None:
            self.files.io.close(self._fd)
            self._fd = None
            assert self._seg is not None
            self.index.seal(self._seg)
            self._seg = None
        seg = self.index.new_segment()
        self._fd = self.files.open(self.files.path(seg), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.files.io.fsync_dir(str(self.files.directory))
        self._seg, self._tail = seg, 0

    def _room_for(self, nbytes: int) -> None:
        """Publish what is pending and roll to a new segment unless `nbytes` more fit in the
        active one."""
        if self._fd is None or self._seg in self._retired or self._tail + nbytes > self.segment_bytes:
            self._publish()
            self._roll()

    def _publish(self) -> None:
        """Sync the active segment, then commit the rows of what was written to it."""
        if not (self._new or self._moved):
            return
        assert self._fd is not None and self._seg is not None
        self.files.io.fsync(self._fd)
        new, moved = self._new, self._moved
        self._new, self._moved = [], []
        if new:
            self.index.commit_rows(new, self._seg, self._tail)
        for key, offset in moved:
            self.index.move_row(key, self._seg, offset, self._tail)

    def retire(self, segment: int, reason: str) -> None:
        """Never write `segment` again; the next write rolls to a new one."""
        self._retired.add(segment)
        try:
            fresh = self.index.retire(segment)
        except sqlite3.Error as exc:  # retired in memory; the next open seals it
            self.index.failed("retire", exc)
            return
        if fresh:
            self.counters["retired_segments"] += 1
            log.error("cold_segment_retired", segment=segment, reason=reason)

    @property
    def active_segment(self) -> int | None:
        return self._seg

    # -- writing -------------------------------------------------------------------------------
    def put(self, keys: Sequence[BlockKey], blocks: Blocks, todo: Sequence[int], *,
            session: str, num_tokens: int) -> None:
        """Write records for `keys[i]`/`blocks[i]`, i in `todo`, and publish them. Raises
        OSError or sqlite3.Error; rows published before the error stay."""
        self._new, self._moved = [], []
        now = time.time()
        meta = (session, num_tokens, now)
        try:
            if self.codec.id == CodecId.RAW and all(self._direct_src_ok(blocks[i]) for i in todo):
                self._put_direct(keys, blocks, todo, meta)
            else:
                self._put_encoded(keys, blocks, todo, meta)
            self._publish()
        finally:
            self._new, self._moved = [], []

    def _row(self, key: BlockKey, offset: int, checksum: int,
             meta: tuple[str, int, float]) -> IndexRow:
        assert self._seg is not None
        session, tokens, now = meta
        return (key, self.namespace, self._seg, offset, self.rec, self.codec.payload_nbytes,
                signed64(checksum), self.codec.name, FORMAT_VERSION, session, tokens, now, now)

    def _direct_src_ok(self, block: torch.Tensor) -> bool:
        """A raw block can be written from its own memory (no staging copy)."""
        g = self.geometry
        if block.device.type != "cpu" or block.dtype != g.dtype \
                or not block.is_contiguous() or block.numel() != g.block_numel:
            return False
        if g.block_bytes % ALIGN:
            return False
        return not self.files.o_direct_active or block.data_ptr() % ALIGN == 0

    def _put_direct(self, keys: Sequence[BlockKey], blocks: Blocks, todo: Sequence[int],
                    meta: tuple[str, int, float]) -> None:
        hdr = memoryview(self._buf)[:ALIGN]
        for i in todo:
            self._room_for(self.rec)
            payload = blocks[i].reshape(-1).view(torch.uint8).numpy().data
            csum = pack_header(self._buf, 0, keys[i], self.namespace, self.geometry, self.codec,
                               payload)
            self._write_all(hdr, self._tail)
            self._write_all(payload, self._tail + ALIGN)
            self._new.append(self._row(keys[i], self._tail, csum, meta))
            self._tail += self.rec

    def _put_encoded(self, keys: Sequence[BlockKey], blocks: Blocks, todo: Sequence[int],
                     meta: tuple[str, int, float]) -> None:
        per_buf = max(1, self._half // self.rec)
        pending: Future[None] | None = None
        try:
            for ci, start in enumerate(range(0, len(todo), per_buf)):
                chunk = todo[start:start + per_buf]
                if self._fd is None or self._seg in self._retired \
                        or self._tail + len(chunk) * self.rec > self.segment_bytes:
                    if pending is not None:
                        pending.result()
                        pending = None
                    self._room_for(len(chunk) * self.rec)
                base, boff = self._tail, (ci % 2) * self._half
                sums = self._encode(boff, [keys[i] for i in chunk], [blocks[i] for i in chunk])
                if pending is not None:
                    pending.result()
                pending = self._pool.submit(
                    self._write_all, memoryview(self._buf)[boff:boff + len(chunk) * self.rec], base)
                for j, i in enumerate(chunk):
                    self._new.append(self._row(keys[i], base + j * self.rec, sums[j], meta))
                self._tail = base + len(chunk) * self.rec
            if pending is not None:
                pending.result()
                pending = None
        finally:
            if pending is not None:  # never reuse the buffer under a write in flight
                try:
                    pending.result()
                except OSError as late:
                    log.debug("cold_write_also_failed", error=str(late))

    def _encode(self, boff: int, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> list[int]:
        """Encode headers and payloads of len(keys) records into the staging buffer at `boff`;
        returns their payload checksums."""
        rec, codec, shape = self.rec, self.codec, self.geometry.block_shape
        n = len(keys)
        staging = torch.frombuffer(self._buf, dtype=torch.uint8)[boff:boff + n * rec].view(n, rec)
        payloads = staging[:, ALIGN:ALIGN + codec.payload_nbytes]
        for j, b in enumerate(blocks):
            codec.encode(b.reshape(1, *shape).cpu(), payloads[j:j + 1])
        mv = memoryview(self._buf)
        sums = []
        for j, key in enumerate(keys):
            off = boff + j * rec
            sums.append(pack_header(self._buf, off, key, self.namespace, self.geometry, codec,
                                    mv[off + ALIGN:off + ALIGN + codec.payload_nbytes]))
        return sums

    def copy(self, key: BlockKey, record: memoryview) -> None:
        """Compaction: append a verified record's bytes and republish its row here."""
        self._new, self._moved = [], []
        try:
            self._room_for(len(record))
            self._buf[:len(record)] = record
            self._write_all(memoryview(self._buf)[:len(record)], self._tail)
            self._moved.append((key, self._tail))
            self._tail += len(record)
            self._publish()
        finally:
            self._new, self._moved = [], []

    @property
    def max_copy_bytes(self) -> int:
        return len(self._buf)

    def _write_all(self, data: memoryview, offset: int) -> None:
        """Sequential writes in io_unit chunks; a short write raises EIO."""
        assert self._fd is not None
        pos = 0
        while pos < len(data):
            chunk = data[pos:pos + self.io_unit]
            try:
                w = self.files.io.pwrite(self._fd, chunk, offset + pos)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.files.o_direct_active and pos == 0:
                    self._reopen_buffered()
                    w = self.files.io.pwrite(self._fd, chunk, offset + pos)
                else:
                    raise
            if w <= 0:
                raise OSError(errno.EIO, "short write")
            pos += w

    def _reopen_buffered(self) -> None:
        assert self._seg is not None and self._fd is not None
        self.files.go_buffered()
        self.files.io.close(self._fd)
        self._fd = self.files.io.open(self.files.path(self._seg), os.O_WRONLY)

    def failed(self, exc: OSError, on_read_only: Callable[[], None]) -> None:
        """After a write error: EROFS makes the store read-only, other errors retire the
        segment; after ENOSPC nothing is appended to the segment again (a partial write)."""
        if exc.errno == errno.EROFS:
            on_read_only()
        elif self._seg is not None and exc.errno != errno.ENOSPC:
            self.retire(self._seg, f"write: {exc.strerror or exc}")
        if exc.errno == errno.ENOSPC and self._seg is not None:
            self._tail = self.segment_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            try:
                self.files.io.close(self._fd)
            except OSError as exc:
                log.warning("cold_close_failed", error=str(exc))
            self._fd = None
