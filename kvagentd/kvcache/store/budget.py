"""The SSD's write budget: a token bucket of bytes the store may write to the cold tier.

An industrial SSD is rated for a number of terabytes written (150-600 TBW for 256 GB-1 TB
drives); written evenly over a target life, that is a budget per day. Write-behind copies and
demotions to the cold tier take from it; what does not fit stays in RAM (write-behind waits
for the next round) or leaves RAM without a cold copy (a demotion becomes a drop). Nothing is
ever wrong for it: a session's token ids are the source of truth, so a block that was not
written is recomputed when it is needed again: the budget trades recompute for wear.

The bucket refills at `bytes_per_day / 86400` per second and holds at most `burst_s` of
that, so a quiet night does not let a morning's burst write a day's budget at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

DAY_S = 86400.0


class WriteBudget:
    """Thread-safe; `bytes_per_day` 0 means no limit."""

    def __init__(self, bytes_per_day: int, *, burst_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_day = int(bytes_per_day)
        self.rate = self.bytes_per_day / DAY_S
        self.capacity = self.rate * burst_s
        self.clock = clock
        self._lock = threading.Lock()
        self._tokens = self.capacity
        self._at = clock()
        self.taken = 0  # bytes granted since start
        self.refused = 0  # bytes asked for and refused
        self._started = clock()

    @property
    def limited(self) -> bool:
        return self.bytes_per_day > 0

    def take(self, nbytes: int) -> bool:
        """Grant `nbytes` now (all or nothing)."""
        if not self.limited:
            self.taken += nbytes
            return True
        with self._lock:
            self._refill()
            if nbytes > self._tokens:
                self.refused += nbytes
                return False
            self._tokens -= nbytes
            self.taken += nbytes
            return True

    def take_blocks(self, n: int, block_bytes: int) -> int:
        """Grant as many of `n` blocks of `block_bytes` as fit now; the rest count refused."""
        if not self.limited:
            self.taken += n * block_bytes
            return n
        with self._lock:
            self._refill()
            k = max(0, min(n, int(self._tokens // block_bytes)))
            self._tokens -= k * block_bytes
            self.taken += k * block_bytes
            self.refused += (n - k) * block_bytes
            return k

    def available(self) -> float:
        """Bytes that could be granted now (inf without a limit)."""
        if not self.limited:
            return float("inf")
        with self._lock:
            self._refill()
            return self._tokens

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def status(self) -> dict[str, Any]:
        elapsed = max(1.0, self.clock() - self._started)
        return {"bytes_per_day": self.bytes_per_day or None,
                "available_bytes": None if not self.limited else int(self.available()),
                "written_bytes": self.taken, "refused_bytes": self.refused,
                "written_per_day_bytes": int(self.taken * DAY_S / elapsed)}
