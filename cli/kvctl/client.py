"""HTTP client for the kvagentd control socket (httpx over a Unix domain socket)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx


class DaemonUnreachable(Exception):
    """Nothing answers on the socket (absent, refused, or the connection broke)."""

    def __init__(self, socket_path: Path, reason: str) -> None:
        super().__init__(reason)
        self.socket_path, self.reason = socket_path, reason


class SocketForbidden(Exception):
    """The socket exists but this user may not connect to it (file permissions)."""

    def __init__(self, socket_path: Path, reason: str) -> None:
        super().__init__(reason)
        self.socket_path, self.reason = socket_path, reason


class RequestTimedOut(Exception):
    """The daemon did not answer within the client's timeout."""


class ApiFailure(Exception):
    """The daemon answered with an error (`{"error": {"kind", "message"}}`)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


class Client:
    """One connection pool to the daemon. Use as a context manager."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        self.socket_path = Path(socket_path)
        self.timeout = timeout
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket_path)),
                                  base_url="http://kvagentd", timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                body: Any = None, ok: tuple[int, ...] = ()) -> Any:
        """Send one request; return the decoded JSON (or text) body of a 2xx reply.

        Statuses in `ok` are returned as well instead of raising ApiFailure.
        """
        with self._translate():
            resp = self._send(self._http.build_request(
                method, path, params=_clean(params), json=body if body is not None else None))
        if not (200 <= resp.status_code < 300 or resp.status_code in ok):
            raise _failure(resp.status_code, resp.content)
        return _decode(resp)

    def stream(self, method: str, path: str, *, params: dict[str, Any] | None = None,
               body: Any = None) -> Iterator[Any]:
        """Iterate a streamed reply: dicts for NDJSON lines, str pieces for text."""
        with self._translate():
            resp = self._send(self._http.build_request(method, path, params=_clean(params),
                                                       json=body), stream=True)
            try:
                if resp.status_code >= 300:
                    raise _failure(resp.status_code, resp.read())
                ctype = resp.headers.get("content-type", "")
                if "ndjson" in ctype or ctype.startswith("application/json"):
                    for line in resp.iter_lines():
                        if line.strip():
                            item = json.loads(line)
                            _raise_if_error_line(item, resp.status_code)
                            yield item
                elif ctype.startswith("text/event-stream"):
                    yield from _sse_events(resp.iter_lines())
                else:
                    yield from resp.iter_text()
            finally:
                resp.close()

    def _send(self, req: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send `req`; a connect refused because the daemon's accept queue is full (EAGAIN,
        a burst or a flood) is retried with backoff within the timeout."""
        deadline = time.monotonic() + self.timeout
        wait = 0.005
        while True:
            try:
                return self._http.send(req, stream=stream)
            except httpx.ConnectError as exc:
                if not _queue_full(exc) or time.monotonic() + wait > deadline:
                    raise
            time.sleep(wait)
            wait = min(wait * 2, 0.2)

    def _translate(self) -> _Translate:
        return _Translate(self.socket_path)


class _Translate:
    """Turn transport errors into DaemonUnreachable / SocketForbidden / RequestTimedOut."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if exc is None:
            return False
        if isinstance(exc, httpx.TimeoutException):
            raise RequestTimedOut(str(exc) or "timed out") from exc
        if isinstance(exc, httpx.TransportError):
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__cause__ or cause.__context__
            if isinstance(cause, PermissionError) or "Permission denied" in str(exc):
                raise SocketForbidden(self.socket_path, str(cause or exc)) from exc
            if not isinstance(exc, httpx.ConnectError):
                raise ApiFailure(0, "connection_broken",
                                 f"the daemon closed the connection: {exc}") from exc
            raise DaemonUnreachable(self.socket_path, str(cause or exc) or type(exc).__name__
                                    ) from exc
        return False


def _queue_full(exc: BaseException) -> bool:
    """True when `exc` comes from connect() finding the listen backlog full (EAGAIN)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, BlockingIOError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _clean(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if params is None:
        return None
    return {k: (str(v).lower() if isinstance(v, bool) else v)
            for k, v in params.items() if v is not None}


def _decode(resp: httpx.Response) -> Any:
    if resp.status_code == 204 or not resp.content:
        return None
    if resp.headers.get("content-type", "").startswith("application/json"):
        return resp.json()
    return resp.text


def _failure(status: int, content: bytes) -> ApiFailure:
    try:
        err = json.loads(content)["error"]
        return ApiFailure(status, str(err["kind"]), str(err["message"]))
    except (ValueError, KeyError, TypeError):
        text = content.decode("utf-8", "replace").strip()[:500]
        return ApiFailure(status, "http_error", text or f"HTTP {status}")


def _raise_if_error_line(item: Any, status: int) -> None:
    """The server ends a failed NDJSON stream with one `{"error": {"kind", "message"}}` line."""
    if isinstance(item, dict) and set(item) == {"error"} and isinstance(item["error"], dict):
        err = item["error"]
        if "kind" in err and "message" in err:
            raise ApiFailure(0, str(err["kind"]), str(err["message"]))


def _sse_events(lines: Iterator[str]) -> Iterator[Any]:
    data: list[str] = []
    for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            text = "\n".join(data)
            data = []
            try:
                yield json.loads(text)
            except ValueError:
                yield text
