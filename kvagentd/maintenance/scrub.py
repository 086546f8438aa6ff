"""Background scrub: verify cold records' checksums at a bounded I/O rate.

Each `run()` walks the cold keys from where the previous run stopped, verifying batches with
the cold store's `verify(keys)` (it reads every record and checks its checksum, returning the
corrupt or unreadable keys) and sleeping between batches so that the average read rate stays at
or below `rate_bytes_per_s`. Corrupt records are reported (ERROR log, `status()`); the cold
store drops them itself, so the engine recomputes those tokens on their next use.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import structlog

from kvagentd.kvcache.base import BlockKey

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ScrubReport:
    checked: int = 0
    bytes: int = 0
    corrupt: list[str] = field(default_factory=list)  # hex keys
    elapsed_s: float = 0.0
    complete_pass: bool = False  # reached the end of the key list
    stopped: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scrubber:
    """Rate-limited checksum verification of a cold store (`keys()`, `verify(keys)`)."""

    def __init__(self, cold: Any, record_bytes: int, rate_bytes_per_s: int, *, batch: int = 16,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cold = cold
        self.record_bytes = max(1, record_bytes)
        self.rate = max(1, rate_bytes_per_s)
        self.batch = max(1, batch)
        self.sleep, self.clock = sleep, clock
        self._cursor = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.passes = 0
        self.total_checked = 0
        self.total_corrupt = 0
        self.last: ScrubReport | None = None

    def stop(self) -> None:
        self._stop.set()

    def run(self, max_bytes: int | None = None) -> ScrubReport:
        """Verify records until the end of the key list (or `max_bytes` read, or `stop()`)."""
        if not self._lock.acquire(blocking=False):
            return ScrubReport(stopped=True)
        try:
            self._stop.clear()
            rep = ScrubReport()
            keys = sorted(self.cold.keys())
            if self._cursor >= len(keys):
                self._cursor = 0
            t0 = self.clock()
            while self._cursor < len(keys):
                if self._stop.is_set() or (max_bytes is not None and rep.bytes >= max_bytes):
                    rep.stopped = True
                    break
                part: list[BlockKey] = keys[self._cursor:self._cursor + self.batch]
                bad = list(self.cold.verify(part))
                self._cursor += len(part)
                rep.checked += len(part)
                rep.bytes += len(part) * self.record_bytes
                for k in bad:
                    rep.corrupt.append(k.hex())
                    log.error("scrub_corrupt_record", key=k.hex())
                # Pace: the bytes read so far may take no less than bytes / rate seconds.
                ahead = rep.bytes / self.rate - (self.clock() - t0)
                if ahead > 0:
                    self.sleep(ahead)
            else:
                rep.complete_pass = True
                self._cursor = 0
                self.passes += 1
            rep.elapsed_s = self.clock() - t0
            self.total_checked += rep.checked
            self.total_corrupt += len(rep.corrupt)
            self.last = rep
            log.info("scrub_done", checked=rep.checked, corrupt=len(rep.corrupt),
                     complete=rep.complete_pass)
            return rep
        finally:
            self._lock.release()

    def status(self) -> dict[str, Any]:
        return {"passes": self.passes, "checked": self.total_checked,
                "corrupt": self.total_corrupt, "rate_bytes_per_s": self.rate,
                "last": self.last.as_dict() if self.last else None}
