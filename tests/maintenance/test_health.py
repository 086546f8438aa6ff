"""SSD health: parsing both tools' JSON, classification, status file, monitor actions."""

from __future__ import annotations

import json

import pytest

from kvagentd.config import Config, KVConfig, MaintenanceConfig
from kvagentd.kvcache.base import BlockInfo, Tier
from kvagentd.maintenance import health
from kvagentd.maintenance.health import HealthState

NVME_CLI_1 = {  # nvme-cli 1.x
    "critical_warning": 0, "temperature": 310, "avail_spare": 100, "spare_thresh": 10,
    "percent_used": 3, "data_units_read": 1234567, "data_units_written": 7654321,
    "host_read_commands": 1, "host_write_commands": 2, "controller_busy_time": 5,
    "power_cycles": 40, "power_on_hours": 4000, "unsafe_shutdowns": 7, "media_errors": 0,
    "num_err_log_entries": 12, "warning_temp_time": 0, "critical_comp_time": 0}
NVME_CLI_2 = {  # nvme-cli 2.x (some fields as objects)
    "critical_warning": {"value": 4, "available_spare": 0, "temp_threshold": 0,
                         "reliability_degraded": 1, "ro": 0, "vmbu_failed": 0, "pmr_ro": 0},
    "temperature": 315, "avail_spare": 100, "spare_thresh": 10, "percent_used": 12,
    "media_errors": 3}
SMARTCTL_NVME = {
    "json_format_version": [1, 0], "smartctl": {"version": [7, 3], "exit_status": 0},
    "device": {"name": "/dev/nvme0", "type": "nvme"}, "smart_status": {"passed": True},
    "nvme_smart_health_information_log": {
        "critical_warning": 0, "temperature": 38, "available_spare": 100,
        "available_spare_threshold": 10, "percentage_used": 85, "data_units_read": 1,
        "media_errors": 0, "num_err_log_entries": 0}}
SMARTCTL_SATA = {
    "device": {"name": "/dev/sda", "type": "sat"}, "smart_status": {"passed": False},
    "ata_smart_attributes": {"revision": 16, "table": [
        {"id": 5, "name": "Reallocated_Sector_Ct", "value": 100, "raw": {"value": 8}},
        {"id": 231, "name": "SSD_Life_Left", "value": 40, "raw": {"value": 40}},
        {"id": 187, "name": "Reported_Uncorrect", "value": 100, "raw": {"value": 2}}]}}


def test_parse_nvme_cli_1():
    s = health.parse_nvme_smart_log(NVME_CLI_1)
    assert (s.percent_used, s.media_errors, s.critical_warning, s.available_spare,
            s.available_spare_threshold) == (3, 0, 0, 100, 10)
    assert health.classify(s, 80.0)[0] is HealthState.OK


def test_parse_nvme_cli_2_objects_and_failed():
    s = health.parse_nvme_smart_log(NVME_CLI_2)
    assert (s.percent_used, s.media_errors, s.critical_warning) == (12, 3, 4)
    state, why = health.classify(s, 80.0)
    assert state is HealthState.FAILED and "0x04" in why[0]


def test_parse_smartctl_nvme_worn():
    s = health.parse_smartctl(SMARTCTL_NVME)
    assert (s.percent_used, s.available_spare, s.passed) == (85, 100, True)
    assert health.classify(s, 80.0)[0] is HealthState.WORN
    assert health.classify(s, 90.0)[0] is HealthState.OK


def test_parse_smartctl_sata():
    s = health.parse_smartctl(SMARTCTL_SATA)
    assert s.percent_used == 60 and s.media_errors == 10 and s.passed is False
    assert health.classify(s, 80.0)[0] is HealthState.FAILED


@pytest.mark.parametrize("doc", [{}, {"foo": 1}, [], "x"])
def test_parse_rejects_other_documents(doc):
    with pytest.raises(ValueError):
        health.parse_nvme_smart_log(doc)
    with pytest.raises(ValueError):
        health.parse_smartctl(doc)


@pytest.mark.parametrize("pu,limit,state", [(79, 80, "ok"), (80, 80, "worn"), (81, 80, "worn"),
                                            (50, 40, "worn"), (0, 1, "ok")])
