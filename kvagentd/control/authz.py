"""Who may call which route, from the peer's kernel credentials (SO_PEERCRED).

Reads: root, the daemon's uid, members of `control.socket_group` (the daemon's primary group
when that is ""), and operators. Changes: root, the daemon's uid and members of
`control.operator_group` (nobody else when that is "").
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass

import structlog

from kvagentd.control.errors import Forbidden
from kvagentd.control.router import Peer

log = structlog.get_logger(__name__)

# Linux <asm-generic/socket.h>; the socket module does not export it.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 256


def peer_of(sock: socket.socket) -> Peer:
    """Kernel-reported credentials of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    try:
        buf = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = frozenset(struct.unpack(f"{len(buf) // 4}I", buf[: len(buf) // 4 * 4]))
    except OSError:
        # NOTE: kernels before 4.13 lack SO_PEERGROUPS; fall back to the group database.
        groups = _groups_from_db(uid, gid)
    return Peer(pid=pid, uid=uid, gid=gid, groups=groups)


def _groups_from_db(uid: int, gid: int) -> frozenset[int]:
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return frozenset({gid})
    return frozenset(os.getgrouplist(name, gid))


def _gid_of(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _name_of_uid(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    daemon_uid: int
    read_gid: int | None
    read_group: str
    operator_gid: int | None
    operator_group: str

    @classmethod
    def from_config(cls, socket_group: str, operator_group: str, *,
                    daemon_uid: int | None = None, daemon_gid: int | None = None) -> AccessPolicy:
        uid = os.getuid() if daemon_uid is None else daemon_uid
        gid = os.getgid() if daemon_gid is None else daemon_gid
        if socket_group:
            read_gid = _gid_of(socket_group)
            if read_gid is None:
                log.warning("socket_group_missing", group=socket_group,
                            effect="only root, the daemon uid and operators may read")
            read_name = socket_group
        else:
            read_gid = gid
            try:
                read_name = grp.getgrgid(gid).gr_name
            except KeyError:
                read_name = str(gid)
        op_gid = _gid_of(operator_group) if operator_group else None
        if operator_group and op_gid is None:
            log.warning("operator_group_missing", group=operator_group,
                        effect="only root and the daemon uid may change state")
        return cls(uid, read_gid, read_name, op_gid, operator_group)

    def may_read(self, peer: Peer) -> bool:
        return self.may_change(peer) or peer.in_group(self.read_gid)

    def may_change(self, peer: Peer) -> bool:
        return peer.uid in (0, self.daemon_uid) or peer.in_group(self.operator_gid)

    def check(self, peer: Peer, method: str, path: str, change: bool) -> None:
        """Raise Forbidden, saying who may, unless `peer` may call this route."""
        if (self.may_change(peer) if change else self.may_read(peer)):
            return
        groups = [self.operator_group] if self.operator_gid is not None else []
        if not change and self.read_gid is not None and self.read_group not in groups:
            groups.append(self.read_group)
        who = f"root, user {_name_of_uid(self.daemon_uid)}"
        if groups:
            who += " and members of group " + " or ".join(repr(g) for g in groups)
        what = "changes daemon state" if change else "reads daemon state"
        raise Forbidden(f"{method} {path} {what}; allowed: {who}; "
                        f"you are uid {peer.uid} gid {peer.gid}")
