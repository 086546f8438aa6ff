"""Failing back from the shadow to the SSD: probes, the space check, and the restore.

While the shadow serves, every health interval probes the SSD (write, fsync, read back and
remove a small file). After `failback_good_probes` good probes in a row the restore writes
every shadow record back to the SSD and only then deletes it from the shadow, so a failure
part way loses nothing and keeps the shadow serving.

A restore starts only when it can finish: the SSD store must take writes (an index that
could not be written at start is reopened first) and the disk must have room for the
shadow's records plus the free-space floor. Otherwise it is deferred (`RestoreDeferred`),
the reason stays in the pair's `restore_deferred` (and its status), and `space_wanted()`
tells the health monitor how much to evict on the SSD to make that room.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from typing import TYPE_CHECKING, Any

import structlog
import torch

from kvagentd.kvcache.cold.causes import Cause
from kvagentd.kvcache.cold.serving import ServingTier

if TYPE_CHECKING:
    from kvagentd.kvcache.cold.failover import FailoverColdStore

log = structlog.get_logger(__name__)

PROBE_NAME = ".kvagentd-probe"


class FailoverError(RuntimeError):
    """A restore could not complete (the SSD is still failing); the shadow keeps serving."""


class RestoreDeferred(FailoverError):
    """A restore did not start: the SSD takes no writes yet, or has no room for the shadow's
    records above the free-space floor. Nothing moved; the shadow keeps serving."""


def probe_once(fo: FailoverColdStore) -> bool:
    """Write, fsync, read back and remove a small file on the SSD through its file_io."""
    fio = fo.file_io
    path = str(fo.probe_dir / PROBE_NAME)
    payload = os.urandom(4096)
    try:
        fio.makedirs(str(fo.probe_dir))  # a directory that could not be created at start
        fd = fio.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if fio.pwrite(fd, payload, 0) != len(payload):
                raise OSError(errno.EIO, "short probe write")
            fio.fsync(fd)
            back = bytearray(len(payload))
            if fio.preadv(fd, [memoryview(back)], 0) != len(payload):
                raise OSError(errno.EIO, "short probe read")
        finally:
            fio.close(fd)
        fio.unlink(path)
    except OSError as exc:
        log.info("ssd_probe_failed", error=str(exc))
        return False
    return bytes(back) == payload


def space_wanted(fo: FailoverColdStore) -> int:
    """Bytes to free on the SSD before the shadow's records fit above the floor (0 when they
    fit, or when the free space is unknown)."""
    free = fo.free_bytes()
    if free is None:
        return 0
    return max(0, int(fo.shadow.bytes_used) + fo.free_floor_bytes - free)


def restore_blocker(fo: FailoverColdStore) -> str | None:
    """Why a restore cannot start now (trying to reopen an SSD store that could not be
    written at start), or None."""
    if fo.primary.unwritable is not None:
        why = fo.primary.reopen()
        if why is not None:
            return f"the SSD store still takes no writes: {why}"
    short = space_wanted(fo)
    if short > 0:
        free = fo.free_bytes()
        return (f"not enough free space on the SSD: {fo.shadow.bytes_used} B to write back "
                f"above the {fo.free_floor_bytes} B floor, {free} B free ({short} B short)")
    return None


def restore(fo: FailoverColdStore, reason: str) -> dict[str, Any]:
    """See `FailoverColdStore.restore`."""

    with fo.restore_lock:
        if fo.state is ServingTier.SSD and not fo.shadow.keys():
            fo.restore_deferred = None
            return {"restored": 0, "serving": fo.state.value}
        if fo.state is ServingTier.SSD:
            fo.set_state(ServingTier.SHADOW, "records left in the shadow", Cause.START)
        fo.resync_errors()
        if fo.wear_read_only:
            raise FailoverError("the SSD is read-only for wear; replace it before restoring")
        blocker = restore_blocker(fo)
        if blocker is not None:
            if blocker != fo.restore_deferred:
                log.warning("cold_restore_deferred", reason=blocker)
            fo.restore_deferred = blocker
            raise RestoreDeferred(f"restore deferred: {blocker}")
        fo.restore_deferred = None
        fo.primary.read_only = False  # set by an EROFS write failure
        fo.set_state(ServingTier.RESTORING, reason)
        moved = _write_back(fo)
        if fo.shadow.keys():
            fo.set_state(ServingTier.SHADOW, "restore left records in the shadow")
            raise FailoverError("restore could not drain the shadow")
        fo.set_state(ServingTier.SSD, reason)
        fo.failbacks += 1
        fo.restored_blocks += moved
        log.warning("cold_tier_failback", restored=moved, reason=reason)
        return {"restored": moved, "serving": fo.state.value}


def _write_back(fo: FailoverColdStore) -> int:
    """Copy every shadow record to the SSD, deleting each from the shadow once stored."""

    moved = 0
    buf = torch.empty(fo.geometry.block_shape, dtype=fo.geometry.dtype)
    for _ in range(8):  # re-list: writes racing the state change may land late
        rows = fo.shadow.snapshot()
        if not rows:
            break
        for b in rows:
            if fo.state is not ServingTier.RESTORING:
                raise FailoverError(f"restore interrupted after {moved} blocks: {fo.reason}")
            if not fo.shadow.read_into([b.key], [buf])[0]:
                continue  # unreadable in the shadow: it was lost there, counted there
            try:
                ok = fo.primary.contains(b.key) or fo.primary.put_many(
                    [b.key], [buf], session=b.sessions[0] if b.sessions else "",
                    num_tokens=fo.geometry.block_tokens)[0]
            except (OSError, sqlite3.Error) as exc:
                ok = False
                fo.restore_failed(f"restore failed: {exc}")
            if not ok:
                fo.restore_failed("restore failed: SSD write refused")
                raise FailoverError(f"restore stopped after {moved} blocks: "
                                    "the SSD refused a write")
            fo.shadow.delete([b.key])
            moved += 1
    return moved


def probe(fo: FailoverColdStore) -> dict[str, Any]:
    """One health-interval probe: while on the shadow, count good probes and fail back
    after `failback_good_probes` in a row (unless the restore is deferred)."""
    if fo.state is not ServingTier.SHADOW:
        return {"probed": False, "serving": fo.state.value}
    ok = probe_once(fo)
    with fo._lock:
        fo.good_probes = fo.good_probes + 1 if ok else 0
        due = fo.good_probes >= fo.failback_good_probes
    out: dict[str, Any] = {"probed": True, "ok": ok, "good_probes": fo.good_probes}
    if due:
        try:
            out["restore"] = restore(fo, f"{fo.good_probes} good probes")
        except RestoreDeferred as exc:
            out["restore_deferred"] = str(exc)
        except FailoverError as exc:
            out["restore_error"] = str(exc)
    return out
