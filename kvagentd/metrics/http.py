"""The optional metrics-only TCP listener (`metrics.listen`), for Prometheus servers that
cannot scrape a Unix socket.

It answers `GET /metrics` (and HEAD) with the daemon's registry, in the Prometheus text format
or OpenMetrics when the scraper asks for it; every other path is 404 and every other method
405. No control route is reachable through it, and it reads nothing from the request but the
path and the Accept header. A slow or silent client is cut after `TIMEOUT_S`; at most
`MAX_CONNECTIONS` are served at once, more are closed at once.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from kvagentd import __version__
from kvagentd.config import parse_listen

log = structlog.get_logger(__name__)

TIMEOUT_S = 10.0
MAX_CONNECTIONS = 8
PATH = "/metrics"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = TIMEOUT_S  # applied to the connection's socket by StreamRequestHandler
    server_version = f"kvagentd-metrics/{__version__}"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path != PATH:
            self._plain(404, f"only {PATH} is served here\n")
            return
        encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
        try:
            body = encoder(self.server.registry)
        except Exception as exc:  # a collector bug must not take the listener down
            log.error("metrics_render_failed", exc_info=exc)
            self._plain(500, "metrics could not be rendered; see the daemon log\n")
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_HEAD = do_GET  # noqa: N815

    def _refuse(self) -> None:
        self._plain(405, f"only GET {PATH} is served here\n", allow="GET, HEAD")

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def _plain(self, status: int, text: str, allow: str | None = None) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        if allow:
            self.send_header("Allow", allow)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics_http", client=self.client_address[0], message=format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: drop, the scraper retries
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class MetricsListener:
    """`start()` binds (raises OSError when it cannot) and serves on a thread; `stop()`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.host, self.port, self.registry = host, port, registry
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens (the actual port when 0 was asked for)."""
        if self._server is None:
            return self.host, self.port
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._server = _Server((self.host, self.port), self.registry)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.5}, name="metrics-http",
                                        daemon=True)
        self._thread.start()
        host, port = self.address
        log.info("metrics_listening", address=f"{host}:{port}", path=PATH,
                 loopback=host in ("127.0.0.1", "::1", "localhost"))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def start_listener(listen: str, registry: CollectorRegistry
                   ) -> tuple[MetricsListener | None, str | None]:
    """The optional metrics-only TCP listener on `listen` ("PORT" or "HOST:PORT"), or why it
    could not start: a port that cannot be bound is a degraded health check, never a failed
    start (the agent matters more than its scrape)."""
    host, port = parse_listen(listen)
    listener = MetricsListener(host, port, registry)
    try:
        listener.start()
    except OSError as exc:
        log.error("metrics_listener_failed", address=f"{host}:{port}", error=str(exc),
                  effect="metrics only on the control socket")
        return None, f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return listener, None
