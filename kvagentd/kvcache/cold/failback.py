"""Failing back from the shadow to the SSD: probes, the space check, and the restore.

While the shadow serves, every health interval probes the SSD (write, fsync, read back and
remove a small file). After `failback_good_probes` good probes in a row the restore writes
every shadow record back to the SSD and only then deletes it from the shadow, so a failure
part way loses nothing and keeps the shadow serving.

A restore starts only when it can finish: the SSD store must take writes (an index that
could not be written at start is reopened first) and the disk must have room for the
shadow's records plus the free-space floor. Otherwise it is deferred (`RestoreDeferred`),
the reason stays in `Failback.deferred` (and the pair's status), and `space_wanted()`
tells the health monitor how much to evict on the SSD to make that room.

`Failback` owns its counters and locks; it drives its pair (`FailoverColdStore`) only through
`FailoverPair`, so the pair imports it and not the other way round.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.causes import Cause
from kvagentd.kvcache.cold.serving import ServingTier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.fileio import FileOps

log = structlog.get_logger(__name__)

PROBE_NAME = ".kvagentd-probe"


class FailoverError(RuntimeError):
    """A restore could not complete (the SSD is still failing); the shadow keeps serving."""


class RestoreDeferred(FailoverError):
    """A restore did not start: the SSD takes no writes yet, or has no room for the shadow's
    records above the free-space floor. Nothing moved; the shadow keeps serving."""


class FailoverPair(Protocol):
    """What the failback reads and switches of its failover pair."""

    @property
    def primary(self) -> ColdStore: ...

    @property
    def shadow(self) -> ColdStore: ...

    @property
    def geometry(self) -> KVGeometry: ...

    @property
    def free_floor_bytes(self) -> int: ...

    @property
    def serving(self) -> ServingTier: ...

    @property
    def reason(self) -> str: ...

    @property
    def wear_read_only(self) -> bool: ...

    def set_state(self, new: ServingTier, reason: str, cause: Cause | None = None) -> None: ...

    def resync_errors(self) -> None: ...

    def restore_failed(self, reason: str) -> None: ...

    def free_bytes(self) -> int | None: ...


class Failback:
    """The way back from the shadow to the SSD of one failover pair, and its counters.

    `lock` guards `good_probes`; `restore_lock` lets one restore run at a time (the counters
    a restore changes, `deferred`, `failbacks` and `restored_blocks`, are written under it).
    NOTE: the pair calls `reset_probes` while holding its own lock, so this object never takes
    the pair's lock while holding `lock`.
    """

    def __init__(self, pair: FailoverPair, *, probe_dir: Path, file_io: FileOps,
                 good_probes_needed: int) -> None:
        self.pair = pair
        self.probe_dir = probe_dir
        self.file_io = file_io
        self.good_probes_needed = good_probes_needed
        self.lock = threading.Lock()
        self.restore_lock = threading.Lock()
        self.good_probes = 0
        self.failbacks = 0
        self.restored_blocks = 0
        self.deferred: str | None = None  # why the last due restore did not start

    def reset_probes(self) -> None:
        """The serving tier changed: good probes count again from zero."""
        with self.lock:
            self.good_probes = 0

    def probe_once(self) -> bool:
        """Write, fsync, read back and remove a small file on the SSD through its file_io."""
        fio = self.file_io
        path = str(self.probe_dir / PROBE_NAME)
        payload = os.urandom(4096)
        try:
            fio.makedirs(str(self.probe_dir))  # a directory that could not be created at start
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

    def space_wanted(self) -> int:
        """Bytes to free on the SSD before the shadow's records fit above the floor (0 when
        they fit, or when the free space is unknown)."""
        pair = self.pair
        free = pair.free_bytes()
        if free is None:
            return 0
        return max(0, int(pair.shadow.bytes_used) + pair.free_floor_bytes - free)

    def blocker(self) -> str | None:
        """Why a restore cannot start now (trying to reopen an SSD store that could not be
        written at start), or None."""
        pair = self.pair
        if pair.primary.unwritable is not None:
            why = pair.primary.reopen()
            if why is not None:
                return f"the SSD store still takes no writes: {why}"
        short = self.space_wanted()
        if short > 0:
            free = pair.free_bytes()
            return (f"not enough free space on the SSD: {pair.shadow.bytes_used} B to write "
                    f"back above the {pair.free_floor_bytes} B floor, {free} B free "
                    f"({short} B short)")
        return None

    def restore(self, reason: str) -> dict[str, Any]:
        """See `FailoverColdStore.restore`."""
        pair = self.pair
        with self.restore_lock:
            if pair.serving is ServingTier.SSD and not pair.shadow.keys():
                self.deferred = None
                return {"restored": 0, "serving": pair.serving.value}
            if pair.serving is ServingTier.SSD:
                pair.set_state(ServingTier.SHADOW, "records left in the shadow", Cause.START)
            pair.resync_errors()
            if pair.wear_read_only:
                raise FailoverError("the SSD is read-only for wear; replace it before restoring")
            blocker = self.blocker()
            if blocker is not None:
                if blocker != self.deferred:
                    log.warning("cold_restore_deferred", reason=blocker)
                self.deferred = blocker
                raise RestoreDeferred(f"restore deferred: {blocker}")
            self.deferred = None
            pair.primary.read_only = False  # set by an EROFS write failure
            pair.set_state(ServingTier.RESTORING, reason)
            moved = self._write_back()
            if pair.shadow.keys():
                pair.set_state(ServingTier.SHADOW, "restore left records in the shadow")
                raise FailoverError("restore could not drain the shadow")
            pair.set_state(ServingTier.SSD, reason)
            self.failbacks += 1
            self.restored_blocks += moved
            log.warning("cold_tier_failback", restored=moved, reason=reason)
            return {"restored": moved, "serving": pair.serving.value}

    def _write_back(self) -> int:
        """Copy every shadow record to the SSD, deleting each from the shadow once stored."""
        pair = self.pair
        moved = 0
        buf = torch.empty(pair.geometry.block_shape, dtype=pair.geometry.dtype)
        for _ in range(8):  # re-list: writes racing the state change may land late
            rows = pair.shadow.snapshot()
            if not rows:
                break
            for b in rows:
                if pair.serving is not ServingTier.RESTORING:
                    raise FailoverError(f"restore interrupted after {moved} blocks: "
                                        f"{pair.reason}")
                if not pair.shadow.read_into([b.key], [buf])[0]:
                    continue  # unreadable in the shadow: it was lost there, counted there
                try:
                    ok = pair.primary.contains(b.key) or pair.primary.put_many(
                        [b.key], [buf], session=b.sessions[0] if b.sessions else "",
                        num_tokens=pair.geometry.block_tokens)[0]
                except (OSError, sqlite3.Error) as exc:
                    ok = False
                    pair.restore_failed(f"restore failed: {exc}")
                if not ok:
                    pair.restore_failed("restore failed: SSD write refused")
                    raise FailoverError(f"restore stopped after {moved} blocks: "
                                        "the SSD refused a write")
                pair.shadow.delete([b.key])
                moved += 1
        return moved

    def probe(self) -> dict[str, Any]:
        """One health-interval probe: while on the shadow, count good probes and fail back
        after `good_probes_needed` in a row (unless the restore is deferred)."""
        if self.pair.serving is not ServingTier.SHADOW:
            return {"probed": False, "serving": self.pair.serving.value}
        ok = self.probe_once()
        with self.lock:
            self.good_probes = self.good_probes + 1 if ok else 0
            good = self.good_probes
        out: dict[str, Any] = {"probed": True, "ok": ok, "good_probes": good}
        if good >= self.good_probes_needed:
            try:
                out["restore"] = self.restore(f"{good} good probes")
            except RestoreDeferred as exc:
                out["restore_deferred"] = str(exc)
            except FailoverError as exc:
                out["restore_error"] = str(exc)
        return out
