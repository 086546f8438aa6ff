"""Connection admission for the control socket: a total cap, a per-uid share, a tarpit.

The accept thread calls `admit(peer)` for every accepted connection, with the peer's kernel
credentials, before any thread is spent on it:

* a uid holding `max_per_uid` connections is refused, so one peer flooding the socket only
  ever holds its own share and the rest of `max_total` stays free for everyone else;
* a uid opening connections faster than `rate_per_uid` per second (bursts of `max_per_uid`
  above it) is refused, so a peer that connects and hangs up in a loop costs an accept and a
  close per connection, never a thread;
* past `max_total`, connections are refused (503 `overloaded`, retry).

A connection refused for its uid's share is not answered at once: it waits `delay_s` in a
bounded tarpit (no thread, only its socket) before its 503. A flooder that reconnects as soon
as it is refused is slowed to `1 / delay_s` reconnects per client per second instead of
spinning the accept loop; others are never delayed by it. The tarpit holds at most
`tarpit_max` sockets; beyond that refusals are answered at once.
"""

from __future__ import annotations

import collections
import functools
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import structlog

from kvagentd.control.errors import NotReady
from kvagentd.control.router import JSON_TYPE, Peer

log = structlog.get_logger(__name__)

REFUSE_DELAY_S = 0.5
TARPIT_MAX = 256
WARN_EVERY_S = 10.0  # at most one warning per uid this often, with the count since the last
# A uid refused this many times within SHED_WINDOW_S is shed for the rest of the window: its
# connections whose client has already hung up are closed as soon as accepted, with no
# reply, no log line and no metric each (those that wait for a reply still get their 503).
# NOTE: a local client that connects and hangs up in a loop makes ~25,000 connections a
# second; answering each with a 503 and counting it let the kernel's accept queue fill, and
# everyone else's connects wait behind it (bench.flood, churn).
SHED_AFTER = 64
SHED_WINDOW_S = 1.0


class Refusal(NamedTuple):
    message: str  # the 503 message
    per_uid: bool  # refused for the uid's share (tarpitted), not for the total


