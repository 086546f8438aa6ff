"""The directories API routes write files into: `<state_dir>/dumps`, and the reports'
`<state_dir>/reports` (`agent/reports.py` writes through the same class).

A route never writes where a request says. It names a file (a name the daemon chooses, or a
plain name the request gives: letters, digits, `_ . -`, no leading dot, an allowed suffix) in
this directory, and `DumpDir.write` makes it safely:

* the directory is opened with O_NOFOLLOW|O_DIRECTORY and must be the daemon's own (owner =
  the daemon's uid, not writable by group or others), so nobody else can plant entries in it;
* the content goes to a fresh temporary name created with O_CREAT|O_EXCL|O_NOFOLLOW (never an
  existing file, never through a symlink), relative to that directory descriptor;
* it is fsynced, then published under its final name by link(2), which is atomic and, unlike
  rename(2), never replaces an existing file (an existing name is a conflict), and the
  temporary name is removed.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_MODE = 0o640
DIR_MODE = 0o750


class DumpNameError(ValueError):
    """A requested file name is not a plain name with an allowed suffix."""


class DumpExists(FileExistsError):
    """A file of that name is already in the dump directory."""


class DumpDirUnsafe(PermissionError):
    """The dump directory is a symlink, not a directory, or not the daemon's alone."""


class DumpDir:
    """Creates files in `path` (default `<state_dir>/dumps`) for the control API."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._counter = 0

    def check_name(self, name: str, suffixes: tuple[str, ...]) -> str:
        """`name` when it is a plain file name ending in one of `suffixes`; else DumpNameError."""
        if not _NAME_RE.fullmatch(name) or ".." in name or not name.endswith(suffixes):
            raise DumpNameError(
                f"{name!r} is not a plain file name: use 1-128 of letters, digits, _ . - "
                f"(not starting with a dot) ending in {' or '.join(suffixes)}")
        return name

    def new_name(self, kind: str, suffix: str) -> str:
        """A daemon-chosen name: `<kind>-<UTC time>-<n><suffix>`."""
        with self._lock:
            self._counter += 1
            n = self._counter
        return f"{kind}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{n}{suffix}"

    def write(self, name: str, produce: Callable[[BinaryIO], object]) -> Path:
        """Create `name` in the directory with what `produce(file)` writes; returns its path.

        Raises DumpExists when the name is taken, DumpDirUnsafe when the directory is not the
        daemon's own, OSError for I/O errors. Nothing is left behind on failure.
        """
        def link(tmp: str, dfd: int) -> None:
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                raise DumpExists(f"{self.path / name} exists; choose another name") from None
            finally:
                os.unlink(tmp, dir_fd=dfd)

        return self._publish(name, produce, link)

    def replace(self, name: str, produce: Callable[[BinaryIO], object]) -> Path:
        """Like `write`, but publish by rename(2) over whatever entry `name` is (a report's
        JSON rewritten when it is done): rename replaces the directory entry itself, so a
        symlink planted under `name` is replaced, never followed."""
        def rename(tmp: str, dfd: int) -> None:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)

        return self._publish(name, produce, rename)

    def _publish(self, name: str, produce: Callable[[BinaryIO], object],
                 publish: Callable[[str, int], None]) -> Path:
        """`produce` into a fresh O_EXCL|O_NOFOLLOW temporary name, fsync it, `publish(tmp,
        dirfd)` it as `name`; the temporary name never outlives a failure."""
        if not _NAME_RE.fullmatch(name) or ".." in name:
            raise DumpNameError(f"{name!r} is not a plain file name")
        dfd = self._open_dir()
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, _CREATE, FILE_MODE, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    produce(f)
                    f.flush()
                    os.fsync(f.fileno())
                publish(tmp, dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass  # already gone (published by rename, or unlinked after a link)
                raise
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return self.path / name

    def _open_dir(self) -> int:
        """A descriptor of the directory (created 0750 when absent); refuses anything else."""
        try:
            os.mkdir(self.path, DIR_MODE)
        except FileExistsError:
            pass  # checked below, through the descriptor
        try:
            dfd = os.open(self.path, _OPEN_DIR)
        except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file in its place
            raise DumpDirUnsafe(f"{self.path} is not a plain directory: {exc.strerror}") from None
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.close(dfd)
            raise DumpDirUnsafe(f"{self.path} must belong to the daemon's user (uid "
                                f"{os.geteuid()}) and be writable by it alone; it is uid "
                                f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}")
        return dfd
