"""The cold tier: append-only, checksummed segment files plus one SQLite index.

On-disk format (format version 1). A directory holds `index.sqlite3` (WAL) and segment files
`seg-NNNNNNNN.kvs`. A segment is a sequence of records; each record is a 4096-byte header area
followed by the payload padded to 4096 bytes, so every record can be read with O_DIRECT:

  header (little-endian): magic "KVBR" | format u16 | codec u8 | dtype u8 | ndim u8 | pad u8 |
                          shape 5 x u32 | key 16s | namespace 16s | payload_len u64 |
                          payload xxh3_64 u64 | header xxh3_64 u64 (of everything before it)

Crash consistency: a batch of records is written sequentially in `io_unit_bytes` chunks and
synced, and only then are its index rows committed. The index is authoritative: a record
without a row is garbage (a torn tail), never served. A new process always appends to a new
segment, so torn tails are never overwritten or read. `bytes_used` is recomputed from the index
on open. Every read verifies header and payload checksums; a failure returns False and is
counted, and a segment that produced an I/O error is retired (never written again).

The index shares the disk: a full or failing disk surfaces as `sqlite3.Error`. An index write
that fails rolls its transaction back and the put returns False (a counted write failure);
last-access updates of reads are deferred and batched, and dropped (counted) when they cannot
be written, so they never fail a read of a record that verified.

Nothing in a record is deserialized with pickle or `torch.load`: a tampered file can fail a
checksum, never execute code.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import sqlite3
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import structlog
import torch
import xxhash

from kvagentd.kvcache.base import BlockInfo, BlockKey, ColdBackend, KVGeometry, Tier
from kvagentd.kvcache.codec import CODEC_BY_ID, CODECS, Codec, CodecId
from kvagentd.kvcache.fileio import FileIO

log = structlog.get_logger(__name__)

MAGIC = b"KVBR"
FORMAT_VERSION = 1
ALIGN = 4096
_HDR = struct.Struct("<4sHBBBB5I16s16sQQ")
_HDR_SUM = struct.Struct("<Q")
HEADER_BYTES = _HDR.size + _HDR_SUM.size  # padded to ALIGN on disk
DIRECT_RUN_BYTES = 16 << 20   # one read call for up to this many bytes of adjacent raw records
DIRECT_RUN_RECORDS = 300      # and at most this many records (3 iovecs each, IOV_MAX 1024)
TOUCH_BATCH = 4096            # deferred last-access updates written together ...
TOUCH_EVERY_S = 1.0           # ... or after this long

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPE_BY_CODE = {v: k for k, v in DTYPE_CODES.items()}

_SCHEMA = """
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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _signed64(x: int) -> int:
    """SQLite integers are signed 64-bit."""
    return x - (1 << 64) if x >= (1 << 63) else x


class _Row(NamedTuple):
    key: bytes
    segment: int
    offset: int
    length: int
    payload_len: int
    checksum: int


