"""What the daemon's main loop is asked to do, from signals, the control API or any thread:
stop (first SIGTERM/SIGINT or `POST /v1/shutdown`), reload (SIGHUP), or just look again.

A self-pipe wakes the loop; signal handlers only set flags and write to it. A second stop
signal exits at once (128 + n), unless it arrives within `SECOND_SIGNAL_MIN_GAP_S` of the
first: then it is a copy of the same request (a wrapper such as timeout(1) signals both the
child and its process group).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import threading
import time
from types import FrameType

SECOND_SIGNAL_MIN_GAP_S = 0.5


class LoopRequests:
    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.reload_requested = False
        self._first_signal_at = 0.0
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def stop(self, reason: str) -> None:
        """Ask the loop to stop (thread-safe, async-signal-safe); the first reason stays."""
        if self.stop_reason is None:
            self.stop_reason = reason
        self.wake()

    def reload(self) -> None:
        self.reload_requested = True
        self.wake()

    def take_reload(self) -> bool:
        """True once per requested reload."""
        if self.reload_requested:
            self.reload_requested = False
            return True
        return False

    def wake(self) -> None:
        try:
            self._w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # buffer full (the loop is due to wake anyway) or the daemon has stopped

    def wait(self, timeout: float) -> None:
        """Sleep until woken or `timeout` seconds have passed."""
        readable, _, _ = select.select([self._r], [], [], timeout)
        if readable:
            try:
                while self._r.recv(4096):
                    pass
            except BlockingIOError:
                pass  # drained

    def install_signals(self) -> bool:
        """SIGTERM/SIGINT stop, SIGHUP reloads; only in the main thread (embedded in tests,
        the host process owns signals). True when installed."""
        if threading.current_thread() is not threading.main_thread():
            return False
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        return True

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        # NOTE: runs between bytecodes of the main thread: set flags and wake only, no logging.
        now = time.monotonic()
        if self.stop_reason is not None:
            if now - self._first_signal_at < SECOND_SIGNAL_MIN_GAP_S:
                return
            os.write(2, b"kvagentd: second stop signal, exiting at once\n")
            os._exit(128 + signum)
        self._first_signal_at = now
        self.stop(signal.Signals(signum).name)

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.reload()

    def close(self) -> None:
        self._r.close()
        self._w.close()