def test_wear_threshold(pu, limit, state):
    s = health.SmartData("nvme-cli", pu, 0, 0, 100, 10)
    assert health.classify(s, limit)[0].value == state


def test_spare_below_threshold_fails():
    s = health.SmartData("nvme-cli", 10, 0, 0, 5, 10)
    assert health.classify(s, 80)[0] is HealthState.FAILED


def test_probe_falls_back_to_smartctl_then_unknown():
    calls = []

    def run(argv):
        calls.append(argv[0])
        if argv[0] == "nvme":
            raise FileNotFoundError("nvme not installed")
        return json.dumps(SMARTCTL_NVME)

    st = health.probe_smart("/dev/nvme0n1", 80.0, run=run)
    assert calls == ["nvme", "smartctl"] and st.state is HealthState.WORN

    def none(argv):
        raise FileNotFoundError(f"{argv[0]} not installed")

    st = health.probe_smart("/dev/nvme0n1", 80.0, run=none)
    assert st.state is HealthState.UNKNOWN and "nvme" in st.error and "smartctl" in st.error


def test_status_file_round_trip_and_garbage(tmp_path):
    p = tmp_path / "h" / "ssd-health.json"
    assert health.read_status(p).state is HealthState.UNKNOWN
    s = health.parse_nvme_smart_log(NVME_CLI_1)
    health.write_status(p, health.HealthStatus(HealthState.OK, 123.0, "/dev/nvme0n1", s, ()))
    back = health.read_status(p)
    assert back.state is HealthState.OK and back.smart == s and back.written_at == 123.0
    assert not list(p.parent.glob(".health-*"))
    for junk in ("{", "[]", '{"state": "exploded"}', '{"state": "ok", "smart": 5}', "\xff"):
        p.write_text(junk, encoding="latin-1")
        r = health.read_status(p)
        assert r.state is HealthState.UNKNOWN and r.error


# ---- the daemon-side monitor -----------------------------------------------------------------

class FakeCold:
    def __init__(self):
        self.read_only = False
        self.io_errors = 0

    def set_read_only(self, flag):
        self.read_only = flag

    def stats(self):
        return {"io_errors": self.io_errors}

    def compact(self, min_dead_ratio=0.5, *, max_copy_bytes=None):
        return 0


class FakeStore:
    """Cold-only blocks (no resident block has a cold copy to give up)."""

    def __init__(self, rows):
        self.rows = rows
        self.evicted = []
        self.paused = None

    def snapshot(self):
        return list(self.rows)

    def drop_cold_copies(self, deficit):
        return 0, 0

    def pause_write_behind(self, reason):
        self.paused = reason

    def evict(self, keys):
        self.evicted += list(keys)
        return len(keys)


def cfg_for(tmp_path, **m) -> Config:
    return Config(kv=KVConfig(cold_dir=tmp_path, cold_ttl_s=100.0),
                  maintenance=MaintenanceConfig(health_status_file=tmp_path / "h.json", **m))


def write(tmp_path, pu, cw=0):
    s = health.SmartData("nvme-cli", pu, 0, cw, 100, 10)
    st, why = health.classify(s, 80.0)
    health.write_status(tmp_path / "h.json", health.HealthStatus(st, 1000.0, "/dev/x", s, tuple(why)))


def test_monitor_unknown_is_not_a_crash(tmp_path):
    mon = health.HealthMonitor(cfg_for(tmp_path), cold=FakeCold(), clock=lambda: 1000.0,
                               disk_usage=lambda p: 10**12)
    r = mon.check()
    assert r.state == "unknown" and not r.cold_read_only and r.warnings
    (tmp_path / "h.json").write_text("not json")
    assert mon.check().state == "unknown"


def test_monitor_wear_makes_cold_read_only_and_back(tmp_path):
    cold = FakeCold()
    mon = health.HealthMonitor(cfg_for(tmp_path), cold=cold, clock=lambda: 1000.0,
                               disk_usage=lambda p: 10**12)
    write(tmp_path, 79)
    assert not mon.check().cold_read_only and not cold.read_only
    write(tmp_path, 80)
    r = mon.check()
    assert r.cold_read_only and cold.read_only and any("read-only" in w for w in r.warnings)
    write(tmp_path, 10)  # a replaced disk
    assert not mon.check().cold_read_only and not cold.read_only


