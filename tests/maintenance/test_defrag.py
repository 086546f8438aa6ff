"""Defrag: the pure compaction plan, and apply through the real store (data byte-identical)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvagentd.config import Config, MaintenanceConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.maintenance import defrag as dfr
from kvagentd.maintenance.service import DefragBusy, Maintenance

from .conftest import GEOM, NS


# ---- the pure plan ---------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["free", "used", "busy"]), min_size=0, max_size=200))
def test_plan_packs_movable_blocks_below_free_slots(cells):
    used = np.array([c != "free" for c in cells], dtype=bool)
    busy = [i for i, c in enumerate(cells) if c == "busy"]
    plan = dfr.plan_compaction("hot", used, busy)
    srcs = [s for s, _ in plan.moves]
    dsts = [d for _, d in plan.moves]
    assert len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)
    for s, d in plan.moves:
        assert used[s] and not used[d] and s not in busy and d < s
    after = used.copy()
    after[dsts] = True
    after[srcs] = False
    assert after.sum() == used.sum()
    movable_after = [i for i in np.flatnonzero(after) if i not in busy]
    free_after = np.flatnonzero(~after)
    if movable_after and free_after.size:
        # No free slot sits below a movable block.
        assert not any(f < max(movable_after) for f in free_after)
    u, f, run, ratio = dfr.measure_bitmap(after)
    assert (plan.predicted.used, plan.predicted.free, plan.predicted.ratio) == (u, f, ratio)
    if not busy:
        assert ratio == 0.0  # all free space in one run


def test_measure_bitmap_examples():
    assert dfr.measure_bitmap(np.array([1, 0, 1, 0, 0, 1], bool)) == (3, 3, 2, pytest.approx(1 / 3))
    assert dfr.measure_bitmap(np.array([1, 1], bool)) == (2, 0, 0, 0.0)
    assert dfr.measure_bitmap(np.array([0, 0, 0], bool)) == (0, 3, 3, 0.0)


def test_cuda_memory_is_null_on_cpu():
    assert dfr.cuda_memory("cpu") is None


# ---- through the store -----------------------------------------------------------------------

def fill(store, sessions: int, blocks_each: int) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Commit `sessions` sessions of distinct tokens; returns session -> (tokens, data)."""
    out = {}
    for s in range(sessions):
        name = f"s{s}"
        tokens = [s * 10_000 + t for t in range(blocks_each * GEOM.block_tokens)]
        slots = store.allocate_hot(blocks_each, name)
        assert slots is not None
        data = torch.randn(blocks_each, *GEOM.block_shape, generator=torch.Generator().manual_seed(s))
        store.hot_arena()[slots] = data
        store.commit(name, tokens, slots, 0)
        store.release(name)
        out[name] = (tokens, data)
    return out


def assert_data(store, sessions):
    for name, (tokens, data) in sessions.items():
        keys = store.block_keys(tokens)
        res = store.ensure_resident(keys, "check")
        assert res.missing_from is None, name
        got = store.hot_arena()[res.slots]
        assert torch.equal(got, data), f"{name}: data changed"
        store.release("check")


@pytest.fixture
def store():
    s = TieredKVStore(GEOM, NS, hot_bytes=128 * GEOM.block_bytes, warm_bytes=64 * GEOM.block_bytes,
                      cold=None)
    yield s
    s.close()


def fragment(store):
    sessions = fill(store, 30, 4)  # 120 of 128 hot slots
    for i in range(0, 30, 2):  # drop every other session: 15 holes of 4 slots
        name = f"s{i}"
        store.drop_session(name, store.block_keys(sessions.pop(name)[0]))
    store.check_integrity()
    return sessions


@pytest.mark.parametrize("max_pause_s", [0.001, 0.1])
def test_defrag_hot_keeps_every_block_and_joins_free_space(store, max_pause_s):
    sessions = fragment(store)
    cfg = Config(maintenance=MaintenanceConfig(defrag_max_pause_s=max_pause_s))
    m = Maintenance(cfg, store, None, None)
    before = m.measure(Tier.HOT)
    assert before.ratio > 0.5
    dry = m.defrag("hot", dry_run=True)["results"][0]
    assert dry["dry_run"] and dry["plan"]["num_moves"] > 0
    assert m.measure(Tier.HOT) == before  # a dry run changes nothing
    seen = []
    res = m.defrag("hot", progress=lambda t, d, n: seen.append((t, d, n)))["results"][0]
    assert res["moved"] == res["planned"] == dry["plan"]["num_moves"] and res["skipped"] == 0
    assert seen and seen[-1] == ("hot", res["planned"], res["planned"])
    after = m.measure(Tier.HOT)
    assert after.ratio == 0.0 and after.used == before.used
    assert after.largest_free_run == after.free
    store.check_integrity()
    assert_data(store, sessions)


def test_defrag_skips_blocks_in_use(store):
    sessions = fragment(store)
    held = "s29"  # the highest-placed session stays in use
    res_keys = store.block_keys(sessions[held][0])
    pinned_slots = store.ensure_resident(res_keys, "busy").slots
    m = Maintenance(Config(), store, None, None)
    m.defrag("hot")
    assert store.ensure_resident(res_keys, "busy2").slots == pinned_slots  # did not move
    store.release("busy2")
    store.release("busy")
    store.check_integrity()
    assert_data(store, sessions)
    assert m.measure(Tier.HOT).ratio < 0.5


def test_relocate_race_is_skipped_not_corrupting(store):
    sessions = fragment(store)
    m = Maintenance(Config(), store, None, None)
    plan = m.plan(Tier.HOT)
    # A block becomes busy after planning: relocate must skip it.
    src = plan.moves[0][0]
    key = next(k for s, k in store._t.owners[Tier.HOT].items() if s == src)
    store.ensure_resident([key], "late")
    res = dfr.apply_plan(store, Tier.HOT, plan, max_pause_s=0.1)
    assert res.skipped == 1 and res.moved == len(plan.moves) - 1
    store.release("late")
    store.check_integrity()
    assert_data(store, sessions)


def test_defrag_stops_when_load_arrives(store):
    sessions = fragment(store)
    m = Maintenance(Config(), store, None, None)
    plan = m.plan(Tier.HOT)
    calls = iter([True, False])
    res = dfr.apply_plan(store, Tier.HOT, plan, max_pause_s=1e-9, first_chunk=4,
                         should_continue=lambda: next(calls, False))
    assert "stopped for load" in res.note and res.moved == 4 < res.planned
    store.check_integrity()
    assert_data(store, sessions)


def test_timer_defrag_waits_for_idle(store):
    fragment(store)
    idle = {"v": False}
    asked = []

    def is_idle(expected_s):
        asked.append(expected_s)
        return idle["v"]

    m = Maintenance(Config(), store, None, None, is_idle=is_idle)
    m._defrag_job()
    assert m.defrag_skipped_busy == 1 and m.defrag_runs == 0 and asked[0] > 0
    idle["v"] = True
    m._defrag_job()
    assert m.defrag_runs == 1 and m.measure(Tier.HOT).ratio == 0.0


def test_concurrent_defrag_is_busy(store):
    m = Maintenance(Config(), store, None, None)
    assert m._defrag_lock.acquire()
    with pytest.raises(DefragBusy):
        m.defrag("hot")
    m._defrag_lock.release()


def test_zero_arg_is_idle_is_accepted(store):
    m = Maintenance(Config(), store, None, None, is_idle=lambda: False)
    fragment(store)
    m._defrag_job()
    assert m.defrag_skipped_busy == 1
