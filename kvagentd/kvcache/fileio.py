"""The OS file operations of the cold tier, behind one protocol.

`FileOps` is what a cold store calls; `FileIO` implements it with `os`. Fault injection
(`kvagentd.kvcache.cold.faults.FaultyFileIO`) implements it too and raises
`OSError(errno, ...)` or writes fewer bytes, exactly as the kernel would. The SQLite index does
its own I/O and is not routed through here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class FileOps(Protocol):
    """Every method may raise OSError."""

    def open(self, path: str, flags: int, mode: int = 0o640) -> int: ...

    def close(self, fd: int) -> None: ...

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        """Write `data` at `offset`; returns bytes written (may be short)."""
        ...

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        """Read into `buffers` from `offset`; returns bytes read (short at end of file)."""
        ...

    def fsync(self, fd: int) -> None:
        """Make written data durable."""
        ...

    def fsync_dir(self, path: str) -> None: ...

    def unlink(self, path: str) -> None: ...

    def rename(self, src: str, dst: str) -> None: ...

    def size(self, path: str) -> int:
        """File size in bytes; raises FileNotFoundError when absent."""
        ...

    def makedirs(self, path: str) -> None: ...


class FileIO:
    """`FileOps` over `os`."""

    O_DIRECT = O_DIRECT

    def open(self, path: str, flags: int, mode: int = 0o640) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fdatasync(fd)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def makedirs(self, path: str) -> None:
        os.makedirs(path, mode=0o750, exist_ok=True)
