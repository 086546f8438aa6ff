"""Long operations stream their progress: verify (records read of the total) and migrate
(blocks handled), ending with the same result the plain request gives; kvctl on a terminal
draws it as a progress line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import torch

from kvagentd.config import load_config
from kvagentd.control.handlers import blocks as handlers
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore
from tests.kvcache.conftest import compute_blocks

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4,
                      dtype=torch.float32)


def _store(d: Path) -> TieredKVStore:
    ns = make_namespace("test-model@1", torch.float32, 4)
    bb = GEOMETRY.block_bytes
    return TieredKVStore(GEOMETRY, ns, hot_bytes=160 * bb, warm_bytes=160 * bb,
                         cold=lambda listener: ColdStore(
                             d / "cold", GEOMETRY, ns, capacity_bytes=8 << 20,
                             segment_bytes=1 << 20, io_unit_bytes=8192, o_direct=False,
                             listener=listener))


@pytest.fixture
def served() -> Iterator[tuple[Path, Any]]:
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    d = Path(tempfile.mkdtemp(prefix="kvp", dir="/tmp"))
    cfg = load_config(None, env={})
    ctl = dataclasses.replace(cfg.control, socket=d / "k.sock", socket_group="",
                              operator_group="")
    store = _store(d)

    daemon = types.SimpleNamespace(services=types.SimpleNamespace(store=store))
    router = Router()
    handlers.register(router, daemon)
    server = ControlServer(ctl, router)
    server.start()
    yield ctl.socket, store
    server.stop(1.0)
    store.close()
    shutil.rmtree(d, ignore_errors=True)
    structlog.reset_defaults()


def _lines(sock: Path, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://k",
                      timeout=60) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(x) for x in r.iter_lines() if x.strip()]


def test_verify_and_migrate_stream_progress_then_the_result(served: Any,
                                                            monkeypatch: Any) -> None:
    import kvagentd.control.progress as progress

    monkeypatch.setattr(progress, "EVERY_S", 0.0)  # every report becomes a line
    sock, store = served
    keys = compute_blocks(store, "s", list(range(150 * 4)), 0, 150)
    assert keys is not None
    store.release("s")
    lines = _lines(sock, "/v1/blocks/migrate", {"session": "s", "to": "cold", "stream": True})
    steps = [x["progress"] for x in lines if "progress" in x]
    assert [p["done"] for p in steps] == [64, 128, 150] and steps[-1]["total"] == 150
    assert lines[-1]["result"]["moved"] == 150 and lines[-1]["result"]["to"] == "cold"
    assert all(b.tier is Tier.COLD for b in store.snapshot())

    lines = _lines(sock, "/v1/verify", {"stream": True})
    steps = [x["progress"] for x in lines if "progress" in x]
    assert steps[0]["done"] == 0 and steps[-1] == {"done": 150, "total": 150}
    assert [p["done"] for p in steps] == sorted(p["done"] for p in steps)
    result = lines[-1]["result"]
    assert result["checked"] == 150 and result["corrupt"] == 0
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://k") as c:
        plain = c.post("/v1/verify", json={}).json()
    assert plain["checked"] == result["checked"]


def test_kvctl_verify_on_a_terminal_draws_progress(served: Any, monkeypatch: Any,
                                                   capsys: Any) -> None:
    import typer

    from kvctl import cmd_blocks

    sock, store = served
    keys = compute_blocks(store, "s", list(range(8)), 0, 2)
    store.release("s")
    assert keys is not None and store.demote(keys, Tier.COLD) == 2
    monkeypatch.setattr(cmd_blocks, "progress_wanted", lambda o: True)
    app = typer.Typer()
    cmd_blocks.register(app)
    app.callback()(lambda: None)
    try:
        app(["verify", "--socket", str(sock)], standalone_mode=False)
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = capsys.readouterr()
    assert "checked 2 records" in out.out
    assert "verifying cold records" in out.err  # the progress line, cleared at the end
