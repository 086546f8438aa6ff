"""Long operations streamed as NDJSON: the work runs on its own thread and reports progress;
the reply is `{"progress": {...}}` lines as it goes (at most every `EVERY_S`), then one
`{"result": ...}` line, or one `{"error": {"kind", "message"}}` line when it failed.

    return stream_work("verify", lambda progress: store.verify(progress=...))
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from kvagentd.control.errors import ApiError, to_api_error

log = structlog.get_logger(__name__)

EVERY_S = 0.25
Report = Callable[[dict[str, Any]], None]


def stream_work(name: str, work: Callable[[Report], Any]) -> Iterator[dict[str, Any]]:
    """Run `work(report)` on a thread; `report(dict)` sends a progress line (throttled, the
    last one before the result always goes out)."""
    q: queue.Queue[dict[str, Any]] = queue.Queue()
    last = [0.0]

    def report(progress: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last[0] >= EVERY_S:
            last[0] = now
            q.put({"progress": progress})

    def run() -> None:
        try:
            q.put({"result": work(report)})
        except Exception as exc:  # noqa: BLE001 - the stream must end with the error
            if not isinstance(exc, ApiError):
                log.error(f"{name}_request_failed", exc_info=exc)
            q.put(to_api_error(exc).body())

    threading.Thread(target=run, name=f"{name}-request", daemon=True).start()

    def lines() -> Iterator[dict[str, Any]]:
        while True:
            item = q.get()
            yield item
            if "result" in item or "error" in item:
                return

    return lines()
