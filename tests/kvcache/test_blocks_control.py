"""`/v1/blocks`, migrate, pin/unpin and verify, through the control server and kvctl."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import types
from pathlib import Path

import pytest
import structlog
import typer
from typer.testing import CliRunner

from kvagentd.config import load_config
from kvagentd.control.handlers import blocks as handlers
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.kvcache.base import Tier
from kvctl import cmd_blocks

from .conftest import compute_blocks


@pytest.fixture
def served(make_store):
    structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
    d = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
    cfg = load_config(None, env={})
    cfg = dataclasses.replace(cfg, control=dataclasses.replace(
        cfg.control, socket=d / "k.sock", socket_group="", operator_group=""))
    store = make_store(hot=4, warm=4)

    daemon = types.SimpleNamespace(services=types.SimpleNamespace(store=store))
    router = Router()
    handlers.register(router, daemon)
    server = ControlServer(cfg.control, router)
    server.start()
    yield cfg, store, daemon
    server.stop(1.0)
    store.close()
    shutil.rmtree(d, ignore_errors=True)
    structlog.reset_defaults()


def kvctl(cfg, *args):
    app = typer.Typer()
    cmd_blocks.register(app)
    return CliRunner().invoke(app, [*args, "--socket", str(cfg.control.socket)])


def test_blocks_migrate_pin_verify(served):
    cfg, store, daemon = served
    keys = compute_blocks(store, "pump-1", list(range(12)), 0, 3)
    store.release("pump-1")
    r = kvctl(cfg, "blocks", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["tiers"]["hot"]["blocks"] == 3
    assert data["sessions"] == [{"session": "pump-1", "hot": 3, "warm": 0, "cold": 0, "other": 0,
                                 "total": 3}]
    r = kvctl(cfg, "migrate", "--session", "pump-1", "--to", "cold")
    assert r.exit_code == 0 and "moved 3 of 3 blocks to cold" in r.output
    assert store.session_blocks()["pump-1"]["cold"] == 3
    r = kvctl(cfg, "migrate", "--block", keys[0].hex(), "--to", "hot", "--json")
    assert json.loads(r.output)["moved"] == 1
    assert {b.key: b.tier for b in store.snapshot()}[keys[0]] is Tier.HOT
    r = kvctl(cfg, "pin", "--block", keys[0].hex())
    assert r.exit_code == 0 and "pinned 1" in r.output
    assert store.evict([keys[0]]) == 0
    r = kvctl(cfg, "unpin", "--block", keys[0].hex())
    assert r.exit_code == 0
    r = kvctl(cfg, "blocks", "--session", "pump-1")
    assert r.exit_code == 0 and keys[1].hex() in r.output and "pump-1" in r.output
    r = kvctl(cfg, "blocks", "--session", "nosuch")  # not found: 1, not the whole table
    assert r.exit_code == 1 and "no blocks for session 'nosuch'" in r.output
    assert "tier" not in r.output
    r = kvctl(cfg, "verify", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["checked"] == 3


def test_bad_requests_and_unknown_targets(served):
    cfg, store, daemon = served
    assert kvctl(cfg, "migrate", "--to", "cold").exit_code == 64
    assert kvctl(cfg, "migrate", "--session", "x", "--to", "tepid").exit_code == 64
    assert kvctl(cfg, "migrate", "--block", "zz", "--to", "cold").exit_code == 64
    assert kvctl(cfg, "pin", "--session", "nobody").exit_code == 1  # 404
    daemon.services.store = None  # a ready daemon without it: not configured, retry is no help
    assert kvctl(cfg, "blocks").exit_code == 69
