"""Who may call which route, and who may write which session, from the peer's kernel
credentials (SO_PEERCRED).

Routes (`AccessPolicy`): reads for root, the daemon's uid, members of `control.socket_group`
(the daemon's primary group when that is "") and operators; changes for root, the daemon's uid
and members of `control.operator_group` (nobody else when that is "").

Sessions (`SessionRules`), on top of the route check:
- *daemon sessions* (created by the daemon itself: the agent's `<asset>-<n>`, reports'
  `report-<asset>-*`, and ids matching `control.daemon_sessions`) are written by the daemon only.
  Nobody asks in them, not even root; an operator asks *about* one by forking it (a change
  route): a new session owned by the operator starts from its token ids, so its stored blocks
  are reused and the live session is never written. Their ids are reserved before they exist,
  so nobody can plant a future agent session.
- any other session belongs to the uid that created it. Its owner may ask in it, read its text
  and drop it; operators may do so in anyone's session; other readers may not.
- every reader sees the list of sessions (with owners) and the text of daemon sessions.
"""

from __future__ import annotations

import fnmatch
import grp
import os
import pwd
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any

import structlog

from kvagentd.control.errors import Forbidden
from kvagentd.control.router import Peer

log = structlog.get_logger(__name__)

# Linux <asm-generic/socket.h>; the socket module does not export it.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 256
_CRED = struct.Struct("3i")


def peer_of(sock: socket.socket) -> Peer:
    """Kernel-reported credentials of the process at the other end of a Unix socket."""
    return with_groups(sock, peer_cred(sock))


def peer_cred(sock: socket.socket) -> Peer:
    """pid, uid and gid of the peer (SO_PEERCRED), without its supplementary groups."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def with_groups(sock: socket.socket, peer: Peer) -> Peer:
    """`peer` with its supplementary groups (SO_PEERGROUPS, else the group database)."""
    uid, gid = peer.uid, peer.gid
    try:
        buf = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS)
        groups = frozenset(struct.unpack(f"{len(buf) // 4}I", buf[: len(buf) // 4 * 4]))
    except OSError:
        # NOTE: kernels before 4.13 lack SO_PEERGROUPS; fall back to the group database.
        groups = _groups_from_db(uid, gid)
    return Peer(pid=peer.pid, uid=uid, gid=gid, groups=groups)


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


def name_of_uid(uid: int) -> str:
    """The user name of `uid`, or the number as text."""
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
        who = f"root, user {name_of_uid(self.daemon_uid)}"
        if groups:
            who += " and members of group " + " or ".join(repr(g) for g in groups)
        what = "changes daemon state" if change else "reads daemon state"
        raise Forbidden(f"{method} {path} {what}; allowed: {who}; "
                        f"you are uid {peer.uid} gid {peer.gid}")


def ask_user(uid: int) -> str:
    """The `<user>` of the daemon's session `<asset>:ask:<user>` for `uid`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name_of_uid(uid))[:48]


class SessionRules:
    """Which sessions are the daemon's, and who may ask in, read or drop a session.

    `owner` below is a stored session's owner uid (None: created by the daemon itself);
    `operator` says whether the peer passes the change-route check.
    """

    def __init__(self, assets: tuple[str, ...], globs: tuple[str, ...] = ()) -> None:
        # NOTE: the agent's names (agent.py `<asset>-<n>` and `<asset>:ask:<user>`, reports.py
        # `report-<asset>-<stamp>`); tests/control/test_session_authz.py checks every id the
        # agent submits matches one.
        names = "|".join(re.escape(a) for a in assets)
        self._agent = re.compile(rf"(?:{names})-\d+|(?:{names}):ask:.*|report-(?:{names})-.*") \
            if assets else None
        self._ask = re.compile(rf"(?:{names}):ask:(.*)") if assets else None
        self.globs = tuple(globs)

    @classmethod
    def from_config(cls, cfg: Any) -> SessionRules:
        return cls(tuple(a.name for a in cfg.agent.assets), tuple(cfg.control.daemon_sessions))

    def reserved(self, session_id: str) -> bool:
        """True for ids only the daemon may create (whether or not they exist yet)."""
        if self._agent is not None and self._agent.fullmatch(session_id):
            return True
        return any(fnmatch.fnmatchcase(session_id, g) for g in self.globs)

    def is_daemon_session(self, session_id: str, exists: bool, owner: int | None) -> bool:
        return self.reserved(session_id) or (exists and owner is None)

    def check_ask(self, peer: Peer, operator: bool, session_id: str, exists: bool,
                  owner: int | None) -> None:
        """Raise Forbidden unless `peer` may append a turn to `session_id`."""
        if self.is_daemon_session(session_id, exists, owner):
            how = ("fork it: kvctl ask --fork --session ID (POST /v1/sessions/ID/fork)"
                   if operator else "operators may fork it (POST /v1/sessions/ID/fork)")
            raise Forbidden(f"session {session_id!r} is written only by the daemon; to ask "
                            f"about it, {how.replace('ID', session_id)}", kind="daemon_session")
        if exists and owner != peer.uid and not operator:
            raise Forbidden(f"session {session_id!r} belongs to {name_of_uid(owner or 0)}; "
                            f"you (uid {peer.uid}) may ask only in sessions you created",
                            kind="not_owner")

    def may_read_text(self, peer: Peer, operator: bool, session_id: str,
                      owner: int | None) -> bool:
        """Whether `peer` may read the conversation of an existing session: an operator any;
        others their own, and the daemon's except another user's questions about an asset
        (`<asset>:ask:<user>` holds that user's words)."""
        if operator:
            return True
        ask = self._ask.fullmatch(session_id) if self._ask is not None else None
        if ask is not None:
            return ask.group(1) == ask_user(peer.uid)
        return owner == peer.uid or self.is_daemon_session(session_id, True, owner)

    def check_drop(self, peer: Peer, operator: bool, session_id: str, owner: int | None) -> None:
        """Raise Forbidden unless `peer` may drop an existing session."""
        if operator or (owner == peer.uid and not self.reserved(session_id)):
            return
        whose = ("the daemon's" if self.is_daemon_session(session_id, True, owner)
                 else f"owned by {name_of_uid(owner or 0)}")
        raise Forbidden(f"session {session_id!r} is {whose}; only its owner and operators may "
                        f"drop it", kind="not_owner")
