"""Batched, verified reads of cold records.

Adjacent records are read with one large sequential read; raw records whose destination
tensor is suitably aligned land directly in it (headers and padding go to a read buffer), the
rest are read into a buffer, verified and decoded. `io_threads` reads are in flight while the
previous run is verified, each into its own buffer. Every record is checked (header checksum,
key, namespace, shape, payload checksum) before its bytes count as read: a failure is counted
and the record reported unreadable, never served.
"""

from __future__ import annotations

import collections
import errno
import mmap
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import structlog
import torch

from kvagentd.kvcache.base import BlockKey, KVGeometry
from kvagentd.kvcache.codec import CODEC_BY_ID, Codec
from kvagentd.kvcache.cold.record import ALIGN, RecordRow, align, check_record
from kvagentd.kvcache.cold.segments import SegmentFiles

log = structlog.get_logger(__name__)

# one read call for up to this many bytes of adjacent raw records. NOTE: on the development
# VM's virtio disk 94 MB read in 4 MiB calls, 4 in flight, took 64 ms (1.55 GB/s); in 16 MiB
# calls, 2 in flight, 80 ms (1.23 GB/s): the device prefers more, smaller requests in flight.
DIRECT_RUN_BYTES = 4 << 20
DIRECT_RUN_RECORDS = 300      # and at most this many records (3 iovecs each, IOV_MAX 1024)

Run = list[tuple[int, RecordRow]]