def test_monitor_failure_and_io_errors_request_failover(tmp_path):
    cold, reasons, probes = FakeCold(), [], []
    mon = health.HealthMonitor(cfg_for(tmp_path), cold=cold, on_failure=reasons.append,
                               on_probe=lambda: probes.append(1), clock=lambda: 1000.0,
                               disk_usage=lambda p: 10**12)
    write(tmp_path, 5)
    assert not mon.check().failover_requested and probes == [1]
    cold.io_errors = 2
    assert mon.check().failover_requested and "2 new cold I/O errors" in reasons[-1]
    assert not mon.check().failover_requested  # no new errors -> a good probe
    write(tmp_path, 5, cw=0x08)
    assert mon.check().failover_requested and "health failed" in reasons[-1]
    assert len(probes) == 2


def test_monitor_free_space_floor_evicts_expired_then_coldest(tmp_path):
    now = 1000.0
    rows = [BlockInfo(b"a", Tier.COLD, False, False, (), now - 10, 100),   # fresh
            BlockInfo(b"b", Tier.COLD, False, False, (), now - 500, 100),  # expired
            BlockInfo(b"c", Tier.COLD, False, False, (), now - 50, 100),   # older than a
            BlockInfo(b"d", Tier.COLD, True, False, (), now - 900, 100),   # pinned
            BlockInfo(b"e", Tier.WARM, False, False, (), now - 900, 100),  # not cold
            BlockInfo(b"f", Tier.COLD, False, True, (), now - 900, 100)]   # in use
    store = FakeStore(rows)
    mon = health.HealthMonitor(cfg_for(tmp_path, free_space_floor_bytes=1000), store=store,
                               cold=FakeCold(), clock=lambda: now, disk_usage=lambda p: 850)
    r = mon.check()
    assert store.evicted == [b"b", b"c"] and r.evicted_blocks == 2
    store.evicted.clear()
    mon.disk_usage = lambda p: 5000
    assert mon.check().evicted_blocks == 0 and store.evicted == []


def test_main_writes_unknown_without_tools(tmp_path, monkeypatch, capsys):
    toml = tmp_path / "k.toml"
    toml.write_text(f'[kv]\ncold_dir = "{tmp_path}"\n[maintenance]\n'
                    f'health_status_file = "{tmp_path / "s.json"}"\n')
    monkeypatch.setattr(health, "_run_tool", lambda argv: (_ for _ in ()).throw(
        FileNotFoundError(f"{argv[0]} not installed")))
    assert health.main(["--config", str(toml), "--write", "--device", "/dev/nvme9n9"]) == 0
    assert health.read_status(tmp_path / "s.json").state in (HealthState.UNKNOWN,)


def test_free_space_floor_on_a_real_cold_store_reclaims_disk(tmp_path):
    """Evicted records are compacted away, so the floor check actually frees disk."""
    import torch

    from kvagentd.kvcache.cold.store import ColdStore

    from .conftest import GEOM, NS, block, key

    cold = ColdStore(tmp_path / "cold", GEOM, NS, capacity_bytes=64 << 20, segment_bytes=64 << 10,
                     o_direct=False)
    for i in range(40):
        assert cold.put(key(i), block(i))
    rows = [BlockInfo(key(i), Tier.COLD, False, False, (), float(i), 8192) for i in range(40)]

    class Store(FakeStore):
        def evict(self, keys):
            self.evicted += list(keys)
            return cold.evict(keys)

    store = Store(rows)
    disk_before = cold.stats()["disk_bytes"]
    mon = health.HealthMonitor(cfg_for(tmp_path, free_space_floor_bytes=200_000), store=store,
                               cold=cold, clock=lambda: 100.0, disk_usage=lambda p: 0)
    r = mon.check()
    assert r.evicted_blocks == len(store.evicted) > 0
    assert store.evicted == [key(i) for i in range(len(store.evicted))]  # oldest first
    assert cold.stats()["disk_bytes"] < disk_before
    outs = [torch.empty(GEOM.block_shape)]
    assert cold.read_into([key(39)], outs) == [True] and torch.equal(outs[0], block(39))
    cold.close()
