from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from kvagentd.daemon.systemd import Notifier, watchdog_interval


def _listener(addr: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(2)
    return s


def test_messages_reach_a_path_socket() -> None:
    d = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))
    s = _listener(str(d / "n.sock"))
    n = Notifier(env={"NOTIFY_SOCKET": str(d / "n.sock")})
    assert n.enabled
    assert n.ready("serving  on\n socket")
    assert s.recv(1024) == b"READY=1\nSTATUS=serving on socket"
    n.status("x")
    n.watchdog()
    n.extend_timeout(1.5)
    n.stopping()
    assert [s.recv(1024) for _ in range(4)] == [
        b"STATUS=x", b"WATCHDOG=1", b"EXTEND_TIMEOUT_USEC=1500000", b"STOPPING=1"]
    n.reloading()
    msg = s.recv(1024).decode().split("\n")
    assert msg[0] == "RELOADING=1" and msg[1].startswith("MONOTONIC_USEC=")
    n.close()
    s.close()


def test_abstract_namespace_address() -> None:
    name = f"kvagentd-test-{os.getpid()}"
    s = _listener(b"\0" + name.encode())
    n = Notifier(env={"NOTIFY_SOCKET": "@" + name})
    assert n.ready()
    assert s.recv(1024) == b"READY=1"
    s.close()


def test_no_notify_socket_is_a_no_op() -> None:
    n = Notifier(env={})
    assert not n.enabled
    assert n.ready() is False and n.watchdog() is False


def test_send_failure_is_reported_not_raised() -> None:
    n = Notifier(env={"NOTIFY_SOCKET": "/nonexistent/notify.sock"})
    assert n.ready() is False
    assert n.status("still fine") is False


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000",
                              "WATCHDOG_PID": str(os.getpid())}) == 0.5
