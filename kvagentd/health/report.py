"""The vocabulary of health: a level, a named check with its reason, and the report of all.

Levels order as ok < degraded < failing; a report's status is its worst check. `degraded`:
the daemon does its job with less margin or with a fault it works around (cold tier on the
shadow, lost blocks recomputed). `failing`: part of its job is not being done (an asset not
ticking, sensor data stale, a service stopped).

The model's commentary is not one of the checks: a small model's prose is not the box's
health. Each asset's `Commentary` rides along in the report, shown and exported on its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class Level(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    FAILING = "failing"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Level.OK: 0, Level.DEGRADED: 1, Level.FAILING: 2}


def worst(levels: Iterable[Level]) -> Level:
    return max(levels, key=lambda lv: lv.rank, default=Level.OK)


@dataclass(frozen=True, slots=True)
class Check:
    """One named check. `name` is stable (`kvctl health ack NAME`); `reason` says why, with
    the figure and the threshold it was judged against."""

    name: str
    level: Level
    reason: str
    ackable: bool = False  # counts something an operator can acknowledge
    # The evidence is unambiguous and already spans its own limit (no sensor data for the
    # stale limit, a full disk, a stalled main loop): health takes this level without a hold.
    at_once: bool = False
    # Set on a settled check (`settle.Settled`): the level the check reads now that has not
    # held long enough to count, and for how long it has held.
    pending: Level | None = None
    pending_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.level.value,
                               "reason": self.reason}
        if self.ackable:
            out["ackable"] = True
        if self.pending is not None:
            out["pending"] = self.pending.value
            out["pending_s"] = round(self.pending_s, 1)
        return out


@dataclass(frozen=True, slots=True)
class Commentary:
    """Whether an asset's ticks get the model's commentary: `ok`, or `missing` once its last
    few model turns gave none (failed, cut by the tick's deadline, or withheld by the check).
    Counters are since start."""

    asset: str
    state: str  # ok | missing
    reason: str
    failed: int = 0
    cut: int = 0
    withheld: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"asset": self.asset, "state": self.state, "reason": self.reason,
                "failed": self.failed, "cut": self.cut, "withheld": self.withheld}


@dataclass(frozen=True, slots=True)
class Report:
    checks: tuple[Check, ...]
    acknowledged_at: float | None = None
    commentary: tuple[Commentary, ...] = ()  # per asset; never part of `level`

    @property
    def level(self) -> Level:
        return worst(c.level for c in self.checks)

    def not_ok(self) -> list[Check]:
        """The checks that are not ok, worst first."""
        return sorted((c for c in self.checks if c.level is not Level.OK),
                      key=lambda c: -c.level.rank)

    def summary(self, limit: int = 3) -> str:
        """One line: "ok", or the level and the worst checks with their reasons."""
        bad = self.not_ok()
        if not bad:
            return "ok"
        parts = [f"{c.name}: {c.reason}" for c in bad[:limit]]
        more = f"; +{len(bad) - limit} more" if len(bad) > limit else ""
        return f"{self.level.value}: " + "; ".join(parts) + more

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.level.value, "checks": [c.as_dict() for c in self.checks],
                "acknowledged_at": self.acknowledged_at,
                "commentary": [c.as_dict() for c in self.commentary]}


def age(seconds: float | None) -> str:
    """A duration for a reason: "0.8 s", "27 s", "4 min", "2.5 h", "3 d"."""
    if seconds is None:
        return "never"
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.0f} d"


def size(n: float | None) -> str:
    """Bytes in binary units: "1.5 GiB"."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def pct(x: float) -> str:
    return f"{100 * x:.0f} %" if x >= 0.01 or x == 0 else f"{100 * x:.1f} %"
