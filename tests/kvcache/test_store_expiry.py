"""Cold TTL expiry without capacity pressure: `TieredKVStore.expire_cold`."""

from __future__ import annotations

import time

import torch

from kvagentd.kvcache.base import Tier

from .conftest import compute_blocks


def test_expire_cold_forgets_only_idle_unpinned_cold_blocks(make_store, make_cold):
    st = make_store(hot=8, warm=8, cold=dict(ttl_s=10.0))
    cold = st.cold
    toks = list(range(16))
    keys = compute_blocks(st, "s", toks, 0, 4)
    st.release("s")
    a, b, c, d = keys
    assert st.demote([a, b, c, d], Tier.COLD) == 4
    assert st.promote([d], Tier.WARM) == 1       # resident, with an (expiring) cold copy
    st.pin([b])
    now = time.time()
    assert st.expire_cold(now) == 0               # nothing has run out yet
    # a cold read refreshes the TTL; an old record of a block used recently in the store stays
    cold.touch([a, b, c, d], now=now - 100)
    assert st.expire_cold(now) == 0               # the store used them a moment ago
    later = now + 60
    cold.read_into([c], [torch.empty(st.geometry.block_shape)])
    cold.touch([c], now=later - 1)                # read just before `later`
    assert st.expire_cold(later) == 1             # a: cold, idle, unpinned, expired
    assert not cold.contains(a) and cold.contains(b) and cold.contains(c) and cold.contains(d)
    where = {i.key: i.tier for i in st.snapshot()}
    assert a not in where and where[b] is Tier.COLD and where[c] is Tier.COLD
    assert where[d] is Tier.WARM
    assert st.match_prefix(toks).num_tokens == 0  # the first block is gone
    assert st.stats()["expired"] == 1
    st.check_integrity()
    st.unpin([b])
    assert st.expire_cold(later) == 1             # b now goes too; c was read, d is warm
    st.check_integrity()
    st.close()


def test_expire_cold_drops_orphan_records(make_store, make_cold, geometry):
    st = make_store(cold=dict(ttl_s=10.0))
    cold = st.cold
    orphan = b"\x01" * 16
    assert cold.put(orphan, torch.zeros(geometry.block_shape))
    assert st.expire_cold(time.time() + 60) == 0   # no block was forgotten ...
    assert not cold.contains(orphan)               # ... but the stray record went
    st.check_integrity()
    st.close()


def test_expire_cold_without_a_cold_tier_is_a_no_op(make_store):
    st = make_store(cold=False)
    assert st.expire_cold() == 0
