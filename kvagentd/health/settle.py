"""Hysteresis: a check's level counts only once it has held (`[health]` `raise_after_s`,
`clear_after_s`), so health does not flap with a figure that wanders around a threshold.

`Settled` is the one object that remembers, per check, since when its reading has been at
least (or at most) each level; the daemon keeps one and passes every fresh report through
`settle`. A check's settled level rises to the worst level its readings have held for
`raise_after_s` (at once for a check marked `at_once`: its evidence already spans its own
limit), and falls to the best level they have held for `clear_after_s`. A check seen for the
first time starts from ok. Each change of a check's settled level, and of the overall level, is
logged once: at warning when worse, at info when better.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import structlog

from kvagentd.config import HealthConfig
from kvagentd.health.report import Check, Level, Report, worst

log = structlog.get_logger(__name__)

_LEVELS = (Level.OK, Level.DEGRADED, Level.FAILING)


@dataclass(slots=True)
class _Track:
    settled: Level = Level.OK
    at_least: dict[Level, float] = field(default_factory=dict)  # reading >= level since
    at_most: dict[Level, float] = field(default_factory=dict)  # reading <= level since

    def observe(self, level: Level, now: float) -> None:
        for lv in _LEVELS:
            if level.rank >= lv.rank:
                self.at_least.setdefault(lv, now)
            else:
                self.at_least.pop(lv, None)
            if level.rank <= lv.rank:
                self.at_most.setdefault(lv, now)
            else:
                self.at_most.pop(lv, None)

    def target(self, c: Check, now: float, h: HealthConfig) -> Level:
        """The level this check settles at now."""
        if c.at_once or c.level is self.settled:
            return c.level
        if c.level.rank > self.settled.rank:  # worse: the worst level held long enough
            held = [lv for lv in _LEVELS if self.settled.rank < lv.rank <= c.level.rank
                    and now - self.at_least[lv] >= h.raise_after_s]
            return max(held, key=lambda lv: lv.rank, default=self.settled)
        held = [lv for lv in _LEVELS if c.level.rank <= lv.rank < self.settled.rank
                and now - self.at_most[lv] >= h.clear_after_s]
        return min(held, key=lambda lv: lv.rank, default=self.settled)


class Settled:
    """The settled level of every check, kept across reports (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._level = Level.OK

    @property
    def level(self) -> Level:
        """The overall settled level of the last report."""
        with self._lock:
            return self._level

    def settle(self, report: Report, h: HealthConfig) -> Report:
        """`report` with each check at its settled level; a check whose reading differs says
        so (`pending`, and a note in its reason)."""
        with self._lock:
            now = self._clock()
            out = []
            for c in report.checks:
                t = self._tracks.setdefault(c.name, _Track())
                t.observe(c.level, now)
                new = t.target(c, now, h)
                if new is not t.settled:
                    _log_change(c.name, t.settled, new, c.reason)
                    t.settled = new
                out.append(self._shown(c, t, now, h))
            seen = {c.name for c in report.checks}
            for name in [n for n in self._tracks if n not in seen]:
                del self._tracks[name]  # a check that is gone (acknowledged, or no longer made)
            settled = dataclasses.replace(report, checks=tuple(out))
            level = worst(c.level for c in out)
            if level is not self._level:
                event = log.warning if level.rank > self._level.rank else log.info
                event("health_changed", old=self._level.value, new=level.value,
                      checks={c.name: c.reason for c in settled.not_ok()})
                self._level = level
            return settled

    def forget(self, names: Collection[str]) -> None:
        """Drop what is remembered of these checks (all when empty): an operator acknowledged
        their counters, so their next reading counts at once."""
        with self._lock:
            for name in list(self._tracks) if not names else names:
                self._tracks.pop(name, None)

    @staticmethod
    def _shown(c: Check, t: _Track, now: float, h: HealthConfig) -> Check:
        if c.level is t.settled:
            return c
        if c.level.rank > t.settled.rank:
            held, hold = now - t.at_least[c.level], h.raise_after_s
            note = f" ({c.level.value} for {_secs(held)}; counts after {_secs(hold)})"
        else:
            held, hold = now - t.at_most[c.level], h.clear_after_s
            note = (f" ({c.level.value} for {_secs(held)}; stays {t.settled.value} until "
                    f"{_secs(hold)})")
        return dataclasses.replace(c, level=t.settled, reason=c.reason + note,
                                   pending=c.level, pending_s=held)


def _log_change(name: str, old: Level, new: Level, reason: str) -> None:
    event = log.warning if new.rank > old.rank else log.info
    event("health_check_changed", check=name, old=old.value, new=new.value, reason=reason)


def _secs(s: float) -> str:
    return f"{s:.0f} s"
