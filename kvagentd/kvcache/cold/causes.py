"""Why a cold store cannot take writes: one classification of OS and SQLite errors.

The failover pair acts on the cause: a full disk is healthy (compaction and eviction may
rewrite it, and the shadow is written back once there is room), a read-only one takes no
writes at all, and a device that reports I/O errors is touched as little as possible.
"""

from __future__ import annotations

import enum
import errno
import os
import sqlite3
from pathlib import Path

# SQLite primary result codes (sqlite3.h); extended codes carry them in the low byte
_SQLITE_PERM, _SQLITE_READONLY, _SQLITE_CORRUPT, _SQLITE_FULL = 3, 8, 11, 13
_SQLITE_CANTOPEN, _SQLITE_AUTH, _SQLITE_NOTADB = 14, 23, 26


class Cause(enum.Enum):
    """Why the cold tier serves from the shadow, or why its SSD store takes no writes."""

    NO_SPACE = "no_space"    # ENOSPC / EDQUOT; SQLite "database or disk is full"
    READ_ONLY = "read_only"  # EROFS, EACCES, EPERM; SQLite READONLY, CANTOPEN, PERM, AUTH
    IO_ERROR = "io_error"    # EIO and whatever else the device reports; SMART says failed
    OPERATOR = "operator"    # an operator asked (kvctl failover activate)
    START = "start"          # the shadow still held records at start

    @property
    def device_healthy(self) -> bool:
        """The SSD itself works: it may be read, compacted and written back to once it
        takes writes again."""
        return self in (Cause.NO_SPACE, Cause.OPERATOR, Cause.START)


_ERRNO_CAUSE = {errno.ENOSPC: Cause.NO_SPACE, errno.EDQUOT: Cause.NO_SPACE,
                errno.EROFS: Cause.READ_ONLY, errno.EACCES: Cause.READ_ONLY,
                errno.EPERM: Cause.READ_ONLY}

_SQLITE_CAUSE = {_SQLITE_FULL: Cause.NO_SPACE, _SQLITE_READONLY: Cause.READ_ONLY,
                 _SQLITE_CANTOPEN: Cause.READ_ONLY, _SQLITE_PERM: Cause.READ_ONLY,
                 _SQLITE_AUTH: Cause.READ_ONLY}


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def cause_of(exc: BaseException) -> Cause:
    """The cause an OSError or sqlite3.Error stands for (IO_ERROR when nothing narrower)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return _ERRNO_CAUSE.get(exc.errno, Cause.IO_ERROR)
    if isinstance(exc, sqlite3.Error):
        code = _sqlite_code(exc)
        if code is not None:
            return _SQLITE_CAUSE.get(code, Cause.IO_ERROR)
        text = str(exc).lower()  # errors raised without a result code
        if "disk is full" in text:
            return Cause.NO_SPACE
        if "readonly" in text or "read-only" in text or "unable to open" in text:
            return Cause.READ_ONLY
    return Cause.IO_ERROR


FULL_BELOW_BYTES = 1 << 20
"""A filesystem with less free space than this counts as full when SQLite reports a bare
I/O error (it does so on a full disk when it cannot grow its shared-memory file)."""


def cause_in(exc: BaseException, directory: Path) -> Cause:
    """`cause_of(exc)`, where an unexplained I/O error on a (nearly) full filesystem counts
    as a full disk."""
    cause = cause_of(exc)
    if cause is Cause.IO_ERROR:
        try:
            st = os.statvfs(directory)
        except OSError:
            return cause
        if st.f_bavail * st.f_frsize < FULL_BELOW_BYTES:
            return Cause.NO_SPACE
    return cause


def is_corrupt(exc: sqlite3.Error) -> bool:
    """The database file itself is damaged (not merely unwritable or on a full disk)."""
    code = _sqlite_code(exc)
    if code is not None:
        return code in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text
