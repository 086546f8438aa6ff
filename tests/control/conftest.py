"""Fixtures: a control server on a short temporary socket path with test routes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import threading
import types
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvagentd.config import Config, load_config
from kvagentd.control.errors import Busy, NotFound
from kvagentd.control.handlers import core
from kvagentd.control.router import Request, Response, Router
from kvagentd.control.server import ControlServer
from kvagentd.metrics.registry import CoreMetrics, new_registry


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory (AF_UNIX paths are limited to 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_config(sock_dir: Path, **control: Any) -> Config:
    cfg = load_config(None, env={})
    ctl = dataclasses.replace(cfg.control, socket=sock_dir / "run" / "k.sock", socket_group="",
                              operator_group="", header_timeout_s=1.0, read_timeout_s=1.0,
                              max_connections=4, max_body_bytes=2048)
    ctl = dataclasses.replace(ctl, **control)
    # Small, private budgets and paths: a daemon built from this config must fit anywhere.
    kv = dataclasses.replace(cfg.kv, cold_dir=sock_dir / "cold", hot_bytes=16 << 20,
                             cold_capacity_bytes=64 << 20, segment_bytes=16 << 20,
                             o_direct=False)
    maint = dataclasses.replace(cfg.maintenance, shadow_dir=sock_dir / "shm",
                                shadow_bytes=16 << 20,
                                health_status_file=sock_dir / "state" / "ssd-health.json")
    model = dataclasses.replace(cfg.model, source="none")
    agent = dataclasses.replace(cfg.agent, enabled=False)
    return dataclasses.replace(cfg, control=ctl, kv=kv, maintenance=maint, model=model,
                               agent=agent)


class FakeDaemon:
    """What the core routes need from the daemon."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.config_path = None
        self.ready = True
        self.phase = "running"
        self.metrics = new_registry()
        self.core_metrics = CoreMetrics(self.metrics)
        self.shutdown_requests: list[str] = []
        # the routes' services (a test sets the ones it serves)
        self.services = types.SimpleNamespace(store=None, placement=None, engine=None,
                                              maintenance=None, remote=None, agent=None)

    def status(self) -> dict[str, Any]:
        return {"version": "test", "phase": self.phase, "ready": self.ready}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "checks": [{"name": "x", "status": "ok", "detail": ""}]}

    def request_shutdown(self, reason: str) -> None:
        self.shutdown_requests.append(reason)


class Harness:
    def __init__(self, server: ControlServer, daemon: FakeDaemon) -> None:
        self.server, self.daemon = server, daemon
        self.path = server.path
        self.release = threading.Event()  # unblocks /test/block
        self.flood_closed = threading.Event()  # set when /test/flood's generator is closed

    def client(self, timeout: float = 5.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path)),
                            base_url="http://kvagentd", timeout=timeout)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        with self.client() as c:
            return c.get(path, **kw)

    def alive(self) -> bool:
        return self.get("/v1/livez").json() == {"alive": True}

    def raw(self, data: bytes, *, shut_wr: bool = True, timeout: float = 5.0) -> bytes:
        """Send raw bytes on a fresh connection; return everything read until close."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.path))
        try:
            s.sendall(data)
            if shut_wr:
                s.shutdown(socket.SHUT_WR)
            return read_all(s)
        finally:
            s.close()


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return out
        if not chunk:
            return out
        out += chunk


NOBODY = 65534


def two_groups() -> tuple[Any, Any]:
    """Two distinct non-root groups of /etc/group (a reader and an operator group)."""
    import grp

    groups = [g for g in grp.getgrall() if g.gr_gid not in (0, NOBODY)]
    if len(groups) < 2:
        pytest.fail("the authorization tests need two non-root groups in /etc/group")
    return groups[0], groups[1]


def request_as(path: Path, method: str, target: str, *, uid: int, gid: int, groups: list[int],
               body: Any = None) -> tuple[int, Any]:
    """Fork; the child drops to uid/gid/groups, connects, sends one request (a JSON body when
    given) and reads the whole reply. Returns (status, parsed JSON body), or (-1, None) when
    connect() was refused by the file system (EACCES)."""
    data = b"" if body is None else json.dumps(body).encode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(60)
            try:
                s.connect(str(path))
            except PermissionError:
                os.write(w, b"EACCES")
                os._exit(0)
            s.sendall(f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
                      "Connection: close\r\n\r\n".encode() + data)
            reply = read_all(s)
            while reply:
                reply = reply[os.write(w, reply):]
        except BaseException:  # report through the exit status; never return into pytest
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    raw = b"".join(chunks)
    if raw == b"EACCES":
        return -1, None
    head, _, payload = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload) if payload.strip() else None


def add_test_routes(router: Router, h: Harness) -> None:
    @router.route("POST", "/test/echo")
    def echo(req: Request) -> dict[str, Any]:
        return {"body": req.json(), "query": req.query}

    @router.route("GET", "/test/items/{name}/{n}")
    def item(req: Request) -> dict[str, Any]:
        if req.params["name"] == "missing":
            raise NotFound("no such item")
        return {"params": req.params, "n": req.query_int("n", 0, lo=0, hi=10)}

    @router.route("GET", "/test/stream/{n}")
    def stream(req: Request) -> Iterator[dict[str, int]]:
        for i in range(int(req.params["n"])):
            yield {"i": i}

    @router.route("GET", "/test/text")
    def text(req: Request) -> Iterator[str]:
        yield "hello "
        yield "world"

    @router.route("GET", "/test/stream-fails")
    def stream_fails(req: Request) -> Iterator[dict[str, int]]:
        yield {"i": 0}
        raise RuntimeError("producer broke")

    @router.route("GET", "/test/stream-busy")
    def stream_busy(req: Request) -> Iterator[str]:
        raise Busy("queue full")
        yield ""  # pragma: no cover

    @router.route("GET", "/test/crash")
    def crash(req: Request) -> dict[str, Any]:
        raise KeyError("secret internal detail")

    @router.route("GET", "/test/block")
    def block(req: Request) -> dict[str, Any]:
        h.release.wait(30)
        return {"released": True}

    @router.route("GET", "/test/flood")
    def flood(req: Request) -> Iterator[bytes]:
        try:
            for _ in range(10_000):
                yield b"x" * 65536
        finally:
            h.flood_closed.set()

    @router.route("GET", "/test/sse")
    def sse(req: Request) -> Response:
        return Response(iter([{"token": "hel"}, "lo\nworld"]), content_type="text/event-stream")

    @router.route("GET", "/test/plain")
    def plain(req: Request) -> Response:
        return Response("plain text", content_type="text/plain")

    @router.route("POST", "/test/change", change=True)
    def change(req: Request) -> dict[str, Any]:
        return {"changed": True}


def start_harness(cfg: Config, policy: Any = None) -> Harness:
    daemon = FakeDaemon(cfg)
    router = Router()
    core.register(router, daemon)
    server = ControlServer(cfg.control, router, policy=policy,
                           observe=daemon.core_metrics.observe_request,
                           is_ready=lambda: daemon.ready)
    h = Harness(server, daemon)
    add_test_routes(router, h)
    server.start()
    return h


@pytest.fixture
def harness(short_dir: Path) -> Iterator[Harness]:
    h = start_harness(make_config(short_dir))
    yield h
    h.release.set()
    h.server.stop(1.0)


def wait_until(pred: Any, timeout: float = 10.0, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
