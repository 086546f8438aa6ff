"""Write-behind to the remote store: one thread, one FIFO queue, a byte budget, a rate limit.

`put_block` / `put_task` never wait: an item that would take the queued bytes past
`budget_bytes` is dropped at once and counted (`dropped`, `dropped_bytes`); so is everything
still queued when `close` runs out of time. The thread sends queued blocks in pipelined
batches of up to `batch_bytes` (one round trip each) and other tasks (session manifests) one
by one, in the order they were queued, at most `rate_bytes_per_s` on average.

Faults: while the link is down the queue waits (within its budget) and the thread probes the
link with backoff; a batch that failed because the link went down is sent again after
recovery. A batch the server refused (full, ACL ...) is dropped and counted (`failed`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from kvagentd.kvcache.base import BlockKey
from kvagentd.kvcache.remote.link import Outcome, RemoteLink, Reply

log = structlog.get_logger(__name__)

BATCH_BYTES = 8 << 20
IDLE_WAIT_S = 0.5


@dataclass(frozen=True, slots=True)
class BlockWrite:
    key: BlockKey
    name: str
    value: bytearray

    @property
    def nbytes(self) -> int:
        return len(self.value)


@dataclass(frozen=True, slots=True)
class Task:
    """A write other than a block, run alone in queue order with the write client:
    `run(client)` returns a value given to `done(reply)`."""

    nbytes: int
    run: Callable[[Any], Any]
    done: Callable[[Reply[Any]], None] | None = None


Item = BlockWrite | Task


class TokenBucket:
    """At most `rate` bytes per second on average, bursts up to `burst` bytes."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.tokens = float(burst)
        self.t = clock()

    def wait_s(self, n: int) -> float:
        """Seconds to wait before `n` bytes may go (0: now); call `take(n)` when they go."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        need = min(n, self.burst)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, n: int) -> None:
        self.tokens -= n


class WriteBehind:
    """See the module docstring. `on_dropped(keys)` hears of blocks that were not written
    (dropped or refused), so their owner may offer them again later; `recycle(value)` gets
    back every block's buffer once it left the queue (written, refused or dropped)."""

    def __init__(self, link: RemoteLink, *, budget_bytes: int, rate_bytes_per_s: int,
                 ttl_s: float, batch_bytes: int = BATCH_BYTES,
                 on_dropped: Callable[[list[BlockKey]], None] | None = None,
                 recycle: Callable[[bytearray], None] | None = None) -> None:
        self.link = link
        self.recycle = recycle
        self.budget_bytes = int(budget_bytes)
        self.ttl_s = max(1, int(ttl_s))
        self.batch_bytes = int(batch_bytes)
        self.on_dropped = on_dropped
        self._bucket = TokenBucket(rate_bytes_per_s, max(rate_bytes_per_s, batch_bytes))
        self._q: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition()
        self._queued_bytes = 0
        self._busy = False
        self._closing = False
        self._deadline = 0.0
        self._thread: threading.Thread | None = None
        self.counters = dict(written=0, written_bytes=0, tasks=0, dropped=0, dropped_bytes=0,
                             failed=0, failed_bytes=0, resent=0)

    # -- producers ---------------------------------------------------------------------------
    def put_blocks(self, items: Sequence[BlockWrite]) -> list[bool]:
        """Queue block records together (the thread sees them as one batch); False (counted)
        for each that the budget cannot take, or all while closing."""
        return self._put(items)

    def put_task(self, task: Task) -> bool:
        return self._put([task])[0]

    def free_bytes(self) -> int:
        """Bytes the budget takes now (a hint before encoding; 0 while closing)."""
        with self._cond:
            return 0 if self._closing else max(0, self.budget_bytes - self._queued_bytes)

    def _put(self, items: Sequence[Item]) -> list[bool]:
        ok: list[bool] = []
        with self._cond:
            for item in items:
                if self._closing or self._queued_bytes + item.nbytes > self.budget_bytes:
                    self.counters["dropped"] += 1
                    self.counters["dropped_bytes"] += item.nbytes
                    ok.append(False)
                else:
                    self._q.append(item)
                    self._queued_bytes += item.nbytes
                    ok.append(True)
            if any(ok):
                self._cond.notify_all()
        dropped = [it for it, good in zip(items, ok) if not good]
        if dropped:
            self._dropped(dropped)
        return ok

    def _dropped(self, items: Sequence[Item]) -> None:
        keys = [it.key for it in items if isinstance(it, BlockWrite)]
        for it in items:
            if isinstance(it, Task) and it.done is not None:
                it.done(Reply(Outcome.SKIPPED, None, "dropped from the write-behind queue"))
        if keys and self.on_dropped is not None:
            self.on_dropped(keys)
        self._recycle(items)

    def _recycle(self, items: Sequence[Item]) -> None:
        if self.recycle is not None:
            for it in items:
                if isinstance(it, BlockWrite):
                    self.recycle(it.value)

    # -- the thread --------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kv-remote-write",
                                            daemon=True)
            self._thread.start()

    def _next(self) -> list[Item] | None:
        """Wait for work (probing a down link); the batch to send, or None to stop."""
        with self._cond:
            while True:
                if self._closing and (not self._q or time.monotonic() >= self._deadline):
                    return None
                if self._q and self.link.up:
                    break
                self._cond.wait(IDLE_WAIT_S if self._q else None)
                if self._q and not self.link.up:
                    self._cond.release()
                    try:
                        self.link.probe()
                    finally:
                        self._cond.acquire()
            head = self._q[0]
            if isinstance(head, Task):
                batch: list[Item] = [head]
            else:
                batch, size = [], 0
                for it in self._q:
                    if not isinstance(it, BlockWrite) or (batch and size + it.nbytes > self.batch_bytes):
                        break
                    batch.append(it)
                    size += it.nbytes
            self._busy = True
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next()
            if batch is None:
                return
            try:
                self._send(batch)
            except Exception:  # the writer must outlive any one bad item (or listener)
                log.exception("remote_write_failed")
                with self._cond:
                    if self._busy:  # not taken off the queue yet: drop it, counted
                        for _ in batch:
                            self._q.popleft()
                        self._queued_bytes -= sum(it.nbytes for it in batch)
                        self.counters["failed"] += len(batch)
                        self._busy = False
                        self._cond.notify_all()

    def _send(self, batch: list[Item]) -> None:
        size = sum(it.nbytes for it in batch)
        wait = self._bucket.wait_s(size)
        if wait > 0:  # the rate limit: wait, but not past a closing deadline
            with self._cond:
                self._cond.wait(wait)
                if self._closing and time.monotonic() >= self._deadline:
                    self._busy = False
                    return  # left queued: `close` drops it, counted
        self._bucket.take(size)
        head = batch[0]
        if isinstance(head, Task):
            reply = self.link.write(head.run)
        else:
            blocks = [it for it in batch if isinstance(it, BlockWrite)]
            reply = self.link.write(lambda c: self._set_blocks(c, blocks))
        if reply.outcome in (Outcome.DOWN, Outcome.SKIPPED):
            with self._cond:  # stays queued: sent again once the link is back
                self._busy = False
                self.counters["resent"] += len(batch)
                self._cond.notify_all()
            return
        self._finish(batch, reply)

    def _set_blocks(self, client: Any, blocks: list[BlockWrite]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for b in blocks:
            pipe.set(b.name, memoryview(b.value), ex=self.ttl_s)
        return list(pipe.execute())

    def _finish(self, batch: list[Item], reply: Reply[Any]) -> None:
        """Tell the batch's listeners how it went, then take it off the queue (so `flush`
        returns only after the listeners heard)."""
        head = batch[0]
        if isinstance(head, Task):
            if head.done is not None:
                head.done(reply)
        elif not reply.ok:
            log.warning("remote_blocks_refused", blocks=len(batch), outcome=reply.outcome.value,
                        error=reply.error)
            self._dropped(batch)
        else:
            self._recycle(batch)
        size = sum(it.nbytes for it in batch)
        with self._cond:
            for _ in batch:
                self._q.popleft()
            self._queued_bytes -= size
            self._busy = False
            n_blocks = sum(1 for it in batch if isinstance(it, BlockWrite))
            if reply.ok:
                self.counters["written"] += n_blocks
                self.counters["written_bytes"] += size if n_blocks else 0
                self.counters["tasks"] += len(batch) - n_blocks
            else:
                self.counters["failed"] += len(batch)
                self.counters["failed_bytes"] += size
            self._cond.notify_all()

    # -- control -----------------------------------------------------------------------------
    def flush(self, timeout: float) -> bool:
        """Wait until everything queued now was sent or dropped; False on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._q or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, IDLE_WAIT_S))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stop taking items, send what the link takes within `timeout`, drop the rest."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout + 2 * self.link.spec.write_timeout_s + 1.0)
            self._thread = None
        with self._cond:
            rest = list(self._q)
            self._q.clear()
            self._queued_bytes = 0
            if rest:
                self.counters["dropped"] += len(rest)
                self.counters["dropped_bytes"] += sum(it.nbytes for it in rest)
        if rest:
            log.warning("remote_write_dropped_at_stop", items=len(rest))
            self._dropped(rest)

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"queued": len(self._q), "queued_bytes": self._queued_bytes,
                    "budget_bytes": self.budget_bytes, "rate_bytes_per_s": int(self._bucket.rate),
                    **self.counters}
