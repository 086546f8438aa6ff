"""Session routes and `kvctl ask | sessions` against an in-process control server."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from kvagentd.config import Config
from kvagentd.control.handlers import sessions as session_routes
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.engine.executor import QueueFull
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine
from tests.control.conftest import FakeDaemon, make_config

from .conftest import make_store


class Server:
    def __init__(self, cfg: Config, engine: Any) -> None:
        self.daemon = FakeDaemon(cfg)
        self.daemon.services.engine = engine
        router = Router()
        session_routes.register(router, self.daemon)
        self.server = ControlServer(cfg.control, router)
        self.server.start()
        self.path = self.server.path

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path)),
                            base_url="http://kvagentd", timeout=60)


@pytest.fixture
def srv(tiny: LoadedModel) -> Iterator[Server]:
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    d = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))
    store = make_store(tiny, d)
    eng = Engine(tiny, store, state_dir=d / "state")
    eng.start()
    s = Server(make_config(d, read_timeout_s=30.0), eng)
    yield s
    s.server.stop(1.0)
    eng.stop()
    store.close()
    shutil.rmtree(d, ignore_errors=True)
    structlog.reset_defaults()


def test_ask_streams_then_lists_and_drops(srv: Server) -> None:
    with srv.client() as c:
        with c.stream("POST", "/v1/sessions/op-1/ask",
                      json={"question": "How is pump 1?", "max_tokens": 6}) as resp:
            assert resp.status_code == 200
            items = [json.loads(line) for line in resp.iter_lines() if line.strip()]
        pieces = [i["text"] for i in items if "text" in i]
        assert items[-1]["done"] is True
        result = items[-1]["result"]
        assert result["new_tokens"] == 6 and "".join(pieces) == result["text"]
        assert len(pieces) >= 2  # streamed piece by piece, not in one lump
        listing = c.get("/v1/sessions").json()["sessions"]
        assert [s["id"] for s in listing] == ["op-1"]
        assert listing[0]["tokens"] > result["prompt_tokens"]
        assert sum(listing[0]["blocks_by_tier"].values()) == listing[0]["blocks"] > 0
        one = c.get("/v1/sessions/op-1").json()
        assert "How is pump 1?" in one["tail"]
        r = c.post("/v1/sessions/op-1/ask", json={"question": "And now?", "max_tokens": 3,
                                                   "stream": False}).json()
        assert r["result"]["reused_tokens"] > 0
        assert c.delete("/v1/sessions/op-1").json() == {"dropped": "op-1"}
        assert c.get("/v1/sessions/op-1").status_code == 404
        assert c.post("/v1/sessions/op-1/drop").status_code == 404


def test_bad_requests_and_busy(srv: Server) -> None:
    with srv.client() as c:
        assert c.post("/v1/sessions/x/ask", json={}).status_code == 400
        big = srv.daemon.config.executor.ask_max_tokens + 1
        assert c.post("/v1/sessions/x/ask",
                      json={"question": "q", "max_tokens": big}).status_code == 400
        assert c.get("/v1/sessions/bad%20id").status_code == 400

    class Full:
        sessions = srv.daemon.services.engine.sessions

        def submit(self, req: Any) -> Any:
            raise QueueFull("32 requests queued")

    srv.daemon.services.engine = Full()
    with srv.client() as c:
        r = c.post("/v1/sessions/x/ask", json={"question": "q"})
        assert r.status_code == 409 and r.json()["error"]["kind"] == "busy"
    srv.daemon.services.engine = None
    with srv.client() as c:
        r = c.get("/v1/sessions")  # a ready daemon without an engine: none configured
        assert r.status_code == 404 and r.json()["error"]["kind"] == "not_configured"


def test_kvctl_ask_and_sessions(srv: Server, capsys: pytest.CaptureFixture[str]) -> None:
    from kvctl import cmd_sessions
    from kvctl.main import app, main

    if not any(c.name == "ask" for c in app.registered_commands):
        cmd_sessions.register(app)
    sock = str(srv.path)
    # a --session that names no session is refused (a typo starts nothing), unless --new
    assert main(["--socket", sock, "ask", "--session", "op-2", "Vibration?"]) == 1
    err = capsys.readouterr().err
    assert "no session 'op-2'" in err and "--new" in err
    assert main(["--socket", sock, "ask", "--session", "op-2", "--new", "Vibration?",
                 "--max-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "5 tokens" in out.err
    assert main(["--socket", sock, "ask", "--session", "op-2", "Again?",
                 "--max-tokens", "3"]) == 0  # it exists now
    capsys.readouterr()
    # turns as text, the template's markers only with --raw
    assert main(["--socket", sock, "sessions", "show", "op-2"]) == 0
    shown = capsys.readouterr().out
    assert "user: Vibration?" in shown and "user: Again?" in shown and "assistant: " in shown
    assert "<|im_start|>" not in shown
    assert main(["--socket", sock, "sessions", "show", "op-2", "--transcript"]) == 0
    whole = capsys.readouterr().out
    assert whole.index("user: Vibration?") < whole.index("user: Again?")
    assert "<|im_start|>" not in whole
    assert main(["--socket", sock, "sessions", "show", "op-2", "--transcript", "--raw"]) == 0
    assert "<|im_start|>user\nVibration?" in capsys.readouterr().out
    assert main(["--socket", sock, "sessions"]) == 0
    table = capsys.readouterr().out
    assert "op-2" in table and "SESSION" in table
    assert main(["--socket", sock, "--json", "sessions"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"][0]["id"] == "op-2"
    assert main(["--socket", sock, "sessions", "drop", "op-2"]) == 0
    assert "dropped session op-2" in capsys.readouterr().out
    assert main(["--socket", sock, "sessions", "drop", "op-2"]) == 1

    class Full:
        sessions = srv.daemon.services.engine.sessions

        def submit(self, req: Any) -> Any:
            raise QueueFull("queue full")

    srv.daemon.services.engine = Full()
    assert main(["--socket", sock, "ask", "q"]) == 75


def test_completion_offers_what_the_daemon_knows(srv: Server) -> None:
    """Shell completion of session ids asks the daemon (the --socket on the line so far);
    without a daemon it offers nothing and prints nothing."""
    import os
    import subprocess
    import sys

    from kvctl import completion

    with srv.client() as c:
        for sid in ("op-7", "op-8", "shift-1"):
            assert c.post(f"/v1/sessions/{sid}/ask", json={"question": "q", "max_tokens": 1,
                                                           "stream": False}).status_code == 200
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'cli'}", "_KVCTL_COMPLETE": "complete_bash",
           "COMP_WORDS": f"kvctl --socket {srv.path} sessions show op-", "COMP_CWORD": "5"}
    r = subprocess.run([sys.executable, "-m", "kvctl.main"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == ["op-7", "op-8"], (r.stdout, r.stderr)
    env["COMP_WORDS"] = "kvctl --socket /nonexistent.sock sessions show op-"
    r = subprocess.run([sys.executable, "-m", "kvctl.main"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.split() == [] and r.stderr == ""
    assert completion.tiers("w") == ["warm"]
