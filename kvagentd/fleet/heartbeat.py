"""The fleet view: each box publishes a heartbeat; any box lists the boxes a remote store knows.

A heartbeat is one JSON document under `<prefix>:box:<box id>` that expires after three
intervals (a box that stopped beating drops out by itself), plus the box's last-seen time in
the sorted set `<prefix>:fleet` (so a box that went away is still listed, as gone, for
`FORGET_AFTER_S`). A box that stops cleanly publishes a last heartbeat with state "stopped",
kept for `FORGET_AFTER_S`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from kvagentd.kvcache.remote import RemoteStore

log = structlog.get_logger(__name__)

FORGET_AFTER_S = 7 * 86400.0
MISSED_BEATS = 3  # a heartbeat older than this many intervals means the box is gone


class Heartbeat:
    def __init__(self, remote: RemoteStore, box: str, interval_s: float) -> None:
        self.remote = remote
        self.box = box
        self.interval_s = float(interval_s)
        self.last_beat: float | None = None
        self.beats = 0
        self.failed = 0

    @property
    def ttl(self) -> int:
        return max(2, int(MISSED_BEATS * self.interval_s + 1))

    def beat(self, about: dict[str, Any], *, stopping: bool = False) -> bool:
        """Publish one heartbeat now, with `about` (what this box says of itself), probing the
        link first while it is down."""
        self.remote.link.probe()
        now = time.time()
        doc = {**about, "box": self.box, "t": now, "interval_s": self.interval_s,
               "state": "stopped" if stopping else "running"}
        text = json.dumps(doc, default=str)
        names = self.remote.names

        def write(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            # a stopped box stays listed as stopped; a running one expires when it stops beating
            pipe.set(names.box(self.box), text, ex=int(FORGET_AFTER_S) if stopping else self.ttl)
            pipe.zadd(names.fleet, {self.box: now})
            pipe.zremrangebyscore(names.fleet, 0, now - FORGET_AFTER_S)
            pipe.execute()

        reply = self.remote.link.write(write)
        if reply.ok:
            self.last_beat = now
            self.beats += 1
        else:
            self.failed += 1
            log.info("heartbeat_failed", outcome=reply.outcome.value, error=reply.error)
        return reply.ok

    def boxes(self) -> list[dict[str, Any]] | None:
        """Every box the remote store knows, newest first: its last heartbeat (when it has not
        expired), `age_s` and `alive`. None when the remote cannot be asked."""
        names = self.remote.names

        def read(c: Any) -> tuple[list[Any], list[Any]]:
            seen = c.zrange(names.fleet, 0, -1, desc=True, withscores=True)
            pipe = c.pipeline(transaction=False)
            for box, _ in seen:
                pipe.get(names.box(box.decode()))
            return seen, list(pipe.execute())

        reply = self.remote.link.write(read)
        if not reply.ok or reply.value is None:
            return None
        now = time.time()
        out = []
        for (box, score), raw in zip(*reply.value):
            doc = _doc(raw)
            age = now - float(score)
            alive = doc is not None and doc.get("state") == "running"
            out.append({**(doc or {}), "box": box.decode(), "last_seen": float(score),
                        "age_s": round(age, 1), "alive": alive,
                        "state": (doc or {}).get("state", "gone")})
        return out

    def get(self, box: str) -> dict[str, Any] | None:
        """The box's current heartbeat (None when it expired, or the remote cannot be asked)."""
        name = self.remote.names.box(box)
        reply = self.remote.link.write(lambda c: c.get(name))
        return _doc(reply.value) if reply.ok else None

    def status(self) -> dict[str, Any]:
        return {"box": self.box, "interval_s": self.interval_s, "beats": self.beats,
                "failed": self.failed, "last_beat": self.last_beat}


def _doc(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None
