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
