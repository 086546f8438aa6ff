"""The store over a failing-over cold tier: no block committed to warm, the shadow or a healthy
SSD is lost when the SSD fails."""

from __future__ import annotations

import torch

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.kvcache.cold.failover import ServingTier

from .conftest import GEOM, NS, block

BT = GEOM.block_tokens


def _compute(st, session, tokens, first, n):
    """Stand-in for the engine: block j of `tokens` holds `block(first + j)`."""
    slots = st.allocate_hot(n, session)
    assert slots is not None
    for j, s in enumerate(slots):
        st.hot_arena()[s].copy_(block(first + j))
    return st.commit(session, tokens, slots, first)


def _tier(st, k):
    return {b.key: b.tier for b in st.snapshot()}[k]


def test_warm_blocks_with_ssd_copies_survive_an_ssd_failure(tiers):
    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=8 * bb, warm_bytes=8 * bb,
                       cold=lambda listener: tiers(listener=listener)[0],
                       persist_on_shutdown=False)
    fo, fio = st.cold, st.cold.file_io
    assert fo.listener is st.cold_link
    toks = list(range(6 * BT))
    keys = _compute(st, "s", toks, 0, 4)
    st.release("s")
    # every block gets an SSD copy, then comes back up to warm: warm slot + SSD copy
    assert st.demote(keys, Tier.COLD) == 4
    assert all(fo.primary.contains(k) for k in keys)
    assert st.promote(keys, Tier.WARM) == 4
    assert all(_tier(st, k) is Tier.WARM for k in keys)
    st.check_integrity()

    # the SSD dies: the next cold write fails over to the shadow
    fio.set(erofs=True, read_eio_rate=1.0)
    more = _compute(st, "s", toks, 4, 1)
    st.release("s")
    assert st.demote(more, Tier.COLD) == 1
    assert fo.serving is ServingTier.SHADOW and fo.shadow.contains(more[0])
    assert st.stats()["cold_copies_dropped"] == 4
    # what operators see (`kvctl blocks`, status): the one block cold now, on the shadow, and
    # the tier's records on both sides (the dead SSD still lists the warm blocks' old copies)
    cold = st.stats()["tiers"]["cold"]
    assert cold["blocks"] == 1 and cold["records"] == 5
    assert cold["primary"]["blocks"] == 4 and cold["shadow"]["blocks"] == 1
    assert cold["bytes_used"] == fo.primary.bytes_used + fo.shadow.bytes_used
    assert fo.shadow.bytes_used > 0
    st.check_integrity()

    # demoting the warm blocks now writes them to the shadow instead of trusting the SSD
    assert st.demote(keys, Tier.COLD) == 4
    assert all(fo.shadow.contains(k) for k in keys)
    st.check_integrity()
    r = st.ensure_resident(keys + more, "t")
    assert r.missing_from is None, r
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(j)), f"block {j} differs"
    st.release("t")
    assert st.stats()["lost"] == 0
    st.check_integrity()

    # fail back: everything moves to the SSD and still reads back
    fio.clear()
    assert fo.restore()["restored"] >= 5
    assert st.demote(keys + more, Tier.COLD) == 5
    r = st.ensure_resident(keys + more, "t")
    assert r.missing_from is None
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(j))
    st.release("t")
    st.check_integrity()
    st.close()


def test_dropped_blocks_also_drop_their_stale_ssd_records(tiers):
    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=4 * bb, warm_bytes=4 * bb,
                       cold=lambda listener: tiers(listener=listener)[0],
                       persist_on_shutdown=False)
    fo = st.cold
    toks = list(range(2 * BT))
    keys = _compute(st, "s", toks, 0, 2)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 2 and st.promote(keys, Tier.WARM) == 2
    assert fo.activate("health monitor: device failed")
    st.drop_session("s", keys)
    assert st.stats()["blocks"] == 0
    assert not any(fo.primary.contains(k) for k in keys)
    st.check_integrity()
    st.close()


def test_a_failing_ssd_index_fails_over_and_loses_nothing(tiers):
    from tests.kvcache.test_coldstore_index_faults import FailingIndex

    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=4 * bb, warm_bytes=4 * bb,
                       cold=lambda listener: tiers(listener=listener)[0],
                       persist_on_shutdown=False)
    fo = st.cold
    toks = list(range(3 * BT))
    keys = _compute(st, "s", toks, 0, 3)
    st.release("s")
    assert st.demote(keys[:1], Tier.COLD) == 1 and fo.primary.contains(keys[0])
    # the SSD fills up: its index refuses every write from now on
    fo.primary.index.db = idx = FailingIndex(fo.primary.index.db, fail_on=("COMMIT", "INSERT", "UPDATE"))
    idx.armed = True
    assert st.demote(keys[1:], Tier.COLD) == 2  # retried on the shadow
    assert fo.serving is ServingTier.SHADOW
    assert all(fo.shadow.contains(k) for k in keys[1:])
    assert not idx.in_transaction
    r = st.ensure_resident(keys, "t")  # the SSD record still reads; its touch is dropped
    assert r.missing_from is None
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(j))
    st.release("t")
    st.check_integrity()
    assert fo.ttl_s == fo.primary.ttl_s
    st.close()  # logs and continues


def test_a_failover_during_a_demotion_keeps_the_block_resident(tiers):
    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=4 * bb, warm_bytes=4 * bb,
                       cold=lambda listener: tiers(listener=listener)[0],
                       persist_on_shutdown=False)
    fo, fio = st.cold, st.cold.file_io
    toks = list(range(2 * BT))
    keys = _compute(st, "s", toks, 0, 2)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 2 and st.promote(keys, Tier.WARM) == 2
    copy = st._mig.copy

    def copy_then_fail(moves):  # the SSD fails while the demotion is in flight
        ok = copy(moves)
        fio.set(read_eio_rate=1.0, erofs=True)
        fo.activate("health monitor: device failed")
        return ok

    st._mig.copy = copy_then_fail
    assert st.demote(keys, Tier.COLD) == 0  # it relied on the SSD copies: reverted
    st._mig.copy = copy
    assert all(_tier(st, k) is Tier.WARM for k in keys)
    st.check_integrity()
    assert st.demote(keys, Tier.COLD) == 2 and all(fo.shadow.contains(k) for k in keys)
    r = st.ensure_resident(keys, "t")
    assert r.missing_from is None
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(j))
    st.release("t")
    st.check_integrity()
    st.close()
