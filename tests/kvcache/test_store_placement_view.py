"""The store's view for placement: a few blocks' metadata, idle victims in LRU order, samples."""

from __future__ import annotations

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement.base import CODE_OF, NONE

from .conftest import compute_blocks


def test_block_states_of_a_few_keys(make_store):
    st = make_store(hot=4, warm=4)
    a = compute_blocks(st, "a", list(range(12)), 0, 3)
    st.release("a")
    st.pin(a[:1])
    st.demote(a[1:2], Tier.WARM)
    st.demote(a[2:], Tier.COLD)
    compute_blocks(st, "b", list(range(100, 104)), 0, 1)  # held: in use
    busy = st.block_keys(list(range(100, 104)))[0]
    got = st.block_states([a[0], b"\x00" * 16, a[1], a[2], busy])
    assert got.tier.tolist() == [CODE_OF[Tier.HOT], NONE, CODE_OF[Tier.WARM],
                                 CODE_OF[Tier.COLD], CODE_OF[Tier.HOT]]
    assert got.idle.tolist() == [False, False, True, True, False]  # pinned, unknown, in use
    assert got.known.tolist() == [True, False, True, True, True]
    snap = {b.key: b.last_access for b in st.snapshot()}
    assert got.last_access.tolist() == [snap[a[0]], 0.0, snap[a[1]], snap[a[2]], snap[busy]]
    st.close()


def test_least_recent_idle_is_the_stores_own_victim_order(make_store):
    st = make_store(hot=6, warm=4)
    keys = compute_blocks(st, "a", list(range(20)), 0, 5)
    st.release("a")
    st.record_access([keys[0]], "a")  # now the most recent
    st.pin([keys[1]])
    assert st.least_recent_idle(Tier.HOT, 10) == keys[2:] + keys[:1]
    assert st.least_recent_idle(Tier.HOT, 2) == keys[2:4]
    assert st.least_recent_idle(Tier.WARM, 10) == []
    compute_blocks(st, "b", list(range(100, 108)), 0, 2)  # in use: never a candidate
    st.demote(keys[2:4], Tier.WARM)
    assert set(st.least_recent_idle(Tier.HOT, 10)) == {keys[4], keys[0]}
    assert st.least_recent_idle(Tier.WARM, 10) == keys[2:4]
    st.close()


def test_sample_idle_draws_distinct_idle_blocks_of_the_tier(make_store):
    st = make_store(hot=8, warm=4)
    idle = compute_blocks(st, "a", list(range(16)), 0, 4)
    st.release("a")
    busy = compute_blocks(st, "b", list(range(100, 108)), 0, 2)  # held until released
    for _ in range(20):
        got = st.sample_idle(Tier.HOT, 8)  # every slot: finds exactly the idle blocks
        assert sorted(got) == sorted(idle) and not set(got) & set(busy)
        few = st.sample_idle(Tier.HOT, 3)
        assert len(few) == len(set(few)) <= 3 and set(few) <= set(idle)
    assert st.sample_idle(Tier.WARM, 4) == [] and st.sample_idle(Tier.HOT, 0) == []
    st.close()
