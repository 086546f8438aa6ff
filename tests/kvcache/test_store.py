from __future__ import annotations

import os
import threading
import time

import pytest

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.cold.record import ALIGN
from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store.state import BlockState

from .conftest import compute_blocks, fill_value

SYSTEM = list(range(1000, 1008))  # two full blocks shared by every session


def _values(store, slots):
    return [store.hot_arena()[s].flatten()[0].item() for s in slots]


def _check_resident(store, keys, session):
    r = store.ensure_resident(keys, session)
    assert r.missing_from is None, r
    assert _values(store, r.slots) == [fill_value(k) for k in keys]
    store.check_integrity()
    return r


def test_shared_prefix_stored_once(make_store):
    st = make_store()
    a = SYSTEM + [1, 2, 3, 4]
    b = SYSTEM + [5, 6, 7, 8]
    compute_blocks(st, "a", a, 0, 3)
    st.release("a")
    m = st.match_prefix(b + [9])
    assert m.num_tokens == 8 and m.keys == st.block_keys(SYSTEM)
    r = _check_resident(st, m.keys, "b")
    assert r.loaded == {"hot": 2, "warm": 0, "cold": 0}
    compute_blocks(st, "b", b, 2, 1)
    st.release("b")
    assert st.stats()["blocks"] == 4
    # a session that recomputes the same prefix gets deduplicated
    compute_blocks(st, "c", SYSTEM, 0, 2)
    st.release("c")
    assert st.stats()["blocks"] == 4 and st.stats()["dedup"] == 2
    assert st.session_blocks()["c"]["hot"] == 2
    st.check_integrity()
    st.drop_session("a", st.block_keys(a))
    assert st.stats()["blocks"] == 3  # a's private block freed; SYSTEM kept for b and c
    st.drop_session("b", st.block_keys(b))
    st.drop_session("c", st.block_keys(SYSTEM))
    assert st.stats()["blocks"] == 0
    st.check_integrity()


def test_drop_frees_unreferenced_tail(make_store):
    st = make_store()
    a = SYSTEM + [1, 2, 3, 4]
    compute_blocks(st, "a", a, 0, 3)
    st.release("a")
    _check_resident(st, st.block_keys(SYSTEM), "b")
    st.release("b")
    st.drop_session("a", st.block_keys(a))
    assert st.match_prefix(a).num_tokens == 8
    assert st.pool(Tier.HOT).num_used == 2


def test_hot_full_demotes_lru_and_values_survive_every_tier(make_store):
    st = make_store(hot=4, warm=2)
    toks = list(range(40))  # 10 blocks
    for i in range(0, 10, 2):
        assert compute_blocks(st, "s", toks, i, 2) is not None
        st.release("s")
        st.check_integrity()
    states = st.stats()["states"]
    assert states == {"hot": 4, "warm": 2, "cold": 4}
    keys = st.match_prefix(toks).keys
    assert len(keys) == 10
    r = _check_resident(st, keys[:4], "t")  # the oldest, now cold
    assert r.loaded["cold"] == 4
    st.release("t")
    assert st.demote(keys[:2], Tier.COLD) == 2
    assert st.promote(keys[:2], Tier.WARM) == 0  # warm is full: a status, nothing moves
    warm = [b.key for b in st.snapshot() if b.tier is Tier.WARM]
    assert st.demote(warm, Tier.COLD) == 2
    assert st.promote(keys[:2], Tier.WARM) == 2
    st.check_integrity()
    _check_resident(st, keys[:4], "t")


def test_allocate_hot_returns_none_when_nothing_can_move(make_store):
    st = make_store(hot=2, warm=0, cold=False)
    assert st.allocate_hot(2, "a") is not None
    assert st.allocate_hot(1, "b") is None
    st.release("a")
    assert st.allocate_hot(2, "b") is not None


def test_pinned_and_in_use_blocks_stay(make_store):
    st = make_store(hot=2, warm=4)
    toks = list(range(8))
    keys = compute_blocks(st, "a", toks, 0, 2)
    assert st.demote(keys, Tier.WARM) == 0  # in use
    st.release("a")
    st.pin(keys[:1])
    assert st.demote(keys, Tier.WARM) == 1
    assert st.evict(keys) == 1 and st.match_prefix(toks).num_tokens == 4
    st.unpin(keys[:1])
    assert st.evict(keys) == 1 and st.stats()["blocks"] == 0
    st.check_integrity()


def test_restart_keeps_sessions_blocks_findable(make_store, make_cold):
    st = make_store(hot=4, warm=4)
    a = SYSTEM + [1, 2, 3, 4]
    compute_blocks(st, "a", a, 0, 3)
    st.release("a")
    st.demote(st.block_keys(a)[:1], Tier.WARM)
    st.close()  # hot and warm blocks are written to cold
    st2 = make_store(hot=4, warm=4)
    m = st2.match_prefix(a)
    assert m.num_tokens == 12
    assert st2.session_blocks() == {"a": {"hot": 0, "warm": 0, "cold": 3, "other": 0}}
    _check_resident(st2, m.keys, "a")
    st2.close()


