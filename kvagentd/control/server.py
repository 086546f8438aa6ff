"""HTTP/1.1 + JSON control server on a Unix socket.

Parsing is the standard library's (`http.server.BaseHTTPRequestHandler`); this module adds what
a daemon needs around it:

* peer credentials (SO_PEERCRED) per connection and per-route authorization (`authz`);
* a total deadline for the request line + headers (`control.header_timeout_s`) and one for the
  body (`control.read_timeout_s`), so a silent or byte-a-second client only ever holds its own
  connection slot, and only for that long;
* at most `control.max_connections` connections, and at most
  `control.max_connections_per_uid` from one uid (judged at accept time from SO_PEERCRED, so a
  peer flooding the socket only ever holds its own share); more are answered 503 and closed;
  a listen backlog of `control.listen_backlog` absorbs bursts of connects;
* a body limit (`control.max_body_bytes`, 413), JSON errors for every failure, including the
  parser's own;
* streamed responses with chunked transfer encoding;
* graceful stop: stop accepting, remove the socket, close idle keep-alive connections, let
  in-flight requests finish within a drain timeout, then cut the rest.
"""

from __future__ import annotations

import errno
import grp
import io
import json
import os
import re
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

import structlog

from kvagentd import __version__
from kvagentd.config import ControlConfig
from kvagentd.control import acl
from kvagentd.control.admission import Admission
from kvagentd.control.authz import AccessPolicy, peer_cred, with_groups
from kvagentd.control.errors import (ApiError, BadRequest, LengthRequired, NotReady,
                                     RequestTimeout, TooLarge, for_status, to_api_error)
from kvagentd.control.router import (JSON_TYPE, NDJSON_TYPE, SSE_TYPE, TEXT_TYPE, Peer,
                                     Request, Response, Route, Router, is_stream)

log = structlog.get_logger(__name__)

_MAX_LINE = 65536
_DIGITS = re.compile(r"[0-9]+", re.ASCII)  # str.isdigit() also accepts "²" and other digits
_MAX_LENGTH_DIGITS = 18  # any longer Content-Length is far past every body limit
ACCEPT_BATCH = 256  # connections accepted per wake-up of the accept loop


class ControlSocketInUse(OSError):
    """Another process is already listening on the configured control socket."""


class _PeerGone(Exception):
    """The client disconnected while its request was being read."""


class _DeadlineReader(io.RawIOBase):
    """Socket reader whose every recv is bounded by the handler's current absolute deadline."""

    def __init__(self, sock: socket.socket, handler: ControlHandler) -> None:
        self._sock, self._h = sock, handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        remaining = self._h.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(remaining)
        n = self._sock.recv_into(buf)
        self._h.bytes_in_request += n
        return n


