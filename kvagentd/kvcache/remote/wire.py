"""Pipelined `GETEX` replies read straight into record buffers.

Why: redis-py hands a reply to its caller as a new `bytes` object. With hiredis parsing, a
0.7 MB record is copied from the socket into redis-py's read buffer, from there into hiredis's,
and from there into the `bytes`; the remote tier then checksums it and copies it once more into
the block's slot. Read this way, a remote read cost 1.5x a plain `GET` of the same bytes
(BENCHMARKS.md, remote tier). Here each record goes from the socket into a buffer the caller
gives (`recv_into`) and is checked and decoded from there while it is still in the CPU's cache.

What is redis-py's and what is not: the connection comes from the client's own pool (so
connecting, TLS, AUTH, the client name and the socket timeouts are redis-py's), and the
commands are packed by the connection's own packer. Only the replies are read here, and only
what `GETEX` answers in RESP2: a bulk string, a nil, or an error line. Anything else, and any
fault midway (timeout, reset, a reply of an unknown shape), disconnects that connection, since
its reply stream is then unknown, and raises a redis-py exception that the link classifies as
it would any other.

`usable(client)` says whether a client can be read this way: a single-server `redis.Redis`
speaking RESP2 without client-side caching. A Cluster client is read through its pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

LINE_MAX = 4096  # a reply's first line: "$<length>" or an error message; longer is no GETEX reply
STAGING_BYTES = 64 << 10  # socket reads for reply lines (bulk bodies bypass it)

Sink = Callable[[int, memoryview | None], None]
"""Called once per name, in order: the record's bytes (a view into the buffer `buffer_for`
gave, valid until the next call), an empty view when the value's length is not a record's, or
None when the key does not exist."""


def usable(client: Any) -> bool:
    """Whether `client` can be read with `getex_into` (see the module docstring)."""
    import redis

    if type(client) is not redis.Redis:
        return False
    pool = client.connection_pool
    kw = getattr(pool, "connection_kwargs", {})
    return (str(kw.get("protocol") or 2) == "2" and getattr(pool, "cache", None) is None
            and not kw.get("cache_config"))


def getex_into(client: Any, names: Sequence[str], ttl: int, length: int,
               buffer_for: Callable[[int], bytearray], sink: Sink) -> None:
    """`GETEX name EX ttl` for every name in one pipeline; each value of `length` bytes is read
    into `buffer_for(i)` (a bytearray of at least `length` bytes) and handed to `sink` before
    the next reply is read. Raises redis-py's exceptions for faults (the connection is then
    dropped) and `ResponseError` for the first error reply, after all replies were read."""
    from redis.exceptions import ConnectionError, InvalidResponse, ResponseError

    pool = client.connection_pool
    conn = pool.get_connection()
    clean = False
    try:
        conn.send_packed_command(conn.pack_commands([("GETEX", n, "EX", ttl) for n in names]))
        sock = conn._sock  # NOTE: redis-py's connected socket (plain or TLS); reads only
        if sock is None:
            raise ConnectionError("the connection has no socket")
        stream = _Stream(sock)
        error = ""
        for i in range(len(names)):
            head = stream.line()
            kind, rest = head[:1], head[1:]
            if kind == b"-":
                error = error or rest.decode("utf-8", "replace")
                continue
            if kind == b"_" or (kind == b"$" and rest == b"-1"):
                sink(i, None)
                continue
            if kind != b"$" or not rest.isdigit():
                raise InvalidResponse(f"unexpected reply to GETEX: {head[:32]!r}")
            n = int(rest)
            if n != length:
                stream.skip(n + 2)
                sink(i, memoryview(b""))
                continue
            view = memoryview(buffer_for(i))[:n]
            stream.read_into(view)
            stream.expect_crlf()
            sink(i, view)
        clean = True
        if error:
            raise ResponseError(error)
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)


class _Stream:
    """Reply bytes from a socket: lines through a small staging buffer, bulk bodies into the
    caller's buffer (what is already staged is copied, the rest received in place)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray(STAGING_BYTES)
        self.mv = memoryview(self.buf)
        self.lo = self.hi = 0

    def _recv(self, into: memoryview) -> int:
        from redis.exceptions import ConnectionError

        n = int(self.sock.recv_into(into))
        if n == 0:
            raise ConnectionError("the server closed the connection mid-reply")
        return n

    def _fill(self) -> None:
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.buf):
            left = self.hi - self.lo
            self.mv[:left] = self.mv[self.lo:self.hi]
            self.lo, self.hi = 0, left
        self.hi += self._recv(self.mv[self.hi:])

    def line(self) -> bytes:
        from redis.exceptions import InvalidResponse

        while True:
            end = self.buf.find(b"\r\n", self.lo, min(self.hi, self.lo + LINE_MAX + 2))
            if end >= 0:
                out = bytes(self.mv[self.lo:end])
                self.lo = end + 2
                return out
            if self.hi - self.lo > LINE_MAX:
                raise InvalidResponse("a reply line longer than GETEX's")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        take = min(len(dst), self.hi - self.lo)
        dst[:take] = self.mv[self.lo:self.lo + take]
        self.lo += take
        while take < len(dst):
            take += self._recv(dst[take:])

    def skip(self, n: int) -> None:
        while n:
            if self.lo == self.hi:
                self._fill()
            step = min(n, self.hi - self.lo)
            self.lo += step
            n -= step

    def expect_crlf(self) -> None:
        from redis.exceptions import InvalidResponse

        end = bytearray(2)
        self.read_into(memoryview(end))
        if end != b"\r\n":
            raise InvalidResponse("a bulk reply not ended by CRLF")