class ColdStore(ColdBackend):
    """Checksummed block records in `directory` for one `geometry` and `namespace`.

    Rows of other namespaces stay on disk (they count towards capacity and are evicted first)
    but are never returned. `codec` is used for new records; existing records decode with the
    codec named in their header. `file_io` holds the OS file operations (see `FileIO`).
    `io_threads`: sequential reads in flight per batched read (the queue depth the SSD sees),
    each into its own read buffer of `read_batch_bytes`.
    Thread-safe; reads are serialized with each other and so are writes.
    """

    def __init__(self, directory: str | os.PathLike[str], geometry: KVGeometry, namespace: bytes,
                 *, codec: str = "raw", capacity_bytes: int = 1 << 30,
                 segment_bytes: int = 256 << 20, io_unit_bytes: int = 128 << 10,
                 o_direct: bool = True, file_io: FileIO | None = None, ttl_s: float = 3600.0,
                 read_batch_bytes: int = 8 << 20, read_only: bool = False,
                 on_evict: Callable[[list[BlockKey]], None] | None = None,
                 io_threads: int = 1) -> None:
        if geometry.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported KV dtype {geometry.dtype}")
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}")
        self.directory = Path(directory)
        self.geometry = geometry
        self.namespace = namespace
        self.codec_name = codec
        self.capacity_bytes = int(capacity_bytes)
        self.segment_bytes = int(segment_bytes)
        self.io_unit = max(ALIGN, _align(int(io_unit_bytes)))
        self.ttl_s = float(ttl_s)
        self.io = file_io or FileIO()
        self.on_evict = on_evict
        self._read_only = read_only
        self._codecs: dict[int, Codec] = {}
        self._codec = self._codec_for(CODECS[codec].id)
        self._rec_len = {cid: ALIGN + _align(self._codec_for(cid).payload_nbytes)
                         for cid in (self._codec.id,)}
        self._o_direct_wanted = o_direct and FileIO.O_DIRECT != 0
        self.o_direct_active = self._o_direct_wanted
        self._lock = threading.RLock()        # index + counters
        self._write_lock = threading.Lock()   # write staging, active segment
        self._read_lock = threading.Lock()    # read staging, read fds
        self.io.makedirs(str(self.directory))
        self._db = self._open_index()
        rec = self._rec_len[self._codec.id]
        # two halves: one is written while the next batch is encoded into the other
        self._whalf = max(self.io_unit, rec * max(1, read_batch_bytes // rec))
        self._wbuf = mmap.mmap(-1, 2 * self._whalf)
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-cold-write")
        rb = max(rec, _align(read_batch_bytes))
        # `io_threads` reads in flight, one more buffer being verified / decoded
        self.io_threads = max(1, int(io_threads))
        self._rbufs = [mmap.mmap(-1, rb) for _ in range(self.io_threads + 1)]
        self._read_pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kv-cold-read")
        self._fd_lock = threading.Lock()
        self._rfds: dict[int, int] = {}
        self._wfd: int | None = None
        self._wseg: int | None = None
        self._wtail = 0
        self._retired: set[int] = set()
        self.counters = dict(reads=0, read_bytes=0, corrupt=0, missing=0, io_errors=0,
                             writes=0, write_bytes=0, write_failures=0, evicted=0,
                             compacted_bytes=0, retired_segments=0, index_errors=0,
                             touch_dropped=0)
        self._touch_pending: dict[bytes, float] = {}
        self._touch_flushed = time.monotonic()
        with self._lock:
            self._db.execute("UPDATE segments SET state='sealed' WHERE state='active'")
            self._bytes_used = self._db.execute(
                "SELECT COALESCE(SUM(length), 0) FROM blocks").fetchone()[0]
        self._closed = False

    def _open_index(self) -> sqlite3.Connection:
        """Open (or create) the index. An unreadable index is set aside, not trusted: the
        store starts empty and the old segments are garbage (costs recomputation, never
        wrong KV)."""
        path = self.directory / "index.sqlite3"
        for attempt in range(2):
            db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(_SCHEMA)
                db.execute("SELECT COUNT(*) FROM blocks").fetchone()
                if attempt:
                    self._discard_old_segments(db)
                return db
            except sqlite3.DatabaseError as exc:
                db.close()
                if attempt:
                    raise
                aside = path.with_name(f"index.sqlite3.corrupt-{int(time.time())}")
                log.error("cold_index_unreadable", path=str(path), error=str(exc), moved_to=str(aside))
                for suffix in ("", "-wal", "-shm"):
                    src = Path(str(path) + suffix)
                    if src.exists():
                        self.io.rename(str(src), str(aside) + suffix)
        raise AssertionError("unreachable")

    def _discard_old_segments(self, db: sqlite3.Connection) -> None:
        """After starting a new index: old segment files are unindexed garbage; remove them."""
        for p in self.directory.glob("seg-*.kvs"):
            try:
                self.io.unlink(str(p))
            except OSError as exc:
                log.warning("cold_unlink_failed", path=str(p), error=str(exc))

    # -- small helpers ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _txn(self):
        """One index transaction (caller holds _lock): committed, or rolled back when a
        statement fails, and the error re-raised."""
        self._db.execute("BEGIN")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.Error as exc:
                    log.error("cold_index_rollback_failed", error=str(exc))
            raise

    def _index_failed(self, what: str, exc: sqlite3.Error) -> None:
        self.counters["index_errors"] += 1
        log.error("cold_index_failed", op=what, error=str(exc), directory=str(self.directory))

    def _codec_for(self, cid: int) -> Codec:
        c = self._codecs.get(cid)
        if c is None:
            c = self._codecs[cid] = CODEC_BY_ID[cid](self.geometry)
        return c

    def _seg_path(self, seg: int) -> str:
        return str(self.directory / f"seg-{seg:08d}.kvs")

    def _open(self, path: str, flags: int) -> int:
        """Open with O_DIRECT when wanted, falling back to buffered I/O where refused."""
        if self._o_direct_wanted and self.o_direct_active:
            try:
                return self.io.open(path, flags | FileIO.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("cold_o_direct_refused", directory=str(self.directory))
                self.o_direct_active = False
        return self.io.open(path, flags)

    @property
    def read_only(self) -> bool:
        return self._read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        """Stop (True) or resume (False) writes; reads continue either way."""
        if value != self._read_only:
            log.warning("cold_read_only", directory=str(self.directory), read_only=value)
        self._read_only = bool(value)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes_used

    # -- writing ---------------------------------------------------------------------------
    def _roll_segment(self) -> None:
        """Seal the active segment and start a new one (caller holds _write_lock)."""
        if self._wfd is not None:
            self.io.close(self._wfd)
            self._wfd = None
            with self._lock:
                self._db.execute("UPDATE segments SET state='sealed' WHERE id=? AND state='active'",
                                 (self._wseg,))
            self._wseg = None
        with self._lock:
            seg = self._db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM segments").fetchone()[0]
            self._db.execute("INSERT INTO segments (id, state, size) VALUES (?, 'active', 0)", (seg,))
        path = self._seg_path(seg)
        self._wfd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.io.fsync_dir(str(self.directory))
        self._wseg, self._wtail = seg, 0

    def _retire(self, seg: int, reason: str) -> None:
        """Never write `seg` again; the writer rolls to a new segment before its next write."""
        with self._lock:
            self._retired.add(seg)
            try:
                cur = self._db.execute(
                    "UPDATE segments SET state='retired' WHERE id=? AND state!='retired'", (seg,))
            except sqlite3.Error as exc:  # retired in memory; the next open seals it anyway
                self._index_failed("retire", exc)
                return
            if cur.rowcount:
                self.counters["retired_segments"] += 1
                log.error("cold_segment_retired", segment=seg, reason=reason)

    def put(self, key: BlockKey, block: torch.Tensor, *, session: str = "", num_tokens: int = 0) -> bool:
        return self.put_many([key], [block], session=session, num_tokens=num_tokens)[0]

    def put_many(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor,
                 *, session: str = "", num_tokens: int = 0) -> list[bool]:
        """Store blocks durably: write all, sync once, then commit the index rows in one
        transaction. Keys already present are left as they are (True). False: read-only,
        full, or an I/O error (counted)."""
        n = len(keys)
        if n == 0:
            return []
        if self._read_only:
            return [False] * n
        with self._write_lock:
            try:
                return self._put_locked(keys, blocks, session, num_tokens)
            except sqlite3.Error as exc:
                return self._put_index_failed(exc, keys)

    def _put_index_failed(self, exc: sqlite3.Error, keys: Sequence[BlockKey]) -> list[bool]:
        """The index refused a write (disk full or failing): rows not committed are failed
        puts; their segment bytes are unindexed garbage. Caller holds _write_lock."""
        self._index_failed("put", exc)
        try:
            done = set(self._rows(keys))
        except sqlite3.Error:
            done = set()
        ok = [k in done for k in keys]
        self.counters["write_failures"] += ok.count(False)
        return ok

    def _put_locked(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor,
                    session: str, num_tokens: int) -> list[bool]:
        """`put_many` with _write_lock held; index errors raise (sqlite3.Error)."""
        n = len(keys)
        codec = self._codec
        rec = self._rec_len[codec.id]
        with self._lock:
            present = set()
            for i in range(0, n, 500):
                part = list(keys[i:i + 500])
                present.update(r[0] for r in self._db.execute(
                    f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(part))})", part))
        todo = [i for i in range(n) if keys[i] not in present]
        ok = [True] * n
        if not todo:
            return ok
        if not self._make_room(len(todo) * rec):
            for i in todo:
                ok[i] = False
            self.counters["write_failures"] += len(todo)
            return ok
        rows: list[tuple] = []
        now = time.time()
        per_buf = max(1, self._whalf // rec)
        pending = None
        if codec.id == CodecId.RAW and all(self._direct_src_ok(blocks[i]) for i in todo):
            try:
                self._put_direct(keys, blocks, todo, rec, rows, session, num_tokens, now)
            except OSError as exc:
                return self._write_failed(exc, keys, todo, rows, ok)
            self.counters["writes"] += len(todo)
            self.counters["write_bytes"] += len(todo) * rec
            return ok
        try:
            for ci, start in enumerate(range(0, len(todo), per_buf)):
                chunk = todo[start:start + per_buf]
                if self._wfd is None or self._wseg in self._retired \
                        or self._wtail + len(chunk) * rec > self.segment_bytes:
                    if pending is not None:
                        pending.result()
                        pending = None
                    if rows:
                        self.io.fsync(self._wfd)
                        self._commit_rows(rows)
                        rows = []
                    self._roll_segment()
                seg, base, boff = self._wseg, self._wtail, (ci % 2) * self._whalf
                sums = self._encode_records(codec, [keys[i] for i in chunk],
                                            [blocks[i] for i in chunk], boff)
                if pending is not None:
                    pending.result()
                pending = self._write_pool.submit(
                    self._write_all, memoryview(self._wbuf)[boff:boff + len(chunk) * rec], base)
                for j, i in enumerate(chunk):
                    rows.append((keys[i], self.namespace, seg, base + j * rec, rec,
                                 codec.payload_nbytes, _signed64(sums[j]), codec.name,
                                 FORMAT_VERSION, session, num_tokens, now, now))
                self._wtail = base + len(chunk) * rec
            if pending is not None:
                pending.result()
                pending = None
            if rows:
                self.io.fsync(self._wfd)
                self._commit_rows(rows)
        except OSError as exc:
            if pending is not None:  # never reuse the buffer under a write in flight
                try:
                    pending.result()
                except OSError as late:
                    log.debug("cold_write_also_failed", error=str(late))
            return self._write_failed(exc, keys, todo, rows, ok)
        self.counters["writes"] += len(todo)
        self.counters["write_bytes"] += len(todo) * rec
        return ok

    def _direct_src_ok(self, block: torch.Tensor) -> bool:
        """A raw block can be written from its own memory (no staging copy)."""
        if block.device.type != "cpu" or block.dtype != self.geometry.dtype \
                or not block.is_contiguous() or block.numel() != self.geometry.block_numel:
            return False
        if self.geometry.block_bytes % ALIGN:
            return False
        return not self.o_direct_active or block.data_ptr() % ALIGN == 0

    def _put_direct(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], todo: list[int],
                    rec: int, rows: list[tuple], session: str, num_tokens: int, now: float) -> None:
        """Raw records written straight from the blocks' memory: header, then the payload in
        io_unit writes; one sync per segment, then the index rows. Caller holds _write_lock."""
        codec = self._codec
        hdr = memoryview(self._wbuf)[:ALIGN]
        for i in todo:
            if self._wfd is None or self._wseg in self._retired \
                    or self._wtail + rec > self.segment_bytes:
                if rows:
                    self.io.fsync(self._wfd)
                    self._commit_rows(rows)
                    rows.clear()
                self._roll_segment()
            payload = memoryview(blocks[i].reshape(-1).view(torch.uint8).numpy())
            csum = self._pack_header(0, keys[i], codec, payload)
            self._write_all(hdr, self._wtail)
            self._write_all(payload, self._wtail + ALIGN)
            rows.append((keys[i], self.namespace, self._wseg, self._wtail, rec, codec.payload_nbytes,
                         _signed64(csum), codec.name, FORMAT_VERSION, session, num_tokens, now, now))
            self._wtail += rec
        if rows:
            self.io.fsync(self._wfd)
            self._commit_rows(rows)
            rows.clear()

    def _pack_header(self, off: int, key: BlockKey, codec: Codec, payload: memoryview) -> int:
        """Write a record header at `_wbuf[off:]`; returns the payload checksum."""
        shape = list(self.geometry.block_shape) + [0] * (5 - len(self.geometry.block_shape))
        csum = xxhash.xxh3_64_intdigest(payload)
        _HDR.pack_into(self._wbuf, off, MAGIC, FORMAT_VERSION, codec.id,
                       DTYPE_CODES[self.geometry.dtype], len(self.geometry.block_shape), 0,
                       *shape, key, self.namespace, codec.payload_nbytes, csum)
        mv = memoryview(self._wbuf)
        _HDR_SUM.pack_into(self._wbuf, off + _HDR.size, xxhash.xxh3_64_intdigest(mv[off:off + _HDR.size]))
        return csum

    def _write_failed(self, exc: OSError, keys: Sequence[BlockKey], todo: list[int],
                      rows: list[tuple], ok: list[bool]) -> list[bool]:
        committed = set()
        with self._lock:
            for i in todo:
                if self._db.execute("SELECT 1 FROM blocks WHERE key=?", (keys[i],)).fetchone():
                    committed.add(i)
        for i in todo:
            ok[i] = i in committed
        failed = len(todo) - len(committed)
        self.counters["write_failures"] += failed
        self.counters["writes"] += len(committed)
        if exc.errno == errno.EROFS:
            self.read_only = True
        elif self._wseg is not None and exc.errno != errno.ENOSPC:
            self._retire(self._wseg, f"write: {exc.strerror or exc}")
        if exc.errno == errno.ENOSPC and self._wseg is not None:
            self._wtail = self.segment_bytes  # never append after a partial write
        log.error("cold_write_failed", errno=exc.errno, error=str(exc), blocks=failed)
        return ok

    def _encode_records(self, codec: Codec, keys: Sequence[BlockKey],
                        blocks: Sequence[torch.Tensor], boff: int = 0) -> list[int]:
        """Encode headers and payloads of len(keys) records into the write staging buffer
        at byte offset `boff`."""
        rec = self._rec_len[codec.id]
        n = len(keys)
        staging = torch.frombuffer(self._wbuf, dtype=torch.uint8)[boff:boff + n * rec].view(n, rec)
        payloads = staging[:, ALIGN:ALIGN + codec.payload_nbytes]
        if isinstance(blocks, torch.Tensor) and blocks.dim() == len(self.geometry.block_shape) + 1:
            codec.encode(blocks.cpu(), payloads)
        else:
            for j, b in enumerate(blocks):
                codec.encode(b.reshape(1, *self.geometry.block_shape).cpu(), payloads[j:j + 1])
        mv = memoryview(self._wbuf)
        sums = []
        for j, key in enumerate(keys):
            off = boff + j * rec
            sums.append(self._pack_header(off, key, codec, mv[off + ALIGN:off + ALIGN + codec.payload_nbytes]))
        return sums

    def _write_all(self, data: memoryview, offset: int) -> None:
        """Sequential writes in io_unit chunks; a short write raises EIO."""
        pos = 0
        while pos < len(data):
            chunk = data[pos:pos + self.io_unit]
            try:
                w = self.io.pwrite(self._wfd, chunk, offset + pos)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.o_direct_active and pos == 0:
                    self._reopen_buffered()
                    w = self.io.pwrite(self._wfd, chunk, offset + pos)
                else:
                    raise
            if w <= 0:
                raise OSError(errno.EIO, "short write")
            pos += w

    def _reopen_buffered(self) -> None:
        log.warning("cold_o_direct_refused", directory=str(self.directory))
        self.o_direct_active = False
        self.io.close(self._wfd)
        self._wfd = self.io.open(self._seg_path(self._wseg), os.O_WRONLY)
        with self._read_lock:
            for fd in self._rfds.values():
                self.io.close(fd)
            self._rfds.clear()

    def _commit_rows(self, rows: list[tuple]) -> None:
        with self._lock, self._txn():
            self._db.executemany(
                "INSERT OR REPLACE INTO blocks (key, namespace, segment, offset, length, "
                "payload_len, checksum, codec, version, session, tokens, created, last_access) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            self._db.execute("UPDATE segments SET size=? WHERE id=?", (self._wtail, self._wseg))
        with self._lock:
            self._bytes_used += sum(r[4] for r in rows)

    def _make_room(self, need: int) -> bool:
        """Evict until `need` more bytes fit: other namespaces, then expired (TTL), then oldest."""
        with self._lock:
            if self._bytes_used + need <= self.capacity_bytes:
                return True
            if need > self.capacity_bytes:
                return False
            self._flush_touches()
            now = time.time()
            cur = self._db.execute(
                "SELECT key, length, namespace FROM blocks ORDER BY (namespace != ?) DESC, "
                "(last_access + ? < ?) DESC, last_access ASC", (self.namespace, self.ttl_s, now))
            victims, free = [], self.capacity_bytes - self._bytes_used
            for key, length, ns in cur:
                if free >= need:
                    break
                victims.append(key)
                free += length
            ours = [k for k in victims]
            self._delete_rows(ours)
            self.counters["evicted"] += len(ours)
        if self.on_evict is not None and ours:
            self.on_evict(ours)
        log.info("cold_evicted", blocks=len(ours), need=need)
        return True

    # -- reading ---------------------------------------------------------------------------
    def _rows(self, keys: Sequence[BlockKey]) -> dict[bytes, _Row]:
        out: dict[bytes, _Row] = {}
        with self._lock:
            for i in range(0, len(keys), 500):
                part = list(keys[i:i + 500])
                for r in self._db.execute(
                        "SELECT key, segment, offset, length, payload_len, checksum FROM blocks "
                        f"WHERE namespace=? AND key IN ({','.join('?' * len(part))})",
                        [self.namespace, *part]):
                    out[r[0]] = _Row(r[0], r[1], r[2], r[3], r[4], r[5] & ((1 << 64) - 1))
        return out

    def _rfd(self, seg: int) -> int:
        with self._fd_lock:  # read threads may ask for the same segment at once
            fd = self._rfds.get(seg)
            if fd is None:
                fd = self._rfds[seg] = self._open(self._seg_path(seg), os.O_RDONLY)
            return fd

    def _runs(self, rows: list[tuple[int, _Row]],
              direct: dict[int, bool] | None = None) -> list[list[tuple[int, _Row]]]:
        """Group rows (sorted by segment, offset) into runs of adjacent records read with one
        call. Staged runs fit a read buffer; direct runs (payloads straight into their
        tensors) only need their headers to fit, up to DIRECT_RUN_BYTES."""
        cap = len(self._rbufs[0])
        direct = direct or {}
        runs: list[list[tuple[int, _Row]]] = []
        for item in rows:
            i, r = item
            if runs:
                li, last = runs[-1][-1]
                first = runs[-1][0][1]
                d = direct.get(i, False)
                if (r.segment == last.segment and r.offset == last.offset + last.length
                        and d == direct.get(li, False)):
                    span = r.offset + r.length - first.offset
                    if (not d and span <= cap) or (d and span <= DIRECT_RUN_BYTES
                                                   and (len(runs[-1]) + 1) * ALIGN <= cap
                                                   and len(runs[-1]) < DIRECT_RUN_RECORDS):
                        runs[-1].append(item)
                        continue
            runs.append([item])
        return runs

    def _direct_ok(self, r: _Row, out: torch.Tensor) -> bool:
        """A raw record can be read straight into `out` (no bounce buffer, no decode)."""
        if r.payload_len != self.geometry.block_bytes or out.device.type != "cpu" \
                or out.dtype != self.geometry.dtype or not out.is_contiguous():
            return False
        return not self.o_direct_active or (out.data_ptr() % ALIGN == 0 and r.payload_len % ALIGN == 0)

    def _read_run(self, run: list[tuple[int, _Row]], buf: mmap.mmap,
                  outs: Sequence[torch.Tensor] | None = None) -> int | OSError:
        """One sequential read of a run of adjacent records: into `buf`, or, with `outs`,
        headers (and padding) into `buf` and each payload straight into its tensor."""
        first, last = run[0][1], run[-1][1]
        length = last.offset + last.length - first.offset
        mv = memoryview(buf)
        if outs is None:
            iov = [mv[:length]]
        else:
            iov, hoff = [], 0
            for i, r in run:
                pad = r.length - ALIGN - r.payload_len
                iov.append(mv[hoff:hoff + ALIGN])
                iov.append(memoryview(outs[i].view(-1).view(torch.uint8).numpy()))
                if pad:
                    iov.append(mv[hoff + ALIGN:hoff + ALIGN + pad])
                hoff += ALIGN + pad
        try:
            fd = self._rfd(first.segment)
            got = self.io.preadv(fd, iov, first.offset)
        except OSError as exc:
            return exc
        return got

    def read_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read, verify and decode each record into its CPU tensor. Adjacent records are read
        with one large sequential read (raw records land directly in their tensors); the next
        read overlaps verifying / decoding the previous one."""
        ok = [False] * len(keys)
        try:
            rows = self._rows(keys)
        except sqlite3.Error as exc:
            self._index_failed("read", exc)
            self.counters["io_errors"] += len(keys)
            return ok
        todo = []
        for i, k in enumerate(keys):
            r = rows.get(k)
            if r is None:
                self.counters["missing"] += 1
            else:
                todo.append((i, r))
        todo.sort(key=lambda it: (it[1].segment, it[1].offset))
        done: list[bytes] = []
        with self._read_lock:
            eligible = {i: self._direct_ok(r, outs[i]) for i, r in todo}
            runs = self._runs(todo, eligible)
            direct = [eligible[run[0][0]] for run in runs]

            nbuf, depth = len(self._rbufs), len(self._rbufs) - 1

            def submit(ri: int):
                return self._read_pool.submit(self._read_run, runs[ri], self._rbufs[ri % nbuf],
                                              outs if direct[ri] else None)

            # runs ri+1 .. ri+depth are read while run ri is verified; a buffer is reused
            # only after its run was consumed
            futs = collections.deque(submit(ri) for ri in range(min(depth, len(runs))))
            try:
                for ri, run in enumerate(runs):
                    got = futs.popleft().result()
                    buf = self._rbufs[ri % nbuf]
                    if ri + depth < len(runs):
                        futs.append(submit(ri + depth))
                    if isinstance(got, OSError):
                        self.counters["io_errors"] += len(run)
                        log.error("cold_read_failed", segment=run[0][1].segment, error=str(got))
                        if got.errno == errno.ENOENT:
                            self.counters["missing"] += len(run)
                        else:
                            self._retire(run[0][1].segment, f"read: {got.strerror or got}")
                        continue
                    base, hoff = run[0][1].offset, 0
                    for i, r in run:
                        if r.offset - base + r.length > got:
                            self.counters["missing"] += 1
                            log.error("cold_record_short", key=r.key.hex(), segment=r.segment)
                            continue
                        if direct[ri]:
                            good = self._verify_direct(buf, hoff, r, outs[i])
                            hoff += r.length - r.payload_len
                        else:
                            good = self._verify_decode(buf, r.offset - base, r, outs[i])
                        if good:
                            ok[i] = True
                            done.append(r.key)
                            self.counters["reads"] += 1
                            self.counters["read_bytes"] += r.length
            finally:  # never leave a read in flight into a buffer the next call reuses
                wait(futs)
        if done:
            self._defer_touch(done, time.time())
        return ok

    def _check_record(self, buf: mmap.mmap, off: int, r: _Row,
                      payload: memoryview | None = None) -> tuple[int, tuple] | str:
        """Header fields of a record at `buf[off:]` after all checks, or why it failed.
        `payload`: where the payload was read to, when not right after the header in `buf`."""
        mv = memoryview(buf)
        h = _HDR.unpack_from(buf, off)
        if h[0] != MAGIC or h[1] != FORMAT_VERSION:
            return "bad magic or format"
        if _HDR_SUM.unpack_from(buf, off + _HDR.size)[0] != xxhash.xxh3_64_intdigest(mv[off:off + _HDR.size]):
            return "header checksum"
        cid, dcode, ndim = h[2], h[3], h[4]
        shape = tuple(h[6:6 + ndim])
        key, ns, plen, psum = h[11], h[12], h[13], h[14]
        if key != r.key or ns != self.namespace:
            return "key or namespace mismatch"
        if cid not in CODEC_BY_ID or DTYPE_BY_CODE.get(dcode) != self.geometry.dtype \
                or shape != self.geometry.block_shape:
            return "codec, dtype or shape mismatch"
        if plen != self._codec_for(cid).payload_nbytes or plen != r.payload_len \
                or ALIGN + plen > r.length:
            return "payload length"
        if payload is None:
            payload = mv[off + ALIGN:off + ALIGN + plen]
        elif cid != CodecId.RAW:
            return "codec mismatch"
        if psum != r.checksum or xxhash.xxh3_64_intdigest(payload) != psum:
            return "payload checksum"
        return cid, h

    def _verify_direct(self, buf: mmap.mmap, hoff: int, r: _Row, out: torch.Tensor) -> bool:
        res = self._check_record(buf, hoff, r, memoryview(out.view(-1).view(torch.uint8).numpy()))
        if isinstance(res, str):
            self.counters["corrupt"] += 1
            log.error("cold_checksum_failed", key=r.key.hex(), segment=r.segment, reason=res)
            return False
        return True

    def _verify_decode(self, buf: mmap.mmap, off: int, r: _Row, out: torch.Tensor) -> bool:
        res = self._check_record(buf, off, r)
        if isinstance(res, str):
            self.counters["corrupt"] += 1
            log.error("cold_checksum_failed", key=r.key.hex(), segment=r.segment, reason=res)
            return False
        codec = self._codec_for(res[0])
        payload = torch.frombuffer(buf, dtype=torch.uint8, offset=off + ALIGN,
                                   count=codec.payload_nbytes).view(1, -1)
        codec.decode(payload, out.view(1, *self.geometry.block_shape))
        return True

    # -- index queries ---------------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM blocks WHERE key=? AND namespace=?",
                                    (key, self.namespace)).fetchone() is not None

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return [r[0] for r in self._db.execute(
                "SELECT key FROM blocks WHERE namespace=? ORDER BY segment, offset", (self.namespace,))]

    def entries(self) -> list[tuple[BlockKey, float, str]]:
        """(key, last_access, session) of this namespace's records, in disk order."""
        with self._lock:
            self._flush_touches()
            return list(self._db.execute(
                "SELECT key, last_access, session FROM blocks WHERE namespace=? "
                "ORDER BY segment, offset", (self.namespace,)))

    def _delete_rows(self, keys: Sequence[BlockKey]) -> int:
        """Caller holds _lock; raises sqlite3.Error (rolled back, nothing deleted)."""
        n = freed = 0
        with self._txn():
            for k in keys:
                row = self._db.execute("SELECT length FROM blocks WHERE key=?", (k,)).fetchone()
                if row is not None:
                    self._db.execute("DELETE FROM blocks WHERE key=?", (k,))
                    self._db.execute("DELETE FROM refs WHERE key=?", (k,))
                    freed += row[0]
                    n += 1
        self._bytes_used -= freed
        for k in keys:
            self._touch_pending.pop(k, None)
        return n

    def delete(self, keys: Iterable[BlockKey]) -> int:
        """Drop records from the index (space is reclaimed by `compact`). An index that
        refuses the write keeps the records (0, counted): they stay valid, only unreferenced."""
        with self._lock:
            try:
                return self._delete_rows(list(keys))
            except sqlite3.Error as exc:
                self._index_failed("delete", exc)
                return 0

    def evict(self, keys: Sequence[BlockKey]) -> int:
        n = self.delete(keys)
        self.counters["evicted"] += n
        return n

    def expired(self, now: float | None = None) -> list[BlockKey]:
        """Keys whose TTL (refreshed on every read) has run out."""
        now = time.time() if now is None else now
        with self._lock:
            self._flush_touches()
            return [r[0] for r in self._db.execute(
                "SELECT key FROM blocks WHERE namespace=? AND last_access + ? < ?",
                (self.namespace, self.ttl_s, now))]

    def touch(self, keys: Sequence[BlockKey], now: float | None = None) -> None:
        """Refresh the TTL of records (an access that did not need a read), now. Never
        raises: an update the index refuses is dropped and counted."""
        self._defer_touch(keys, time.time() if now is None else now, flush=True)

    def _defer_touch(self, keys: Sequence[BlockKey], now: float, flush: bool = False) -> None:
        """Queue last-access updates; written in one transaction per TOUCH_BATCH keys or
        TOUCH_EVERY_S, and before anything that reads last_access (expiry, eviction)."""
        with self._lock:
            for k in keys:
                self._touch_pending[k] = now
            if flush or len(self._touch_pending) >= TOUCH_BATCH \
                    or time.monotonic() - self._touch_flushed >= TOUCH_EVERY_S:
                self._flush_touches()

    def _flush_touches(self) -> None:
        """Write the queued last-access updates (caller may hold _lock). A failed write drops
        them (counted in `touch_dropped`): the cost is an earlier TTL expiry, never a read."""
        with self._lock:
            pending, self._touch_pending = self._touch_pending, {}
            self._touch_flushed = time.monotonic()
            if not pending:
                return
            try:
                with self._txn():
                    self._db.executemany("UPDATE blocks SET last_access=? WHERE key=?",
                                         [(t, k) for k, t in pending.items()])
            except sqlite3.Error as exc:
                self.counters["touch_dropped"] += len(pending)
                log.warning("cold_touch_dropped", blocks=len(pending), error=str(exc))

    # -- session references (persisted so that per-session counts survive a restart) -------
    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        """Replace the stored session -> keys map (only keys that have a record are kept)."""
        with self._lock:
            try:
                with self._txn():
                    self._db.execute("DELETE FROM refs")
                    self._db.executemany(
                        "INSERT OR IGNORE INTO refs (session, key) SELECT ?, key FROM blocks "
                        "WHERE key=?", [(s, k) for s, ks in refs.items() for k in ks])
            except sqlite3.Error as exc:  # the previous map stays; counts may be stale
                self._index_failed("save_refs", exc)

    def load_refs(self) -> dict[str, list[BlockKey]]:
        out: dict[str, list[BlockKey]] = {}
        with self._lock:
            for s, k in self._db.execute(
                    "SELECT r.session, r.key FROM refs r JOIN blocks b ON b.key = r.key "
                    "WHERE b.namespace=?", (self.namespace,)):
                out.setdefault(s, []).append(k)
        return out

    def snapshot(self) -> list[BlockInfo]:
        refs: dict[bytes, list[str]] = {}
        for s, ks in self.load_refs().items():
            for k in ks:
                refs.setdefault(k, []).append(s)
        with self._lock:
            self._flush_touches()
            rows = list(self._db.execute(
                "SELECT key, last_access, length FROM blocks WHERE namespace=?", (self.namespace,)))
        return [BlockInfo(k, Tier.COLD, False, False, tuple(refs.get(k, ())), la, ln)
                for k, la, ln in rows]

    # -- maintenance -----------------------------------------------------------------------
    def compact(self, min_dead_ratio: float = 0.5) -> int:
        """Rewrite the live records of non-active segments whose dead share is at least
        `min_dead_ratio` (and of retired segments) into the active segment, then delete those
        files. Returns bytes reclaimed. Unreadable records are dropped and counted."""
        reclaimed = 0
        with self._write_lock, self._read_lock:
            try:
                with self._lock:
                    segs = list(self._db.execute(
                        "SELECT s.id, s.state, s.size, COALESCE(SUM(b.length), 0) FROM segments s "
                        "LEFT JOIN blocks b ON b.segment = s.id WHERE s.state != 'active' GROUP BY s.id"))
                for seg, state, size, live in segs:
                    if state != "retired" and size and (size - live) / size < min_dead_ratio:
                        continue
                    if live and self._read_only:
                        continue
                    if live and not self._move_live(seg):
                        continue
                    fd = self._rfds.pop(seg, None)
                    if fd is not None:
                        self.io.close(fd)
                    try:
                        reclaimed += self.io.size(self._seg_path(seg))
                        self.io.unlink(self._seg_path(seg))
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        log.warning("cold_unlink_failed", segment=seg, error=str(exc))
                        continue
                    with self._lock:
                        self._db.execute("DELETE FROM segments WHERE id=?", (seg,))
            except sqlite3.Error as exc:  # a full disk: what was moved stays consistent
                self._index_failed("compact", exc)
        self.counters["compacted_bytes"] += reclaimed
        return reclaimed

    def _move_live(self, seg: int) -> bool:
        """Copy live records of `seg` (verified) to the write position; caller holds both I/O locks."""
        with self._lock:
            rows = [_Row(r[0], r[1], r[2], r[3], r[4], r[5] & ((1 << 64) - 1)) for r in self._db.execute(
                "SELECT key, segment, offset, length, payload_len, checksum FROM blocks "
                "WHERE segment=? ORDER BY offset", (seg,))]
        buf = self._rbufs[0]
        for r in rows:
            if r.length > len(self._wbuf):
                return False
            got = self._read_run([(0, r)], buf)
            if isinstance(got, OSError) or got < r.length or isinstance(self._check_record(buf, 0, r), str):
                self.counters["corrupt"] += 1
                with self._lock:
                    self._delete_rows([r.key])
                continue
            try:
                if self._wfd is None or self._wseg in self._retired \
                        or self._wtail + r.length > self.segment_bytes:
                    self._roll_segment()
                self._wbuf[:r.length] = buf[:r.length]
                self._write_all(memoryview(self._wbuf)[:r.length], self._wtail)
                self.io.fsync(self._wfd)
            except OSError as exc:
                log.error("cold_compact_write_failed", error=str(exc))
                if self._wseg is not None:
                    self._retire(self._wseg, f"write: {exc.strerror or exc}")
                return False
            with self._lock:
                self._db.execute("UPDATE blocks SET segment=?, offset=? WHERE key=?",
                                 (self._wseg, self._wtail, r.key))
                self._wtail += r.length
                self._db.execute("UPDATE segments SET size=? WHERE id=?", (self._wtail, self._wseg))
        return True

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None) -> dict[str, int]:
        """Scrub: read and check every record of this namespace. `missing`: its segment file
        is absent or short; `corrupt`: checksum / header mismatch or I/O error. `repair`
        drops both kinds from the index. Rate-limited when `rate_bytes_per_s` is given."""
        with self._lock:
            rows = [_Row(r[0], r[1], r[2], r[3], r[4], r[5] & ((1 << 64) - 1)) for r in self._db.execute(
                "SELECT key, segment, offset, length, payload_len, checksum FROM blocks "
                "WHERE namespace=? ORDER BY segment, offset", (self.namespace,))]
        checked = corrupt = missing = nbytes = 0
        bad: list[bytes] = []
        t0 = time.monotonic()
        for r in rows:
            with self._read_lock:
                if not os.path.exists(self._seg_path(r.segment)):
                    missing += 1
                    bad.append(r.key)
                    continue
                got = self._read_run([(0, r)], self._rbufs[0])
                checked += 1
                if isinstance(got, OSError):
                    corrupt += 1
                    bad.append(r.key)
                elif got < r.length:
                    missing += 1
                    bad.append(r.key)
                elif isinstance(self._check_record(self._rbufs[0], 0, r), str):
                    corrupt += 1
                    bad.append(r.key)
                    log.error("cold_checksum_failed", key=r.key.hex(), segment=r.segment, reason="scrub")
            nbytes += r.length
            if rate_bytes_per_s:
                ahead = nbytes / rate_bytes_per_s - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        repaired = 0
        if repair and bad:
            repaired = self.delete(bad)
        self.counters["corrupt"] += corrupt
        return {"checked": checked, "corrupt": corrupt, "missing": missing, "repaired": repaired,
                "bytes": nbytes}

    def stats(self) -> dict[str, object]:
        with self._lock:
            n, = self._db.execute("SELECT COUNT(*) FROM blocks WHERE namespace=?", (self.namespace,)).fetchone()
            segs = dict(self._db.execute("SELECT state, COUNT(*) FROM segments GROUP BY state").fetchall())
            disk, = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM segments").fetchone()
            return {"directory": str(self.directory), "blocks": n, "bytes_used": self._bytes_used,
                    "live_bytes": self._bytes_used, "dead_bytes": max(0, disk - self._bytes_used),
                    "disk_bytes": disk, "capacity_bytes": self.capacity_bytes,
                    "codec": self.codec_name, "read_only": self._read_only,
                    "o_direct": self.o_direct_active, "segments": segs, **self.counters}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._write_lock, self._read_lock:
            self._read_pool.shutdown(wait=True)
            self._write_pool.shutdown(wait=True)
            for fd in list(self._rfds.values()) + ([self._wfd] if self._wfd is not None else []):
                try:
                    self.io.close(fd)
                except OSError as exc:
                    log.warning("cold_close_failed", error=str(exc))
            self._rfds.clear()
            self._wfd = None
            with self._lock:
                self._flush_touches()
                try:  # a failing disk must not stop the shutdown: the next open re-seals
                    self._db.execute("UPDATE segments SET state='sealed' WHERE state='active'")
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                except sqlite3.Error as exc:
                    self._index_failed("close", exc)
                try:
                    self._db.close()
                except sqlite3.Error as exc:
                    self._index_failed("close", exc)
