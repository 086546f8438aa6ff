"""Pinned blocks and blocks in use survive the cold tier's capacity eviction; a cold tier that
drops one anyway is caught by `check_integrity()`."""

from __future__ import annotations

import pytest
import structlog

from kvagentd.kvcache.base import BlockKey, Tier
from kvagentd.kvcache.placement.base import CODE_OF
from kvagentd.kvcache.store.state import BlockState, IntegrityError

from .conftest import compute_blocks, fill_value

REC = 8192  # one record of the test geometry: a 4096-byte header area + the padded payload


class _Protects:
    """A listener that protects a fixed set of keys and records evictions."""

    def __init__(self, keep: set[BlockKey]) -> None:
        self.keep = keep
        self.evicted: list[BlockKey] = []

    def cold_protected(self, keys):
        return {k for k in keys if k in self.keep}

    def cold_evicted(self, keys):
        self.evicted.extend(keys)

    def cold_failed_over(self):
        raise AssertionError("a single cold store never fails over")


def test_capacity_eviction_skips_protected_records(make_cold, geometry, namespace):
    from kvagentd.kvcache.keys import block_keys
    import torch

    keys = block_keys(namespace, list(range(4 * 8)), 4)
    heard = _Protects({keys[0], keys[2]})
    cs = make_cold(capacity_bytes=4 * REC, listener=heard)
    z = torch.zeros(geometry.block_shape)
    with structlog.testing.capture_logs() as logs:
        for k in keys[:6]:
            assert cs.put(k, z)
    # the oldest records went, except the protected ones (counted; logged at debug only:
    # routine for a full tier)
    assert heard.evicted == [keys[1], keys[3]] and cs.stats()["evicted"] == 2
    assert {e["log_level"] for e in logs if e["event"] == "cold_evicted"} == {"debug"}
    assert set(cs.keys()) == {keys[0], keys[2], keys[4], keys[5]}
    # full of protected records: a refusal, not a device fault
    heard.keep = set(cs.keys())
    with structlog.testing.capture_logs() as logs:
        assert cs.put(keys[6], z) is False
    # the log says why the blocks that were to go to cold did not
    (full,) = [e for e in logs if e["event"] == "cold_full"]
    assert full["refused"] == 1 and "pinned or in use" in full["reason"]
    st = cs.stats()
    assert st["refused_full"] == 1 and st["write_failures"] == 0
    assert set(cs.keys()) == {keys[0], keys[2], keys[4], keys[5]}
    cs.close()


def test_pinned_cold_block_survives_a_filling_cold_tier(make_store):
    st = make_store(hot=4, warm=0, cold={"capacity_bytes": 4 * REC})
    toks = list(range(4 * 12))
    keys = compute_blocks(st, "s", toks, 0, 1)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 1
    st.pin(keys)  # an operator pins it while it is cold (or after a restart)
    for i in range(1, 10):  # many more blocks pass through the cold tier after it
        more = compute_blocks(st, "s", toks, i, 1)
        st.release("s")
        assert st.demote(more, Tier.COLD) == 1
    assert st.cold.bytes_used <= 4 * REC
    assert st.cold.contains(keys[0])
    assert st.match_prefix(toks[:4]).keys == keys
    st.check_integrity()
    r = st.ensure_resident(keys, "t")
    assert r.missing_from is None
    assert st.hot_arena()[r.slots[0]].flatten()[0].item() == fill_value(keys[0])
    st.release("t")
    st.check_integrity()
    st.close()


def test_store_protects_pinned_in_use_and_cold_reads(make_store):
    st = make_store(hot=4, warm=0)
    toks = list(range(4 * 3))
    keys = compute_blocks(st, "s", toks, 0, 3)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 3
    assert st.cold_link.cold_protected(keys) == set()
    st.pin(keys[:1])
    r = st.ensure_resident(keys[1:2], "req")  # held by a running request
    assert st.cold_link.cold_protected(keys) == {keys[0], keys[1]}
    st.release("req")
    st.unpin(keys[:1])
    assert st.cold_link.cold_protected(keys) == set()
    assert r.missing_from is None
    st.close()


def test_integrity_catches_a_pinned_block_evicted_anyway(make_store):
    st = make_store(hot=4, warm=0)
    toks = list(range(4 * 2))
    keys = compute_blocks(st, "s", toks, 0, 2)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 2
    st.pin(keys[:1])
    # a cold tier that ignores the protection drops both records
    st.cold.delete(keys)
    st.cold_link.cold_evicted(list(keys))
    states = {b.key: b.tier for b in st.snapshot()}
    assert keys[0] in states and states[keys[0]] is None  # LOST: kept, to be recomputed
    assert keys[1] not in states  # unpinned: forgotten as before
    assert st.stats()["states"].get(BlockState.LOST.value) == 1
    with pytest.raises(IntegrityError, match="pinned or in-use"):
        st.check_integrity()
    st.close()


def test_a_refused_cold_write_is_one_warning_with_its_reason(make_store):
    """Blocks a full cold tier refuses stay where they were, and the log says so once per
    batch, with how many and why (not one line per block)."""
    st = make_store(hot=8, warm=0, cold={"capacity_bytes": 2 * REC})
    toks = list(range(4 * 8))
    kept = compute_blocks(st, "s", toks, 0, 2)
    st.release("s")
    assert st.demote(kept, Tier.COLD) == 2
    st.pin(kept)  # cold is now full of records that must stay
    more = compute_blocks(st, "t", toks[:4] + list(range(100, 128)), 1, 3)
    st.release("t")
    with structlog.testing.capture_logs() as logs:
        assert st.demote(more, Tier.COLD) == 0
    (line,) = [e for e in logs if e["event"] == "migration_failed"]
    assert line["blocks"] == 3 and line["src"] == "hot" and line["dst"] == "cold"
    assert line["keys"] == [k.hex() for k in more]
    assert "pinned or in-use" in line["reason"]
    where = st.block_states(more)
    assert where.known.all() and (where.tier == CODE_OF[Tier.HOT]).all()
    st.check_integrity()
