"""Tier pressure with nowhere to demote (a worn, read-only SSD and a full warm tier): room a
request needs is made by dropping the least recently used idle blocks for recompute, never a
pinned block or one in use, and blocks with a cold copy stay in the cold tier."""

from __future__ import annotations

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.store.room import Drop, Leg, PoolState, plan_drop

from .conftest import compute_blocks, fill_value


def _pools(hot_free, hot_idle, warm_free, warm_idle):
    def idle(keys):
        return lambda n, ex: [k for k in keys if k not in ex][:n]
    return {Tier.HOT: PoolState(hot_free, idle(hot_idle)),
            Tier.WARM: PoolState(warm_free, idle(warm_idle))}


def test_plan_drop_demotes_hot_victims_into_room_dropped_in_warm():
    h, w = [b"h%d" % i for i in range(4)], [b"w%d" % i for i in range(2)]
    assert plan_drop(Tier.HOT, 1, _pools(1, h, 0, w)) == []
    assert plan_drop(Tier.HOT, 3, _pools(0, h, 0, w)) == [
        Drop(Tier.WARM, (w[0], w[1])), Leg(Tier.HOT, Tier.WARM, (h[0], h[1])),
        Drop(Tier.HOT, (h[2],))]
    assert plan_drop(Tier.HOT, 2, _pools(0, h, 1, w)) == [
        Drop(Tier.WARM, (w[0],)), Leg(Tier.HOT, Tier.WARM, (h[0], h[1]))]
    assert plan_drop(Tier.WARM, 1, _pools(0, h, 0, w)) == [Drop(Tier.WARM, (w[0],))]
    assert plan_drop(Tier.HOT, 1, _pools(0, [], 0, w)) is None  # nothing idle in hot
    assert plan_drop(Tier.HOT, 2, _pools(0, h, 0, w), exclude={h[0]}) == [
        Drop(Tier.WARM, (w[0], w[1])), Leg(Tier.HOT, Tier.WARM, (h[1], h[2]))]
    # blocks with a cold copy go to the cold tier first, at no cost
    pools = _pools(0, h, 0, w)
    pools[Tier.HOT] = pools[Tier.HOT]._replace(copied=lambda n, ex: [h[1]][:n])
    assert plan_drop(Tier.HOT, 2, pools) == [
        Drop(Tier.HOT, (h[1],)), Drop(Tier.WARM, (w[0],)), Leg(Tier.HOT, Tier.WARM, (h[0],))]


def test_read_only_cold_and_full_warm_drop_idle_blocks_for_room(make_store):
    st = make_store(hot=4, warm=2)
    toks = list(range(4 * 16))
    kept = compute_blocks(st, "old", toks, 0, 1)  # it will have a cold copy
    st.release("old")
    assert st.demote(kept, Tier.COLD) == 1 and st.promote(kept, Tier.HOT) == 1
    pinned = compute_blocks(st, "old", toks, 1, 1)
    st.pin(pinned)
    st.release("old")
    rest = compute_blocks(st, "old", toks, 2, 2)
    st.release("old")
    st.demote(rest, Tier.WARM)
    compute_blocks(st, "old", toks, 4, 2)  # hot: kept, pinned and these two; warm: rest
    st.release("old")
    st.cold.set_read_only(True)  # the SSD reached its wear limit
    assert st.stats()["tiers"]["hot"]["free"] == 0 and st.stats()["tiers"]["warm"]["free"] == 0

    slots = st.allocate_hot(3, "new")
    assert slots is not None and len(slots) == 3
    states = {b.key: b.tier for b in st.snapshot()}
    assert states[pinned[0]] is Tier.HOT  # never dropped
    assert states[kept[0]] is Tier.COLD  # its cold copy serves it
    assert st.stats()["dropped"] >= 2
    assert not st.cold.stats()["writes"] > 1  # nothing new was written to the worn SSD
    st.check_integrity()
    st.release("new")
    # a dropped block is recomputed, never served wrong: the prefix match stops before it
    m = st.match_prefix(toks)
    assert all(states.get(k) is not None for k in m.keys)
    r = st.ensure_resident(m.keys, "check")
    assert r.missing_from is None
    assert [st.hot_arena()[s].flatten()[0].item() for s in r.slots] == \
        [fill_value(k) for k in m.keys]
    st.release("check")
    st.check_integrity()


def test_cold_blocks_of_a_request_are_loaded_though_nothing_takes_idle_blocks(make_store):
    st = make_store(hot=3, warm=1)
    toks = list(range(4 * 16))
    wanted = compute_blocks(st, "a", toks, 0, 2)
    st.release("a")
    assert st.demote(wanted, Tier.COLD) == 2
    compute_blocks(st, "b", toks, 8, 3)  # hot full of idle blocks
    st.release("b")
    compute_blocks(st, "b", toks, 11, 1)
    st.release("b")  # and warm full too
    st.cold.set_read_only(True)
    r = st.ensure_resident(wanted, "a")
    assert r.missing_from is None and r.loaded["cold"] == 2
    assert [st.hot_arena()[s].flatten()[0].item() for s in r.slots] == \
        [fill_value(k) for k in wanted]
    st.release("a")
    assert st.stats()["dropped"] >= 1
    st.check_integrity()
