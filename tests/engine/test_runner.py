"""The request path over the real tiered store: resume from every tier, lost blocks,
all-cached prompts, hot-pool pressure, restart."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from kvagentd.engine.executor import HotPoolFull
from kvagentd.config import ExecutorConfig
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine
from kvagentd.kvcache.base import Tier

from .conftest import BLOCK_TOKENS, greedy_reference, make_store

SYSTEM = "You watch the vibration of pump 1 and answer briefly."
N = 24


@pytest.fixture(params=["contiguous", "paged"])
def engine(request: pytest.FixtureRequest, tiny: LoadedModel, tmp_path: Path):
    store = make_store(tiny, tmp_path)
    eng = Engine(tiny, store, state_dir=tmp_path / "state",
                 executor_config=ExecutorConfig(kv_layout=request.param))
    eng.start()
    yield eng
    eng.stop()
    store.close()


def _next_ids(eng: Engine, session: str, text: str) -> list[int]:
    s = eng.table.get(session)
    assert s is not None
    return s.token_ids + eng.chat.next_turn(text)


@pytest.mark.parametrize("tier", [Tier.HOT, Tier.WARM, Tier.COLD])
def test_resume_matches_full_recompute(engine: Engine, tiny: LoadedModel, tier: Tier) -> None:
    first = engine.ask("s", "How is the pump running today?", max_new_tokens=N, system=SYSTEM)
    assert first.reused_tokens == 0 and first.new_tokens > 0
    keys = engine.table.get("s").block_keys
    assert keys
    if tier is not Tier.HOT:
        assert engine.store.demote(keys, tier) == len(keys)
    ids = _next_ids(engine, "s", "And the bearing temperature?")
    expected = greedy_reference(tiny, ids, N)
    res = engine.ask("s", "And the bearing temperature?", max_new_tokens=N)
    got = engine.table.get("s").token_ids[len(ids): len(ids) + res.new_tokens]
    assert got == expected[: res.new_tokens]
    assert res.reused_tokens == len(keys) * BLOCK_TOKENS
    assert res.loaded[tier.value] == len(keys)
    assert res.prefill_tokens == len(ids) - res.reused_tokens
    assert res.recomputed_tokens == 0
    engine.store.check_integrity()


def test_corrupt_cold_block_is_recomputed_and_counted(engine: Engine, tiny: LoadedModel,
                                                      tmp_path: Path) -> None:
    engine.ask("s", "Report the vibration level of the drive end bearing please.",
               max_new_tokens=N, system=SYSTEM)
    keys = engine.table.get("s").block_keys
    assert len(keys) >= 3
    assert engine.store.demote(keys, Tier.COLD) == len(keys)
    bad = 2
    db = sqlite3.connect(tmp_path / "cold" / "index.sqlite3")
    seg, off, length = db.execute("SELECT segment, offset, length FROM blocks WHERE key = ?",
                                  (keys[bad],)).fetchone()
    db.close()
    with open(tmp_path / "cold" / f"seg-{seg:08d}.kvs", "r+b") as f:
        f.seek(off + length - 100)
        byte = f.read(1)
        f.seek(off + length - 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    ids = _next_ids(engine, "s", "Is that within limits?")
    expected = greedy_reference(tiny, ids, N)
    before = engine.metrics.recomputed_tokens._value.get()
    res = engine.ask("s", "Is that within limits?", max_new_tokens=N)
    got = engine.table.get("s").token_ids[len(ids): len(ids) + res.new_tokens]
    assert got == expected[: res.new_tokens]
    assert res.recomputed_tokens == (len(keys) - bad) * BLOCK_TOKENS
    assert res.reused_tokens == bad * BLOCK_TOKENS
    assert engine.metrics.recomputed_tokens._value.get() - before == res.recomputed_tokens
    # the recomputed blocks were committed again: the next turn reuses them
    res2 = engine.ask("s", "Thanks.", max_new_tokens=4)
    assert res2.recomputed_tokens == 0 and res2.reused_tokens >= len(keys) * BLOCK_TOKENS
    engine.store.check_integrity()


def _aligned_question(engine: Engine) -> str:
    """A question whose first-turn prompt is a whole number of blocks."""
    q = "status"
    while len(engine.chat.first_turn(SYSTEM, q)) % BLOCK_TOKENS:
        q += " ok"
    return q


def test_every_prompt_token_cached(engine: Engine) -> None:
    q = _aligned_question(engine)
    n_prompt = len(engine.chat.first_turn(SYSTEM, q))
    a = engine.ask("a", q, max_new_tokens=8, system=SYSTEM)
    steps = engine.executor.step_count
    b = engine.ask("b", q, max_new_tokens=8, system=SYSTEM)  # same prompt ids, all stored
    assert b.prompt_tokens == n_prompt
    if engine.blocks.layout == "contiguous":
        # the logits that followed these ids are known: the first token needs no forward
        assert b.reused_tokens == n_prompt and b.prefill_tokens == 0
        assert engine.executor.step_count - steps == b.new_tokens - 1
        assert engine.memo.hits == 1
    else:  # the last id runs again for its logits
        assert b.reused_tokens == n_prompt - 1 and b.prefill_tokens == 1
    assert b.text == a.text
    engine.store.check_integrity()


def test_equal_system_prompts_share_blocks(engine: Engine) -> None:
    engine.ask("a", "first question about the motor", max_new_tokens=4, system=SYSTEM)
    res = engine.ask("b", "a different question", max_new_tokens=4, system=SYSTEM)
    assert res.reused_tokens >= BLOCK_TOKENS
    assert engine.table.get("a").block_keys[0] == engine.table.get("b").block_keys[0]


def test_hot_pressure_demotes_idle_sessions(tiny: LoadedModel, tmp_path: Path) -> None:
    store = make_store(tiny, tmp_path, hot_blocks=8, warm_blocks=64)
    eng = Engine(tiny, store, state_dir=tmp_path / "state")
    eng.start()
    try:
        for i in range(6):  # each session needs about 5 hot blocks; 8 exist
            res = eng.ask(f"s{i}", f"question number {i} about the gearbox", max_new_tokens=N,
                          system=SYSTEM)
            assert res.new_tokens > 0
        listing = {s["id"]: s["blocks_by_tier"] for s in eng.sessions.list()}
        assert sum(t["warm"] for t in listing.values()) > 0
        res = eng.ask("s0", "and again?", max_new_tokens=4)
        assert res.reused_tokens > 0 and res.loaded["warm"] > 0
        store.check_integrity()
    finally:
        eng.stop()
        store.close()


def test_hot_pool_too_small_fails_clearly(tiny: LoadedModel, tmp_path: Path) -> None:
    store = make_store(tiny, tmp_path, hot_blocks=2, warm_blocks=4, cold=False)
    eng = Engine(tiny, store, state_dir=tmp_path / "state")
    eng.start()
    try:
        with pytest.raises(HotPoolFull, match="hot pool"):
            eng.ask("s", "a question that needs more blocks than the pool has",
                    max_new_tokens=64, system=SYSTEM)
        store.check_integrity()
        assert eng.ask("t", "hi", max_new_tokens=2, system="s").new_tokens > 0  # still serving
    finally:
        eng.stop()
        store.close()


def test_restart_resumes_from_cold(tiny: LoadedModel, tmp_path: Path) -> None:
    store = make_store(tiny, tmp_path)
    eng = Engine(tiny, store, state_dir=tmp_path / "state")
    eng.start()
    eng.ask("s", "Describe the current vibration trend.", max_new_tokens=N, system=SYSTEM)
    keys = eng.table.get("s").block_keys
    eng.stop()
    store.close()  # persists hot/warm blocks to the cold tier

    store = make_store(tiny, tmp_path)
    eng = Engine(tiny, store, state_dir=tmp_path / "state")
    eng.start()
    try:
        assert eng.sessions.get("s")["blocks_by_tier"]["cold"] == len(keys)
        ids = _next_ids(eng, "s", "What should we check first?")
        expected = greedy_reference(tiny, ids, N)
        res = eng.ask("s", "What should we check first?", max_new_tokens=N)
        got = eng.table.get("s").token_ids[len(ids): len(ids) + res.new_tokens]
        assert got == expected[: res.new_tokens]
        assert res.loaded["cold"] == len(keys)
        assert res.reused_tokens == len(keys) * BLOCK_TOKENS
    finally:
        eng.stop()
        store.close()


def test_drop_session_forgets_blocks(engine: Engine) -> None:
    engine.ask("gone", "temporary question", max_new_tokens=4, system="unique system prompt")
    keys = engine.table.get("gone").block_keys
    assert engine.sessions.drop("gone") is True
    assert engine.sessions.get("gone") is None and engine.sessions.drop("gone") is False
    known = {b.key for b in engine.store.snapshot()}
    assert not (set(keys) & known)


def test_continue_session_without_a_new_turn(engine: Engine, tiny: LoadedModel) -> None:
    engine.ask("c", "Describe the pump.", max_new_tokens=N, system=SYSTEM)
    ids = engine.table.get("c").token_ids
    stored = len(engine.table.get("c").block_keys) * BLOCK_TOKENS
    expected = greedy_reference(tiny, ids, 4)
    res = engine.ask("c", None, max_new_tokens=4)
    assert res.prompt_tokens == len(ids)
    assert res.reused_tokens == min(stored, len(ids) - 1) > 0
    assert engine.table.get("c").token_ids[len(ids): len(ids) + res.new_tokens] == \
        expected[: res.new_tokens]
    with pytest.raises(ValueError, match="no tokens"):
        engine.ask("unknown", None)
