"""HTTP/1.1 + JSON control server on a Unix socket: its lifecycle.

The parts, one module each:

* `socketfile`: the socket file (stale socket, mode, group, operators' ACL, removal);
* `listener`: the accept loop; at most `control.max_connections` connections, and at most
  `control.max_connections_per_uid` from one uid (judged at accept time from SO_PEERCRED, so a
  peer flooding the socket only ever holds its own share, `admission`); more are answered 503
  and closed; a listen backlog of `control.listen_backlog` absorbs bursts of connects;
* `connection`: one connection's requests (deadlines, body limit, JSON errors, streaming).

This module starts them and stops them gracefully: stop accepting, remove the socket, close
idle keep-alive connections, let in-flight requests finish within a drain timeout, then cut
the rest.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from kvagentd.config import ControlConfig
from kvagentd.control.admission import Admission
from kvagentd.control.authz import AccessPolicy
from kvagentd.control.connection import ControlHandler
from kvagentd.control.host import TrackedConnection
from kvagentd.control.listener import Listener
from kvagentd.control.router import Router
from kvagentd.control.socketfile import SocketFile

log = structlog.get_logger(__name__)


class ControlServer:
    """The control socket: `start()` binds and serves in a thread, `stop()` drains and removes it."""

    def __init__(self, cfg: ControlConfig, router: Router, *, policy: AccessPolicy | None = None,
                 observe: Any = None, is_ready: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.is_ready: Callable[[], bool] = is_ready or (lambda: True)
        self.router = router
        self.socket_file = SocketFile(cfg)
        self.path = self.socket_file.path
        self.policy = policy or AccessPolicy.from_config(cfg.socket_group, cfg.operator_group)
        self.stopping = False
        self._observe_cb = observe
        self.admission = Admission(cfg.max_connections, cfg.max_connections_per_uid,
                                   cfg.connect_rate_per_uid)
        self._conns: set[TrackedConnection] = set()
        self._lock = threading.Condition()
        self._server: Listener | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self.socket_file.prepare()
        server = Listener(self, ControlHandler)
        old_umask = os.umask(0o177)  # the socket is created 0600, then opened up to socket_mode
        try:
            server.server_bind()
        finally:
            os.umask(old_umask)
        try:
            self.socket_file.publish()
            server.server_activate()
        except BaseException:
            server.server_close()
            self.path.unlink(missing_ok=True)
            raise
        self.socket_file.remember()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="control-accept", daemon=True)
        self._thread.start()
        log.info("control_listening", socket=str(self.path), mode=oct(self.cfg.socket_mode),
                 max_connections=self.cfg.max_connections,
                 max_connections_per_uid=self.cfg.max_connections_per_uid,
                 backlog=self.cfg.listen_backlog)

    def stop(self, drain_timeout: float) -> bool:
        """Stop accepting, remove the socket, wait up to `drain_timeout` s for in-flight requests.

        Returns True when every request finished in time; the rest are cut.
        """
        self.stopping = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.admission.close_all()
        self.socket_file.remove()
        with self._lock:
            for h in list(self._conns):
                if not h.busy:
                    _shutdown_socket(h.connection)
            deadline = time.monotonic() + drain_timeout
            while any(h.busy for h in self._conns):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 0.1))
            cut = [h for h in self._conns if h.busy]
            for h in list(self._conns):
                _shutdown_socket(h.connection)
        if cut:
            log.warning("control_drain_timeout", cut_requests=len(cut), drain_timeout_s=drain_timeout)
        else:
            log.info("control_stopped")
        return not cut

    @property
    def serving(self) -> bool:
        """True while the accept thread runs (the watchdog is withheld otherwise)."""
        return self._thread is not None and self._thread.is_alive() and not self.stopping

    @property
    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for h in self._conns if h.busy)

    @property
    def rejected_connections(self) -> int:
        return self.admission.refused

    @property
    def rejected_per_uid(self) -> int:
        return self.admission.refused_per_uid

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # -- bookkeeping used by the connections -------------------------------------------------

    def register(self, h: TrackedConnection) -> None:
        with self._lock:
            self._conns.add(h)

    def unregister(self, h: TrackedConnection) -> None:
        with self._lock:
            self._conns.discard(h)
            self._lock.notify_all()

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        if self._observe_cb is not None:
            self._observe_cb(route, method, status, seconds)


def _shutdown_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer or by its handler
