"""Blocks lost before a request (found by a scrub, a prefetch or evicted) are counted as
recomputed when the session comes back, in the result and in
`kvagentd_engine_recomputed_tokens_total` (it once stayed 0 after 11 lost blocks)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine
from kvagentd.kvcache.base import Tier

from .conftest import BLOCK_TOKENS, make_store

SYSTEM = "You watch the vibration of pump 1 and answer briefly."


def _corrupt(cold_dir: Path, key: bytes) -> None:
    db = sqlite3.connect(cold_dir / "index.sqlite3")
    seg, off, length = db.execute("SELECT segment, offset, length FROM blocks WHERE key = ?",
                                  (key,)).fetchone()
    db.close()
    with open(cold_dir / f"seg-{seg:08d}.kvs", "r+b") as f:
        f.seek(off + length - 100)
        byte = f.read(1)
        f.seek(off + length - 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_blocks_lost_before_the_request_count_as_recomputed(tiny: LoadedModel,
                                                            tmp_path: Path) -> None:
    registry = CollectorRegistry()
    store = make_store(tiny, tmp_path)
    eng = Engine(tiny, store, state_dir=tmp_path / "state", registry=registry)
    eng.start()
    try:
        eng.ask("s", "Report the vibration level of the drive end bearing please.",
                max_new_tokens=24, system=SYSTEM)
        keys = eng.table.get("s").block_keys
        assert len(keys) >= 3
        assert store.demote(keys, Tier.COLD) == len(keys)
        bad = 1
        _corrupt(tmp_path / "cold", keys[bad])
        scrub = store.verify(repair=True)  # found LOST before any request reads it
        assert scrub["corrupt"] == 1 and store.match_prefix(
            eng.table.get("s").token_ids).num_tokens == bad * BLOCK_TOKENS
        res = eng.ask("s", "Is that within limits?", max_new_tokens=4)
        assert res.recomputed_tokens == (len(keys) - bad) * BLOCK_TOKENS
        assert res.reused_tokens == bad * BLOCK_TOKENS
        text = generate_latest(registry).decode()
        assert f"kvagentd_engine_recomputed_tokens_total {float(res.recomputed_tokens)}" in text
        again = eng.ask("s", "Thanks.", max_new_tokens=4)
        assert again.recomputed_tokens == 0  # committed again, reused from here on
        store.check_integrity()
    finally:
        eng.stop()
        store.close()
