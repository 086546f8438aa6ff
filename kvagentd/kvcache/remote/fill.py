"""`LocalFill`: blocks read from the remote store, copied into this box's cold tier behind the
request that read them.

A block read from the remote is already served (verified, decoded into its tier slot) and is
still in the remote store, so its local cold copy is a cache of the remote, not the block's
only durable copy. Writing it synchronously put a synced write of every fetched block (95 MB
for a 2k-token SmolLM2 session) in the path of a session's resume; here the request hands the
record bytes it received to one thread and goes on. Until the thread has written a block, a
read of it goes to the remote again; if this box stops before, the remote still has it.

The thread waits until no read has queued records for `settle_s`: blocks are read from the
remote because a request needs them now, and writing them meanwhile (a decode and a checksum
under the GIL and a synced write per block: for a 2k-token SmolLM2 session about 0.1 s of CPU
and 95 MB of writes) would compete with that request for the two cores it runs on.

Bounded: at most `budget_bytes` of records wait (more is not queued, counted `fill_skipped`:
the next read of those blocks fetches them again). The thread verifies each record again as
it decodes it into a reused staging buffer (one xxh3 per block, off the request's path).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch

from kvagentd.kvcache.base import BlockKey, ColdTier
from kvagentd.kvcache.remote.records import RemoteRecords

log = structlog.get_logger(__name__)

BUDGET_BYTES = 256 << 20
BATCH = 8  # blocks per local put (one sync)
SETTLE_S = 2.0  # quiet time after the last read before the copy starts

Batch = list[tuple[BlockKey, bytes]]


class LocalFill:
    def __init__(self, local: ColdTier, records: RemoteRecords,
                 count: Callable[[str, int], None], *, budget_bytes: int = BUDGET_BYTES,
                 settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.local = local
        self.records = records
        self.count = count
        self.budget_bytes = budget_bytes
        self.settle_s = settle_s
        self.clock = clock
        self._last_submit = 0.0
        self._queue: collections.deque[Batch] = collections.deque()
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._staging: torch.Tensor | None = None

    def submit(self, items: Sequence[tuple[BlockKey, bytes]]) -> int:
        """Queue verified records for the local cold tier; never waits. Returns how many were
        queued (the rest did not fit the budget, or the fill is closed)."""
        take: Batch = []
        with self._cond:
            room = self.budget_bytes - self._queued_bytes
            for key, value in items:
                if self._closed or len(value) > room:
                    break
                take.append((key, value))
                room -= len(value)
            if take:
                self._last_submit = self.clock()
                self._queue.append(take)
                self._queued_bytes += sum(len(v) for _, v in take)
                self._start()
                self._cond.notify_all()
        if len(take) < len(items):
            self.count("fill_skipped", len(items) - len(take))
        return len(take)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-remote-fill", daemon=True)
            self._thread.start()

    def pending(self) -> int:
        """Record bytes waiting or being written."""
        with self._cond:
            return self._queued_bytes

    def flush(self, timeout: float) -> bool:
        """Write everything queued so far now (no settling) and wait until it is written (or
        dropped); False on timeout."""
        with self._cond:
            self._last_submit = self.clock() - self.settle_s  # settled now
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued within `timeout` (the rest stays in the remote only), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("remote_fill_unfinished", pending_bytes=self.pending())

    def _settled(self) -> bool:
        return self._closed or self.clock() - self._last_submit >= self.settle_s

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                while not self._settled():
                    wait = self.settle_s - (self.clock() - self._last_submit)
                    self._cond.wait(max(0.01, wait))
                batch = self._queue.popleft()
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # a fill is a cache: its failure loses nothing
                log.exception("remote_fill_failed", blocks=len(batch))
                self.count("fill_failed", len(batch))
            finally:
                with self._cond:
                    self._queued_bytes -= sum(len(v) for _, v in batch)
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, batch: Batch) -> None:
        if self.local.read_only:
            self.count("fill_skipped", len(batch))
            return
        shape = self.records.geometry.block_shape
        if self._staging is None:
            self._staging = torch.empty((BATCH, *shape), dtype=self.records.geometry.dtype)
        for s in range(0, len(batch), BATCH):
            part = batch[s:s + BATCH]
            keys: list[BlockKey] = []
            for key, value in part:
                # verified when it was served; checked again as it is decoded here
                if self.records.decode_into(key, value, self._staging[len(keys)]) is None:
                    keys.append(key)
            stored = self.local.put_many(keys, self._staging[:len(keys)]) if keys else []
            self.count("filled_local", sum(stored))
