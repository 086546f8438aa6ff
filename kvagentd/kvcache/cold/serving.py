"""Which device serves the cold tier (the SSD, the /dev/shm shadow, or a restore between
them), its allowed changes, and the read-only view health checks and metrics take of it."""

from __future__ import annotations

import enum
from typing import NamedTuple


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
