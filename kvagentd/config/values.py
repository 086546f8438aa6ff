"""The value types config fields use beyond the builtins, and their parsers.

`ByteSize` (an int written as 1048576, "512MiB" or "18GB"; `parse_size`), `CronText` (a
schedule checked by `kvagentd.scheduling.cron`) and `parse_listen` (the metrics listener's address).
Parsers raise `ValueError`; the loader turns that into a `ConfigError` naming the field.
"""

from __future__ import annotations

import re


class ByteSize(int):
    """An int that config files may write as "18GiB" / "512 MB"."""


class CronText(str):
    """A schedule: a crontab expression ("0 6 * * 1") or "<day-of-week> HH:MM" (`kvagentd.scheduling.cron`),
    checked when the configuration is loaded."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "ki": 1024,
               "mib": 1024**2, "mi": 1024**2, "gib": 1024**3, "gi": 1024**3, "tib": 1024**4,
               "ti": 1024**4}


def parse_size(text: str) -> int:
    """Parse "18GiB" / "512 MB" / "4096" into bytes; raises ValueError."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])



def parse_listen(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "9464", "HOST:PORT" or "[V6]:PORT"; raises ValueError."""
    text = text.strip()
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    elif text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address needs brackets and a port: [::1]:9464")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError("expected PORT, HOST:PORT or [IPV6]:PORT")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"port {port_text!r} is not in 1-65535")
    return host, int(port_text)