class Admission:
    """Slots of the control server's connections; thread-safe."""

    def __init__(self, max_total: int, max_per_uid: int, rate_per_uid: float, *,
                 delay_s: float = REFUSE_DELAY_S, tarpit_max: int = TARPIT_MAX,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_total, self.max_per_uid, self.rate_per_uid = max_total, max_per_uid, rate_per_uid
        self.delay_s, self.tarpit_max = delay_s, tarpit_max
        self.clock = clock
        self._lock = threading.Lock()
        self._held = 0
        self._by_uid: dict[int, int] = {}
        # Token buckets of new connections per uid: (tokens, time of the last refill).
        self._buckets: dict[int, tuple[float, float]] = {}
        self._warned: dict[int, tuple[float, int]] = {}  # uid -> (last warning, refused since)
        self._tarpit: collections.deque[tuple[float, socket.socket, str]] = collections.deque()
        self.refused = 0  # every refusal
        self.refused_per_uid = 0  # refusals because the uid held its share
        self.shed = 0  # connections closed unanswered (a uid shed for flooding)
        self._recent: dict[int, tuple[float, int]] = {}  # uid -> (window start, refusals)
        self._shedding: dict[int, float] = {}  # uid -> shed until (clock)

    def shedding(self, uid: int) -> bool:
        """True while `uid` floods (refused SHED_AFTER times in a window): the accept loop
        closes its connection unanswered (counted in `shed`). Lock-free on purpose: one dict
        read on the accept thread."""
        until = self._shedding.get(uid)
        if until is None:
            return False
        if self.clock() < until:
            self.shed += 1
            return True
        self._shedding.pop(uid, None)
        return False

    def admit(self, peer: Peer) -> Refusal | None:
        """Take a slot for `peer` (None), or return why not."""
        refusal = self._admit(peer)
        if refusal is not None and refusal.per_uid:
            self._warn(peer.uid, refusal.message)
            self._count_refusal(peer.uid)
        return refusal

    def _count_refusal(self, uid: int) -> None:
        now = self.clock()
        start, n = self._recent.get(uid, (now, 0))
        if now - start >= SHED_WINDOW_S:
            start, n = now, 0
        n += 1
        self._recent[uid] = (start, n)
        if n >= SHED_AFTER:
            self._shedding[uid] = start + SHED_WINDOW_S
            self._recent.pop(uid, None)
        if len(self._recent) > 4096:
            self._recent = {u: v for u, v in self._recent.items() if now - v[0] < SHED_WINDOW_S}

    def _warn(self, uid: int, message: str) -> None:
        now = self.clock()
        with self._lock:
            last, count = self._warned.get(uid, (now - WARN_EVERY_S, 0))
            if now - last < WARN_EVERY_S:
                self._warned[uid] = (last, count + 1)
                return
            self._warned[uid] = (now, 0)
        log.warning("control_connections_refused", uid=uid, refused=count + 1, reason=message)

    def _admit(self, peer: Peer) -> Refusal | None:
        with self._lock:
            mine = self._by_uid.get(peer.uid, 0)
            if mine >= self.max_per_uid:
                self.refused += 1
                self.refused_per_uid += 1
                return Refusal(f"too many connections from uid {peer.uid} ({mine}; "
                               f"control.max_connections_per_uid = {self.max_per_uid}); "
                               "close some or retry later", True)
            if not self._take_token(peer.uid):
                self.refused += 1
                self.refused_per_uid += 1
                return Refusal(f"uid {peer.uid} opens connections faster than "
                               f"control.connect_rate_per_uid ({self.rate_per_uid:g}/s); "
                               "retry later", True)
            if self._held >= self.max_total:
                self.refused += 1
                return Refusal(f"too many connections (control.max_connections = "
                               f"{self.max_total}); retry", False)
            self._held += 1
            self._by_uid[peer.uid] = mine + 1
            return None

    def _take_token(self, uid: int) -> bool:
        """Spend one of `uid`'s connection tokens (caller holds the lock)."""
        now = self.clock()
        burst = float(self.max_per_uid) + self.rate_per_uid
        tokens, last = self._buckets.get(uid, (burst, now))
        tokens = min(burst, tokens + (now - last) * self.rate_per_uid)
        if tokens < 1.0:
            self._buckets[uid] = (tokens, now)
            return False
        self._buckets[uid] = (tokens - 1.0, now)
        if len(self._buckets) > 4096:  # forget uids whose buckets are full again
            self._buckets = {u: b for u, b in self._buckets.items()
                             if b[0] + (now - b[1]) * self.rate_per_uid < burst}
        return True

    def release(self, peer: Peer) -> None:
        """Give back the slot `admit` gave `peer`."""
        with self._lock:
            self._held -= 1
            left = self._by_uid[peer.uid] - 1
            if left:
                self._by_uid[peer.uid] = left
            else:
                del self._by_uid[peer.uid]

    def refuse(self, sock: socket.socket, refusal: Refusal) -> None:
        """Answer `sock` 503 and close it: after the tarpit delay for a per-uid refusal."""
        if refusal.per_uid:
            with self._lock:
                if len(self._tarpit) < self.tarpit_max:
                    self._tarpit.append((self.clock() + self.delay_s, sock,
                                         refusal.message))
                    return
        _answer_and_close(sock, refusal.message)

    def reap(self) -> None:
        """Answer and close tarpitted connections whose delay is over (the accept loop calls it)."""
        now = self.clock()
        due = []
        with self._lock:
            while self._tarpit and self._tarpit[0][0] <= now:
                due.append(self._tarpit.popleft())
        for _, sock, why in due:
            _answer_and_close(sock, why)

    def close_all(self) -> None:
        """Answer every tarpitted connection now (at stop)."""
        with self._lock:
            due, self._tarpit = list(self._tarpit), collections.deque()
        for _, sock, why in due:
            _answer_and_close(sock, why)

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def held_by_uid(self) -> dict[int, int]:
        with self._lock:
            return dict(self._by_uid)

    def status(self) -> dict[str, object]:
        with self._lock:
            return {"held": self._held, "uids": len(self._by_uid), "tarpit": len(self._tarpit),
                    "refused": self.refused, "refused_per_uid": self.refused_per_uid,
                    "shed": self.shed, "shedding_uids": len(self._shedding),
                    "max_connections": self.max_total, "max_connections_per_uid": self.max_per_uid}


@functools.lru_cache(maxsize=256)
def _reply(why: str) -> bytes:
    body = json.dumps(NotReady(why, kind="overloaded").body()).encode() + b"\n"
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: {JSON_TYPE}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _answer_and_close(sock: socket.socket, why: str) -> None:
    try:
        sock.setblocking(False)  # a fresh socket's buffer takes this; never wait on a peer
        sock.send(_reply(why))
    except OSError:
        pass  # the refused client is gone or not reading; it is dropped either way
    sock.close()