def test_other_namespace_matches_nothing(make_store, make_cold, geometry):
    st = make_store()
    compute_blocks(st, "a", SYSTEM, 0, 2)
    st.release("a")
    st.close()
    other = make_namespace("other-model", geometry.dtype, geometry.block_tokens)
    st2 = make_store(namespace=other, cold=dict(namespace=other))  # same directory, other model
    assert st2.match_prefix(SYSTEM).num_tokens == 0 and st2.stats()["blocks"] == 0


def test_corrupt_cold_block_is_lost_not_served(make_store, tmp_path):
    st = make_store(hot=4, warm=4)
    toks = list(range(12))
    keys = compute_blocks(st, "a", toks, 0, 3)
    st.release("a")
    assert st.demote(keys, Tier.COLD) == 3
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    rec = os.path.getsize(seg) // 3
    with open(seg, "r+b") as f:
        f.seek(rec + ALIGN + 8)
        f.write(b"\xff\xff")
    r = st.ensure_resident(keys, "b")
    assert r.missing_from == 1 and len(r.slots) == 1
    assert _values(st, r.slots) == [fill_value(keys[0])]
    stats = st.stats()
    assert stats["lost"] == 1 and stats["states"].get("lost") == 1
    assert stats["tiers"]["cold"]["corrupt"] == 1
    assert st.match_prefix(toks).num_tokens == 4
    st.check_integrity()
    st.release("b")
    # the engine recomputes from the missing block on; the new copy replaces the lost one
    compute_blocks(st, "b", toks, 1, 2)
    st.release("b")
    assert st.match_prefix(toks).num_tokens == 12
    _check_resident(st, keys, "c")


class _SlowReads(FileIO):
    def __init__(self):
        self.delay = 0.0

    def preadv(self, fd, buffers, offset):
        time.sleep(self.delay)
        return super().preadv(fd, buffers, offset)


