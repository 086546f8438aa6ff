"""A full cold disk while the shadow serves: eviction and compaction keep running on the SSD,
and the shadow is written back only when the disk has room for it above the floor."""

from __future__ import annotations

from pathlib import Path

import torch

from kvagentd.config import Config, KVConfig, MaintenanceConfig
from kvagentd.kvcache.base import ColdListener, Tier
from kvagentd.kvcache.cold import FailoverColdStore, FaultyFileIO, ServingTier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.maintenance.health import HealthMonitor

from .conftest import GEOM, NS, block

REC = 8192  # one record of GEOM
FLOOR = 64 * REC


def _compute(st: TieredKVStore, session: str, toks: list[int], first: int, n: int) -> list[bytes]:
    slots = st.allocate_hot(n, session)
    assert slots is not None
    for j, s in enumerate(slots):
        st.hot_arena()[s].copy_(block(first + j))
    keys = st.commit(session, toks, slots, first)
    st.release(session)
    return keys


def test_full_disk_restore_waits_for_room_while_eviction_and_compaction_run(tmp_path: Path):
    fio = FaultyFileIO(seed=3)
    free = {"bytes": 1 << 30}

    def cold(listener: ColdListener) -> FailoverColdStore:
        ssd = ColdStore(tmp_path / "ssd", GEOM, NS, capacity_bytes=64 << 20,
                        segment_bytes=8 * REC, io_unit_bytes=64 << 10, o_direct=False,
                        file_io=fio, listener=listener)
        shadow = ColdStore(tmp_path / "shm", GEOM, NS, capacity_bytes=4 << 20,
                           segment_bytes=8 * REC, o_direct=False, listener=listener)
        return FailoverColdStore(ssd, shadow, GEOM, probe_dir=tmp_path / "ssd", file_io=fio,
                                 failback_good_probes=2, shadow_capacity_bytes=4 << 20,
                                 listener=listener, free_bytes=lambda: free["bytes"],
                                 free_floor_bytes=FLOOR)

    bb = GEOM.block_bytes
    st = TieredKVStore(GEOM, NS, hot_bytes=8 * bb, warm_bytes=0, cold=cold,
                       persist_on_shutdown=False)
    fo = st.cold
    assert isinstance(fo, FailoverColdStore)
    toks = list(range(4 * 64))
    old = []
    for i in range(0, 40, 4):  # forty blocks on the SSD, oldest first
        keys = _compute(st, "s", toks, i, 4)
        assert st.demote(keys, Tier.COLD) == 4
        old += keys
    assert all(fo.primary.contains(k) for k in old)
    assert st.promote(old[-2:], Tier.HOT) == 2  # resident, with SSD copies

    # the disk fills up (another tenant): the next cold write fails over, for want of space
    fio.set(enospc=True)
    free["bytes"] = 0
    new = _compute(st, "s", toks, 40, 4)
    assert st.demote(new, Tier.COLD) == 4
    assert fo.serving is ServingTier.SHADOW and fo.status()["cause"] == "no_space"
    assert all(fo.shadow.contains(k) for k in new)
    # a full disk is no failing device: the SSD copies of resident blocks are still relied on
    assert st.stats()["cold_copies_dropped"] == 0
    assert st.demote(old[-2:], Tier.COLD) == 2 and not any(fo.shadow.contains(k)
                                                           for k in old[-2:])
    fio.clear()  # writes work again, but the disk has little room

    cfg = Config(kv=KVConfig(cold_dir=tmp_path / "ssd"),
                 maintenance=MaintenanceConfig(health_status_file=tmp_path / "h.json",
                                               free_space_floor_bytes=FLOOR))
    mon = HealthMonitor(cfg, store=st, cold=fo, on_failure=fo.activate, on_probe=fo.probe,
                        space_wanted=fo.space_wanted, disk_usage=lambda _p: free["bytes"])
    free["bytes"] = FLOOR + 2 * REC  # above the floor, not enough for the shadow's 4 records
    disk_before = fo.primary.stats()["disk_bytes"]
    for _ in range(3):  # the write errors seen once, then good probes: the restore is due
        mon.check()
    st_ = fo.status()
    assert fo.serving is ServingTier.SHADOW
    assert st_["restore_deferred"] and "not enough free space" in st_["restore_deferred"]
    assert st_["restore_need_bytes"] == 4 * REC + FLOOR and st_["ssd_free_bytes"] == free["bytes"]
    assert all(fo.shadow.contains(k) for k in new)
    assert not any(fo.primary.contains(k) for k in new)
    # the monitor made room on the SSD meanwhile: the oldest blocks went and compaction
    # (allowed on a healthy device that was only full) reclaimed their segments
    assert fo.space_wanted() == 2 * REC
    report = mon.last
    assert report is not None and report.evicted_blocks >= 2
    assert not fo.primary.contains(old[0]) and fo.primary.contains(old[-1])
    assert fo.primary.stats()["disk_bytes"] < disk_before
    assert "restore deferred" in " ".join(report.warnings) or "waits for" in " ".join(
        report.warnings)

    free["bytes"] = 1 << 30  # room now: the next good probe writes the shadow back
    mon.check()
    assert fo.serving is ServingTier.SSD
    assert fo.status()["cause"] is None and fo.status()["restore_deferred"] is None
    assert fo.shadow.keys() == [] and all(fo.primary.contains(k) for k in new)
    r = st.ensure_resident(new, "t")
    assert r.missing_from is None
    for j, s in enumerate(r.slots):
        assert torch.equal(st.hot_arena()[s], block(40 + j))
    st.release("t")
    st.check_integrity()
    st.close()
