"""Which device serves the cold tier (the SSD, the /dev/shm shadow, or a restore between
them), its allowed changes, and the read-only view health checks and metrics take of it."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvagentd.kvcache.cold.failover import FailoverColdStore


class ServingTier(enum.Enum):
    SSD = "ssd"
    SHADOW = "shadow"
    RESTORING = "restoring"


TRANSITIONS: dict[ServingTier, frozenset[ServingTier]] = {
    ServingTier.SSD: frozenset({ServingTier.SHADOW}),
    ServingTier.SHADOW: frozenset({ServingTier.RESTORING}),
    ServingTier.RESTORING: frozenset({ServingTier.SSD, ServingTier.SHADOW}),
}


class ColdView(NamedTuple):
    """What `FailoverColdStore.view()` reports: serving state and per-device counters
    ("ssd", "shadow": the `ColdStore.counters` of each, e.g. reads, read_bytes, writes,
    write_bytes, corrupt, missing, io_errors, write_failures, evicted)."""

    serving: str  # ServingTier value
    since: float  # unix seconds of the last switch
    reason: str
    read_only: bool  # the SSD store refuses writes (wear limit, EROFS)
    ssd_bytes: int
    ssd_capacity_bytes: int
    shadow_bytes: int
    shadow_capacity_bytes: int
    counters: dict[str, dict[str, int]]
    index_discarded: dict[str, str | None]  # why a device's index was set aside at open
    failovers: int
    failbacks: int
    cause: str | None = None  # Cause value of the switch to the shadow (None on the SSD)
    ssd_unwritable: str | None = None  # why the SSD directory could not be written at open
    restore_deferred: str | None = None  # why the last due restore did not start
    restore_need_bytes: int = 0  # free SSD space a restore wants (shadow records + floor)


def view_of(fo: FailoverColdStore) -> ColdView:
    """Read-only figures of a failover pair for health checks and metrics (no index scans)."""
    with fo._lock:
        serving, since, reason = fo.state.value, fo.since, fo.reason
        cause, deferred = fo.cause, fo.restore_deferred
    p, s = fo.primary, fo.shadow
    return ColdView(serving=serving, since=since, reason=reason,
                    read_only=bool(p.read_only) or p.unwritable is not None,
                    ssd_bytes=p.bytes_used, ssd_capacity_bytes=p.capacity_bytes,
                    shadow_bytes=s.bytes_used, shadow_capacity_bytes=fo.shadow_capacity_bytes,
                    counters={"ssd": dict(p.counters), "shadow": dict(s.counters)},
                    index_discarded={"ssd": p.index.discarded_at_open,
                                     "shadow": s.index.discarded_at_open},
                    failovers=fo.failovers, failbacks=fo.failbacks,
                    cause=cause.value if cause else None, ssd_unwritable=p.unwritable,
                    restore_deferred=deferred,
                    restore_need_bytes=(int(s.bytes_used) + fo.free_floor_bytes
                                        if serving != ServingTier.SSD.value else 0))
