"""A cold disk below its free space floor recovers while the daemon runs: the cold copies of
blocks resident in hot or warm go first (nothing is lost), then cold-only blocks; write-behind
writes no copies while the disk is short, and catches up once the space returns."""

from __future__ import annotations

from pathlib import Path

import torch

from kvagentd.config import Config, KVConfig, MaintenanceConfig
from kvagentd.kvcache.base import ColdListener, Tier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.kvcache.store.writebehind import WriteBehindPolicy
from kvagentd.maintenance.health import HealthMonitor

from .conftest import GEOM, NS, block

FLOOR = 1 << 20


def _compute(st: TieredKVStore, session: str, toks: list[int], first: int, n: int,
             content: int = 0) -> list[bytes]:
    slots = st.allocate_hot(n, session)
    assert slots is not None
    for j, s in enumerate(slots):
        st.hot_arena()[s].copy_(block(content + first + j))
    keys = st.commit(session, toks, slots, first)
    st.release(session)
    return keys


def test_copies_of_resident_blocks_go_first_and_write_behind_waits(tmp_path: Path) -> None:
    def cold(listener: ColdListener) -> ColdStore:
        return ColdStore(tmp_path / "ssd", GEOM, NS, capacity_bytes=64 << 20,
                         segment_bytes=1 << 20, o_direct=False, listener=listener)

    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=16 * bb, warm_bytes=0, cold=cold,
                       persist_on_shutdown=False,
                       write_behind=WriteBehindPolicy(interval_s=3600.0, rate_bytes_per_s=0))
    wb = st.write_behind
    assert wb is not None and st.cold is not None
    toks = list(range(4 * 64))
    only_cold = _compute(st, "a", toks, 0, 4)
    assert st.demote(only_cold, Tier.COLD) == 4  # these live only on the disk
    resident = _compute(st, "b", toks[::-1], 0, 6, content=100)
    assert wb.run_round().written == 6  # copies written ahead of a power cut
    assert all(st.cold.contains(k) for k in resident + only_cold)

    free = {"bytes": FLOOR - 3 * bb}
    cfg = Config(kv=KVConfig(cold_dir=tmp_path / "ssd"),
                 maintenance=MaintenanceConfig(health_status_file=tmp_path / "h.json",
                                               free_space_floor_bytes=FLOOR))
    mon = HealthMonitor(cfg, store=st, cold=st.cold, disk_usage=lambda _p: free["bytes"])
    report = mon.check()
    # three copies were enough: no cold-only block went, no block was lost
    assert report.evicted_blocks == 3
    assert sum(not st.cold.contains(k) for k in resident) == 3
    assert all(st.cold.contains(k) for k in only_cold)
    assert st.stats()["states"].get("hot", 0) == 6
    assert wb.status()["paused"] and "below floor" in wb.status()["paused"]
    assert wb.run_round().written == 0  # the copies wait while the disk is short
    # a deficit the copies cannot cover reaches the cold-only blocks, oldest first
    free["bytes"] = FLOOR - 8 * bb
    mon.check()
    assert not any(st.cold.contains(k) for k in resident)
    assert sum(not st.cold.contains(k) for k in only_cold) >= 1
    r = st.ensure_resident(resident, "t")  # every resident block is still served
    assert r.missing_from is None
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(100 + j))
    st.release("t")

    free["bytes"] = 1 << 30  # space returns: write-behind resumes and catches up
    mon.check()
    assert wb.status()["paused"] is None
    assert wb.run_round().written == 6
    assert all(st.cold.contains(k) for k in resident)
    st.check_integrity()
    st.close()
