"""Background scrub: verify cold records' checksums at a bounded I/O rate.

`Scrubber.run()` asks the cold store to read and check every record (`verify`, header and
payload checksums) with its read rate capped at `rate_bytes_per_s`, so a scrub never competes
with foreground cold reads for more than that bandwidth. Corrupt or missing records are
reported (the cold store logs each at ERROR; `status()` has the counts). They are not dropped
here: the next read of such a block fails its checksum, the store marks it lost and the engine
recomputes its tokens, so wrong KV is never served.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ScrubReport:
    checked: int = 0
    corrupt: int = 0
    missing: int = 0
    bytes: int = 0
    elapsed_s: float = 0.0
    rate_bytes_per_s: float = 0.0
    skipped: str = ""  # why nothing was checked (another scrub running)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scrubber:
    """Rate-limited checksum verification of a cold store (`verify(repair, rate_bytes_per_s)`)."""

    def __init__(self, cold: Any, rate_bytes_per_s: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cold = cold
        self.rate = max(1, int(rate_bytes_per_s))
        self.clock = clock
        self._lock = threading.Lock()
        self.passes = 0
        self.total_checked = 0
        self.total_corrupt = 0
        self.last: ScrubReport | None = None

    def run(self, rate_bytes_per_s: float | None = None) -> ScrubReport:
        """One full pass; a second concurrent call returns at once with `skipped` set."""
        if not self._lock.acquire(blocking=False):
            return ScrubReport(skipped="a scrub is already running")
        try:
            rate = float(rate_bytes_per_s or self.rate)
            t0 = self.clock()
            out = self.cold.verify(repair=False, rate_bytes_per_s=rate)
            rep = ScrubReport(int(out.get("checked", 0)), int(out.get("corrupt", 0)),
                              int(out.get("missing", 0)), int(out.get("bytes", 0)),
                              self.clock() - t0, rate)
            self.passes += 1
            self.total_checked += rep.checked
            self.total_corrupt += rep.corrupt + rep.missing
            self.last = rep
            level = log.error if rep.corrupt or rep.missing else log.info
            level("scrub_done", checked=rep.checked, corrupt=rep.corrupt, missing=rep.missing,
                  bytes=rep.bytes, elapsed_s=round(rep.elapsed_s, 3))
            return rep
        finally:
            self._lock.release()

    def stop(self) -> None:
        """Nothing to interrupt between records; a running pass ends on its own."""

    def status(self) -> dict[str, Any]:
        return {"passes": self.passes, "checked": self.total_checked,
                "bad_records": self.total_corrupt, "rate_bytes_per_s": self.rate,
                "last": self.last.as_dict() if self.last else None}
