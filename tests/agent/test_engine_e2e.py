"""The tick path on the real engine (tiny random-weight Llama, SmolLM2 tokenizer) and store."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from kvagentd.agent.agent import Agent
from kvagentd.agent.prompts import SYSTEM_PROMPT
from kvagentd.config import AssetConfig, ExecutorConfig, FaultConfig, ModelConfig
from kvagentd.kvcache.base import Tier

from .conftest import ManualClock, agent_config

BLOCK_TOKENS = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvagentd.engine.model import load_model, model_geometry
    from kvagentd.engine.service import Engine
    from kvagentd.engine.tiny import tiny_model_dir
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.kvcache.keys import make_namespace
    from kvagentd.kvcache.store import TieredKVStore

    cache = Path(os.environ.get("KVAGENTD_TEST_CACHE",
                                Path(tempfile.gettempdir()) / "kvagentd-test-cache"))
    model_dir = tiny_model_dir(cache)
    loaded = load_model(ModelConfig(source="hf_dir", path=model_dir, dtype="float32",
                                    device="cpu"), cache)
    geometry = model_geometry(loaded.model, BLOCK_TOKENS, loaded.dtype)
    ns = make_namespace(loaded.fingerprint, loaded.dtype, BLOCK_TOKENS)
    d = tmp_path_factory.mktemp("e2e")
    store = TieredKVStore(geometry, ns, hot_bytes=512 * geometry.block_bytes,
                          warm_bytes=512 * geometry.block_bytes,
                          cold=lambda listener: ColdStore(
                              d / "cold", geometry, ns, capacity_bytes=256 << 20,
                              segment_bytes=16 << 20, o_direct=False, listener=listener))
    engine = Engine(loaded, store, state_dir=d / "engine", executor_config=ExecutorConfig())
    engine.start()
    yield engine, store, d
    engine.stop()
    store.close()


def test_tick_end_to_end_reuses_the_session_kv(stack, scheduler):
    engine, store, d = stack
    clock = ManualClock()
    ag = Agent(agent_config(assets=(AssetConfig(name="e2e-a"),), assessment_max_tokens=8),
               engine.executor, scheduler, d / "a", clock=clock, store_stats=store.stats)
    rows = []
    for _ in range(3):
        rows.append(ag.tick_once("e2e-a"))
        clock.advance(3)
    assert all(r["kind"] == "tick" and r["session"] == "e2e-a-1" for r in rows)
    assert all(isinstance(r["assessment"], str) and r["note"] == "" for r in rows)
    st = ag.assets["e2e-a"]
    assert st.last_result["new_tokens"] >= 1
    # The third turn reuses every full block of the two turns before it.
    assert st.last_result["reused_tokens"] >= st.last_result["prompt_tokens"] - 2 * 64
    assert engine.sessions.tokens("e2e-a-1") == st.session_tokens or \
        abs(engine.sessions.tokens("e2e-a-1") - st.session_tokens) <= 4
    s = ag.status()["assets"]["e2e-a"]
    assert s["prompt_tokens_reused"] > 0.3 and s["llm_errors"] == 0
    store.check_integrity()


def test_rollover_shares_the_system_prompt_blocks(stack, scheduler):
    engine, store, d = stack
    clock = ManualClock()
    ag = Agent(agent_config(assets=(AssetConfig(name="e2e-b"),), assessment_max_tokens=8,
                            session_token_budget=600),
               engine.executor, scheduler, d / "b", clock=clock)
    sessions = []
    while len(set(sessions)) < 2 and len(sessions) < 40:
        sessions.append(ag.tick_once("e2e-b")["session"])
        clock.advance(3)
    assert sessions[-1] == "e2e-b-2"
    s1, s2 = engine.table.get("e2e-b-1"), engine.table.get("e2e-b-2")
    system_ids = engine.chat.first_turn(SYSTEM_PROMPT, "")
    common = 0
    while s1.token_ids[common] == s2.token_ids[common]:
        common += 1
    n_shared = common // BLOCK_TOKENS
    assert n_shared >= (len(system_ids) - 8) // BLOCK_TOKENS >= 5
    assert s1.block_keys[:n_shared] == s2.block_keys[:n_shared]
    assert s1.block_keys[n_shared] != s2.block_keys[n_shared]
    info = {b.key: b for b in store.snapshot()}
    assert {"e2e-b-1", "e2e-b-2"} <= set(info[s1.block_keys[0]].sessions)
    assert len(s1.token_ids) <= 600 + 64


def test_replay_resumes_a_session_from_the_cold_tier(stack, scheduler):
    engine, store, d = stack
    clock = ManualClock()
    ag = Agent(agent_config(assets=(AssetConfig(name="e2e-c", fault=FaultConfig(
        kind="outer_race", onset_s=0.0)),), assessment_max_tokens=8, report_max_tokens=16),
        engine.executor, scheduler, d / "c", clock=clock, store_stats=store.stats)
    for _ in range(3):
        ag.tick_once("e2e-c")
        clock.advance(3)
    event = ag.events.query(asset="e2e-c", anomalies=True, newest_first=False)[0]
    keys = engine.table.get(event["session"]).block_keys
    assert keys and store.demote(keys, Tier.COLD) > 0
    cold_before = store.stats()["loaded_cold"]
    rid = ag.reports.start("replay", event=event["id"])
    doc = ag.reports.wait_for(rid, timeout=120)
    assert doc["state"] == "done", doc.get("error")
    assert store.stats()["loaded_cold"] > cold_before
    assert doc["store_after"]["loaded_cold"] > doc["store_before"]["loaded_cold"]
    assert doc["generation"]["reused_tokens"] > 0
    assert len(doc["files"]) == 4  # md, json, trend and the event window's spectrum
    # The flagged session was live: the next tick opens a new one.
    assert ag.tick_once("e2e-c")["session"] == "e2e-c-2"
    store.check_integrity()


def test_weekly_report_on_the_engine(stack, scheduler):
    engine, store, d = stack
    clock = ManualClock()
    ag = Agent(agent_config(assets=(AssetConfig(name="e2e-d"),), assessment_max_tokens=4,
                            report_max_tokens=8), engine.executor, scheduler, d / "d",
               clock=clock)
    ag.tick_once("e2e-d")
    doc = ag.reports.wait_for(ag.reports.start("weekly", asset="e2e-d"), timeout=120)
    assert doc["state"] == "done", doc.get("error")
    assert doc["generation"]["new_tokens"] >= 1 and len(doc["files"]) == 3
    assert engine.sessions.exists(doc["generation"]["session"])


def test_one_beat_of_assets_shares_model_steps(stack, scheduler):
    """Three assets ticking in the same beat reach the engine together: their turns run in the
    same batched steps."""
    import threading

    engine, store, d = stack
    names = [f"beat-{i}" for i in range(3)]
    ag = Agent(agent_config(assets=tuple(AssetConfig(name=n, seed=i + 1)
                                         for i, n in enumerate(names)),
                            assessment_max_tokens=8, tick_interval_s=30.0),
               engine.executor, scheduler, d / "beat", store_stats=store.stats)
    sizes: list[int] = []
    engine.executor.on_step = lambda size, tokens, s: sizes.append(size)
    try:
        threads = [threading.Thread(target=ag._tick_job, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.executor.on_step = None
    assert ag.model is not None and ag.model.beat.last_size == 3
    assert max(sizes) == 3  # every step of the beat ran the three sequences together
    for n in names:
        assert ag.assets[n].last_result is not None and ag.assets[n].llm_errors == 0
