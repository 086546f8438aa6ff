"""POSIX access ACLs: give one more group access to a file the daemon owns.

Why: the control socket is mode 0660, group `control.socket_group`, in a 0750 directory. An
operator (group `control.operator_group`) must be able to connect without also joining the
socket group, so the daemon adds an ACL entry for the operator group to the socket (rw) and to
its directory (search). Linux has no group nesting; an ACL is how one file serves two groups.

The ACL is written as the kernel's `system.posix_acl_access` extended attribute (the format of
<linux/posix_acl_xattr.h>: a little-endian u32 version 2, then (u16 tag, u16 perm, u32 id)
entries sorted by tag and id, with a mask entry whenever named entries exist). NOTE: written
here instead of through pylibacl: it is a stable kernel ABI of a few lines, and pylibacl ships
no wheels (it needs a C compiler and libacl headers on the box).
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from pathlib import Path

XATTR = "system.posix_acl_access"
VERSION = 2
UNDEFINED_ID = 0xFFFFFFFF
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_HEAD = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")

R, W, X = 4, 2, 1


class AclUnsupported(OSError):
    """The file system does not store ACLs (mounted without them, or no support)."""


def encode(entries: dict[tuple[int, int], int]) -> bytes:
    """The xattr value for {(tag, id): perm}."""
    return _HEAD.pack(VERSION) + b"".join(
        _ENTRY.pack(tag, perm, ident) for (tag, ident), perm in sorted(entries.items()))


def decode(blob: bytes) -> dict[tuple[int, int], int]:
    """{(tag, id): perm} of an xattr value; raises ValueError on a malformed one."""
    if len(blob) < _HEAD.size or (len(blob) - _HEAD.size) % _ENTRY.size:
        raise ValueError(f"ACL of {len(blob)} bytes")
    (version,) = _HEAD.unpack_from(blob)
    if version != VERSION:
        raise ValueError(f"ACL version {version}")
    out = {}
    for off in range(_HEAD.size, len(blob), _ENTRY.size):
        tag, perm, ident = _ENTRY.unpack_from(blob, off)
        out[(tag, ident)] = perm
    return out


def read(path: Path) -> dict[tuple[int, int], int]:
    """The access ACL of `path`: its stored one, or the one its mode bits mean."""
    try:
        return decode(os.getxattr(path, XATTR, follow_symlinks=False))
    except OSError as exc:
        if exc.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
            raise
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    return {(USER_OBJ, UNDEFINED_ID): (mode >> 6) & 7, (GROUP_OBJ, UNDEFINED_ID): (mode >> 3) & 7,
            (OTHER, UNDEFINED_ID): mode & 7}


def grant_group(path: Path, gid: int, perm: int) -> None:
    """Give group `gid` exactly `perm` (R|W|X bits) on `path`, keeping every other entry.

    The mask becomes the union of the group-class entries, so the named entry is effective
    and the mode's group bits (which show the mask) still say what the owning group may.
    Raises AclUnsupported where the file system has no ACLs.
    """
    entries = read(path)
    entries[(GROUP, gid)] = perm
    entries[(MASK, UNDEFINED_ID)] = 0
    entries[(MASK, UNDEFINED_ID)] = _union(entries)
    try:
        os.setxattr(path, XATTR, encode(entries), follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EOPNOTSUPP:
            raise AclUnsupported(exc.errno, f"{path}: the file system stores no ACLs") from None
        raise


def group_perm(path: Path, gid: int) -> int | None:
    """The effective permission of named group `gid` on `path` (None: no entry)."""
    entries = read(path)
    perm = entries.get((GROUP, gid))
    if perm is None:
        return None
    return perm & entries.get((MASK, UNDEFINED_ID), 7)


def _union(entries: dict[tuple[int, int], int]) -> int:
    out = 0
    for (tag, _), perm in entries.items():
        if tag in (USER, GROUP_OBJ, GROUP):
            out |= perm
    return out
