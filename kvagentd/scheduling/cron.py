"""Cron expressions of the configuration, as APScheduler 3.x triggers.

`trigger(text)` accepts
- a standard crontab expression, five fields `MIN HOUR DAY MONTH DOW` ("0 6 * * 1": Mondays at
  06:00), with the usual `*`, lists, ranges, steps and month / weekday names;
- the older short form `<day-of-week> HH:MM` ("mon 06:00", "mon-fri 18:30", "* 06:00").
Times are local (the scheduler's time zone). Anything else raises `CronError` saying which
field is wrong and why; the configuration loader turns that into exit 78 naming the field.

NOTE: APScheduler 3.x numbers weekdays from Monday = 0, crontab from Sunday = 0 (and 7), and its
`CronTrigger.from_crontab` passes the day-of-week field through unchanged, so "0 6 * * 1" would
fire on Tuesdays. The day-of-week field is therefore rewritten to weekday names first.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from apscheduler.triggers.cron import CronTrigger

# crontab numbering: 0 and 7 are Sunday.
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_SHORT_RE = re.compile(r"^\s*([a-z0-9,\-*/]+)\s+(\d{1,2}):(\d{2})\s*$", re.IGNORECASE)
_FIELDS = ("minute", "hour", "day of month", "month", "day of week")
EXAMPLE = "'0 6 * * 1' (MIN HOUR DAY MONTH DOW: Mondays at 06:00) or 'mon 06:00'"


class CronError(ValueError):
    """A schedule that is not a valid crontab expression."""


def trigger(text: str) -> CronTrigger:
    """The trigger for `text` (see the module docstring); raises CronError."""
    if not isinstance(text, str) or not text.strip():
        raise CronError(f"an empty schedule; expected {EXAMPLE}")
    short = _SHORT_RE.match(text)
    if short is not None:
        dow, hour, minute = short.group(1), short.group(2), short.group(3)
        fields = [minute, hour, "*", "*", dow]
    else:
        fields = text.split()
        if len(fields) != 5:
            raise CronError(f"{len(fields)} fields; expected 5 or the short form: {EXAMPLE}")
    try:
        fields[4] = weekdays(fields[4])
    except CronError as exc:
        raise CronError(f"day of week {fields[4]!r}: {exc}") from None
    for name, value in zip(_FIELDS, fields):
        try:
            CronTrigger(**{_APS_NAMES[name]: value})
        except ValueError as exc:
            raise CronError(f"{name} {value!r}: {exc}") from None
    out = CronTrigger.from_crontab(" ".join(fields))
    # NOTE: a date no month has ("0 6 31 2 *") parses; APScheduler then finds no fire time
    # up to year 9999 (0.1 s) and the job would never run
    if out.get_next_fire_time(None, datetime.now(UTC)) is None:
        raise CronError(f"never fires: no date has day of month {fields[2]!r} in month "
                        f"{fields[3]!r}")
    return out


_APS_NAMES = {"minute": "minute", "hour": "hour", "day of month": "day", "month": "month",
              "day of week": "day_of_week"}


def weekdays(field: str) -> str:
    """A crontab day-of-week field as APScheduler weekday names ("1-5" -> "mon,tue,...")."""
    if field == "*":
        return field
    days: set[int] = set()
    for item in field.lower().split(","):
        part, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) == 0:
                raise CronError(f"step {step_text!r} must be a positive integer")
            step = int(step_text)
        if part == "*":
            lo, hi = 0, 6
        elif "-" in part:
            a, _, b = part.partition("-")
            lo, hi = _day(a), _day(b)
            if hi == 0 and lo > 0:
                hi = 7  # "5-0": Friday to Sunday
            if lo > hi:
                raise CronError(f"range {part!r} runs backwards")
        else:
            lo = hi = _day(part)
            if step_text:
                hi = 6 if lo < 7 else 7
        days.update(d % 7 for d in range(lo, hi + 1, step))
    return ",".join(_DAYS[d] for d in sorted(days, key=lambda d: (d + 6) % 7))


def _day(token: str) -> int:
    if token.isdigit():
        n = int(token)
        if n > 7:
            raise CronError(f"{token} is not a weekday (0-7, 0 and 7 are Sunday)")
        return n
    if token[:3] in _DAYS and len(token) == 3:
        return _DAYS.index(token)
    raise CronError(f"{token!r} is not a weekday (0-7 or sun..sat)")
