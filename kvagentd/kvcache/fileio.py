"""The OS file operations the cold store uses, in one replaceable object.

`ColdStore(file_io=...)` takes any object with these methods; the default calls `os`.
Fault injection (EIO, ENOSPC, EROFS, torn writes, latency) wraps or subclasses `FileIO` and
raises `OSError(errno, ...)` or writes fewer bytes, exactly as the kernel would. The SQLite
index does its own I/O and is not routed through here.
"""

from __future__ import annotations

import os
from typing import Sequence


class FileIO:
    """Thin wrappers over `os`; every method may raise OSError."""

    O_DIRECT: int = getattr(os, "O_DIRECT", 0)

    def open(self, path: str, flags: int, mode: int = 0o640) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """Write `data` at `offset`; returns bytes written (may be short)."""
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Read into `buffers` from `offset`; returns bytes read (short at end of file)."""
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        """Make written data durable (fdatasync where available)."""
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def size(self, path: str) -> int:
        """File size in bytes; raises FileNotFoundError when absent."""
        return os.stat(path).st_size

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o750, exist_ok=True)
