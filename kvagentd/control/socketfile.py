"""The control socket's file: its directory, a stale socket left by a crash, its mode, group
and operators' ACL, and its removal at stop (only if it is still ours)."""

from __future__ import annotations

import errno
import grp
import os
import socket
import stat
from pathlib import Path

import structlog

from kvagentd.config import ControlConfig
from kvagentd.control import acl

log = structlog.get_logger(__name__)


class ControlSocketInUse(OSError):
    """Another process is already listening on the configured control socket."""


class SocketFile:
    """`control.socket` on disk: `prepare()` before bind, `publish()` after, `remove()` at stop."""

    def __init__(self, cfg: ControlConfig) -> None:
        self.cfg = cfg
        self.path = Path(cfg.socket)
        self._inode: int | None = None

    def prepare(self) -> None:
        """Create the directory if missing; remove a stale socket; raise ControlSocketInUse if
        another process listens on it or the path is not a socket."""
        self._prepare_directory()
        self._remove_stale_socket()

    def publish(self) -> None:
        """Open the bound socket up to `socket_mode`, its group and the operators' ACL."""
        self._set_socket_permissions()
        self._grant_operators()

    def remember(self) -> None:
        """Note the bound socket's inode, so that `remove()` never unlinks a successor's."""
        self._inode = self.path.stat().st_ino

    def remove(self) -> None:
        """Unlink the socket if it is still the one `remember()` saw."""
        try:
            if self._inode is not None and self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass  # already gone

    def _prepare_directory(self) -> None:
        d = self.path.parent
        if d.exists():
            return
        d.mkdir(parents=True, mode=0o750)
        os.chmod(d, 0o750)
        gid = self._socket_gid()
        if gid is not None:
            try:
                os.chown(d, -1, gid)
            except PermissionError as exc:
                log.warning("control_dir_chgrp_failed", dir=str(d), group=self.cfg.socket_group,
                            error=exc.strerror)

    def _socket_gid(self) -> int | None:
        if not self.cfg.socket_group:
            return None
        try:
            return grp.getgrnam(self.cfg.socket_group).gr_gid
        except KeyError:
            return None

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketInUse(errno.EEXIST,
                                     f"{self.path} exists and is not a socket; remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("control_stale_socket_removed", socket=str(self.path))
            self.path.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise ControlSocketInUse(exc.errno or errno.EADDRINUSE,
                                     f"cannot probe {self.path}: {exc}") from None
        finally:
            probe.close()
        raise ControlSocketInUse(errno.EADDRINUSE,
                                 f"another process is listening on {self.path}")

    def _set_socket_permissions(self) -> None:
        os.chmod(self.path, self.cfg.socket_mode)
        if not self.cfg.socket_group:
            return
        gid = self._socket_gid()
        if gid is None:
            log.warning("control_socket_group_missing", group=self.cfg.socket_group,
                        socket=str(self.path), effect="socket keeps the daemon's group")
            return
        if os.stat(self.path).st_gid == gid:
            return  # NOTE: no chown call: the unit's syscall filter denies @chown
        try:
            os.chown(self.path, -1, gid)
        except PermissionError as exc:
            log.warning("control_socket_chgrp_failed", group=self.cfg.socket_group,
                        error=exc.strerror)

    def _grant_operators(self) -> None:
        """Let `control.operator_group` connect without joining `control.socket_group`: an ACL
        entry on the socket (rw) and its directory (search). See control.acl."""
        ops = self.cfg.operator_group
        if not ops or ops == self.cfg.socket_group:
            return
        try:
            gid = grp.getgrnam(ops).gr_gid
        except KeyError:
            return  # AccessPolicy already warned: nobody is an operator
        for path, perm in ((self.path, acl.R | acl.W), (self.path.parent, acl.X)):
            try:
                acl.grant_group(path, gid, perm)
            except OSError as exc:  # no ACLs on this file system, or not ours to change
                log.warning("control_operator_acl_failed", path=str(path), group=ops,
                            error=exc.strerror or str(exc),
                            effect=f"operators also need group {self.cfg.socket_group!r}")
                return
        log.info("control_operator_acl", group=ops, socket=str(self.path))
