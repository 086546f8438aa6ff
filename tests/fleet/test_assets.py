"""An asset moved in the config: the new box continues the asset's session from the remote tier;
the old box, back with the asset still configured, leaves the model turns to the box that runs
it now (its ticks log features only), so two boxes never write one asset's sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvagentd.agent import grounding
from tests.redisd import RedisServer

from .conftest import Box, box_config

ASSET = '[[agent.assets]]\nname = "pump-1"\nseed = 3\n'


def test_an_asset_moved_in_the_config_continues_its_session_on_the_new_box(
        fdir: Path, redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny random model's text depends on the prompt, which carries the wall-clock time: a
    # commentary it happens to write empty (or contradicting) is withheld and rolls the session
    # over. What is tested here is where the session continues, so every commentary passes.
    monkeypatch.setattr(grounding, "check", lambda *a, **k: grounding.Verdict(True))
    a = Box(box_config(fdir, redis.url, "box-a", assets=ASSET))
    b = None
    try:
        rows = [a.agent.tick_once("pump-1") for _ in range(3)]
        sid = rows[-1]["session"]
        assert [r["session"] for r in rows] == ["pump-1-1"] * 3  # the model's turn ran each time
        a.flush()
        history = a.engine.table.get(sid)
        assert history is not None and history.turns == 3
        a.stop()  # box A is gone (its last heartbeat says stopped)

        b = Box(box_config(fdir, redis.url, "box-b", assets=ASSET))
        assert b.fleet.leases.get(sid).held  # adopted at start
        row = b.agent.tick_once("pump-1")
        assert row["session"] == sid
        done = b.agent.assets["pump-1"].last_result
        assert done["recomputed_tokens"] == 0
        assert done["reused_tokens"] == len(history.token_ids) // 16 * 16
        assert b.engine.table.get(sid).turns == 4
        b.flush()

        # A comes back, pump-1 still in its config: B runs the asset, so A ticks without the model
        a = Box(box_config(fdir, redis.url, "box-a", assets=ASSET))
        row = a.agent.tick_once("pump-1")
        assert row["session"] is None and row["assessment"] is None  # no model turn here
        assert "box-b" in row["note"]
        assert row["zone"] in ("A", "B", "C", "D")  # the measurement still happens
        assert a.agent.status()["assets"]["pump-1"]["llm_held_by"] == "box-b"
        assert b.engine.table.get(sid).turns == 4
        listing = {x["box"]: x for x in a.fleet.boxes()}
        assert listing["box-b"]["alive"] and listing["box-b"]["assets"]["pump-1"]["session"] == sid
    finally:
        a.stop()
        if b is not None:
            b.stop()
