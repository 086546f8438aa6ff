"""A first-turn ask that fails leaves no session behind: not in the session table and not as
references on stored blocks (what `/v1/blocks` lists per session)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import structlog

from kvagentd.control.handlers import blocks as block_routes
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine
from tests.control.conftest import make_config

from .conftest import make_store
from .test_control import Server

SYSTEM = "You are the maintenance assistant of a pump station. Answer in one short sentence."


def test_failed_first_ask_leaves_no_ghost_session(tiny: LoadedModel) -> None:
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    d = Path(tempfile.mkdtemp(prefix="kvg", dir="/tmp"))
    store = make_store(tiny, d, hot_blocks=3, warm_blocks=4, cold=False)
    eng = Engine(tiny, store, state_dir=d / "state")
    eng.start()
    srv = Server(make_config(d, read_timeout_s=30.0), eng)
    block_routes.register(srv.server.router, srv.daemon)
    srv.daemon.services.store = store
    try:
        assert eng.ask("a", "hi", max_new_tokens=2, system=SYSTEM).new_tokens > 0
        shared = set(store.keys_of_session("a"))
        assert shared, "the system prompt fills at least one shared block"
        with srv.client() as c:
            r = c.post("/v1/sessions/ghost/ask", json={
                "question": "a question far too long for three hot blocks " * 8,
                "system": SYSTEM, "max_tokens": 64, "stream": False})
            assert r.status_code >= 400 and "error" in r.json()
            assert c.get("/v1/sessions/ghost").status_code == 404
            assert c.delete("/v1/sessions/ghost").status_code == 404
            listed = {s["session"] for s in c.get("/v1/blocks").json()["sessions"]}
            assert "ghost" not in listed and "a" in listed
        assert store.keys_of_session("ghost") == []
        assert set(store.keys_of_session("a")) == shared  # the other session keeps its blocks
        store.check_integrity()
    finally:
        srv.server.stop(1.0)
        eng.stop()
        store.close()
        shutil.rmtree(d, ignore_errors=True)
        structlog.reset_defaults()
