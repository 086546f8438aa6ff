"""Fair connections: one uid flooding the socket does not lock out another; bursts of connects
fit the listen backlog. The flooder and the prober are forked children running as other uids."""

from __future__ import annotations

import json
import os
import selectors
import signal
import threading
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.control.conftest import (NOBODY, Harness, make_config, read_all, start_harness,
                                    two_groups)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")

PROBER = 54321
FLOOD_CLIENTS = 40  # the finding: 40 idle clients reconnecting in a loop


def _drop(uid: int, gid: int) -> None:
    os.setgroups([gid])
    os.setgid(uid)
    os.setuid(uid)


def _flood(path: Path, uid: int, gid: int) -> int:
    """Fork a child keeping FLOOD_CLIENTS connections open: each sends nothing and reconnects
    as soon as the daemon closes it (refused or timed out), in a loop."""
    pid = os.fork()
    if pid == 0:
        try:
            _drop(uid, gid)
            sel = selectors.DefaultSelector()

            def connect() -> None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(path))
                sel.register(s, selectors.EVENT_READ)

            for _ in range(FLOOD_CLIENTS):
                connect()
            while True:
                for key, _ in sel.select():
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    try:
                        data = s.recv(65536)
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(s)
                        s.close()
                        connect()
        finally:
            os._exit(0)
    return pid


def _probe(path: Path, uid: int, gid: int, seconds: float, every: float = 0.05) -> list[int]:
    """Fork a child that sends GET /v1/livez on a fresh connection every `every` s for
    `seconds`; returns each probe's HTTP status (0: no reply, -1: refused at connect)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            _drop(uid, gid)
            out: list[int] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                try:
                    s.connect(str(path))
                    s.sendall(b"GET /v1/livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    reply = read_all(s)
                    out.append(int(reply.split(b" ", 2)[1]) if reply else 0)
                except OSError:
                    out.append(-1)
                finally:
                    s.close()
                time.sleep(every)
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(data)


@pytest.fixture
def open_harness(short_dir: Path) -> Iterator[tuple[Harness, int]]:
    reader, _ = two_groups()
    cfg = make_config(short_dir, socket_mode=0o666, socket_group=reader.gr_name,
                      max_connections=16, max_connections_per_uid=4, header_timeout_s=1.0)
    (short_dir / "run").mkdir(mode=0o755)
    os.chmod(short_dir, 0o755)
    h = start_harness(cfg)
    yield h, reader.gr_gid
    h.server.stop(1.0)


def test_a_second_uid_is_answered_during_a_flood(open_harness: tuple[Harness, int]) -> None:
    h, reader = open_harness
    flooder = _flood(h.path, NOBODY, reader)
    try:
        time.sleep(0.5)  # the flood is established
        statuses = _probe(h.path, PROBER, reader, seconds=3.0)
    finally:
        os.kill(flooder, signal.SIGKILL)
        os.waitpid(flooder, 0)
    assert h.server.rejected_per_uid > 0  # the flood did hit its share
    assert len(statuses) >= 10
    assert statuses == [200] * len(statuses)
    assert h.alive()


def test_the_flooder_gets_its_share_and_a_clear_refusal(open_harness: tuple[Harness, int]
                                                        ) -> None:
    h, reader = open_harness
    held = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(h.path))
        held.append(s)
    try:
        # The fifth from this uid (root) is refused with a reason; another uid is served.
        reply = h.raw(b"GET /v1/livez HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b" 503 " in reply.split(b"\r\n", 1)[0]
        assert b"max_connections_per_uid" in reply and b"uid 0" in reply
        statuses = _probe(h.path, PROBER, reader, seconds=0.2)
        assert statuses and set(statuses) == {200}
    finally:
        for s in held:
            s.close()


def test_a_burst_of_connects_fits_the_backlog(short_dir: Path) -> None:
    h = start_harness(make_config(short_dir))
    # Stop the accept loop so that every connect must wait in the backlog.
    h.server._server.shutdown()
    socks, refused = [], 0
    try:
        for _ in range(200):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(h.path))
            except BlockingIOError:  # EAGAIN: the backlog is full
                refused += 1
            socks.append(s)
    finally:
        for s in socks:
            s.close()
        h.server.stop(0.5)
    assert refused == 0


def test_kvctl_retries_a_full_accept_queue(short_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvctl.main import main

    h = start_harness(make_config(short_dir, listen_backlog=16, max_connections=64,
                                  max_connections_per_uid=64))
    h.server._server.shutdown()  # nobody accepts: connects wait in the backlog
    fillers = []
    try:
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(str(h.path))
            except BlockingIOError:
                break
        assert len(fillers) <= 64  # the backlog is full now
        restart = threading.Timer(0.5, h.server._server.serve_forever,
                                  kwargs={"poll_interval": 0.2})
        restart.start()
        assert main(["--socket", str(h.path), "--json", "--timeout", "10", "status"]) == 0
        assert '"version": "test"' in capsys.readouterr().out
    finally:
        for s in fillers:
            s.close()
        h.server.stop(0.5)  # also ends the restarted accept loop
