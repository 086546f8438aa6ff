"""Inputs that once answered 500 (or nothing) get a 4xx JSON error, and the server keeps
serving: odd Content-Length values (with and without Expect: 100-continue), deeply nested
JSON, huge JSON integers, and a job that never ran."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvagentd.control.errors import to_api_error
from kvagentd.control.router import Request
from kvagentd.engine.executor import JobNotRun

from .conftest import Harness, make_config, start_harness


@pytest.fixture
def h(short_dir: Path) -> Iterator[Harness]:
    harness = start_harness(make_config(short_dir, max_body_bytes=64 << 10))

    @harness.server.router.route("POST", "/test/not-run")
    def not_run(req: Request) -> None:
        raise JobNotRun("job 7 (op-1): deadline passed before it started")

    yield harness
    harness.server.stop(1.0)


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 100"):  # an interim reply, then the real one
        head, _, body = body.partition(b"\r\n\r\n")
    assert head, "no reply at all"
    return int(head.split(b" ", 2)[1]), json.loads(body) if body.strip() else {}


@pytest.mark.parametrize("length,status", [
    (b"\xb2", 400),                     # superscript two: str.isdigit() says yes, int() says no
    (b"1\xb2", 400),
    (b"\xd9\xa3", 400),                 # Arabic-Indic digit three (UTF-8 bytes)
    (b"-5", 400),
    (b"5" * 5000, 413),                 # a 5,000-digit length: too large, not a crash
    (b"0" * 30 + b"7", 400),            # 7 after 30 zeros is 7 bytes; only 0 are sent
])
@pytest.mark.parametrize("expect", [False, True])
def test_odd_content_length_is_4xx(h: Harness, length: bytes, status: int,
                                   expect: bool) -> None:
    head = b"POST /test/echo HTTP/1.1\r\nContent-Length: " + length + b"\r\n"
    if expect:
        head += b"Expect: 100-continue\r\n"
    raw = h.raw(head + b"\r\n")
    got, body = _status_and_body(raw)
    assert got == status, raw[:300]
    assert body["error"]["kind"] in ("bad_request", "too_large")
    assert b"100 Continue" not in raw or status == 400 and length.startswith(b"0")
    assert h.alive()


def test_deeply_nested_json_is_400(h: Harness) -> None:
    with h.client() as c:
        r = c.post("/test/echo", content=b"[" * 1000 + b"]" * 1000)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
        r = c.post("/test/echo", content=b'{"a":' * 1000 + b"1" + b"}" * 1000)
        assert r.status_code == 400
        assert c.post("/test/echo", content=b"[" * 50 + b"]" * 50).status_code == 200
    assert h.alive()


def test_json_integer_of_4301_digits_is_400(h: Harness) -> None:
    with h.client() as c:
        r = c.post("/test/echo", content=b'{"event": ' + b"9" * 4301 + b"}")
        assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
        assert "not valid JSON" in r.json()["error"]["message"]
        ok = c.post("/test/echo", content=b'{"event": ' + b"9" * 4000 + b"}")
        assert ok.status_code == 200
    assert h.alive()


def test_a_job_that_never_ran_is_busy_not_internal(h: Harness) -> None:
    assert to_api_error(JobNotRun("x")).status == 409
    with h.client() as c:
        r = c.post("/test/not-run")
    assert r.status_code == 409 and r.json()["error"]["kind"] == "busy"
    assert "deadline passed" in r.json()["error"]["message"]


# -- RFC 9112 framing ---------------------------------------------------------------------------

@pytest.mark.parametrize("head", [
    b"Content-Length: 2\r\nContent-Length: 3\r\n",          # which one frames the body?
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",  # the request-smuggling shape
    b"Content-Length: 2\r\nX-Folded: a\r\n b\r\n",          # obs-fold
])
def test_ambiguous_framing_is_400_and_closes(h: Harness, head: bytes) -> None:
    raw = h.raw(b"POST /test/echo HTTP/1.1\r\n" + head + b"\r\n{}GET /v1/livez HTTP/1.1\r\n\r\n")
    got, body = _status_and_body(raw)
    assert got == 400 and "RFC 9112" in body["error"]["message"], raw[:300]
    assert raw.count(b"HTTP/1.1 ") == 1  # nothing after it was read as a request
    assert h.alive()


def test_repeated_equal_content_length_is_one_length(h: Harness) -> None:
    raw = h.raw(b"POST /test/echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n"
                b"Connection: close\r\n\r\n{}")
    assert _status_and_body(raw) == (200, {"body": {}, "query": {}})


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/9.9"])
def test_other_http_versions_are_505_with_their_own_kind(h: Harness, version: bytes) -> None:
    got, body = _status_and_body(h.raw(b"GET /v1/livez " + version + b"\r\n\r\n"))
    assert got == 505 and body["error"]["kind"] == "http_version_not_supported"


def test_head_is_get_without_a_body(h: Harness) -> None:
    with h.client() as c:
        get = c.get("/v1/livez")
        head = c.head("/v1/livez")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == get.headers["content-length"]
        assert c.head("/v1/nope").status_code == 404
        assert c.get("/v1/livez").status_code == 200  # the connection still frames correctly


def test_head_of_a_stream_sends_headers_and_never_starts_it(h: Harness) -> None:
    started: list[int] = []

    @h.server.router.route("GET", "/test/lazy")
    def lazy(req: Request) -> Iterator[dict[str, int]]:
        def gen() -> Iterator[dict[str, int]]:
            started.append(1)
            yield {"i": 0}
        return gen()

    with h.client() as c:
        r = c.head("/test/lazy")
        assert r.status_code == 200 and r.content == b""
        assert c.get("/v1/livez").status_code == 200
    assert started == []


def test_partial_request_line_then_silence_is_408(h: Harness) -> None:
    raw = h.raw(b"GET /v1/li", shut_wr=False)  # the 1 s header deadline passes
    got, body = _status_and_body(raw)
    assert got == 408 and body["error"]["kind"] == "request_timeout"
    assert h.alive()


@pytest.mark.parametrize("payload,field", [
    (b'{"question": "why \\ud800?"}', "question"),
    (b'{"a": {"b": ["ok", "\\uDFFF"]}}', "a.b[1]"),
    (b'"\\udc00"', "(the body)"),
])
def test_lone_surrogate_is_400_naming_the_field(h: Harness, payload: bytes, field: str) -> None:
    with h.client() as c:
        r = c.post("/test/echo", content=payload)
        assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
        assert repr(field) in r.json()["error"]["message"] and "surrogate" in r.text
        ok = c.post("/test/echo", content=b'{"q": "\\ud83d\\ude00"}')  # a pair is text
        assert ok.status_code == 200 and ok.json()["body"] == {"q": "\U0001f600"}
