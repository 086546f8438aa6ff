"""Segment files of one cold directory: naming, opening with O_DIRECT (falling back to buffered
I/O where the filesystem refuses it), and the cache of read descriptors.

A new process always appends to a new segment, so torn tails are never overwritten or read.
A segment that produced an I/O error is retired: never written again (its readable records
stay until compaction moves them).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import structlog

from kvagentd.kvcache.fileio import O_DIRECT, FileOps

log = structlog.get_logger(__name__)


class SegmentFiles:
    """Files of one directory (its owner creates it). `read_lock` serializes users of the
    read buffers and of the cached read descriptors (batched reads, compaction, verify); it
    is held to drop them."""

    def __init__(self, directory: Path, io: FileOps, *, o_direct: bool) -> None:
        self.directory = directory
        self.io = io
        self.o_direct_wanted = o_direct and O_DIRECT != 0
        self.o_direct_active = self.o_direct_wanted
        self.read_lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._rfds: dict[int, int] = {}

    def path(self, segment: int) -> str:
        return str(self.directory / f"seg-{segment:08d}.kvs")

    def open(self, path: str, flags: int) -> int:
        """Open with O_DIRECT while it is in use, falling back to buffered I/O where refused."""
        if self.o_direct_active:
            try:
                return self.io.open(path, flags | O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("cold_o_direct_refused", directory=str(self.directory))
                self.o_direct_active = False
        return self.io.open(path, flags)

    def read_fd(self, segment: int) -> int:
        with self._fd_lock:  # read threads may ask for the same segment at once
            fd = self._rfds.get(segment)
            if fd is None:
                fd = self._rfds[segment] = self.open(self.path(segment), os.O_RDONLY)
            return fd

    def close_read_fd(self, segment: int) -> None:
        """Caller holds `read_lock`."""
        with self._fd_lock:
            fd = self._rfds.pop(segment, None)
        if fd is not None:
            self.io.close(fd)

    def close_read_fds(self) -> None:
        """Caller holds `read_lock`."""
        with self._fd_lock:
            fds, self._rfds = list(self._rfds.values()), {}
        for fd in fds:
            try:
                self.io.close(fd)
            except OSError as exc:
                log.warning("cold_close_failed", error=str(exc))

    def go_buffered(self) -> None:
        """O_DIRECT was refused mid-way: use buffered I/O from now on (read descriptors are
        reopened without it)."""
        log.warning("cold_o_direct_refused", directory=str(self.directory))
        self.o_direct_active = False
        with self.read_lock:
            self.close_read_fds()
