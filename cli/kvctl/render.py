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
        cells.append([formats.get(k, cell)(row.get(k)) for k, _ in columns])
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
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    return str(value)


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
                out.append(f"{pad}{str(k) + ':':<{width + 1}} {cell(v)}")
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
    """Seconds as '3d 4h', '2h 5m', '4m 2s' or '3.2s'."""
    if seconds is None:
        return "-"
    s = float(seconds)
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
