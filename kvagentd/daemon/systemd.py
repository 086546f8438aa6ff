"""sd_notify without libsystemd: datagrams to `$NOTIFY_SOCKET`.

A leading "@" in the address means the Linux abstract namespace. Without the variable every call
is a no-op, so the daemon runs the same in the foreground, in tests and under systemd.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    """Sends READY / STATUS / WATCHDOG / EXTEND_TIMEOUT_USEC / STOPPING / RELOADING."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        elif addr:
            log.warning("notify_socket_unsupported", address=addr)
        self._sock: socket.socket | None = None
        self._warned = False
        self.watchdog_interval_s = watchdog_interval(env)

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def notify(self, *fields: str) -> bool:
        """Send one message of `KEY=value` fields; False when disabled or the send failed."""
        if self._addr is None:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            # NOTE: non-blocking: a manager that does not read its socket must never stall
            # the daemon (a datagram socket's queue is short); such a message is dropped.
            self._sock.sendto("\n".join(fields).encode(), socket.MSG_DONTWAIT, self._addr)
        except OSError as exc:
            if not self._warned:  # systemd gone or socket misconfigured: say it once
                log.warning("sd_notify_failed", error=str(exc), fields=list(fields))
                self._warned = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={_one_line(status)}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask systemd for `seconds` more before the start (or stop) times out."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1_000_000)}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={_one_line(status)}"] if status else []))

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets systemd >= 253 (Type=notify-reload) match the reload to this message.
        return self.notify("RELOADING=1",
                           f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of `$WATCHDOG_USEC`, None when not requested."""
    env = os.environ if env is None else env
    pid = env.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    return int(usec) / 2 / 1_000_000


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]
