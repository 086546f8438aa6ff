"""Victim choice: per-pool LRU of idle blocks, examined only as far as the victims needed."""

from __future__ import annotations

from collections import OrderedDict

from kvagentd.kvcache.base import Tier

from .conftest import compute_blocks


class CountingLRU(OrderedDict):
    """An idle LRU that counts how many entries were looked at."""

    examined = 0

    def __iter__(self):
        for k in super().__iter__():
            self.examined += 1
            yield k


def _tiers(st, keys):
    where = {b.key: b.tier for b in st.snapshot()}
    return [where[k] for k in keys]


def test_make_room_demotes_least_recently_used_idle_blocks(make_store):
    st = make_store(hot=6, warm=8)
    keys = compute_blocks(st, "s", list(range(24)), 0, 6)
    st.release("s")
    st.check_integrity()
    st.record_access(keys[:2], "s")   # 0 and 1 become the most recent
    st.pin(keys[2:3])                 # 2 may not move
    st.check_integrity()
    assert st.allocate_hot(3, "t") is not None
    H, W = Tier.HOT, Tier.WARM
    assert _tiers(st, keys) == [H, H, H, W, W, W]
    st.check_integrity()
    st.unpin(keys[2:3])               # unpinned: now the most recent idle hot block
    r = st.ensure_resident(keys[3:4], "u")  # 0 is the LRU hot block: it makes room
    assert r.missing_from is None
    assert _tiers(st, keys) == [W, H, H, H, W, W]
    st.check_integrity()
    st.release("u")
    st.release("t")
    st.check_integrity()


def test_choosing_victims_examines_only_the_victims(make_store):
    n = 64
    st = make_store(hot=n, warm=n)
    keys = compute_blocks(st, "s", list(range(4 * n)), 0, n)
    st.release("s")
    lru = st._t.idle[Tier.HOT] = CountingLRU(st._t.idle[Tier.HOT])
    st.check_integrity()
    lru.examined = 0
    assert st.allocate_hot(2, "t") is not None
    assert lru.examined <= 2
    assert _tiers(st, keys[:2]) == [Tier.WARM, Tier.WARM]  # the two oldest went
    st.release("t")
    st.check_integrity()


def test_integrity_check_catches_a_stale_idle_entry(make_store):
    import pytest

    from kvagentd.kvcache.store.state import IntegrityError

    st = make_store(hot=4, warm=4)
    keys = compute_blocks(st, "s", list(range(8)), 0, 2)
    with pytest.raises(IntegrityError):  # in use, yet listed idle
        st._t.idle[Tier.HOT][keys[0]] = None
        st.check_integrity()
    del st._t.idle[Tier.HOT][keys[0]]
    st.release("s")
    st.check_integrity()
