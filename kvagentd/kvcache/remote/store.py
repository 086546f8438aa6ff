"""`RemoteStore`: the shared remote store as this box uses it: the link (connection and its
state), the key names of this namespace, the record codec and the one write-behind queue.

The remote tier (`tier.py`) and the fleet services (session hand-over, heartbeats) share one
`RemoteStore`, so a session's manifest is queued behind the blocks it names and every write
counts against one budget and one rate limit. The remote tier closes it (the store is the last
service to stop).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvagentd.kvcache.base import BlockKey, KVGeometry
from kvagentd.kvcache.remote.link import ClientFactory, RemoteLink, RemoteSpec, make_client
from kvagentd.kvcache.remote.names import RemoteNames
from kvagentd.kvcache.remote.records import RemoteRecords
from kvagentd.kvcache.remote.writer import BlockWrite, Task, WriteBehind

RECENT_S = 300.0  # a drop, refusal or corrupt read this recent makes the remote "degraded"
SENT_MEMORY = 1 << 16  # keys remembered as sent (not offered again while remembered)


class RemoteStore:
    def __init__(self, spec: RemoteSpec, geometry: KVGeometry, namespace: bytes, *,
                 codec: str = "raw", factory: ClientFactory = make_client) -> None:
        self.spec = spec
        self.namespace = namespace
        self.link = RemoteLink(spec, factory=factory)
        self.names = RemoteNames(spec.key_prefix, namespace)
        self.records = RemoteRecords(geometry, namespace, codec)
        self.writer = WriteBehind(self.link, budget_bytes=spec.write_queue_bytes,
                                  rate_bytes_per_s=spec.write_rate_bytes_per_s, ttl_s=spec.ttl_s,
                                  on_dropped=self._not_sent, recycle=self._recycle)
        # record buffers are reused: at most the queue's budget of them ever exists, and a
        # steady stream of writes allocates nothing
        self._free: list[bytearray] = []
        self.last_trouble = 0.0  # time.time() of the last drop, refusal or corrupt read
        self.trouble = ""
        self._lock = threading.Lock()
        self._sent: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()
        self._ups_seen = 0
        self.counters = dict(offered=0, queued=0, already_sent=0, no_room=0)
        self.reads = dict(lookups=0, lookup_keys=0, lookup_found=0, remote_reads=0,
                          remote_hits=0, remote_missing=0, remote_corrupt=0,
                          remote_unavailable=0, filled_local=0, fill_skipped=0,
                          fill_failed=0)

    @property
    def ttl(self) -> int:
        """Seconds every key lives after its last write (or read, for blocks)."""
        return max(1, int(self.spec.ttl_s))

    def count(self, name: str, n: int = 1) -> None:
        """Add to a read-side figure (`reads`: lookups, remote reads by result, local fills)."""
        with self._lock:
            self.reads[name] += n

    def noted(self, what: str) -> None:
        """Remember a fault that health reports for `RECENT_S`."""
        self.last_trouble, self.trouble = time.time(), what

    # -- blocks --------------------------------------------------------------------------------
    def publish_blocks(self, keys: Sequence[BlockKey],
                       blocks: Sequence[torch.Tensor] | torch.Tensor) -> int:
        """Queue the records of these blocks for write-behind, except those sent recently (a
        restarted or flushed server is assumed empty again: the memory is cleared when the
        link comes back). Encodes now (the caller's tensors may change afterwards); never
        waits for the remote. Returns how many were queued."""
        self._forget_if_reconnected()
        todo: list[int] = []
        with self._lock:
            self.counters["offered"] += len(keys)
            for i, key in enumerate(keys):
                if key in self._sent:
                    self._sent.move_to_end(key)
                    self.counters["already_sent"] += 1
                else:
                    todo.append(i)
        # queued a batch at a time: the writer sends one batch while the next is encoded
        per = max(1, self.writer.batch_bytes // self.records.length)
        queued: list[BlockKey] = []
        for s in range(0, len(todo), per):
            part = todo[s:s + per][:self.writer.free_bytes() // self.records.length]
            if len(part) < len(todo[s:s + per]):
                with self._lock:
                    self.counters["no_room"] += len(todo) - s - len(part)
                self.noted("write-behind queue full: blocks were not sent")
            if not part:
                break
            items = []
            for i in part:
                with self._lock:
                    buf = self._free.pop() if self._free else None
                key = keys[i]
                items.append(BlockWrite(key, self.names.block(key),
                                        self.records.encode(key, blocks[i], buf)))
            self.writer.start()
            queued += [it.key for it, ok in zip(items, self.writer.put_blocks(items)) if ok]
            if len(part) < per:
                break
        with self._lock:
            for key in queued:
                self._sent[key] = None
            while len(self._sent) > SENT_MEMORY:
                self._sent.popitem(last=False)
            self.counters["queued"] += len(queued)
        return len(queued)

    def _recycle(self, value: bytearray) -> None:
        if len(value) == self.records.length:
            with self._lock:
                if (len(self._free) + 1) * len(value) <= self.spec.write_queue_bytes:
                    self._free.append(value)

    def forget_sent(self, keys: Sequence[BlockKey]) -> None:
        """These blocks are not (or no longer validly) in the remote: offer them again."""
        with self._lock:
            for k in keys:
                self._sent.pop(k, None)

    def _not_sent(self, keys: list[BlockKey]) -> None:
        self.forget_sent(keys)
        self.noted(f"{len(keys)} block writes dropped or refused")

    def _forget_if_reconnected(self) -> None:
        ups = self.link.counters["downs"]
        if ups != self._ups_seen:
            with self._lock:
                self._ups_seen = ups
                self._sent.clear()

    def submit(self, task: Task) -> bool:
        """Queue a write behind everything queued so far; False (counted) when it does not
        fit the budget."""
        self.writer.start()
        ok = self.writer.put_task(task)
        if not ok:
            self.noted("write-behind queue full: a write was dropped")
        return ok

    def status(self) -> dict[str, Any]:
        """JSON-ready: the link (state, counters), the write-behind queue, block publishing, reads
    through the remote tier."""
        with self._lock:
            published, reads = dict(self.counters), dict(self.reads)
        return {"link": self.link.status(), "write_behind": self.writer.status(),
                "published": published, "reads": reads, "ttl_s": self.ttl,
                "last_trouble": self.trouble or None,
                "last_trouble_at": self.last_trouble or None}

    def health(self) -> dict[str, Any]:
        """`{"status": ok|degraded, "detail"}`: degraded while the link is down and for
        `RECENT_S` after a dropped or refused write or a corrupt record."""
        url = self.spec.display_url()
        if not self.link.up:
            w = self.writer.status()
            return {"status": "degraded",
                    "detail": f"remote {url} unreachable since {time.ctime(self.link.since)} "
                              f"({self.link.last_error}); reads recompute, "
                              f"{w['queued']} writes queued, {w['dropped']} dropped"}
        if time.time() - self.last_trouble < RECENT_S:
            return {"status": "degraded", "detail": f"remote {url}: {self.trouble} "
                                                    f"at {time.ctime(self.last_trouble)}"}
        return {"status": "ok", "detail": f"remote {url} up"}

    def close(self, timeout: float = 5.0) -> None:
        """Send what the link takes within `timeout` (the rest is dropped, counted), then
        close the connections."""
        self.writer.close(timeout)
        self.link.close()