def test_readers_wait_for_a_migrating_block(make_store, make_cold):
    fio = _SlowReads()
    st = make_store(hot=8, warm=0, cold=dict(file_io=fio))
    toks = list(range(8))
    keys = compute_blocks(st, "a", toks, 0, 2)
    st.release("a")
    st.demote(keys, Tier.COLD)
    fio.delay = 0.3
    results = {}

    def reader(name):
        results[name] = st.ensure_resident(keys, name)

    threads = [threading.Thread(target=reader, args=(n,)) for n in ("r1", "r2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for r in results.values():
        assert r.missing_from is None
        assert _values(st, r.slots) == [fill_value(k) for k in keys]
    assert results["r1"].slots == results["r2"].slots
    # the records were read once: the second reader waited for the first one's move (both
    # may count the blocks as loaded from cold, when both looked before the move began)
    assert st.cold.stats()["reads"] == 2
    st.check_integrity()


def test_relocate_moves_idle_blocks_only(make_store):
    st = make_store(hot=6)
    keys = compute_blocks(st, "a", list(range(16)), 0, 4)
    st.release("a")
    st.evict(keys[:2])
    held = st.ensure_resident(keys[3:], "b")
    assert st.relocate(Tier.HOT, [(2, 0), (held.slots[0], 1)]) == 1
    assert 3 in st.busy_slots(Tier.HOT)
    st.release("b")
    assert st.occupancy(Tier.HOT).tolist() == [True, False, False, True, False, False]
    _check_resident(st, keys[2:], "c")


def test_access_listener_and_background_promote(make_store):
    seen = []
    st = make_store(hot=4, warm=4, access_listener=lambda ks, s: seen.append((len(ks), s)))
    keys = compute_blocks(st, "a", list(range(8)), 0, 2)
    st.record_access(keys, "a")
    assert seen == [(2, "a")]
    st.release("a")
    st.demote(keys, Tier.COLD)
    assert st.promote(keys, Tier.WARM, background=True) == 2
    deadline = time.time() + 10
    while st.stats()["states"].get("warm", 0) < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert st.stats()["states"] == {"warm": 2}
    st.check_integrity()
    st.close()


def test_block_state_of_snapshot(make_store):
    st = make_store()
    keys = compute_blocks(st, "a", list(range(8)), 0, 2)
    snap = {b.key: b for b in st.snapshot()}
    assert snap[keys[0]].tier is Tier.HOT and snap[keys[0]].in_use and snap[keys[0]].sessions == ("a",)
    st.release("a")
    st.demote(keys[:1], Tier.COLD)
    snap = {b.key: b for b in st.snapshot()}
    assert snap[keys[0]].tier is Tier.COLD and not snap[keys[0]].in_use
    assert st._t.meta[keys[0]].state is BlockState.COLD


def test_verify_repair_marks_cold_only_blocks_lost(make_store, tmp_path):
    st = make_store(hot=4, warm=4)
    toks = list(range(8))
    keys = compute_blocks(st, "a", toks, 0, 2)
    st.release("a")
    st.demote(keys, Tier.COLD)
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    with open(seg, "r+b") as f:
        f.seek(os.path.getsize(seg) // 2 + ALIGN + 4)
        f.write(b"\x55")
    assert st.verify()["corrupt"] == 1
    assert st.match_prefix(toks).num_tokens == 8  # a scrub without repair changes nothing
    report = st.verify(repair=True)
    assert report["repaired"] == 1
    assert st.match_prefix(toks).num_tokens == 4 and st.stats()["states"].get("lost") == 1
    st.check_integrity()


def _config(tmp_path, **kv):
    import dataclasses

    from kvagentd.config import Config, KVConfig, MaintenanceConfig

    return Config(kv=dataclasses.replace(KVConfig(), cold_dir=tmp_path / "c", **kv),
                  maintenance=dataclasses.replace(MaintenanceConfig(), shadow_dir=tmp_path / "shm",
                                                  shadow_bytes=1 << 22))


def test_composition_root_builds_tiers_from_the_config(tmp_path, geometry, namespace):
    from kvagentd.services import build_tiers

    bb = geometry.block_bytes
    cfg = _config(tmp_path, hot_bytes=8 * bb, warm_ratio=0.5, cold_capacity_bytes=1 << 22,
                  segment_bytes=1 << 20, cold_codec="int8")
    st = build_tiers(cfg, geometry, namespace, "cpu").store
    stats = st.stats()
    assert stats["tiers"]["hot"]["capacity"] == 8 and stats["tiers"]["warm"]["capacity"] == 4
    assert stats["tiers"]["cold"]["codec"] == "int8"
    compute_blocks(st, "a", list(range(8)), 0, 2)
    st.release("a")
    st.close()
    st = build_tiers(cfg, geometry, namespace, "cpu").store
    assert st.match_prefix(list(range(8))).num_tokens == 8
    r = st.ensure_resident(st.match_prefix(list(range(8))).keys, "a")
    got = [st.hot_arena()[s].flatten()[0].item() for s in r.slots]
    want = [fill_value(k) for k in st.block_keys(list(range(8)))]
    assert got == pytest.approx(want, rel=0.01)  # int8 round trip of a constant block
    st.close()


def test_prefetches_queued_at_once_are_bounded_by_the_placement_setting(tmp_path, geometry,
                                                                        namespace):
    """`placement.prefetch_max_inflight` bounds the background prefetches queued behind the one
    the mover is working on; more are dropped and counted, and the foreground never waits."""
    import dataclasses
    import threading

    from kvagentd.config import PlacementConfig
    from kvagentd.kvcache.base import Tier
    from kvagentd.services import build_tiers

    bb = geometry.block_bytes
    cfg = dataclasses.replace(_config(tmp_path, hot_bytes=8 * bb, warm_ratio=0.5,
                                      cold_capacity_bytes=1 << 22, segment_bytes=1 << 20),
                              placement=PlacementConfig(prefetch_max_inflight=2))
    st = build_tiers(cfg, geometry, namespace, "cpu").store
    mover = st._mover
    working, release = threading.Event(), threading.Event()
    real = mover.promote_now

    def stalled(keys, tier):  # the mover thread stops on its first batch until released
        working.set()
        release.wait(10.0)
        return real(keys, tier)

    mover.promote_now = stalled
    try:
        keys = [bytes([i]) * 16 for i in range(6)]
        assert st.promote(keys[:1], Tier.HOT, background=True) == 1
        assert working.wait(10.0)  # taken off the queue: it holds none now
        queued = [st.promote(keys[i:i + 1], Tier.HOT, background=True) for i in range(1, 6)]
        assert queued == [1, 1, 0, 0, 0]  # two queued, three dropped
        assert st.counters["prefetch_queued"] == 3 and st.counters["prefetch_dropped"] == 3
    finally:
        release.set()
        st.close()


def test_pools_never_reallocate_and_stats_are_json(make_store):
    import json

    st = make_store(hot=3, warm=2)
    hot, warm = st.hot_arena(), st.warm_arena()
    ptrs = (hot.data_ptr(), warm.data_ptr())
    toks = list(range(40))
    for i in range(0, 10, 2):
        compute_blocks(st, "s", toks, i, 2)
        st.release("s")
    _check_resident(st, st.block_keys(toks)[:3], "t")
    st.release("t")
    assert st.hot_arena() is hot and st.warm_arena() is warm
    assert (hot.data_ptr(), warm.data_ptr()) == ptrs
    json.dumps(st.stats())
    json.dumps(st.status())


def test_after_a_crash_cold_blocks_keep_their_writing_session(make_store):
    st = make_store(hot=4, warm=4, persist_on_shutdown=False)
    keys = compute_blocks(st, "pump-2", list(range(8)), 0, 2)
    st.release("pump-2")
    st.demote(keys, Tier.COLD)  # written with the session, the refs table never saved
    st2 = make_store(hot=4, warm=4)  # a second process over the same directory, as after a kill
    assert st2.session_blocks() == {"pump-2": {"hot": 0, "warm": 0, "cold": 2, "other": 0}}
