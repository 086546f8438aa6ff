"""One control connection: HTTP/1.1 requests read, limited, dispatched and answered.

Parsing is the standard library's (`http.server.BaseHTTPRequestHandler`); this module adds:

* peer credentials (SO_PEERCRED, read by the listener at accept time) and per-route
  authorization (`authz`);
* a total deadline for the request line + headers (`control.header_timeout_s`) and one for the
  body (`control.read_timeout_s`), so a silent or byte-a-second client only ever holds its own
  connection slot, and only for that long;
* a body limit (`control.max_body_bytes`, 413), JSON errors for every failure, including the
  parser's own;
* streamed responses with chunked transfer encoding.
"""

from __future__ import annotations

import io
import json
import re
import socket
import socketserver
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlsplit

import structlog

from kvagentd import __version__
from kvagentd.control.authz import with_groups
from kvagentd.control.errors import (ApiError, BadRequest, LengthRequired, NotReady,
                                     RequestTimeout, TooLarge, for_status, to_api_error)
from kvagentd.control.router import (JSON_TYPE, NDJSON_TYPE, SSE_TYPE, TEXT_TYPE, Peer,
                                     Request, Response, Route, is_stream)

if TYPE_CHECKING:
    from kvagentd.control.listener import Listener

log = structlog.get_logger(__name__)

_MAX_LINE = 65536
_DIGITS = re.compile(r"[0-9]+", re.ASCII)  # str.isdigit() also accepts "²" and other digits
_MAX_LENGTH_DIGITS = 18  # any longer Content-Length is far past every body limit


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
    server: Listener

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
        self.ctl.register(self)

    def finish(self) -> None:
        self.ctl.unregister(self)
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
        # NOTE: what the error replies and the request log read, before the line is parsed
        self.requestline, self.request_version, self.command = "", "HTTP/1.0", ""
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

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = (  # noqa: E731
        lambda self: self._dispatch())

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
            self.ctl.observe(route_name, self.command, err.status, time.monotonic() - started)
            self._send_api_error(err)
            return
        status = self._send_result(result)
        self.ctl.observe(route_name, self.command, status, time.monotonic() - started)

    def _read_request(self) -> tuple[Request, Route]:
        if self.ctl.stopping:
            self.close_connection = True
            raise NotReady("kvagentd is shutting down")
        if getattr(self.headers, "defects", None):
            self.close_connection = True
            raise BadRequest(f"malformed header block: {self.headers.defects[0]!r}")
        self._check_framing()
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
        method = "GET" if self.command == "HEAD" else self.command  # HEAD: GET without a body
        route, params = self.ctl.router.match(method, path)
        self.ctl.policy.check(self.peer, method, path, route.change)
        if not route.before_ready and not self.ctl.is_ready():
            raise NotReady("kvagentd is not ready (starting or stopping); "
                           "retry when GET /v1/readyz answers 200")
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        req = Request(method=method, path=path, params=params, query=query,
                      headers=headers, body=body, peer=self.peer, route=route.pattern,
                      operator=self.ctl.policy.may_change(self.peer))
        return req, route

    def _check_framing(self) -> None:
        """RFC 9112 message framing: a request whose length is ambiguous is refused (400) and
        its connection closed, since a peer behind it could read the body as the next request
        (section 6.3); so is a header folded over lines (obs-fold, section 5.2) or a value
        with a bare CR or LF in it."""
        lengths = self.headers.get_all("Content-Length") or []
        problem = ""
        if len({v.strip() for v in lengths}) > 1:
            problem = f"{len(lengths)} different Content-Length headers"
        elif lengths and "Transfer-Encoding" in self.headers:
            problem = "both Content-Length and Transfer-Encoding"
        else:
            for name, value in self.headers.items():
                if "\r" in value or "\n" in value:
                    problem = f"header {name[:40]!r} folded over lines or holding a bare CR/LF"
                    break
        if problem:
            self.close_connection = True
            raise BadRequest(f"ambiguous request framing: {problem} (RFC 9112)")

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
            if self.command == "HEAD":  # the headers GET would send; the producer never runs
                self._prepare_write()
                self.send_response(status)
                self.send_header("Content-Type", ctype or NDJSON_TYPE)
                self.send_header("Cache-Control", "no-cache")
                for k, v in headers.items():
                    self.send_header(k, v)
                if self.request_version == "HTTP/1.1":
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                return status
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
        self.ctl.observe("<malformed>", getattr(self, "command", "") or "-", code, 0.0)

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
