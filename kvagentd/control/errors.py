"""API errors and the one place that maps exceptions to them.

Handlers raise `ApiError` subclasses for expected failures (bad input, not found, busy ...).
`to_api_error()` is the single mapping from any exception to an `ApiError`; the server calls it
for everything a handler raises and renders the result as
`{"error": {"kind": ..., "message": ...}}` with the error's HTTP status.
"""

from __future__ import annotations

import errno
from typing import Any, TypeVar

T = TypeVar("T")


class ApiError(Exception):
    """An error the control API reports to its client. `kind` is stable; `message` is for humans."""

    status: int = 500
    kind: str = "internal"

    def __init__(self, message: str, *, kind: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"kind": self.kind, "message": self.message}}


class BadRequest(ApiError):
    status, kind = 400, "bad_request"


class BadConfig(BadRequest):
    """A configuration (for example a reloaded file) is invalid."""

    kind = "bad_config"


class Forbidden(ApiError):
    status, kind = 403, "forbidden"


class NotFound(ApiError):
    status, kind = 404, "not_found"


class MethodNotAllowed(ApiError):
    status, kind = 405, "method_not_allowed"


class RequestTimeout(ApiError):
    status, kind = 408, "request_timeout"


class Busy(ApiError):
    """The daemon cannot take this now (queue full, operation already running); retry later."""

    status, kind = 409, "busy"


class Conflict(ApiError):
    """The request contradicts what exists (for example a session id already taken)."""

    status, kind = 409, "conflict"


class Fenced(Conflict):
    """The session was handed over to another box; this box no longer writes it."""

    kind = "session_fenced"


class LengthRequired(ApiError):
    status, kind = 411, "length_required"


class TooLarge(ApiError):
    status, kind = 413, "too_large"


class KVCapacity(TooLarge):
    """The request needs more KV than the daemon can hold for one request (the message names
    the limit, e.g. kv.hot_bytes); retrying does not help, a shorter request or a larger
    limit does."""

    kind = "kv_capacity"


class Internal(ApiError):
    status, kind = 500, "internal"


class Storage(ApiError):
    """The daemon cannot write what the request needs to its state directory (a full or
    failing disk): the message names the path and the system's error."""

    status, kind = 507, "insufficient_storage"


class NotImplementedMethod(ApiError):
    status, kind = 501, "not_implemented"


class VersionNotSupported(ApiError):
    status, kind = 505, "http_version_not_supported"


class NotReady(ApiError):
    """The daemon (or the service a route needs) is not up yet, or is shutting down."""

    status, kind = 503, "not_ready"


class Timeout(ApiError):
    """The work was accepted but did not finish within its deadline."""

    status, kind = 504, "timeout"


# Exceptions raised below the control layer, mapped by qualified class name so that importing
# this module never imports the engine (torch) or the store. Checked along the exception's MRO.
_MAPPED_BY_NAME: dict[str, type[ApiError]] = {
    "kvagentd.config.errors.ConfigError": BadConfig,
    "kvagentd.engine.executor.QueueFull": Busy,
    # A job whose deadline passed while it waited, or that the stopping executor never ran.
    "kvagentd.engine.executor.JobNotRun": Busy,
    # A request that does not fit the hot pool (or the batch memory) even alone.
    "kvagentd.engine.executor.HotPoolFull": KVCapacity,
    "kvagentd.engine.blocks.BatchMemoryExceeded": KVCapacity,
    "kvagentd.engine.sessions.SessionFenced": Fenced,
    "concurrent.futures._base.TimeoutError": Timeout,
    "builtins.TimeoutError": Timeout,
    "json.decoder.JSONDecodeError": BadRequest,
}

# A disk that is full, read-only or failing under the daemon: 507 naming the path, not 500.
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

_BY_STATUS: dict[int, type[ApiError]] = {
    cls.status: cls
    for cls in (BadRequest, Forbidden, NotFound, MethodNotAllowed, RequestTimeout, Busy,
                LengthRequired, TooLarge, Internal, NotImplementedMethod, NotReady, Timeout,
                VersionNotSupported)
}


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception to the `ApiError` the client sees.

    Unknown exceptions become `Internal` with a message that does not leak internals; the
    caller logs the traceback.
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:
        where = f"cannot write {exc.filename}" if exc.filename else "cannot write the state"
        return Storage(f"{where}: {exc.strerror or exc}")
    for cls in type(exc).__mro__:
        target = _MAPPED_BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if target is not None:
            return target(str(exc) or target.kind.replace("_", " "))
    return Internal("internal error; the daemon log has the details")


def for_status(status: int, message: str) -> ApiError:
    """The `ApiError` for an HTTP status (used for protocol-level errors found by the parser)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = ApiError(message, kind="bad_request" if 400 <= status < 500 else "internal")
        err.status = status
        return err
    return cls(message)


def require_service(service: T | None, missing: str) -> T:
    """`service` (one of `ControlDeps.services`), or 404 `not_configured` naming what is
    missing. NOTE: routes that use it answer only once the daemon is ready (503 before), when
    every service its configuration asks for exists: one absent now is absent for good, so
    "retry" (503) would be wrong."""
    if service is None:
        raise NotFound(missing, kind="not_configured")
    return service
