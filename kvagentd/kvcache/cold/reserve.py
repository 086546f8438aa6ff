"""A reserve of disk space in the cold directory, kept for the day the disk is full.

On a full disk SQLite cannot record even a deletion, so the daemon could not free the space
its own records fill. `SpaceReserve` keeps a file of `nbytes` there while there is room;
when the index reports a full disk, `release()` deletes it, which gives the index room to
record evictions and compaction; `ensure()` takes the space again once there is room.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import structlog

from kvagentd.kvcache.fileio import FileOps

log = structlog.get_logger(__name__)

RESERVE_NAME = "space.reserve"
_CHUNK = 1 << 20


class SpaceReserve:
    """The reserve file of one cold directory. Not thread-safe: its store calls it under its
    writer lock."""

    def __init__(self, directory: Path, io: FileOps, nbytes: int) -> None:
        self.path = str(directory / RESERVE_NAME)
        self.io = io
        self.nbytes = max(0, int(nbytes))
        self.released = 0  # times it was given up for a full disk

    @property
    def held(self) -> int:
        """Bytes held now (0 when released or never taken)."""
        try:
            return min(self.nbytes, self.io.size(self.path))
        except OSError:
            return 0

    def ensure(self) -> bool:
        """Take the reserve if it is not held; False (nothing left behind) when the disk has
        no room for it or takes no writes. Never raises."""
        if self.nbytes == 0 or self.held >= self.nbytes:
            return self.nbytes > 0
        tmp = self.path + ".tmp"
        try:
            fd = self.io.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                zeros = bytes(_CHUNK)
                for off in range(0, self.nbytes, _CHUNK):
                    n = min(_CHUNK, self.nbytes - off)
                    if self.io.pwrite(fd, memoryview(zeros)[:n], off) != n:
                        raise OSError(errno.ENOSPC, "short write")
                self.io.fsync(fd)
            finally:
                self.io.close(fd)
            self.io.rename(tmp, self.path)
        except OSError as exc:
            try:
                self.io.unlink(tmp)
            except OSError:
                pass
            log.info("cold_reserve_not_taken", path=self.path, error=str(exc))
            return False
        return True

    def release(self) -> bool:
        """Give the space back to the filesystem; True when there was some to give."""
        if self.held == 0:
            return False
        try:
            self.io.unlink(self.path)
        except OSError as exc:
            log.warning("cold_reserve_release_failed", path=self.path, error=str(exc))
            return False
        self.released += 1
        log.warning("cold_reserve_released", path=self.path, bytes=self.nbytes)
        return True