class ControlHandler(BaseHTTPRequestHandler):
    """One connection; requests on it are served one after another (HTTP/1.1 keep-alive)."""

    protocol_version = "HTTP/1.1"
    default_request_version = "HTTP/1.0"  # never answer in HTTP/0.9 (no status line)
    server_version = f"kvagentd/{__version__}"
    sys_version = ""
    server: _UnixServer

    deadline: float = 0.0
    bytes_in_request: int = 0
    busy: bool = False
    responded: bool = False  # a status line went out for the current request
    body_consumed: bool = False  # the current request's body has been read off the socket

    # -- connection setup / teardown -------------------------------------------------------

    def setup(self) -> None:
        self.ctl = self.server.control
        self.connection = self.request
        # NOTE: the accept thread read the peer's credentials and passes them as the address;
        # its groups are read here, off the accept path.
        self.peer = with_groups(self.connection, cast(Peer, self.client_address))
        self.deadline = time.monotonic() + self.ctl.cfg.header_timeout_s
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self), 16384)
        self.wfile = socketserver._SocketWriter(self.connection)  # type: ignore[attr-defined]
        self.ctl._register(self)

    def finish(self) -> None:
        self.ctl._unregister(self)
        try:
            self.wfile.flush()
        except OSError:
            pass  # the peer is gone; nothing left to deliver
        self.wfile.close()
        self.rfile.close()

    # -- one request -----------------------------------------------------------------------

    def handle_one_request(self) -> None:
        self.busy = False
        self.bytes_in_request = 0
        self.responded = False
        self.body_consumed = False
        self.deadline = time.monotonic() + self.ctl.cfg.header_timeout_s
        if self.ctl.stopping:
            self.close_connection = True
            return
        try:
            self.raw_requestline = self.rfile.readline(_MAX_LINE + 1)
            self.busy = True
            if len(self.raw_requestline) > _MAX_LINE:
                self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            handler = getattr(self, "do_" + self.command, None)
            if handler is None:
                self.send_error(501, f"method {self.command!r} is not supported")
                return
            handler()
            self.wfile.flush()
        except TimeoutError:
            self.close_connection = True
            if self.bytes_in_request and not self.responded:
                self._quiet_error(408, "request not received within the deadline")
        except OSError as exc:  # the peer went away or the drain cut the connection
            log.debug("control_connection_dropped", error=str(exc))
            self.close_connection = True
        finally:
            self.busy = False

    def handle_expect_100(self) -> bool:
        text = self.headers.get("Content-Length")
        if text is not None:
            try:
                self._content_length(text)
            except ApiError as err:  # refused before the client sends the body
                self.send_error(err.status, err.message)
                return False
        return super().handle_expect_100()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = lambda self: self._dispatch()  # noqa: E731

    def _dispatch(self) -> None:
        started = time.monotonic()
        route_name = "<unmatched>"
        try:
            req, route = self._read_request()
            route_name = route.pattern
            result = route.handler(req)
        except _PeerGone:
            self.close_connection = True
            return
        except Exception as exc:  # every failure maps to one JSON error (errors.to_api_error)
            if not self.body_consumed and self._has_body():
                # NOTE: the unread body would be parsed as the next request on this connection.
                self.close_connection = True
            err = to_api_error(exc)
            if not isinstance(exc, ApiError):
                log.error("handler_failed", route=route_name, method=self.command, exc_info=exc)
            elif err.status >= 500 and err.status != 503:
                log.warning("request_failed", route=route_name, kind=err.kind,
                            message=err.message)
            self.ctl._observe(route_name, self.command, err.status, time.monotonic() - started)
            self._send_api_error(err)
            return
        status = self._send_result(result)
        self.ctl._observe(route_name, self.command, status, time.monotonic() - started)

    def _read_request(self) -> tuple[Request, Route]:
        if self.ctl.stopping:
            self.close_connection = True
            raise NotReady("kvagentd is shutting down")
        if getattr(self.headers, "defects", None):
            self.close_connection = True
            raise BadRequest(f"malformed header block: {self.headers.defects[0]!r}")
        target = self.path
        if not target.startswith("/"):
            parts = urlsplit(target)  # absolute-form, e.g. http://localhost/v1/status
            if parts.scheme not in ("http", "https") or not parts.path.startswith("/"):
                raise BadRequest(f"request target must be a path, got {target[:80]!r}")
            target = parts.path + ("?" + parts.query if parts.query else "")
        path, _, qs = target.partition("?")
        try:
            query = dict(parse_qsl(qs, keep_blank_values=True, strict_parsing=False,
                                   max_num_fields=100))
        except ValueError as exc:
            raise BadRequest(f"bad query string: {exc}") from None
        route, params = self.ctl.router.match(self.command, path)
        self.ctl.policy.check(self.peer, self.command, path, route.change)
        if not route.before_ready and not self.ctl.is_ready():
            raise NotReady("kvagentd is not ready (starting or stopping); "
                           "retry when GET /v1/readyz answers 200")
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        req = Request(method=self.command, path=path, params=params, query=query,
                      headers=headers, body=body, peer=self.peer, route=route.pattern,
                      operator=self.ctl.policy.may_change(self.peer))
        return req, route

    def _has_body(self) -> bool:
        return ("Transfer-Encoding" in self.headers
                or self.headers.get("Content-Length", "0").strip() not in ("", "0"))

    def _read_body(self) -> bytes:
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise LengthRequired("chunked request bodies are not accepted; send Content-Length")
        text = self.headers.get("Content-Length")
        if text is None:
            self.body_consumed = True
            return b""
        try:
            length = self._content_length(text)
        except ApiError:
            self.close_connection = True
            raise
        self.deadline = time.monotonic() + self.ctl.cfg.read_timeout_s
        try:
            body = self.rfile.read(length) if length else b""
        except TimeoutError:
            self.close_connection = True
            raise RequestTimeout(f"request body not received within control.read_timeout_s "
                                 f"({self.ctl.cfg.read_timeout_s} s)") from None
        except OSError as exc:
            raise _PeerGone(str(exc)) from None
        if len(body) != length:
            self.close_connection = True
            raise BadRequest("request body shorter than Content-Length")
        self.body_consumed = True
        return body

    def _content_length(self, text: str) -> int:
        """The declared body length; BadRequest unless plain ASCII digits, TooLarge past
        `control.max_body_bytes` (without converting an absurdly long number)."""
        digits = text.strip()
        if not _DIGITS.fullmatch(digits):
            raise BadRequest(f"bad Content-Length {text[:40]!r}: expected ASCII digits")
        if len(digits.lstrip("0")) > _MAX_LENGTH_DIGITS:
            raise TooLarge(f"request body of {len(digits)}-digit length exceeds "
                           f"control.max_body_bytes ({self.ctl.cfg.max_body_bytes})")
        length = int(digits)
        if length > self.ctl.cfg.max_body_bytes:
            raise TooLarge(self._too_large_text(length))
        return length

    def _too_large_text(self, length: int) -> str:
        return (f"request body of {length} bytes exceeds control.max_body_bytes "
                f"({self.ctl.cfg.max_body_bytes})")

    # -- responses -------------------------------------------------------------------------

    def send_response(self, code: int, message: str | None = None) -> None:
        self.responded = True
        super().send_response(code, message)

    def _prepare_write(self) -> None:
        self.connection.settimeout(self.ctl.cfg.read_timeout_s)
        if self.ctl.stopping:
            self.close_connection = True

    def _send_result(self, result: Any) -> int:
        status, ctype, headers, body = 200, None, {}, result
        if isinstance(result, Response):
            status, ctype, headers, body = (result.status, result.content_type,
                                            result.headers, result.body)
        if body is None:
            self._send_bytes(204 if status == 200 else status, b"", None, headers)
        elif isinstance(body, bytes | str):
            data = body.encode() if isinstance(body, str) else body
            self._send_bytes(status, data, ctype or TEXT_TYPE, headers)
        elif is_stream(body):
            status = self._send_stream(status, iter(body), ctype, headers)
        else:
            data = json.dumps(body, default=str).encode() + b"\n"
            self._send_bytes(status, data, ctype or JSON_TYPE, headers)
        return status

    def _send_bytes(self, status: int, data: bytes, ctype: str | None,
                    headers: dict[str, str]) -> None:
        self._prepare_write()
        self.send_response(status)
        if ctype is not None:
            self.send_header("Content-Type", ctype)
        if status != 204:
            self.send_header("Content-Length", str(len(data)))
        for k, v in headers.items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if data and self.command != "HEAD":
            self.wfile.write(data)

    def _send_api_error(self, err: ApiError) -> None:
        if err.status in (408, 411, 413):  # the rest of the request was not read
            self.close_connection = True
        data = json.dumps(err.body()).encode() + b"\n"
        self._send_bytes(err.status, data, JSON_TYPE, err.headers)

    def _send_stream(self, status: int, items: Iterator[Any], ctype: str | None,
                     headers: dict[str, str]) -> int:
        try:
            try:
                first = next(items)
            except StopIteration:
                first = None
            except Exception as exc:  # failed before the first byte: a normal error reply
                err = to_api_error(exc)
                if not isinstance(exc, ApiError):
                    log.error("stream_failed", path=self.path, exc_info=exc)
                self._send_api_error(err)
                return err.status
            if ctype is None:
                ctype = NDJSON_TYPE if isinstance(first, dict | list) else TEXT_TYPE
            self._prepare_write()
            chunked = self.request_version == "HTTP/1.1"
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Cache-Control", "no-cache")
            for k, v in headers.items():
                self.send_header(k, v)
            if chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.close_connection = True
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.flush()
            if first is not None:
                self._write_chunk(_encode_item(first, ctype), chunked)
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    break
                except Exception as exc:  # the producer failed mid-stream: tell, then end
                    err = to_api_error(exc)
                    log.error("stream_failed", path=self.path, kind=err.kind, exc_info=exc)
                    if ctype == TEXT_TYPE:
                        # NOTE: plain text has no in-band error; an unterminated chunked body
                        # tells the client the stream broke.
                        self.close_connection = True
                        return status
                    self._write_chunk(_encode_item(err.body(), ctype, event="error"), chunked)
                    break
                self._write_chunk(_encode_item(item, ctype), chunked)
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            return status
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def _write_chunk(self, data: bytes, chunked: bool) -> None:
        if not data:
            return
        if chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)
        self.wfile.flush()

    # -- errors found by the parser (BaseHTTPRequestHandler calls these) -------------------

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        if message is None:
            message = self.responses.get(code, ("error",))[0]
        if code == 400 and explain is None and "syntax" not in message.lower():
            message = f"malformed request: {message}"
        self.close_connection = True
        try:
            self._send_bytes(code, json.dumps(for_status(code, message).body()).encode() + b"\n",
                             JSON_TYPE, {})
        except OSError:
            pass  # the peer is gone; the connection is being closed anyway
        self.ctl._observe("<malformed>", getattr(self, "command", "") or "-", code, 0.0)

    def _quiet_error(self, code: int, message: str) -> None:
        try:
            self.request_version = "HTTP/1.0"
            self.send_error(code, message)
            self.wfile.flush()
        except OSError:
            pass  # best effort: the client is slow or gone

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("control_http", message=format % args, peer_uid=self.peer.uid)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        log.debug("control_request", request=self.requestline[:200], status=str(code),
                  peer_uid=self.peer.uid, peer_pid=self.peer.pid)


