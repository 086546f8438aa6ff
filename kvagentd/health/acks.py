"""What an operator has seen: `kvctl health ack` records the counters behind the checks that
count faults (checksum failures, lost blocks, a discarded cold index, failed jobs), and those
checks count from there on. Nothing else is cleared: a fault still present (the cold tier on
the shadow, stale sensor data) stays in the report until it is gone.

Held in memory: the counters themselves start from zero with each start of the daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping


class Acknowledgements:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self.at: float | None = None  # unix seconds of the last acknowledgement

    def since(self, name: str, total: int) -> int:
        """Of the `total` counted under `name` since start, how many are new since the ack."""
        with self._lock:
            return max(0, total - self._seen.get(name, 0))

    def ack(self, counters: Mapping[str, int], now: float,
            names: Collection[str] = ()) -> dict[str, int]:
        """Record `counters` as seen (only those under `names`, or whose check is named in
        `names` as "service:agent" for its jobs; all when empty). Returns what was recorded."""
        chosen = {k: v for k, v in counters.items() if not names or _matches(k, names)}
        with self._lock:
            self._seen.update(chosen)
            self.at = now
        return chosen


def _matches(counter: str, names: Collection[str]) -> bool:
    if counter in names:
        return True
    if counter.startswith("job:"):
        job = counter[4:]
        return any(n.startswith("service:") and job.startswith(n[8:]) for n in names) \
            or "jobs" in names
    return False
