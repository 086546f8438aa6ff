"""The SSD's write budget: write-behind and demotions take from one token bucket; what does not
fit stays in RAM (write-behind) or leaves it without a cold copy (a demotion becomes a drop),
and a dropped block is recomputed, never served wrong."""

from __future__ import annotations

from pathlib import Path

import torch

from kvagentd.kvcache.base import ColdListener, KVGeometry, Tier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.kvcache.store.budget import DAY_S, WriteBudget
from kvagentd.kvcache.store.writebehind import WriteBehindPolicy

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float32)
NS = make_namespace("budget-test", torch.float32, 4)
BB = GEOM.block_bytes


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_bucket_refills_at_the_daily_rate_up_to_its_burst() -> None:
    clock = Clock()
    b = WriteBudget(int(DAY_S) * 100, burst_s=10.0, clock=clock)  # 100 B/s, 1000 B burst
    assert b.take(600) and not b.take(600) and b.take(400)
    assert b.refused == 600 and b.taken == 1000
    clock.t += 3.0
    assert not b.take(301) and b.take(300)
    clock.t += 3600.0  # a quiet hour refills the burst only
    assert b.available() == 1000
    unlimited = WriteBudget(0)
    assert unlimited.take(10**12) and unlimited.available() == float("inf")


def _store(tmp_path: Path, budget: WriteBudget) -> TieredKVStore:
    def cold(listener: ColdListener) -> ColdStore:
        return ColdStore(tmp_path / "cold", GEOM, NS, capacity_bytes=64 << 20,
                         segment_bytes=1 << 20, o_direct=False, listener=listener)

    return TieredKVStore(GEOM, NS, hot_bytes=8 * BB, warm_bytes=0, cold=cold,
                         persist_on_shutdown=False, write_budget=budget,
                         write_behind=WriteBehindPolicy(interval_s=3600.0, rate_bytes_per_s=0,
                                                        batch_blocks=2))


def _commit(st: TieredKVStore, session: str, toks: list[int], n: int) -> list[bytes]:
    slots = st.allocate_hot(n, session)
    assert slots is not None
    for j, s in enumerate(slots):
        st.hot_arena()[s].fill_(float(j + 1))
    keys = st.commit(session, toks, slots, 0)
    st.release(session)
    return keys


def test_write_behind_writes_what_the_budget_allows_and_the_rest_waits(tmp_path: Path) -> None:
    clock = Clock()
    budget = WriteBudget(int(DAY_S) * BB, burst_s=4.0, clock=clock)  # 1 block/s, 4 burst
    st = _store(tmp_path, budget)
    wb = st.write_behind
    assert wb is not None and st.cold is not None
    keys = _commit(st, "a", list(range(4 * 6)), 6)
    assert wb.run_round().written == 4  # the burst: two batches of two
    assert wb.status()["rounds_over_budget"] == 1
    assert sum(st.cold.contains(k) for k in keys) == 4
    clock.t += 2.0
    assert wb.run_round().written == 2  # the rest, once the budget refilled
    assert all(st.cold.contains(k) for k in keys)
    assert st.stats()["write_budget"]["written_bytes"] == 6 * BB
    st.close()


def test_a_demotion_past_the_budget_drops_and_the_block_is_recomputed(tmp_path: Path) -> None:
    clock = Clock()
    budget = WriteBudget(int(DAY_S) * BB, burst_s=2.0, clock=clock)  # two blocks' worth
    st = _store(tmp_path, budget)
    assert st.cold is not None
    keys = _commit(st, "a", list(range(4 * 4)), 4)
    assert st.demote(keys, Tier.COLD) == 2  # as many as the budget allows
    assert [st.cold.contains(k) for k in keys] == [True, True, False, False]
    assert budget.refused == 2 * BB
    # the hot pool is needed: the blocks without a cold copy are dropped, not written
    more = st.allocate_hot(8, "b")
    assert more is not None and len(more) == 8
    st.release("b")
    st.check_integrity()
    m = st.match_prefix(list(range(4 * 4)))
    assert list(m.keys) == keys[:2]  # the two on the SSD; the dropped two are recomputed
    st.close()


def test_take_blocks_grants_whole_blocks_that_fit() -> None:
    clock = Clock()
    b = WriteBudget(int(DAY_S) * 100, burst_s=10.0, clock=clock)  # 1000 B
    assert b.take_blocks(5, 300) == 3 and b.refused == 600 and b.available() == 100
