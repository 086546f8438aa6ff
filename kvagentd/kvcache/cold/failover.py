"""Shadow-partition failover of the cold tier.

`FailoverColdStore` is the `ColdTier` the store sees. It holds the SSD cold store (primary)
and a size-capped cold store of the same format in `maintenance.shadow_dir` (tmpfs). It serves
cold writes from one of them:

    SSD --activate--> SHADOW --restore--> RESTORING --(shadow drained)--> SSD
                                             \\--(a write-back failed)--> SHADOW

- activate: a write fault on the SSD (EIO, ENOSPC, EROFS seen as new I/O errors of the primary,
  or an OSError out of it), read EIOs, the health monitor saying the device failed, or an
  operator. The write that hit the fault is retried on the shadow, so it is not lost.
- While on the shadow, new writes go to the shadow; reads look in the shadow first, then on the
  SSD: a block on the failing SSD either reads and verifies, or is reported missing (the engine
  recomputes it). Nothing is deleted from the SSD by failing over.
- the listener's `cold_failed_over()` (the store) is called after every switch to the shadow
  caused by a fault: cold copies made on the SSD may be unreadable now, so the store writes
  hot and warm blocks again when it demotes them.
- restore (an operator, or `failback_good_probes` consecutive good probes of the SSD): every
  shadow record is read, written to the SSD and only then deleted from the shadow; a failure
  stops the restore and keeps serving from the shadow. So no committed block is lost. A
  restore starts only when the SSD store takes writes and the disk has room for the shadow's
  records above the free-space floor; otherwise it is deferred (`failback.py`).
- every switch to the shadow has a `cause` (`causes.Cause`): a full disk, a read-only one,
  I/O errors, an operator, or records left in the shadow at start. An SSD directory that
  cannot be written at start (read-only, a full disk) starts the pair on the shadow instead
  of failing: its records stay readable.
- while the shadow serves, compaction keeps running: on the shadow, and on the SSD (rewriting
  live records only while the device itself is healthy, a full disk; only dropping dead
  segments after I/O errors; not at all while it is read-only).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog
import torch

from kvagentd.kvcache.base import (BlockInfo, BlockKey, ColdEntry, ColdListener, KVGeometry,
                                   VerifyProgress)
from kvagentd.kvcache.cold.causes import Cause
from kvagentd.kvcache.cold.failback import PROBE_NAME, Failback, FailoverError, RestoreDeferred
from kvagentd.kvcache.cold.serving import TRANSITIONS, ColdView, ServingTier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.fileio import FileIO, FileOps
from kvagentd.kvcache.transitions import check_transition

log = structlog.get_logger(__name__)

__all__ = ["PROBE_NAME", "ColdView", "FailoverColdStore", "FailoverError", "RestoreDeferred",
           "ServingTier"]


def _suspect(cause: Cause) -> bool:
    """Copies already on the SSD may be unreadable: anything but a full disk (a file system
    turns read-only at run time after I/O errors; an operator has a reason)."""
    return cause is not Cause.NO_SPACE


def _io_errors(store: ColdStore) -> int:
    """Faults a cold store has counted: read I/O errors plus failed writes (EIO, ENOSPC, EROFS)."""
    c = store.counters
    return c["io_errors"] + c["write_failures"]


class FailoverColdStore:
    """Cold tier = SSD `primary` with a `shadow` stand-in; see the module docstring.

    `file_io` is the primary's file-operation object (probes go through it so that injected or
    real faults show); `probe_dir` the primary's directory; `listener` hears of failovers
    (the primary and the shadow report their own evictions to it). The way back to the SSD,
    and its counters, are `failback` (`failback.Failback`).
    """

    def __init__(self, primary: ColdStore, shadow: ColdStore, geometry: KVGeometry, *,
                 probe_dir: Path, file_io: FileOps | None = None, failback_good_probes: int = 3,
                 shadow_capacity_bytes: int = 0, clock: Callable[[], float] = time.time,
                 listener: ColdListener | None = None,
                 free_bytes: Callable[[], int | None] | None = None,
                 free_floor_bytes: int = 0) -> None:
        if primary.namespace != shadow.namespace:
            raise ValueError("the SSD store and its shadow hold different namespaces")
        self.primary, self.shadow, self.geometry = primary, shadow, geometry
        self.namespace = primary.namespace
        self.listener = listener
        self.probe_dir = Path(probe_dir)
        self.file_io: FileOps = file_io if file_io is not None else FileIO()
        self.shadow_capacity_bytes = shadow_capacity_bytes
        self.free_floor_bytes = int(free_floor_bytes)
        self._free_bytes = free_bytes
        self.clock = clock
        self._lock = threading.RLock()
        self.state = ServingTier.SSD
        self.cause: Cause | None = None  # why the shadow serves (None while the SSD does)
        self.since = clock()
        self.reason = "start"
        self.failovers = 0
        self.failback = Failback(self, probe_dir=self.probe_dir, file_io=self.file_io,
                                 good_probes_needed=failback_good_probes)
        self._errors_seen = _io_errors(primary)
        self._wear_read_only = bool(primary.read_only)
        if primary.unwritable is not None:
            # A read-only cold directory, or a full disk: serve from the shadow meanwhile;
            # the SSD's records stay readable. Nothing to tell the store: it holds no
            # blocks yet.
            cause = primary.unwritable_cause or Cause.IO_ERROR
            self.set_state(ServingTier.SHADOW, "the cold directory could not be written at "
                           f"start ({cause.value}): {primary.unwritable}", cause)
            self.failovers += 1
        elif (free := self.free_bytes()) is not None and free < self.free_floor_bytes:
            # A full disk (the index got the reserve's room to open): new records go to the
            # shadow until eviction makes room above the floor.
            self.set_state(ServingTier.SHADOW, f"the cold disk has {free} B free at start, "
                           f"below the {self.free_floor_bytes} B floor", Cause.NO_SPACE)
            self.failovers += 1
        elif shadow.keys():
            # A previous run failed over and stopped before failing back: keep serving the
            # shadow's records and write them back after good probes.
            self.set_state(ServingTier.SHADOW,
                           f"shadow holds {len(shadow.keys())} blocks at start", Cause.START)

    # ---- state ---------------------------------------------------------------------------
    def set_state(self, new: ServingTier, reason: str, cause: Cause | None = None) -> None:
        """Switch the serving tier (along `TRANSITIONS`); `cause` of a switch to the shadow
        (kept when None: the restore going back)."""
        with self._lock:
            check_transition(TRANSITIONS, self.state, new, "cold tier serving")
            old, self.state = self.state, new
            self.since, self.reason = self.clock(), reason
            self.failback.reset_probes()
            if new is ServingTier.SSD:
                self.cause = None
            elif cause is not None:
                self.cause = cause
        log.warning("cold_tier_serving", old=old.value, new=new.value, reason=reason,
                    cause=self.cause.value if self.cause else None)

    @property
    def serving(self) -> ServingTier:
        return self.state

    @property
    def wear_read_only(self) -> bool:
        """The SSD was made read-only for wear (a restore must wait for a new device)."""
        return self._wear_read_only

    def activate(self, reason: str, cause: Cause | None = None) -> bool:
        """Send new cold writes to the shadow; False when already there. `cause` defaults to
        what the SSD store's last failed write said (else I/O errors). Already on the shadow,
        I/O errors replace a milder cause (compaction then stops rewriting the SSD). The store
        is told to stop relying on SSD copies unless the disk is merely full (`_suspect`):
        those copies read."""
        cause = cause or self.primary.last_fault or Cause.IO_ERROR
        with self._lock:
            switched = self.state is not ServingTier.SHADOW
            if switched:
                if self.state is ServingTier.SSD:
                    self.failovers += 1
                self.set_state(ServingTier.SHADOW, reason, cause)  # a restore notices, stops
                suspect = _suspect(cause)
            else:
                escalate = cause is Cause.IO_ERROR and self.cause is not Cause.IO_ERROR
                # copies kept so far (a full disk) are suspect from now on
                suspect = escalate and not _suspect(self.cause or Cause.NO_SPACE)
                if escalate:
                    self.cause = cause
                    log.warning("cold_tier_failover_cause", cause=cause.value, reason=reason)
        if suspect:
            self._notify_failover()
        return switched

    def restore_failed(self, reason: str) -> None:
        """A write-back failed part way: serve from the shadow again."""
        cause = self.primary.last_fault or Cause.IO_ERROR
        with self._lock:
            if self.state is not ServingTier.RESTORING:
                return
            self.set_state(ServingTier.SHADOW, reason, cause)
        if _suspect(cause):
            self._notify_failover()

    def resync_errors(self) -> None:
        """Forget the SSD store's faults seen so far (before a restore writes to it)."""
        with self._lock:
            self._errors_seen = _io_errors(self.primary)

    def free_bytes(self) -> int | None:
        """Free bytes on the SSD's filesystem, or None when unknown."""
        if self._free_bytes is not None:
            return self._free_bytes()
        try:
            st = os.statvfs(self.probe_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def space_wanted(self) -> int:
        """Bytes to free on the SSD before a restore deferred for space can start (0 when
        none is deferred for space, or the shadow's records fit)."""
        if self.state is ServingTier.SSD or self.failback.deferred is None \
                or self.primary.unwritable is not None:
            return 0
        return self.failback.space_wanted()

    def _notify_failover(self) -> None:
        """Tell the store that SSD copies are no longer to be relied on (no lock held)."""
        if self.listener is None:
            return
        try:
            self.listener.cold_failed_over()
        except Exception:  # the failover itself has happened; a listener bug must not undo it
            log.exception("cold_failover_hook_failed")

    def _primary_faulted(self) -> bool:
        """New I/O errors on the primary since last looked (consumes them)."""
        n = _io_errors(self.primary)
        with self._lock:
            new = n > self._errors_seen
            self._errors_seen = n
        return new

    # ---- ColdTier ------------------------------------------------------------------------
    def put(self, key: BlockKey, block: torch.Tensor, *, session: str = "",
            num_tokens: int = 0) -> bool:
        return self.put_many([key], [block], session=session, num_tokens=num_tokens)[0]

    def read_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        result = [False] * len(keys)
        shadow_empty = self.shadow.bytes_used == 0
        in_shadow = [] if shadow_empty else [i for i, k in enumerate(keys) if self.shadow.contains(k)]
        taken = set(in_shadow)
        rest = [i for i in range(len(keys)) if i not in taken]
        if in_shadow:
            got = self.shadow.read_into([keys[i] for i in in_shadow], [outs[i] for i in in_shadow])
            for i, ok in zip(in_shadow, got):
                result[i] = ok
        if rest:
            try:
                got = self.primary.read_into([keys[i] for i in rest], [outs[i] for i in rest])
            except (OSError, sqlite3.Error) as exc:
                got = [False] * len(rest)
                self.activate(f"cold read failed on the SSD: {exc}", Cause.IO_ERROR)
            for i, ok in zip(rest, got):
                result[i] = ok
            if not all(got) and self._primary_faulted():
                self.activate("cold read errors on the SSD", Cause.IO_ERROR)
        return result

    def contains(self, key: BlockKey) -> bool:
        return self.shadow.contains(key) or self.primary.contains(key)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """0: every record of this box's cold tier is listed by its owner at start."""
        return 0

    def offer(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], *,
              session: str = "") -> None:
        """Nothing: blocks reach this tier when the store demotes or persists them."""

    def delete(self, keys: Iterable[BlockKey]) -> int:
        keys = list(keys)
        n = self.shadow.delete(keys)
        try:
            n += self.primary.delete(keys)
        except (OSError, sqlite3.Error) as exc:
            log.warning("cold_delete_failed", error=str(exc))
        return n

    def keys(self) -> list[BlockKey]:
        seen = dict.fromkeys(self.shadow.keys())
        seen.update(dict.fromkeys(self.primary.keys()))
        return list(seen)

    def snapshot(self) -> list[BlockInfo]:
        rows = {b.key: b for b in self.primary.snapshot()}
        rows.update({b.key: b for b in self.shadow.snapshot()})
        return list(rows.values())

    def evict(self, keys: Sequence[BlockKey]) -> int:
        return self.delete(keys)

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """Checksum-verify the records of both stores (the scrub); counts summed, progress
        over both (the shadow first)."""
        on_shadow = on_ssd = None
        if progress is not None:
            report = progress
            n_shadow, n_ssd = self.shadow.index.count(), self.primary.index.count()

            def on_shadow(done: int, total: int) -> None:
                report(done, total + n_ssd)

            def on_ssd(done: int, total: int) -> None:
                report(n_shadow + done, n_shadow + total)
        a = self.shadow.verify(repair=repair, rate_bytes_per_s=rate_bytes_per_s,
                               progress=on_shadow)
        try:
            b = self.primary.verify(repair=repair, rate_bytes_per_s=rate_bytes_per_s,
                                    progress=on_ssd)
        except OSError as exc:
            self.activate(f"verify failed on the SSD: {exc.strerror or exc}")
            b = {}
        return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in set(a) | set(b)}

    def compact(self, min_dead_ratio: float = 0.5, *, max_copy_bytes: int | None = None) -> int:
        """Segment compaction of the SSD store, and of the shadow while it serves; on the
        shadow, the SSD's live records are rewritten only while the device is healthy (a
        full disk), dead segments dropped after I/O errors, nothing while it is read-only."""
        if self.state is ServingTier.SSD:
            return self.primary.compact(min_dead_ratio, max_copy_bytes=max_copy_bytes)
        n = self.shadow.compact(min_dead_ratio, max_copy_bytes=max_copy_bytes)
        cause = self.cause or Cause.IO_ERROR
        if cause is Cause.READ_ONLY or self.primary.unwritable_cause is Cause.READ_ONLY:
            return n
        try:
            n += self.primary.compact(min_dead_ratio, rewrite=cause.device_healthy,
                                      max_copy_bytes=max_copy_bytes)
        except OSError as exc:
            log.warning("cold_compact_failed", error=str(exc))
        return n

    def set_read_only(self, flag: bool) -> None:
        """Wear limit reached (or cleared): the SSD takes no new records; not a failover."""
        self._wear_read_only = flag
        self.primary.read_only = flag

    @property
    def read_only(self) -> bool:
        return self.primary.read_only and self.state is ServingTier.SSD

    @property
    def durable(self) -> bool:
        """Only the SSD is: the shadow is RAM (/dev/shm)."""
        return self.state is ServingTier.SSD

    @property
    def ttl_s(self) -> float:
        """The cold TTL (the SSD store's; the shadow uses the same configuration)."""
        return self.primary.ttl_s

    @property
    def bytes_used(self) -> int:
        return int(self.primary.bytes_used) + int(self.shadow.bytes_used)

    def put_many(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor,
                 *, session: str = "", num_tokens: int = 0) -> list[bool]:
        if self.state is not ServingTier.SHADOW:
            before = _io_errors(self.primary)
            try:
                ok = self.primary.put_many(keys, blocks, session=session, num_tokens=num_tokens)
                fault = _io_errors(self.primary) > before
                reason = "cold write failed on the SSD"
            except (OSError, sqlite3.Error) as exc:
                ok, fault = [False] * len(keys), True
                reason = f"cold write failed on the SSD: {exc}"
            if all(ok) or not fault:
                return ok
            self.activate(reason)
            rest = [i for i, good in enumerate(ok) if not good]
            again = self.shadow.put_many([keys[i] for i in rest], [blocks[i] for i in rest],
                                         session=session, num_tokens=num_tokens)
            for i, good in zip(rest, again):
                ok[i] = good
            return ok
        return self.shadow.put_many(keys, blocks, session=session, num_tokens=num_tokens)

    def expired(self, now: float | None = None) -> list[BlockKey]:
        return list(dict.fromkeys(self.shadow.expired(now) + self.primary.expired(now)))

    def touch(self, keys: Sequence[BlockKey], now: float | None = None) -> None:
        self.shadow.touch(keys, now)
        self.primary.touch(keys, now)

    def entries(self) -> list[ColdEntry]:
        seen = {e[0]: e for e in self.primary.entries()}
        seen.update({e[0]: e for e in self.shadow.entries()})
        return list(seen.values())

    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        refs = {s: list(ks) for s, ks in refs.items()}
        self.shadow.save_refs(refs)
        try:
            self.primary.save_refs(refs)
        except OSError as exc:
            log.warning("cold_save_refs_failed", error=str(exc))

    def load_refs(self) -> dict[str, list[BlockKey]]:
        out = {s: list(ks) for s, ks in self.primary.load_refs().items()}
        for s, ks in self.shadow.load_refs().items():
            out[s] = list(dict.fromkeys(out.get(s, []) + ks))
        return out

    def stats(self) -> dict[str, Any]:
        """The SSD's figures, except what the tier holds: records and bytes of both (while on
        the shadow the SSD may hold none of them), each side also under its own name."""
        p, s = self.primary.stats(), self.shadow.stats()
        return {**{k: v for k, v in p.items() if k != "io_errors"},
                "blocks": int(p.get("blocks", 0)) + int(s.get("blocks", 0)),
                "bytes_used": int(p.get("bytes_used", 0)) + int(s.get("bytes_used", 0)),
                "io_errors": _io_errors(self.primary) + _io_errors(self.shadow),
                "failover": self.status(), "primary": p, "shadow": s}

    def status(self) -> dict[str, Any]:
        used = self.shadow.bytes_used
        cap = self.shadow_capacity_bytes
        fb = self.failback
        return {"serving": self.state.value, "since": self.since, "reason": self.reason,
                "shadow_blocks": len(self.shadow.keys()), "shadow_bytes": used,
                "shadow_capacity_bytes": cap,
                "shadow_fill": round(used / cap, 4) if cap else None,
                "good_probes": fb.good_probes, "failback_after": fb.good_probes_needed,
                "failovers": self.failovers, "failbacks": fb.failbacks,
                "restored_blocks": fb.restored_blocks,
                "cause": self.cause.value if self.cause else None,
                "ssd_unwritable": self.primary.unwritable,
                "restore_deferred": fb.deferred,
                "restore_need_bytes": (int(used) + self.free_floor_bytes
                                       if self.state is not ServingTier.SSD else 0),
                "ssd_free_bytes": self.free_bytes()}

    def view(self) -> ColdView:
        """Read-only figures for health checks and metrics (no index scans)."""
        with self._lock:
            serving, since, reason, cause = self.state.value, self.since, self.reason, self.cause
        fb, p, s = self.failback, self.primary, self.shadow
        return ColdView(serving=serving, since=since, reason=reason,
                        read_only=bool(p.read_only) or p.unwritable is not None,
                        ssd_bytes=p.bytes_used, ssd_capacity_bytes=p.capacity_bytes,
                        shadow_bytes=s.bytes_used,
                        shadow_capacity_bytes=self.shadow_capacity_bytes,
                        counters={"ssd": dict(p.counters), "shadow": dict(s.counters)},
                        index_discarded={"ssd": p.index.discarded_at_open,
                                         "shadow": s.index.discarded_at_open},
                        failovers=self.failovers, failbacks=fb.failbacks,
                        cause=cause.value if cause else None, ssd_unwritable=p.unwritable,
                        restore_deferred=fb.deferred,
                        restore_need_bytes=(int(s.bytes_used) + self.free_floor_bytes
                                            if serving != ServingTier.SSD.value else 0))

    def probe(self) -> dict[str, Any]:
        """One health-interval probe: while on the shadow, count good probes and fail back
        after `failback_good_probes` in a row (unless the restore is deferred)."""
        return self.failback.probe()

    def close(self) -> None:
        self.shadow.close()
        try:
            self.primary.close()
        except (OSError, sqlite3.Error) as exc:
            log.error("cold_close_failed", directory=str(self.probe_dir), error=str(exc))

    # ---- probes and failback -------------------------------------------------------------
    def probe_once(self) -> bool:
        """Write, fsync, read back and remove a small file on the SSD through its file_io."""
        return self.failback.probe_once()

    def restore(self, reason: str = "operator request") -> dict[str, Any]:
        """Write every shadow record back to the SSD, then empty the shadow and serve from the
        SSD. Raises `RestoreDeferred` (nothing moved) when the SSD store takes no writes or
        the disk lacks room for the shadow's records above the floor, `FailoverError` (and
        keeps serving from the shadow) if a write fails."""
        return self.failback.restore(reason)
