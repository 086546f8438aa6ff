"""`ColdStore`: one directory of append-only, checksummed segment files plus one SQLite index,
behind the `ColdTier` contract (kvcache/base.py).

The parts: the record format (`record.py`), the index (`index.py`), the segment files
(`segments.py`), the writer (`writer.py`: append, sync, then commit rows) and the batched
reader (`reader.py`). This facade adds capacity (eviction to stay under `capacity_bytes`),
TTL bookkeeping, compaction and the scrub (`upkeep.py`), and turns every storage fault into a
counted, returned outcome: `put_many` returns False for a record it could not store,
`read_into` False for one it could not read and verify. `bytes_used` is recomputed from the
index on open.

A directory that cannot be written at open (read-only, or a full disk) does not stop the
store: it opens for reading, takes no records, and says why (`unwritable`, with its `Cause`)
until `reopen` succeeds. A small reserve file (`reserve.py`) is given up when the index finds
the disk full, so that evictions and compaction can still be recorded.

Thread-safe: reads are serialized with each other (they share buffers), and so are writes;
compaction holds both.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from kvagentd.kvcache.base import (BlockInfo, BlockKey, ColdEntry, ColdListener, KVGeometry, Tier,
                                   VerifyProgress)
from kvagentd.kvcache.codec import CODECS
from kvagentd.kvcache.cold.causes import Cause, cause_of
from kvagentd.kvcache.cold.index import ColdIndex
from kvagentd.kvcache.cold.reader import SegmentReader
from kvagentd.kvcache.cold.record import DTYPE_CODES, RecordRow
from kvagentd.kvcache.cold.reserve import SpaceReserve
from kvagentd.kvcache.cold.segments import SegmentFiles
from kvagentd.kvcache.cold.upkeep import Upkeep
from kvagentd.kvcache.cold.writer import Blocks, SegmentWriter
from kvagentd.kvcache.fileio import FileIO, FileOps

log = structlog.get_logger(__name__)

_EVICT_BATCH = 256  # eviction candidates the listener is asked about at once
RESERVE_BYTES = 8 << 20  # the space reserve of a cold directory (at most capacity / 16)


class ColdStore:
    """Checksummed block records in `directory` for one `geometry` and `namespace`.

    Rows of other namespaces stay on disk (they count towards capacity and are evicted first)
    but are never returned. `codec` is used for new records; existing records decode with the
    codec named in their header. `file_io` holds the OS file operations. `io_threads`:
    sequential reads in flight per batched read (the queue depth the SSD sees), each into its
    own read buffer of `read_batch_bytes`. `listener` hears of records evicted for capacity
    (and names those that must stay). `reserve_bytes`: the space reserve (default
    min(RESERVE_BYTES, capacity / 16)).
    """

    def __init__(self, directory: str | os.PathLike[str], geometry: KVGeometry, namespace: bytes,
                 *, codec: str = "raw", capacity_bytes: int = 1 << 30,
                 segment_bytes: int = 256 << 20, io_unit_bytes: int = 128 << 10,
                 o_direct: bool = True, file_io: FileOps | None = None, ttl_s: float = 3600.0,
                 read_batch_bytes: int = 8 << 20, read_only: bool = False,
                 listener: ColdListener | None = None, io_threads: int = 1,
                 reserve_bytes: int | None = None) -> None:
        if geometry.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported KV dtype {geometry.dtype}")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.directory = Path(directory)
        self.geometry = geometry
        self.namespace = namespace
        self.codec_name = codec
        self.capacity_bytes = int(capacity_bytes)
        self.ttl_s = float(ttl_s)
        self.io: FileOps = file_io if file_io is not None else FileIO()
        self.listener = listener
        self._read_only = read_only
        self.counters = dict(reads=0, read_bytes=0, corrupt=0, missing=0, io_errors=0,
                             writes=0, write_bytes=0, write_failures=0, refused_full=0,
                             evicted=0,
                             compacted_bytes=0, retired_segments=0)
        self.last_fault: Cause | None = None  # the cause of the last failed write
        self._dir_error: tuple[str, Cause] | None = None
        try:
            self.io.makedirs(str(self.directory))
        except OSError as exc:
            self._dir_error = (f"cannot create {self.directory}: {exc.strerror or exc}",
                               cause_of(exc))
        self.files = SegmentFiles(self.directory, self.io, o_direct=o_direct)
        self.index = ColdIndex(self.directory, namespace, self.io)
        self.reserve = SpaceReserve(self.directory, self.io,
                                    reserve_bytes if reserve_bytes is not None
                                    else min(RESERVE_BYTES, self.capacity_bytes // 16))
        codec_obj = CODECS[codec](geometry)
        self.writer = SegmentWriter(self.files, self.index, geometry, namespace, codec_obj,
                                    segment_bytes=segment_bytes, io_unit_bytes=io_unit_bytes,
                                    buffer_bytes=read_batch_bytes, counters=self.counters)
        self.reader = SegmentReader(self.files, geometry, namespace,
                                    record_len=self.writer.rec, buffer_bytes=read_batch_bytes,
                                    io_threads=io_threads, counters=self.counters,
                                    on_io_error=self.writer.retire)
        self.upkeep = Upkeep(self.files, self.index, self.reader, self.writer, self.counters,
                             on_read_only=lambda: self.set_read_only(True))
        self._closed = False
        self._settle_unwritable()
        if self.unwritable is not None:
            log.error("cold_store_unwritable", directory=str(self.directory),
                      reason=self.unwritable)

    # -- properties --------------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        """Stop (True) or resume (False) writes; reads continue either way."""
        if value != self._read_only:
            log.warning("cold_read_only", directory=str(self.directory), read_only=value)
        self._read_only = bool(value)

    def set_read_only(self, flag: bool) -> None:
        self.read_only = flag

    @property
    def durable(self) -> bool:
        """A directory is taken to be on non-volatile storage (the failover pair knows when
        its stand-in is RAM)."""
        return True

    @property
    def unwritable(self) -> str | None:
        """Why this directory takes no records now (it could not be written at open), or
        None. Unlike `read_only` (wear, an operator), it ends only with `reopen`."""
        if self._dir_error is not None:
            return self._dir_error[0]
        return self.index.unwritable

    @property
    def unwritable_cause(self) -> Cause | None:
        if self._dir_error is not None:
            return self._dir_error[1]
        return self.index.unwritable_cause

    def _settle_unwritable(self) -> None:
        """At open: an index that found the disk full gets the reserve's space and one more
        try; a writable one takes the reserve if it is not held."""
        if self.unwritable_cause is Cause.NO_SPACE and self._dir_error is None \
                and self.reserve.release():
            self.index.reopen()
        if self.unwritable is None:
            self.reserve.ensure()

    def reopen(self) -> str | None:
        """Try again to make a directory that could not be written at open writable (it was
        made writable, space was freed); returns why it still cannot be, or None."""
        with self.writer.lock, self.files.read_lock:
            if self._dir_error is not None:
                try:
                    self.io.makedirs(str(self.directory))
                    self._dir_error = None
                except OSError as exc:
                    self._dir_error = (f"cannot create {self.directory}: "
                                       f"{exc.strerror or exc}", cause_of(exc))
                    return self._dir_error[0]
            if self.index.unwritable is not None:
                self.files.close_read_fds()
                self.index.reopen()
            self._settle_unwritable()
        if self.unwritable is None:
            log.warning("cold_store_writable", directory=str(self.directory))
        return self.unwritable

    @property
    def bytes_used(self) -> int:
        return self.index.bytes_used

    @property
    def record_bytes(self) -> int:
        return self.writer.rec

    @property
    def o_direct_active(self) -> bool:
        return self.files.o_direct_active

    @property
    def io_threads(self) -> int:
        return self.reader.io_threads

    # -- writing -----------------------------------------------------------------------------
    def put(self, key: BlockKey, block: torch.Tensor, *, session: str = "",
            num_tokens: int = 0) -> bool:
        return self.put_many([key], [block], session=session, num_tokens=num_tokens)[0]

    def put_many(self, keys: Sequence[BlockKey], blocks: Blocks, *, session: str = "",
                 num_tokens: int = 0) -> list[bool]:
        """Store blocks durably: write all, sync, then commit their rows. Keys already present
        are left as they are (True). False: read-only, full of records that must stay
        (`refused_full`), or an I/O error (`write_failures`)."""
        n = len(keys)
        if n == 0:
            return []
        if self._read_only or self.unwritable is not None:
            return [False] * n
        todo: list[int] = []
        with self.writer.lock:
            try:
                present = self.index.present(keys)
                todo = [i for i in range(n) if keys[i] not in present]
                if not todo:
                    return [True] * n
                if not self._make_room(len(todo) * self.writer.rec):
                    # full of records that must stay: a refusal, not a fault of the device
                    self.counters["refused_full"] += len(todo)
                    log.warning("cold_full", refused=len(todo), capacity_bytes=self.capacity_bytes,
                                reason="every record left is pinned or in use",
                                hint="raise kv.cold_capacity_bytes, or unpin blocks")
                    return [keys[i] in present for i in range(n)]
                self.writer.put(keys, blocks, todo, session=session, num_tokens=num_tokens)
            except OSError as exc:
                return self._put_failed(keys, todo, exc)
            except sqlite3.Error as exc:
                self.index.failed("put", exc)
                self.last_fault = cause_of(exc)
                return self._put_failed(keys, None, None)
        self.counters["writes"] += len(todo)
        self.counters["write_bytes"] += len(todo) * self.writer.rec
        return [True] * n

    def _put_failed(self, keys: Sequence[BlockKey], todo: list[int] | None,
                    exc: OSError | None) -> list[bool]:
        """After a failed write: what the index holds is stored, the rest failed (counted);
        their segment bytes are unindexed garbage."""
        try:
            done = self.index.present(keys)
        except sqlite3.Error:
            done = set()
        ok = [k in done for k in keys]
        failed = ok.count(False)
        self.counters["write_failures"] += failed
        if todo is not None:
            self.counters["writes"] += sum(1 for i in todo if ok[i])
        if exc is not None:
            self.last_fault = cause_of(exc)
            self.writer.failed(exc, on_read_only=lambda: self.set_read_only(True))
            log.error("cold_write_failed", errno=exc.errno, error=str(exc), blocks=failed)
        return ok

    def _make_room(self, need: int) -> bool:
        """Evict until `need` more bytes fit: other namespaces, then expired (TTL), then the
        least recently accessed, never a record the listener protects (pinned, in use).
        False when that cannot free enough (nothing is evicted then). The listener hears
        which of this namespace's records went."""
        with self.index.lock:
            if self.index.bytes_used + need <= self.capacity_bytes:
                return True
            if need > self.capacity_bytes:
                return False
            victims: list[BlockKey] = []
            free = self.capacity_bytes - self.index.bytes_used
            batch: list[tuple[BlockKey, int]] = []
            for row in self.index.eviction_order(self.ttl_s, time.time()):
                batch.append(row)
                if len(batch) < _EVICT_BATCH and free + sum(n for _, n in batch) < need:
                    continue
                free = self._take_victims(batch, victims, free, need)
                batch = []
                if free >= need:
                    break
            if batch and free < need:
                free = self._take_victims(batch, victims, free, need)
            if free < need:
                return False
            self.index.delete_rows(victims)
            self.counters["evicted"] += len(victims)
        if self.listener is not None and victims:
            self.listener.cold_evicted(victims)
        # routine once the tier is full (an LRU at capacity): counted (`evicted`, in `kvctl
        # status` and kvagentd_cold_evicted_records), not logged at info every few writes
        log.debug("cold_evicted", blocks=len(victims), need=need)
        return True

    def _take_victims(self, rows: list[tuple[BlockKey, int]], victims: list[BlockKey],
                      free: int, need: int) -> int:
        """Add the unprotected `rows` to `victims` until `need` bytes are free; returns the
        bytes free then."""
        keep = self.listener.cold_protected([k for k, _ in rows]) if self.listener else set()
        for key, length in rows:
            if free >= need:
                break
            if key in keep:
                continue
            victims.append(key)
            free += length
        return free

    # -- reading -----------------------------------------------------------------------------
    def read_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read, verify and decode each record into its CPU tensor (see `SegmentReader`)."""
        ok = [False] * len(keys)
        try:
            rows = self.index.rows(keys)
        except sqlite3.Error as exc:
            self.index.failed("read", exc)
            self.counters["io_errors"] += len(keys)
            return ok
        todo: list[tuple[int, RecordRow]] = []
        for i, k in enumerate(keys):
            r = rows.get(k)
            if r is None:
                self.counters["missing"] += 1
            else:
                todo.append((i, r))
        todo.sort(key=lambda it: (it[1].segment, it[1].offset))
        done = self.reader.read_into(todo, outs, ok)
        if done:
            self.index.defer_touch(done, time.time())
        return ok

    # -- the index -----------------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return self.index.contains(key)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """0: every record of this box's cold tier is listed by its owner at start."""
        return 0

    def offer(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], *,
              session: str = "") -> None:
        """Nothing: blocks reach this tier when the store demotes or persists them."""

    def keys(self) -> list[BlockKey]:
        return self.index.keys()

    def entries(self) -> list[ColdEntry]:
        return self.index.entries()

    def delete(self, keys: Iterable[BlockKey]) -> int:
        """Drop records from the index (space is reclaimed by `compact`). An index that
        refuses the write keeps the records (0, counted): they stay valid, only unreferenced.
        On a full disk the space reserve is given up for the index first."""
        keys = list(keys)
        try:
            return self.index.delete_rows(keys)
        except sqlite3.Error as exc:
            if cause_of(exc) is Cause.NO_SPACE and self.reserve.release():
                try:  # the reserve's space lets the index record the deletion
                    return self.index.delete_rows(keys)
                except sqlite3.Error as again:
                    exc = again
            self.index.failed("delete", exc)
            return 0

    def evict(self, keys: Sequence[BlockKey]) -> int:
        n = self.delete(keys)
        self.counters["evicted"] += n
        return n

    def expired(self, now: float | None = None) -> list[BlockKey]:
        """Keys whose TTL (refreshed on every read) has run out."""
        return self.index.expired(self.ttl_s, time.time() if now is None else now)

    def touch(self, keys: Sequence[BlockKey], now: float | None = None) -> None:
        """Refresh the TTL of records now. Never raises (a refused update is counted)."""
        self.index.defer_touch(keys, time.time() if now is None else now, flush=True)

    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        """Replace the stored session -> keys map (only keys that have a record are kept) and
        sync the index; nothing while the directory takes no writes."""
        if self.unwritable is not None:
            return
        try:
            self.index.save_refs(refs)
        except sqlite3.Error as exc:  # the previous map stays; counts may be stale
            self.index.failed("save_refs", exc)

    def load_refs(self) -> dict[str, list[BlockKey]]:
        return self.index.load_refs()

    def snapshot(self) -> list[BlockInfo]:
        refs: dict[bytes, list[str]] = {}
        for s, ks in self.load_refs().items():
            for k in ks:
                refs.setdefault(k, []).append(s)
        return [BlockInfo(k, Tier.COLD, False, False, tuple(refs.get(k, ())), la, ln)
                for k, la, ln in self.index.usage()]

    # -- maintenance ---------------------------------------------------------------------------
    def compact(self, min_dead_ratio: float = 0.5, *, rewrite: bool = True,
                max_copy_bytes: int | None = None) -> int:
        """Reclaim the space of segments whose dead share is at least `min_dead_ratio` (and
        of retired ones), rewriting their live records first, deadest first and at most about
        `max_copy_bytes` of them; without `rewrite` (or while read-only), only segments with
        nothing live go. Returns bytes reclaimed. Then takes the space reserve again if there
        is room."""
        if self._dir_error is not None:
            return 0
        try:
            reclaimed = self.upkeep.compact(
                min_dead_ratio, rewrite=rewrite and not self._read_only
                and self.index.unwritable is None, max_copy_bytes=max_copy_bytes)
        except sqlite3.Error as exc:  # a full disk: what was moved stays consistent
            self.index.failed("compact", exc)
            if cause_of(exc) is Cause.NO_SPACE:
                self.reserve.release()
            return 0
        if self.unwritable is None:
            with self.writer.lock:
                self.reserve.ensure()
        return reclaimed

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """Scrub: read and check every record of this namespace (see `Upkeep.verify`).
        `missing`: its segment file is absent or short; `corrupt`: checksum / header mismatch
        or I/O error; `moved`: records compaction moved during the pass, checked again where
        they went (a moved, valid record is neither reported nor repaired). `repair` drops
        the bad ones from the index, each only while its row still points where it was found
        bad. Rate-limited when asked."""
        return self.upkeep.verify(repair, rate_bytes_per_s, progress)

    def stats(self) -> dict[str, Any]:
        n = self.index.count()
        segs, disk = self.index.segment_counts()
        used = self.index.bytes_used
        return {"directory": str(self.directory), "blocks": n, "bytes_used": used,
                "live_bytes": used, "dead_bytes": max(0, disk - used), "disk_bytes": disk,
                "capacity_bytes": self.capacity_bytes, "codec": self.codec_name,
                "read_only": self._read_only, "o_direct": self.files.o_direct_active,
                "segments": segs, **self.counters, "index_errors": self.index.errors,
                "touch_dropped": self.index.touch_dropped, "unwritable": self.unwritable,
                "unwritable_cause": c.value if (c := self.unwritable_cause) else None,
                "last_fault": self.last_fault.value if self.last_fault else None,
                "reserve_bytes": self.reserve.held, "reserve_released": self.reserve.released}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.writer.lock, self.files.read_lock:
            self.reader.close()
            self.writer.close()
            self.files.close_read_fds()
            self.index.close()