def _encode_item(item: Any, ctype: str, event: str | None = None) -> bytes:
    if ctype.startswith(SSE_TYPE):
        text = item if isinstance(item, str) else json.dumps(item, default=str)
        lines = "".join(f"data: {line}\n" for line in text.split("\n"))
        return ((f"event: {event}\n" if event else "") + lines + "\n").encode()
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    return json.dumps(item, default=str).encode() + b"\n"


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False

    def __init__(self, control: ControlServer) -> None:
        self.control = control
        self.request_queue_size = control.cfg.listen_backlog
        super().__init__(str(control.path), ControlHandler, bind_and_activate=False)

    def server_activate(self) -> None:
        super().server_activate()
        self.socket.setblocking(False)  # accepts drain the backlog until EAGAIN

    def _handle_request_noblock(self) -> None:
        # NOTE: socketserver accepts one connection per wake-up of its selector; under a flood
        # that lets the backlog fill (connects then fail with EAGAIN). Drain it in batches.
        for _ in range(ACCEPT_BATCH):
            try:
                request, _ = self.socket.accept()
            except OSError:  # EAGAIN: the backlog is empty (or the peer left already)
                return
            try:
                self.process_request(request, None)
            except Exception:
                self.handle_error(request, None)
                self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            peer = peer_cred(request)
        except OSError:  # the peer left before we looked
            self.shutdown_request(request)
            return
        refusal = self.control.admission.admit(peer)
        if refusal is not None:
            self.control._observe("<rejected>", "-", 503, 0.0)
            self.control.admission.refuse(request, refusal)
            return
        try:
            super().process_request(request, peer)
        except BaseException:
            self.control.admission.release(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.control.admission.release(client_address)

    def service_actions(self) -> None:
        self.control.admission.reap()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.error("control_connection_failed", exc_info=True)


class ControlServer:
    """The control socket: `start()` binds and serves in a thread, `stop()` drains and removes it."""

    def __init__(self, cfg: ControlConfig, router: Router, *, policy: AccessPolicy | None = None,
                 observe: Any = None, is_ready: Callable[[], bool] | None = None) -> None:
        self.cfg = cfg
        self.is_ready: Callable[[], bool] = is_ready or (lambda: True)
        self.router = router
        self.path = Path(cfg.socket)
        self.policy = policy or AccessPolicy.from_config(cfg.socket_group, cfg.operator_group)
        self.stopping = False
        self._observe_cb = observe
        self.admission = Admission(cfg.max_connections, cfg.max_connections_per_uid,
                                   cfg.connect_rate_per_uid)
        self._conns: set[ControlHandler] = set()
        self._lock = threading.Condition()
        self._server: _UnixServer | None = None
        self._thread: threading.Thread | None = None
        self._inode: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._prepare_directory()
        self._remove_stale_socket()
        server = _UnixServer(self)
        old_umask = os.umask(0o177)  # the socket is created 0600, then opened up to socket_mode
        try:
            server.server_bind()
        finally:
            os.umask(old_umask)
        try:
            self._set_socket_permissions()
            self._grant_operators()
            server.server_activate()
        except BaseException:
            server.server_close()
            self.path.unlink(missing_ok=True)
            raise
        self._inode = self.path.stat().st_ino
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
        self._remove_own_socket()
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

    # -- socket file -------------------------------------------------------------------------

    def _prepare_directory(self) -> None:
        d = self.path.parent
        if d.exists():
            return
        d.mkdir(parents=True, mode=0o750)
        os.chmod(d, 0o750)
        gid = self._socket_gid()
        if gid is not None:
            try:
                os.chown(d, -1, gid)
            except PermissionError as exc:
                log.warning("control_dir_chgrp_failed", dir=str(d), group=self.cfg.socket_group,
                            error=exc.strerror)

    def _socket_gid(self) -> int | None:
        if not self.cfg.socket_group:
            return None
        try:
            return grp.getgrnam(self.cfg.socket_group).gr_gid
        except KeyError:
            return None

    def _remove_stale_socket(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketInUse(errno.EEXIST,
                                     f"{self.path} exists and is not a socket; remove it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("control_stale_socket_removed", socket=str(self.path))
            self.path.unlink(missing_ok=True)
            return
        except OSError as exc:
            raise ControlSocketInUse(exc.errno or errno.EADDRINUSE,
                                     f"cannot probe {self.path}: {exc}") from None
        finally:
            probe.close()
        raise ControlSocketInUse(errno.EADDRINUSE,
                                 f"another process is listening on {self.path}")

    def _set_socket_permissions(self) -> None:
        os.chmod(self.path, self.cfg.socket_mode)
        if not self.cfg.socket_group:
            return
        gid = self._socket_gid()
        if gid is None:
            log.warning("control_socket_group_missing", group=self.cfg.socket_group,
                        socket=str(self.path), effect="socket keeps the daemon's group")
            return
        if os.stat(self.path).st_gid == gid:
            return  # NOTE: no chown call: the unit's syscall filter denies @chown
        try:
            os.chown(self.path, -1, gid)
        except PermissionError as exc:
            log.warning("control_socket_chgrp_failed", group=self.cfg.socket_group,
                        error=exc.strerror)

    def _grant_operators(self) -> None:
        """Let `control.operator_group` connect without joining `control.socket_group`: an ACL
        entry on the socket (rw) and its directory (search). See control.acl."""
        ops = self.cfg.operator_group
        if not ops or ops == self.cfg.socket_group:
            return
        try:
            gid = grp.getgrnam(ops).gr_gid
        except KeyError:
            return  # AccessPolicy already warned: nobody is an operator
        for path, perm in ((self.path, acl.R | acl.W), (self.path.parent, acl.X)):
            try:
                acl.grant_group(path, gid, perm)
            except OSError as exc:  # no ACLs on this file system, or not ours to change
                log.warning("control_operator_acl_failed", path=str(path), group=ops,
                            error=exc.strerror or str(exc),
                            effect=f"operators also need group {self.cfg.socket_group!r}")
                return
        log.info("control_operator_acl", group=ops, socket=str(self.path))

    def _remove_own_socket(self) -> None:
        try:
            if self._inode is not None and self.path.stat().st_ino == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass  # already gone

    # -- bookkeeping used by the handlers ----------------------------------------------------

    def _register(self, h: ControlHandler) -> None:
        with self._lock:
            self._conns.add(h)

    def _unregister(self, h: ControlHandler) -> None:
        with self._lock:
            self._conns.discard(h)
            self._lock.notify_all()

    def _observe(self, route: str, method: str, status: int, seconds: float) -> None:
        if self._observe_cb is not None:
            self._observe_cb(route, method, status, seconds)


def _shutdown_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer or by its handler
