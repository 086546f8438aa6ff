from __future__ import annotations

import pytest

from kvagentd.control.errors import (ApiError, BadConfig, BadRequest, Busy, Internal,
                                     MethodNotAllowed, NotFound, NotReady, Timeout, for_status,
                                     to_api_error)
from kvagentd.control.router import Peer, Request, Router, is_stream
from kvagentd.config import ConfigError


def _req(body: bytes = b"", query: dict[str, str] | None = None) -> Request:
    return Request("POST", "/x", {}, query or {}, {}, body, Peer(1, 0, 0))


def test_path_params_are_matched_and_percent_decoded() -> None:
    r = Router()
    r.route("GET", "/v1/blocks/{key}/tier/{tier}")(lambda req: {})
    route, params = r.match("GET", "/v1/blocks/ab%2Fcd/tier/warm")
    assert route.pattern == "/v1/blocks/{key}/tier/{tier}"
    assert params == {"key": "ab/cd", "tier": "warm"}


def test_unknown_path_is_404_and_wrong_method_is_405_with_allow() -> None:
    r = Router()
    r.route("GET", "/v1/status")(lambda req: {})
    r.route("POST", "/v1/status", change=True)(lambda req: {})
    with pytest.raises(NotFound):
        r.match("GET", "/v1/nope")
    with pytest.raises(MethodNotAllowed) as exc:
        r.match("DELETE", "/v1/status")
    assert exc.value.headers["Allow"] == "GET, POST"
    assert exc.value.status == 405


def test_param_does_not_span_segments() -> None:
    r = Router()
    r.route("GET", "/v1/sessions/{name}")(lambda req: {})
    with pytest.raises(NotFound):
        r.match("GET", "/v1/sessions/a/b")


def test_change_defaults_by_method_and_can_be_explicit() -> None:
    r = Router()
    get = r.add("GET", "/a", lambda req: {})
    post = r.add("POST", "/a", lambda req: {})
    get_change = r.add("GET", "/b", lambda req: {}, change=True)
    post_read = r.add("POST", "/c", lambda req: {}, change=False)
    assert (get.change, post.change, get_change.change, post_read.change) == (
        False, True, True, False)


def test_routes_wait_for_readiness_unless_marked() -> None:
    r = Router()
    assert r.add("GET", "/a", lambda req: {}).before_ready is False
    assert r.add("GET", "/b", lambda req: {}, before_ready=True).before_ready is True


def test_duplicate_route_and_bad_pattern_are_rejected() -> None:
    r = Router()
    r.add("GET", "/a", lambda req: {})
    with pytest.raises(ValueError, match="twice"):
        r.add("GET", "/a", lambda req: {})
    with pytest.raises(ValueError, match="start with"):
        r.add("GET", "a", lambda req: {})


def test_request_json_and_query_helpers() -> None:
    assert _req(b"").json() == {}
    assert _req(b'{"a": 1}').json_object() == {"a": 1}
    with pytest.raises(BadRequest, match="not valid JSON"):
        _req(b"{nope").json()
    with pytest.raises(BadRequest, match="JSON object"):
        _req(b"[1]").json_object()
    with pytest.raises(BadRequest, match="not valid JSON"):
        _req(b"\xff\xfe").json()
    q = _req(query={"n": "5", "bad": "x", "flag": "yes", "off": "0", "weird": "maybe"})
    assert q.query_int("n", 1, lo=0, hi=10) == 5
    assert q.query_int("absent", 7) == 7
    with pytest.raises(BadRequest, match="'bad' must be an integer"):
        q.query_int("bad", 0)
    with pytest.raises(BadRequest, match=r"in \[0, 3\]"):
        q.query_int("n", 0, lo=0, hi=3)
    assert q.query_bool("flag") is True and q.query_bool("off") is False
    with pytest.raises(BadRequest):
        q.query_bool("weird")


def test_is_stream_distinguishes_iterators_from_json_values() -> None:
    assert is_stream(iter([1]))
    assert is_stream(x for x in "ab")
    for value in ({}, [], (), "s", b"b"):
        assert not is_stream(value)


def test_error_mapping_in_one_place() -> None:
    assert to_api_error(Busy("x")).status == 409
    err = to_api_error(ConfigError("kv.hot_bytes", "x", "a size"))
    assert isinstance(err, BadConfig) and err.status == 400 and err.kind == "bad_config"
    assert "kv.hot_bytes" in err.message
    assert isinstance(to_api_error(TimeoutError()), Timeout)
    hidden = to_api_error(KeyError("secret"))
    assert isinstance(hidden, Internal) and "secret" not in hidden.message
    # Engine queue-full maps to busy, by qualified name (no engine import needed).
    queue_full = type("QueueFull", (RuntimeError,), {"__module__": "kvagentd.engine.executor"})
    assert to_api_error(queue_full("queue is full")).status == 409


def test_error_body_shape_and_status_lookup() -> None:
    assert NotReady("starting").body() == {"error": {"kind": "not_ready", "message": "starting"}}
    assert for_status(413, "big").kind == "too_large"
    odd = for_status(418, "teapot")
    assert isinstance(odd, ApiError) and odd.status == 418 and odd.kind == "bad_request"
