"""Pipelined GETEX replies read straight into record buffers (`remote/wire.py`), against a real
redis-server and against a socket that delivers the same replies a few bytes at a time."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from kvagentd.kvcache.remote import wire
from tests.redisd import RedisServer

LENGTH = 100_000


def _read(client, names: list[str], length: int = LENGTH) -> list[bytes | None]:
    got: list[bytes | None] = []

    def sink(i: int, view: memoryview | None) -> None:
        assert i == len(got)  # in order, once each
        got.append(None if view is None else bytes(view))

    wire.getex_into(client, names, 60, length, lambda i: bytearray(length), sink)
    return got


def test_records_missing_keys_and_wrong_lengths_in_one_pipeline(redis: RedisServer) -> None:
    """Each reply reaches the sink in order: a record as its bytes, a missing key as None, a
    value of another length as an empty view (the tier refuses it as a short record); the TTL
    is refreshed; the connection goes back to the pool clean and reads again."""
    vals = [random.Random(i).randbytes(LENGTH) for i in range(3)]
    with redis.client() as c:
        c.set("a", vals[0])
        c.set("b", vals[1], ex=5)
        c.set("short", b"x" * 10)
        c.set("c", vals[2])
        assert wire.usable(c)
        got = _read(c, ["a", "missing", "b", "short", "c"])
        assert got == [vals[0], None, vals[1], b"", vals[2]]
        assert c.ttl("b") > 50  # GETEX EX refreshed it
        pool = c.connection_pool
        assert not pool._in_use_connections and len(pool._available_connections) == 1
        assert _read(c, ["c", "a"]) == [vals[2], vals[0]]
        assert len(pool._available_connections) == 1  # the same connection, reused


def test_an_error_reply_raises_after_every_reply_was_read(redis: RedisServer) -> None:
    """A key of another type answers an error: the records around it are still served, the
    error is raised at the end, and the connection stays in step for the next read."""
    from redis.exceptions import ResponseError

    with redis.client() as c:
        c.set("a", b"1" * LENGTH)
        c.rpush("list", "x")
        c.set("b", b"2" * LENGTH)
        got: list[bytes | None] = []
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            wire.getex_into(c, ["a", "list", "b"], 60, LENGTH, lambda i: bytearray(LENGTH),
                            lambda i, v: got.append(None if v is None else bytes(v[:1])))
        assert got == [b"1", b"2"]
        assert _read(c, ["b"]) == [b"2" * LENGTH]


def test_a_stalled_server_times_out_and_the_connection_is_dropped(redis: RedisServer) -> None:
    """A reply that does not come within the socket timeout raises (an OSError, which the link
    takes as the remote down) and the connection is closed, not returned mid-reply."""
    import redis as redispy

    with redis.client() as admin, redispy.Redis(host="127.0.0.1", port=redis.port,
                                                 socket_timeout=0.3) as c:
        c.set("a", b"1" * LENGTH)
        conn = c.connection_pool.get_connection()
        c.connection_pool.release(conn)
        admin.client_pause(1500, all=True)
        t = time.monotonic()
        with pytest.raises((OSError, redispy.exceptions.TimeoutError)):
            _read(c, ["a"])
        assert time.monotonic() - t < 1.2
        assert conn._sock is None  # disconnected
        time.sleep(1.5)
        assert _read(c, ["a"]) == [b"1" * LENGTH]


class _Trickle:
    """A socket whose `recv_into` hands out `data` in pieces of 1-7 bytes (or larger bodies
    in one go, as a kernel may), then end of stream."""

    def __init__(self, data: bytes, seed: int) -> None:
        self.data, self.pos, self.rng = data, 0, random.Random(seed)

    def recv_into(self, buf: memoryview) -> int:
        n = min(len(buf), len(self.data) - self.pos, self.rng.choice([1, 2, 3, 7, 4096]))
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def _resp(values: list[bytes | None]) -> bytes:
    out = b""
    for v in values:
        out += b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_replies_split_anywhere_are_read_whole(seed: int) -> None:
    """Reply lines and bodies cut at any byte by the socket are reassembled exactly."""
    rng = random.Random(seed)
    vals: list[bytes | None] = [rng.randbytes(300), None, rng.randbytes(300), b"odd",
                                rng.randbytes(300)]
    stream = wire._Stream(_Trickle(_resp(vals), seed))
    got: list[bytes | None] = []
    for _ in vals:
        head = stream.line()
        if head == b"$-1":
            got.append(None)
            continue
        n = int(head[1:])
        buf = bytearray(n)
        stream.read_into(memoryview(buf))
        stream.expect_crlf()
        got.append(bytes(buf))
    assert got == vals


def test_a_reply_cut_short_or_of_another_shape_raises() -> None:
    from redis.exceptions import ConnectionError, InvalidResponse

    cut = wire._Stream(_Trickle(b"$300\r\n" + b"x" * 100, 0))
    assert cut.line() == b"$300"
    with pytest.raises(ConnectionError):
        cut.read_into(memoryview(bytearray(300)))
    bad_end = wire._Stream(_Trickle(b"$3\r\nabcXY", 0))
    bad_end.line()
    bad_end.read_into(memoryview(bytearray(3)))
    with pytest.raises(InvalidResponse):
        bad_end.expect_crlf()
    with pytest.raises(InvalidResponse):
        wire._Stream(_Trickle(b"+" + b"x" * 5000 + b"\r\n", 0)).line()


def test_only_single_server_resp2_clients_are_read_directly(redis: RedisServer,
                                                            rdir: Path) -> None:
    import redis as redispy

    assert not wire.usable(redispy.Redis(host="127.0.0.1", port=redis.port, protocol=3))
    assert not wire.usable(object())
    with redis.client() as c:
        assert wire.usable(c)


def test_concurrent_reads_each_get_their_own_connection(redis: RedisServer) -> None:
    """Two threads reading at once through one client never mix replies."""
    with redis.client() as c:
        for i in range(4):
            c.set(f"k{i}", bytes([i]) * LENGTH)
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                for _ in range(20):
                    assert _read(c, [f"k{i}", f"k{(i + 1) % 4}"]) == [
                        bytes([i]) * LENGTH, bytes([(i + 1) % 4]) * LENGTH]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
