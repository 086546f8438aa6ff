"""Write-behind: committed hot and warm blocks reach the cold tier in rounds, with their
session references, so a store opened after a crash finds them; never a wrong block, and
the idle LRU order is left as it was."""

from __future__ import annotations

import random
import threading

import torch

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.store.writebehind import WriteBehindPolicy

from .conftest import compute_blocks, fill_value

POLICY = WriteBehindPolicy(interval_s=3600.0, rate_bytes_per_s=1 << 30, batch_blocks=3)


def test_a_round_writes_committed_blocks_and_references_a_crash_keeps(make_store, make_cold):
    st = make_store(hot=8, warm=8, write_behind=POLICY, persist_on_shutdown=False)
    a, b = list(range(4 * 6)), list(range(4 * 4)) + [900 + i for i in range(8)]
    ka = compute_blocks(st, "a", a, 0, 6)
    st.release("a")
    kb = compute_blocks(st, "b", b, 4, 2)  # b shares a's first four blocks
    st.release("b")
    st.demote(ka[:3], Tier.WARM)
    wb = st.write_behind
    assert wb is not None
    res = wb.run_round()
    assert res.written == 8 and res.left == 0 and res.moved == 0
    assert all(st.cold.contains(k) for k in ka + kb)
    assert {b.key: b.tier for b in st.snapshot()}[ka[0]] is Tier.WARM  # still resident
    assert wb.run_round().written == 0  # nothing new
    assert st.demote(ka[3:], Tier.COLD) == 3 and st.cold.stats()["writes"] == 8  # no rewrite

    # a crash: nothing is closed; a new store over the same directory finds everything
    again = make_store(hot=8, warm=8, persist_on_shutdown=False)
    assert again.match_prefix(a).keys == ka
    assert again.match_prefix(b + [1, 2, 3, 4]).keys == ka[:4] + kb
    refs = again.session_blocks()
    assert refs["a"]["cold"] == 6 and refs["b"]["cold"] == 2  # b referenced only its own
    r = again.ensure_resident(ka, "a")
    assert r.missing_from is None
    assert [again.hot_arena()[s].flatten()[0].item() for s in r.slots] == \
        [fill_value(k) for k in ka]
    again.release("a")
    again.check_integrity()


def test_rounds_leave_the_idle_lru_order_alone(make_store):
    st = make_store(hot=8, warm=8, write_behind=POLICY)
    toks = list(range(4 * 6))
    for i in range(6):
        compute_blocks(st, f"s{i}", toks, i, 1)
        st.release(f"s{i}")
    st.record_access(st.block_keys(toks)[:2], "s0")  # the first two become most recent
    before = list(st._t.idle[Tier.HOT])
    assert st.write_behind.run_round().written == 6
    assert list(st._t.idle[Tier.HOT]) == before
    st.check_integrity()


def test_read_only_cold_tier_is_not_written(make_store):
    st = make_store(hot=8, warm=8, write_behind=POLICY)
    compute_blocks(st, "s", list(range(8)), 0, 2)
    st.release("s")
    st.cold.set_read_only(True)
    res = st.write_behind.run_round()
    assert res.written == 0 and res.left == 2 and st.cold.stats()["writes"] == 0


def test_blocks_moving_during_rounds_are_never_written_wrong(make_store, make_cold, geometry):
    st = make_store(hot=6, warm=6, write_behind=POLICY)
    toks = list(range(4 * 40))
    keys = []
    for i in range(0, 12, 3):
        keys += compute_blocks(st, f"s{i}", toks, i, 3)
        st.release(f"s{i}")
    stop = threading.Event()
    rng = random.Random(5)

    def churn() -> None:
        while not stop.is_set():
            k = rng.sample(keys, 3)
            st.demote(k, Tier.WARM)
            st.promote(k, Tier.HOT)
            occ = st.occupancy(Tier.HOT)
            free = [i for i, used in enumerate(occ) if not used]
            used = [i for i, u in enumerate(occ) if u]
            if free and used:
                st.relocate(Tier.HOT, [(rng.choice(used), free[0])])

    t = threading.Thread(target=churn)
    t.start()
    try:
        for _ in range(20):
            st.write_behind.run_round()
    finally:
        stop.set()
        t.join()
    stored = [k for k in keys if st.cold.contains(k)]
    assert stored
    outs = [torch.empty(geometry.block_shape) for _ in stored]
    assert all(st.cold.read_into(stored, outs))
    assert [o.flatten()[0].item() for o in outs] == [fill_value(k) for k in stored]
    assert all(bool((o == o.flatten()[0]).all()) for o in outs)  # whole blocks, none torn
    st.check_integrity()


def test_nothing_is_written_while_the_ram_shadow_serves(tmp_path, geometry, namespace):
    from kvagentd.kvcache.cold import ColdTierSpec, build_cold_tier
    from kvagentd.kvcache.store import TieredKVStore

    spec = ColdTierSpec(cold_dir=tmp_path / "ssd", shadow_dir=tmp_path / "shm",
                        capacity_bytes=8 << 20, segment_bytes=1 << 20, o_direct=False,
                        shadow_bytes=2 << 20)
    bb = geometry.block_bytes
    st = TieredKVStore(geometry, namespace, hot_bytes=8 * bb, warm_bytes=8 * bb,
                       cold=lambda listener: build_cold_tier(spec, geometry, namespace, listener),
                       write_behind=POLICY)
    compute_blocks(st, "s", list(range(8)), 0, 2)
    st.release("s")
    st.cold.activate("drill")
    res = st.write_behind.run_round()
    assert res.written == 0 and res.left == 2 and st.cold.shadow.keys() == []
    st.cold.restore()
    assert st.write_behind.run_round().written == 2
    assert len(st.cold.primary.keys()) == 2
    st.close()
