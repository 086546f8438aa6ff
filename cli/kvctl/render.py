"""Rendering of daemon replies: JSON with --json, aligned human text otherwise."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import typer

from kvctl.common import Opts


def emit(o: Opts, data: Any, human: Callable[[Any], str] | None = None) -> None:
    """Print `data` as JSON (--json) or through `human` (default: an indented key/value view)."""
    if o.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
        return
    text = human(data) if human is not None else kv(data)
    if text:
        typer.echo(text.rstrip("\n"))


def table(rows: Iterable[dict[str, Any]], columns: Sequence[tuple[str, str]],
          formats: dict[str, Callable[[Any], str]] | None = None) -> str:
    """Aligned text table; `columns` are (key, header) pairs; `formats` per key."""
    formats = formats or {}
    cells = [[h.upper() for _, h in columns]]
    for row in rows:
        cells.append([formats[k](row.get(k)) if k in formats else human(k, row.get(k))
                      for k, _ in columns])
    if len(cells) == 1:
        return "(none)"
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.0f}" if abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {human(str(k), v)}" for k, v in value.items()) or "-"
    return str(value)


# Keys whose numbers are unix times, byte counts, seconds or 0-1 ratios: a person reads them
# as times, sizes, durations and percentages (JSON keeps the numbers).
_TIME_KEYS = {"t", "since", "created", "finished", "started", "last_used", "last_access",
              "next_run", "modified", "time"}
_EPOCH_MIN = 1e8  # seconds since 1970 later than 1973: a time, not a count


def human(key: str, value: Any) -> str:
    """`value` as a person reads it, judged by its key (see `_TIME_KEYS`, `*_bytes`,
    `*_s`, `*_at`, `*ratio`/`fill`); anything else as `cell` shows it."""
    k = key.lower()
    if value is None or isinstance(value, bool):
        return cell(value)
    if isinstance(value, int | float):
        if k.endswith("_bytes") or k in ("bytes", "size"):
            return size(value)
        if (k in _TIME_KEYS or k.endswith(("_at", "_time", "_since"))) and value > _EPOCH_MIN:
            return when(value)
        if k.endswith(("_mm_s", "_m_s2")):  # a velocity or an acceleration, not a duration
            return f"{value:.3g} {'mm/s' if k.endswith('_mm_s') else 'm/s²'}"
        if k.endswith("_s") or k.endswith("_seconds"):
            return duration(value)
        if k.endswith("ratio") or k.endswith("_fill") or k == "fragmentation":
            return percent(100 * value)
    if isinstance(value, str) and (k in _TIME_KEYS or k.endswith("_at")) and len(value) >= 19 \
            and value[4:5] == "-" and value[10:11] == "T":
        return when(value)
    return cell(value)


def kv(data: Any, indent: int = 0) -> str:
    """Indented `key: value` view of nested dicts and lists."""
    pad = "  " * indent
    if isinstance(data, dict):
        if not data:
            return f"{pad}(empty)"
        width = max(len(str(k)) for k in data)
        out = []
        for k, v in data.items():
            if isinstance(v, dict | list) and v and not _flat_list(v):
                out.append(f"{pad}{k}:")
                out.append(kv(v, indent + 1))
            else:
                out.append(f"{pad}{str(k) + ':':<{width + 1}} {human(str(k), v)}")
        return "\n".join(out)
    if isinstance(data, list):
        out = []
        for item in data:
            if isinstance(item, dict):
                out.append(f"{pad}-")
                out.append(kv(item, indent + 1))
            else:
                out.append(f"{pad}- {cell(item)}")
        return "\n".join(out) or f"{pad}(none)"
    return f"{pad}{cell(data)}"


def _flat_list(v: Any) -> bool:
    return isinstance(v, list) and all(not isinstance(x, dict | list) for x in v)


def size(n: float | int | None) -> str:
    """Bytes in binary units: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def duration(seconds: float | None) -> str:
    """Seconds as '3d 4h', '2h 5m', '4m 2s', '3.2s' or '12 ms'."""
    if seconds is None:
        return "-"
    s = float(seconds)
    if abs(s) < 0.1:
        return f"{s * 1000:.0f} ms" if abs(s) >= 0.001 else f"{s * 1e6:.0f} us"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {sec}s"


def percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def when(t: float | int | str | None) -> str:
    """Unix seconds (or an ISO 8601 string) as local time, '2026-12-01 12:03:05', with the
    age when recent: '2026-12-01 12:03:05 (4m 2s ago)'."""
    if t is None or t == "":
        return "-"
    import time
    from datetime import datetime

    if isinstance(t, str):
        try:
            ts = datetime.fromisoformat(t).timestamp()
        except ValueError:
            return t
    else:
        ts = float(t)
    text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    ago = time.time() - ts
    if 0 <= ago < 7 * 86400:
        text += f" ({duration(ago)} ago)"
    elif -7 * 86400 < ago < 0:
        text += f" (in {duration(-ago)})"
    return text


class Progress:
    """One line of progress on stderr while a long call runs, redrawn in place: a label, a
    bar when done/total are known, the elapsed time. Only on a terminal (`enabled`); a no-op
    otherwise, so pipes and --json stay clean. Use as a context manager; `clear()` removes
    the line (before printing over it)."""

    WIDTH = 24

    def __init__(self, label: str, enabled: bool, stream: Any = None) -> None:
        import sys
        import threading
        import time

        self.label, self.enabled = label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.text = ""
        self.done: int | None = None
        self.total: int | None = None
        self._t0 = time.monotonic()
        self._clock = time.monotonic
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = 0

    def __enter__(self) -> Progress:
        if self.enabled:
            import threading

            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def update(self, text: str | None = None, done: int | None = None,
               total: int | None = None) -> None:
        with self._lock:
            if text is not None:
                self.text = text
            if done is not None:
                self.done, self.total = done, total
        self._draw()

    def line(self) -> str:
        """The text drawn now."""
        parts = [self.label]
        if self.done is not None and self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * self.WIDTH)
            parts.append(f"[{'#' * fill}{'.' * (self.WIDTH - fill)}] {self.done}/{self.total}")
        if self.text:
            parts.append(self.text)
        parts.append(duration(self._clock() - self._t0))
        return "  ".join(parts)

    def clear(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None
        with self._lock:
            if self._shown:
                self.stream.write("\r" + " " * self._shown + "\r")
                self.stream.flush()
                self._shown = 0

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    def _draw(self) -> None:
        if not self.enabled or self._stop.is_set():
            return
        with self._lock:
            text = self.line()
            pad = max(0, self._shown - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._shown = len(text)