class SegmentReader:
    """The read side of one cold directory; uses `files.read_lock` for its buffers."""

    def __init__(self, files: SegmentFiles, geometry: KVGeometry, namespace: bytes, *,
                 record_len: int, buffer_bytes: int, io_threads: int,
                 counters: dict[str, int], on_io_error: Callable[[int, str], None]) -> None:
        self.files, self.geometry, self.namespace = files, geometry, namespace
        self.counters = counters
        self.on_io_error = on_io_error  # (segment, reason): retire it
        self.io_threads = max(1, int(io_threads))
        rb = max(record_len, align(buffer_bytes))
        self.bufs = [mmap.mmap(-1, rb) for _ in range(self.io_threads + 1)]
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kv-cold-read")
        self._codecs: dict[int, Codec] = {}

    def codec(self, cid: int) -> Codec:
        c = self._codecs.get(cid)
        if c is None:
            c = self._codecs[cid] = CODEC_BY_ID[cid](self.geometry)
        return c

    def check(self, buf: mmap.mmap, off: int, row: RecordRow,
              payload: memoryview | None = None) -> int | str:
        """The record's codec id after every check, or why it failed."""
        return check_record(buf, off, row, self.namespace, self.geometry, self.codec, payload)

    # -- planning reads ------------------------------------------------------------------------
    def direct_ok(self, row: RecordRow, out: torch.Tensor) -> bool:
        """A raw record can be read straight into `out` (no bounce buffer, no decode)."""
        if row.payload_len != self.geometry.block_bytes or out.device.type != "cpu" \
                or out.dtype != self.geometry.dtype or not out.is_contiguous():
            return False
        return not self.files.o_direct_active or (
            out.data_ptr() % ALIGN == 0 and row.payload_len % ALIGN == 0)

    def runs(self, rows: Run, direct: dict[int, bool] | None = None) -> list[Run]:
        """Group rows (sorted by segment, offset) into runs of adjacent records read with one
        call. Staged runs fit a read buffer; direct runs (payloads straight into their
        tensors) only need their headers to fit, up to DIRECT_RUN_BYTES."""
        cap = len(self.bufs[0])
        direct = direct or {}
        out: list[Run] = []
        for item in rows:
            i, r = item
            if out:
                li, last = out[-1][-1]
                first = out[-1][0][1]
                d = direct.get(i, False)
                if (r.segment == last.segment and r.offset == last.offset + last.length
                        and d == direct.get(li, False)):
                    span = r.offset + r.length - first.offset
                    if (not d and span <= cap) or (d and span <= DIRECT_RUN_BYTES
                                                   and (len(out[-1]) + 1) * ALIGN <= cap
                                                   and len(out[-1]) < DIRECT_RUN_RECORDS):
                        out[-1].append(item)
                        continue
            out.append([item])
        return out

    def read_run(self, run: Run, buf: mmap.mmap,
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
                iov.append(outs[i].view(-1).view(torch.uint8).numpy().data)
                if pad:
                    iov.append(mv[hoff + ALIGN:hoff + ALIGN + pad])
                hoff += ALIGN + pad
        try:
            fd = self.files.read_fd(first.segment)
            return self.files.io.preadv(fd, iov, first.offset)
        except OSError as exc:
            return exc

    # -- the batched read ----------------------------------------------------------------------
    def read_into(self, todo: Run, outs: Sequence[torch.Tensor], ok: list[bool]) -> list[BlockKey]:
        """Read, verify and decode each `(i, row)` of `todo` (sorted by segment, offset) into
        `outs[i]`, setting `ok[i]`; returns the keys read. The next read overlaps verifying
        the previous one."""
        done: list[BlockKey] = []
        with self.files.read_lock:
            eligible = {i: self.direct_ok(r, outs[i]) for i, r in todo}
            runs = self.runs(todo, eligible)
            direct = [eligible[run[0][0]] for run in runs]
            nbuf, depth = len(self.bufs), len(self.bufs) - 1

            def submit(ri: int) -> Future[int | OSError]:
                return self._pool.submit(self.read_run, runs[ri], self.bufs[ri % nbuf],
                                         outs if direct[ri] else None)

            # runs ri+1 .. ri+depth are read while run ri is verified; a buffer is reused
            # only after its run was consumed
            futs = collections.deque(submit(ri) for ri in range(min(depth, len(runs))))
            try:
                for ri, run in enumerate(runs):
                    got = futs.popleft().result()
                    buf = self.bufs[ri % nbuf]
                    if ri + depth < len(runs):
                        futs.append(submit(ri + depth))
                    if isinstance(got, OSError):
                        self._read_failed(run, got)
                        continue
                    self._verify_run(run, got, buf, outs, direct[ri], ok, done)
            finally:  # never leave a read in flight into a buffer the next call reuses
                wait(futs)
        return done

    def _read_failed(self, run: Run, exc: OSError) -> None:
        self.counters["io_errors"] += len(run)
        log.error("cold_read_failed", segment=run[0][1].segment, error=str(exc))
        if exc.errno == errno.ENOENT:
            self.counters["missing"] += len(run)
        else:
            self.on_io_error(run[0][1].segment, f"read: {exc.strerror or exc}")

    def _verify_run(self, run: Run, got: int, buf: mmap.mmap, outs: Sequence[torch.Tensor],
                    direct: bool, ok: list[bool], done: list[BlockKey]) -> None:
        base, hoff = run[0][1].offset, 0
        for i, r in run:
            if r.offset - base + r.length > got:
                self.counters["missing"] += 1
                log.error("cold_record_short", key=r.key.hex(), segment=r.segment)
                continue
            if direct:
                good = self._verify_direct(buf, hoff, r, outs[i])
                hoff += r.length - r.payload_len
            else:
                good = self._verify_decode(buf, r.offset - base, r, outs[i])
            if good:
                ok[i] = True
                done.append(r.key)
                self.counters["reads"] += 1
                self.counters["read_bytes"] += r.length

    def _verify_direct(self, buf: mmap.mmap, hoff: int, r: RecordRow, out: torch.Tensor) -> bool:
        res = self.check(buf, hoff, r, out.view(-1).view(torch.uint8).numpy().data)
        return self._checked(res, r)

    def _verify_decode(self, buf: mmap.mmap, off: int, r: RecordRow, out: torch.Tensor) -> bool:
        res = self.check(buf, off, r)
        if not self._checked(res, r):
            return False
        assert isinstance(res, int)
        codec = self.codec(res)
        payload = torch.frombuffer(buf, dtype=torch.uint8, offset=off + ALIGN,
                                   count=codec.payload_nbytes).view(1, -1)
        codec.decode(payload, out.view(1, *self.geometry.block_shape))
        return True

    def _checked(self, res: int | str, r: RecordRow) -> bool:
        if isinstance(res, str):
            self.counters["corrupt"] += 1
            log.error("cold_checksum_failed", key=r.key.hex(), segment=r.segment, reason=res)
            return False
        return True

    # -- one record (compaction, verify) ------------------------------------------------------
    def read_one(self, row: RecordRow) -> tuple[int | OSError, mmap.mmap]:
        """Read one record into the first buffer; caller holds `files.read_lock`."""
        return self.read_run([(0, row)], self.bufs[0]), self.bufs[0]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
