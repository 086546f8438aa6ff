"""The control server: routes, errors, limits, timeouts, streaming, draining, socket file."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.control.socketfile import ControlSocketInUse
from tests.control.conftest import Harness, make_config, read_all, start_harness, wait_until


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.strip() else {}


# -- routes and errors ------------------------------------------------------------------------

def test_json_route_with_params_query_and_body(harness: Harness) -> None:
    with harness.client() as c:
        r = c.get("/test/items/pump/3", params={"n": "4"})
        assert r.status_code == 200
        assert r.json() == {"params": {"name": "pump", "n": "3"}, "n": 4}
        r = c.post("/test/echo", params={"q": "1"}, json={"a": [1, 2]})
        assert r.json() == {"body": {"a": [1, 2]}, "query": {"q": "1"}}


@pytest.mark.parametrize("method,path,status,kind", [
    ("GET", "/v1/nope", 404, "not_found"),
    ("GET", "/test/items/missing/1", 404, "not_found"),
    ("DELETE", "/v1/status", 405, "method_not_allowed"),
    ("GET", "/test/items/x/1?n=99", 400, "bad_request"),
    ("GET", "/test/crash", 500, "internal"),
])
def test_errors_are_json_with_fitting_status(harness: Harness, method: str, path: str,
                                             status: int, kind: str) -> None:
    with harness.client() as c:
        r = c.request(method, path)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and body["error"]["kind"] == kind
    assert body["error"]["message"]
    assert "secret internal detail" not in r.text
    assert harness.alive()


def test_invalid_json_body_is_400(harness: Harness) -> None:
    with harness.client() as c:
        r = c.post("/test/echo", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_keep_alive_serves_several_requests_on_one_connection(harness: Harness) -> None:
    with harness.client() as c:
        for _ in range(5):
            assert c.get("/v1/livez").status_code == 200
    assert harness.server.rejected_connections == 0


def test_absolute_form_target_is_accepted(harness: Harness) -> None:
    raw = harness.raw(b"GET http://localhost/v1/livez HTTP/1.1\r\nHost: x\r\n"
                      b"Connection: close\r\n\r\n")
    assert _status_and_body(raw) == (200, {"alive": True})


def test_text_response(harness: Harness) -> None:
    r = harness.get("/test/plain")
    assert r.text == "plain text" and r.headers["content-type"] == "text/plain"


def test_metrics_count_requests_by_route(harness: Harness) -> None:
    harness.get("/v1/livez")
    harness.get("/v1/nope")
    text = harness.get("/v1/metrics").text
    assert 'kvagentd_control_requests_total{method="GET",route="/v1/livez",status="200"} 1.0' in text
    assert 'route="<unmatched>",status="404"' in text


# -- streaming --------------------------------------------------------------------------------

def test_stream_of_dicts_is_chunked_ndjson(harness: Harness) -> None:
    with harness.client() as c, c.stream("GET", "/test/stream/4") as r:
        assert r.headers["transfer-encoding"] == "chunked"
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines == [{"i": i} for i in range(4)]


def test_stream_of_text_pieces(harness: Harness) -> None:
    with harness.client() as c, c.stream("GET", "/test/text") as r:
        assert r.headers["content-type"].startswith("text/plain")
        assert "".join(r.iter_text()) == "hello world"


def test_server_sent_events(harness: Harness) -> None:
    with harness.client() as c, c.stream("GET", "/test/sse") as r:
        assert r.headers["content-type"] == "text/event-stream"
        body = r.read()
    assert body == b'data: {"token": "hel"}\n\ndata: lo\ndata: world\n\n'


def test_stream_failing_midway_ends_with_error_line(harness: Harness) -> None:
    with harness.client() as c, c.stream("GET", "/test/stream-fails") as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[0] == {"i": 0}
    assert lines[-1]["error"]["kind"] == "internal"
    assert harness.alive()


def test_stream_failing_before_first_item_is_a_normal_error(harness: Harness) -> None:
    r = harness.get("/test/stream-busy")
    assert r.status_code == 409 and r.json()["error"]["kind"] == "busy"


def test_http10_stream_is_delimited_by_close(harness: Harness) -> None:
    raw = harness.raw(b"GET /test/stream/2 HTTP/1.0\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    assert [json.loads(x) for x in body.splitlines()] == [{"i": 0}, {"i": 1}]


# -- malformed input and limits ---------------------------------------------------------------

@pytest.mark.parametrize("data,status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /v1/livez HTTP/9.9\r\n\r\n", 505),
    (b"GET /v1/livez HTTP/1.1\r\nno colon header\r\n\r\n", 400),
    (b"BREW /v1/livez HTTP/1.1\r\n\r\n", 501),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"POST /test/echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411),
    (b"POST /test/echo HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /test/echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nshort", 400),
    (b"GET nopath HTTP/1.1\r\n\r\n", 400),
    (b"GET /v1/livez HTTP/1.1\r\n" + b"X-A: b\r\n" * 200 + b"\r\n", 431),
])
def test_malformed_requests_get_4xx_or_5xx_json_and_server_keeps_serving(
        harness: Harness, data: bytes, status: int) -> None:
    raw = harness.raw(data)
    got, body = _status_and_body(raw)
    assert got == status
    assert "error" in body and body["error"]["message"]
    assert harness.alive()


@pytest.mark.parametrize("target", ["/v1/nope", "/v1/status"])
def test_unread_body_of_a_rejected_request_is_never_parsed_as_a_request(
        harness: Harness, target: str) -> None:
    smuggled = b"POST /v1/shutdown HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    raw = harness.raw(b"POST " + target.encode() + b" HTTP/1.1\r\nContent-Length: "
                      + str(len(smuggled)).encode() + b"\r\n\r\n" + smuggled)
    assert raw.count(b"HTTP/1.1 ") == 1 and _status_and_body(raw)[0] in (404, 405)
    assert harness.daemon.shutdown_requests == []


def test_oversized_body_is_413_without_reading_it(harness: Harness) -> None:
    with harness.client() as c:
        r = c.post("/test/echo", content=b"x" * 5000)
    assert r.status_code == 413 and r.json()["error"]["kind"] == "too_large"
    assert "control.max_body_bytes" in r.json()["error"]["message"]
    assert harness.alive()


def test_oversized_body_with_expect_continue_is_refused_before_100(harness: Harness) -> None:
    raw = harness.raw(b"POST /test/echo HTTP/1.1\r\nContent-Length: 999999\r\n"
                      b"Expect: 100-continue\r\n\r\n")
    assert b"100 Continue" not in raw
    assert _status_and_body(raw)[0] == 413


def test_body_at_the_limit_is_accepted(harness: Harness) -> None:
    payload = json.dumps({"s": "x" * (2048 - 9)}).encode()
    assert len(payload) == 2048
    with harness.client() as c:
        assert c.post("/test/echo", content=payload).status_code == 200


def test_silent_client_is_dropped_and_does_not_block_others(harness: Harness) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(harness.path))
    assert harness.alive()  # served while the silent client holds its connection
    assert s.recv(1024) == b""  # closed by the 1 s header deadline, without a reply
    s.close()


def test_byte_a_second_client_is_cut_by_the_total_header_deadline(harness: Harness) -> None:
    request = b"GET /v1/livez HTTP/1.1\r\n" + b"X-Slow: " + b"a" * 200 + b"\r\n\r\n"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(harness.path))
    sent = 0
    cut = False
    try:
        for byte in request:
            s.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.02)
            assert harness.alive() if sent % 40 == 0 else True
    except (BrokenPipeError, ConnectionResetError):
        cut = True
    s.settimeout(5)
    reply = read_all(s)
    s.close()
    # header_timeout_s is 1 s in total; sending everything would take > 4 s.
    assert cut or sent < len(request) or b"408" in reply.split(b"\r\n", 1)[0]
    if reply:
        assert b" 408 " in reply.split(b"\r\n", 1)[0]
    assert harness.alive()


def test_slow_body_is_cut_by_the_read_deadline(harness: Harness) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(harness.path))
    s.sendall(b"POST /test/echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
    reply = read_all(s)
    s.close()
    assert b" 408 " in reply.split(b"\r\n", 1)[0]
    assert harness.alive()


def test_client_that_does_not_read_its_stream_is_cut_and_the_producer_closed(
        harness: Harness) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(harness.path))
    s.sendall(b"GET /test/flood HTTP/1.1\r\nHost: x\r\n\r\n")
    assert harness.flood_closed.wait(30)  # send timeout (1 s) hit, generator closed
    assert harness.alive()
    s.close()
    assert wait_until(lambda: harness.server.connections == 0)


def test_connections_beyond_the_limit_get_503_and_slots_come_back(short_dir: Path) -> None:
    harness = start_harness(make_config(short_dir, header_timeout_s=60.0))
    try:
        _fill_and_free_connection_slots(harness)
    finally:
        harness.server.stop(1.0)


def _fill_and_free_connection_slots(harness: Harness) -> None:
    idle = []
    for _ in range(4):  # max_connections = 4
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(harness.path))
        idle.append(s)
    assert wait_until(lambda: harness.server.connections == 4)
    extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    extra.settimeout(5)
    extra.connect(str(harness.path))
    status, body = _status_and_body(read_all(extra))
    extra.close()
    assert status == 503 and body["error"]["kind"] == "overloaded"
    assert "max_connections" in body["error"]["message"]
    for s in idle:
        s.close()
    assert wait_until(lambda: harness.server.connections == 0)
    assert harness.alive()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=0, max_size=512))
def test_garbage_bytes_never_stop_the_server(harness: Harness, data: bytes) -> None:
    raw = harness.raw(data, timeout=5.0)
    if raw:
        assert raw.startswith(b"HTTP/1.")
        assert 400 <= int(raw.split(b" ", 2)[1]) < 600 or raw.split(b" ", 2)[1] == b"200"
    assert harness.alive()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
       headers=st.lists(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126),
                                max_size=40), max_size=5))
def test_garbage_request_lines_and_headers_get_a_status_line(harness: Harness, line: str,
                                                             headers: list[str]) -> None:
    data = ("\r\n".join([line, *headers]) + "\r\n\r\n").encode()
    raw = harness.raw(data, timeout=5.0)
    if raw:
        assert raw.startswith(b"HTTP/1.")
    assert harness.alive()


# -- stop, drain, socket file ----------------------------------------------------------------

def test_socket_and_directory_permissions(harness: Harness) -> None:
    assert stat.S_IMODE(os.stat(harness.path).st_mode) == 0o660
    assert stat.S_IMODE(os.stat(harness.path.parent).st_mode) == 0o750


def test_stop_drains_in_flight_request_then_removes_socket(short_dir: Path) -> None:
    h = start_harness(make_config(short_dir))
    result: dict = {}

    def slow() -> None:
        with h.client(timeout=10) as c:
            result["r"] = c.get("/test/block")

    t = threading.Thread(target=slow)
    t.start()
    assert wait_until(lambda: h.server.in_flight == 1)
    threading.Timer(0.3, h.release.set).start()
    assert h.server.stop(drain_timeout=10.0) is True
    t.join(10)
    assert result["r"].json() == {"released": True}
    assert not h.path.exists()


def test_stop_cuts_requests_that_outlive_the_drain_timeout(short_dir: Path) -> None:
    h = start_harness(make_config(short_dir))
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            with h.client(timeout=10) as c:
                c.get("/test/block")
        except httpx.HTTPError as exc:
            errors.append(exc)

    t = threading.Thread(target=slow)
    t.start()
    assert wait_until(lambda: h.server.in_flight == 1)
    assert h.server.stop(drain_timeout=0.2) is False
    h.release.set()
    t.join(10)
    assert not h.path.exists()


def test_stale_socket_is_replaced(short_dir: Path) -> None:
    cfg = make_config(short_dir)
    path = Path(cfg.control.socket)
    path.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    h = start_harness(cfg)
    try:
        assert h.alive()
    finally:
        h.server.stop(1.0)


def test_refuses_socket_in_use_or_non_socket_path(short_dir: Path) -> None:
    cfg = make_config(short_dir)
    h = start_harness(cfg)
    try:
        with pytest.raises(ControlSocketInUse, match="another process is listening"):
            ControlServer(cfg.control, Router()).start()
        assert h.alive()
    finally:
        h.server.stop(1.0)
    Path(cfg.control.socket).write_text("not a socket")
    with pytest.raises(ControlSocketInUse, match="not a socket"):
        ControlServer(cfg.control, Router()).start()
