"""Rate limiting of repeated warnings, with counts (a `logging.Filter` on the daemon's handler).

A warning is "the same" as an earlier one when it comes from the same logger with the same
event and the same subject (its `asset`, `job`, `service`, `tier`, `device`, `check` or
`session` field; for records of other libraries, the same message template). The first one is
written at once; the same one again within `interval_s` is held back and counted. The next
one written after the interval carries `repeated=N` (how many were held back) and
`repeat_window_s`; `flush()` (the daemon's main loop calls it every few seconds) writes the
last held-back one with its count when no new one came, so a burst that stops is still
reported. Records at other levels pass untouched.

`DropSchedulerSkips` drops APScheduler's own line for a skipped or missed run: the daemon
logs each (as `job_skipped`, with totals), so it is not said twice.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUBJECT_FIELDS = ("asset", "job", "service", "tier", "device", "check", "session")
_SUMMARY_ATTR = "_kvagentd_repeat_summary"


@dataclass(slots=True)
class _Window:
    started: float
    held: int = 0
    last: logging.LogRecord | None = None  # the last one held back


def _key(record: logging.LogRecord) -> tuple[Any, ...]:
    msg = record.msg
    if isinstance(msg, dict):  # a structlog event
        return (record.name, msg.get("event"),
                *(str(msg.get(f)) for f in SUBJECT_FIELDS if f in msg))
    return (record.name, str(msg))  # a library's: its message template


class RepeatLimiter(logging.Filter):
    def __init__(self, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[Any, ...], _Window] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or self.interval_s <= 0 \
                or getattr(record, _SUMMARY_ATTR, False):
            return True
        key, now = _key(record), self.clock()
        with self._lock:
            w = self._windows.get(key)
            if w is not None and now - w.started < self.interval_s:
                w.held += 1
                w.last = record
                return False
            held = w.held if w is not None else 0
            self._windows[key] = _Window(now)
        if held:
            _annotate(record, held, self.interval_s)
        return True

    def flush(self) -> list[logging.LogRecord]:
        """Summaries of the windows that ended with warnings held back (the last one held,
        with its count); windows with nothing held are forgotten."""
        now, out = self.clock(), []
        with self._lock:
            for key, w in list(self._windows.items()):
                if now - w.started < self.interval_s:
                    continue
                if w.held and w.last is not None:
                    rec = copy.copy(w.last)
                    _annotate(rec, w.held, self.interval_s)
                    setattr(rec, _SUMMARY_ATTR, True)
                    out.append(rec)
                del self._windows[key]
        return out


def _annotate(record: logging.LogRecord, held: int, window_s: float) -> None:
    if isinstance(record.msg, dict):
        record.msg = {**record.msg, "repeated": held, "repeat_window_s": window_s}
    else:
        record.msg = f"{record.getMessage()} (repeated {held} more times in {window_s:.0f} s)"
        record.args = None


class DropSchedulerSkips(logging.Filter):
    """Drop APScheduler's "skipped: maximum number of running instances" and "was missed by"
    warnings (the daemon reports skipped and missed runs itself)."""

    _TEMPLATES = ("skipped: maximum number of running instances", "was missed by")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("apscheduler") or record.levelno != logging.WARNING:
            return True
        return not any(t in str(record.msg) for t in self._TEMPLATES)
