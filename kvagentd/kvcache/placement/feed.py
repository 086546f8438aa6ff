"""The access feed: the store reports every inference event's blocks here; placement drains it.

The store calls `record` on the inference path, so it only appends to a bounded buffer under a
short lock: heat, trace and prefetch bookkeeping happen later, on placement's own thread. When
placement falls behind by more than `capacity` events the oldest are dropped and counted (heat is
advisory; memory must not grow while placement is stalled).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ..base import BlockKey

AccessListener = Callable[[Sequence[BlockKey], str], None]
"""What a store calls after each inference event with the blocks it used and the session."""


class Access(NamedTuple):
    """One inference event: the blocks it touched, in prefix order."""

    keys: Sequence[BlockKey]
    session: str
    time: float  # the feed's clock at `record` (wall seconds in the daemon)


class AccessFeed:
    """Bounded, thread-safe buffer of `Access` events between the store and placement."""

    def __init__(self, capacity: int = 65536, *, clock: Callable[[], float] = time.time) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.clock = clock
        self._events: deque[Access] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self.recorded = 0  # events ever recorded
        self.dropped = 0  # events dropped because nobody drained them in time

    def record(self, keys: Sequence[BlockKey], session: str) -> None:
        """The store's access listener: `keys` were used by one inference event of `session`."""
        ev = Access(keys, session, self.clock())
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.popleft()
                self.dropped += 1
            self._events.append(ev)
            self.recorded += 1
        self._ready.set()

    def drain(self) -> list[Access]:
        """Every event recorded since the last drain, oldest first."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
            self._ready.clear()
        return out

    def wait(self, timeout: float | None) -> bool:
        """Block until an event is pending or `timeout` passes; True when one is pending."""
        return self._ready.wait(timeout)

    def wake(self) -> None:
        """Wake a `wait` without an event (shutdown)."""
        self._ready.set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
