"""Routes, requests and responses of the control API.

A handler module registers routes on a `Router`:

    @router.route("GET", "/v1/blocks/{key}", change=False)
    def get_block(req: Request) -> dict: ...

`change=True` marks a route that mutates state (only root, the daemon's uid and the operator
group may call it). A handler returns a JSON-ready dict (200), a `Response` (own status, text
body or stream), or an iterator (streamed with chunked transfer encoding: dict items as
NDJSON lines, str/bytes items as they are). It raises `kvagentd.control.errors.ApiError`
subclasses for expected failures.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from kvagentd.control.errors import BadRequest, MethodNotAllowed, NotFound

JSON_TYPE = "application/json"
NDJSON_TYPE = "application/x-ndjson"
SSE_TYPE = "text/event-stream"
TEXT_TYPE = "text/plain; charset=utf-8"


@dataclass(frozen=True, slots=True)
class Peer:
    """Credentials of the connected process (SO_PEERCRED) plus its supplementary groups."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()

    def in_group(self, gid: int | None) -> bool:
        return gid is not None and (gid == self.gid or gid in self.groups)


# JSON may escape a UTF-16 surrogate on its own ("\ud800"); Python decodes it to a str that no
# encoder, tokenizer or log line accepts. Raw UTF-8 cannot hold one (it fails to decode), so
# only a body with such an escape is walked.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if _lone_surrogate(k, "") is not None:
                return f"{path}.<key>" if path else "<key>"
            found = _lone_surrogate(v, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


@dataclass(frozen=True, slots=True)
class Request:
    """One parsed request. `params` come from `{name}` segments of the route pattern."""

    method: str
    path: str
    params: dict[str, str]
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes
    peer: Peer
    route: str = ""  # the matched pattern, e.g. "/v1/blocks/{key}"
    operator: bool = False  # the peer may call change routes (root, daemon uid, operator group)

    def json(self) -> Any:
        """The body parsed as JSON; an empty body is `{}`. Raises BadRequest on invalid JSON."""
        if not self.body.strip():
            return {}
        try:
            data = json.loads(self.body)
        except RecursionError:
            raise BadRequest("request body is JSON nested too deeply") from None
        except (UnicodeDecodeError, ValueError) as exc:
            # NOTE: ValueError besides JSONDecodeError: an integer of more than 4300 digits
            # (sys.int_info.str_digits_check_threshold) is refused by int() while parsing.
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if _ESCAPED_SURROGATE.search(self.body):
            where = _lone_surrogate(data, "")
            if where is not None:
                raise BadRequest(f"field {where or '(the body)'!r} holds a lone UTF-16 surrogate "
                                 f"(an escape \\ud800-\\udfff not part of a pair): not text")
        return data

    def json_object(self) -> dict[str, Any]:
        """The body as a JSON object; raises BadRequest for any other JSON value."""
        data = self.json()
        if not isinstance(data, dict):
            raise BadRequest("request body must be a JSON object")
        return data

    def query_int(self, name: str, default: int, *, lo: int | None = None,
                  hi: int | None = None) -> int:
        """An integer query parameter, range-checked; raises BadRequest naming it."""
        text = self.query.get(name)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise BadRequest(f"query parameter {name!r} must be an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise BadRequest(f"query parameter {name!r} must be in [{lo}, {hi}], got {value}")
        return value

    def query_bool(self, name: str, default: bool = False) -> bool:
        text = self.query.get(name)
        if text is None:
            return default
        if text.lower() in ("1", "true", "yes", "on", ""):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise BadRequest(f"query parameter {name!r} must be true or false, got {text!r}")


@dataclass(slots=True)
class Response:
    """An explicit response: JSON (`body` dict/list), text/bytes, or a stream (`body` iterator)."""

    body: Any = None
    status: int = 200
    content_type: str | None = None  # default: JSON, or by the first item of a stream
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Any]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: str
    change: bool
    handler: Handler
    regex: re.Pattern[str]
    before_ready: bool = False


_PARAM_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _compile(pattern: str) -> re.Pattern[str]:
    if not pattern.startswith("/"):
        raise ValueError(f"route pattern must start with '/': {pattern!r}")
    out, pos = [], 0
    for m in _PARAM_RE.finditer(pattern):
        out.append(re.escape(pattern[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>[^/]+)")
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("^" + "".join(out) + "$")


class Router:
    """Maps (method, path) to a route; unknown path -> NotFound, known path other method -> 405."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def route(self, method: str, pattern: str, change: bool | None = None, *,
              before_ready: bool = False) -> Callable[[Handler], Handler]:
        """Decorator registering `handler` for `method` `pattern`.

        `change` defaults to False for GET and True for every other method. Routes answer 503
        `not_ready` until the daemon is ready, unless `before_ready` (liveness, status ...).
        """
        def deco(handler: Handler) -> Handler:
            self.add(method, pattern, handler, change=change, before_ready=before_ready)
            return handler
        return deco

    def add(self, method: str, pattern: str, handler: Handler, *,
            change: bool | None = None, before_ready: bool = False) -> Route:
        method = method.upper()
        if change is None:
            change = method not in ("GET", "HEAD")
        for r in self._routes:
            if r.method == method and r.pattern == pattern:
                raise ValueError(f"route {method} {pattern} registered twice")
        route = Route(method, pattern, bool(change), handler, _compile(pattern), before_ready)
        self._routes.append(route)
        return route

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        allowed: list[str] = []
        for r in self._routes:
            m = r.regex.match(path)
            if m is None:
                continue
            if r.method == method.upper():
                return r, {k: unquote(v) for k, v in m.groupdict().items()}
            allowed.append(r.method)
        if allowed:
            allow = ", ".join(sorted(set(allowed)))
            raise MethodNotAllowed(f"{method} is not allowed on {path}; allowed: {allow}",
                                   headers={"Allow": allow})
        raise NotFound(f"no route for {path}")

    def routes(self) -> list[Route]:
        return list(self._routes)


def is_stream(body: Any) -> bool:
    """True for iterators/generators (streamed), False for JSON values, text and bytes."""
    return isinstance(body, Iterator) or (
        isinstance(body, Iterable) and not isinstance(body, dict | list | tuple | str | bytes))
