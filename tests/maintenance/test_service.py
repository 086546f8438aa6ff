"""The maintenance service on a real scheduler, its control routes and kvctl commands."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import types
from pathlib import Path

import pytest
import torch
import typer
from apscheduler.schedulers.background import BackgroundScheduler
from typer.testing import CliRunner

from kvagentd.config import Config, load_config
from kvagentd.control.handlers import maintenance as handlers
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.kvcache.base import Tier
from kvagentd.maintenance import health
from kvagentd.kvcache.cold.failover import ServingTier
from kvagentd.kvcache.cold import build_cold_tier
from kvagentd.maintenance.service import JOB_IDS, Maintenance
from kvagentd.services import build_tiers, cold_tier_spec
from kvctl import cmd_maintenance

from .conftest import GEOM, NS, block, key
from .test_defrag import assert_data, fragment
from .test_tune import make_tree


@pytest.fixture
def env():
    d = Path(tempfile.mkdtemp(prefix="kvm", dir="/tmp"))  # short: AF_UNIX path limit
    cold = d / "cold"
    cold.mkdir()
    mcfg = make_tree(d / "fake", cold, nr=16)
    base = load_config(None, env={})
    cfg = dataclasses.replace(
        base,
        kv=dataclasses.replace(base.kv, cold_dir=cold, cold_capacity_bytes=64 << 20,
                               segment_bytes=1 << 20, io_unit_bytes=64 << 10),
        maintenance=dataclasses.replace(
            base.maintenance, sysfs_root=mcfg.sysfs_root, proc_root=mcfg.proc_root,
            systemd_dir=mcfg.systemd_dir, shadow_dir=d / "shm", shadow_bytes=4 << 20,
            health_status_file=d / "ssd-health.json", failback_good_probes=2,
            free_space_floor_bytes=0, health_interval_s=3600.0),
        control=dataclasses.replace(base.control, socket=d / "run" / "k.sock", socket_group="",
                                    operator_group=""))
    cfg = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, hot_bytes=128 * GEOM.block_bytes,
                                                          warm_ratio=0.5))
    store, cold_tier = build_tiers(cfg, GEOM, NS)
    sched = BackgroundScheduler()
    sched.start()
    m = Maintenance(cfg, store, cold_tier, sched)
    yield cfg, store, cold_tier, sched, m
    m.stop()
    sched.shutdown(wait=False)
    store.close()
    shutil.rmtree(d, ignore_errors=True)


def test_start_schedules_jobs_and_stop_removes_them(env):
    cfg, store, cold, sched, m = env
    m.start()
    assert {j.id for j in sched.get_jobs()} == set(JOB_IDS)
    new = dataclasses.replace(cfg, maintenance=dataclasses.replace(cfg.maintenance,
                                                                   defrag_interval_s=60.0))
    m.reload(new)
    assert sched.get_job("maintenance.defrag").trigger.interval.total_seconds() == 60.0
    st = m.status()
    json.dumps(st)  # JSON-ready
    assert st["failover"]["serving"] == "ssd" and st["health"]["state"] == "unknown"
    m.stop()
    assert not sched.get_jobs()


def test_health_status_failed_fails_over_and_probes_fail_back(env):
    cfg, store, cold, sched, m = env
    assert cold.put(key(1), block(1))
    s = health.SmartData("nvme-cli", 10, 5, health.CW_READ_ONLY, 100, 10)
    health.write_status(cfg.maintenance.health_status_file,
                        health.HealthStatus(health.HealthState.FAILED, 0.0, "/dev/x", s, ("ro",)))
    m._health_job()
    assert cold.serving is ServingTier.SHADOW
    view = cold.view()
    assert view.serving == "shadow" and "SSD health failed" in view.reason
    assert cold.put(key(2), block(2)) and cold.shadow.contains(key(2))
    s = health.SmartData("nvme-cli", 10, 5, 0, 100, 10)
    health.write_status(cfg.maintenance.health_status_file,
                        health.HealthStatus(health.HealthState.OK, 0.0, "/dev/x", s, ()))
    m._health_job()
    assert cold.serving is ServingTier.SHADOW  # one good probe of two
    m._health_job()
    assert cold.serving is ServingTier.SSD and cold.shadow.keys() == []
    assert cold.primary.contains(key(2))
    assert cold.view().serving == "ssd" and cold.view().failbacks == 1
    assert m.monitor.last is not None and m.monitor.last.state == "ok"


def test_wear_makes_the_cold_tier_read_only(env):
    cfg, store, cold, sched, m = env
    s = health.SmartData("nvme-cli", 91, 0, 0, 100, 10)
    health.write_status(cfg.maintenance.health_status_file,
                        health.HealthStatus(health.HealthState.WORN, 0.0, "/dev/x", s, ("wear",)))
    rep = m.monitor.check()
    assert rep.cold_read_only and cold.primary.read_only
    assert cold.put(key(3), block(3)) is False and cold.serving is ServingTier.SSD


def serve(cfg: Config, m: Maintenance) -> ControlServer:
    router = Router()
    handlers.register(router, types.SimpleNamespace(services=types.SimpleNamespace(maintenance=m)))
    server = ControlServer(cfg.control, router)
    server.start()
    return server


def kvctl(cfg: Config, *args: str):
    app = typer.Typer()
    cmd_maintenance.register(app)
    return CliRunner().invoke(app, [*args[:1], *args[1:], "--socket", str(cfg.control.socket)]
                              if args[0] != "failover" else
                              [args[0], args[1], "--socket", str(cfg.control.socket), *args[2:]])


def jout(r) -> dict:
    """The JSON document in kvctl's output (log lines of the in-process server may surround it)."""
    lines = r.output.splitlines()
    return json.loads("\n".join(lines[lines.index("{"):len(lines) - lines[::-1].index("}")]))


def test_control_routes_and_kvctl(env, monkeypatch):
    cfg, store, cold, sched, m = env
    sessions = fragment(store)
    server = serve(cfg, m)
    try:
        r = kvctl(cfg, "defrag", "--tier", "hot", "--dry-run")
        assert r.exit_code == 0, r.output
        assert "planned" in r.output and "moves:" in r.output
        assert m.measure(Tier.HOT).ratio > 0.5
        r = kvctl(cfg, "defrag", "--tier", "hot", "--json")
        assert r.exit_code == 0, r.output
        res = jout(r)["results"][0]
        assert res["after"]["ratio"] == 0.0 and res["moved"] > 0
        assert_data(store, sessions)
        r = kvctl(cfg, "defrag", "--tier", "all")
        assert r.exit_code == 0 and "cold" in r.output
        r = kvctl(cfg, "defrag", "--tier", "nope")
        assert r.exit_code == 64
        r = kvctl(cfg, "tune")
        assert r.exit_code == 0 and "nr_requests" in r.output and ">= 64" in r.output
        row = next(ln for ln in r.output.splitlines() if ln.startswith("nr_requests"))
        assert row.split()[1] == "16" and row.split()[-1] == "no"
        monkeypatch.setattr(os, "geteuid", lambda: 1000)
        r = kvctl(cfg, "tune", "--apply")
        assert r.exit_code == 77 and "root" in r.output
        r = kvctl(cfg, "failover", "status")
        assert r.exit_code == 0 and "served by: ssd" in r.output
        r = kvctl(cfg, "failover", "activate", "--reason", "swap drill")
        assert r.exit_code == 0 and "served by: shadow" in r.output
        assert cold.put(key(9), block(9)) and cold.shadow.contains(key(9))
        r = kvctl(cfg, "failover", "status", "--json")
        st = jout(r)
        assert st["serving"] == "shadow" and st["reason"] == "swap drill" and st["shadow_blocks"] == 1
        r = kvctl(cfg, "failover", "restore", "--reason", "new SSD in")
        assert r.exit_code == 0 and "restored 1 blocks" in r.output and "served by: ssd" in r.output
        assert jout(kvctl(cfg, "failover", "status", "--json"))["reason"] == "new SSD in"
        kvctl(cfg, "failover", "activate")
        kvctl(cfg, "failover", "restore")  # who asked, where no reason is given
        assert re.fullmatch(r"operator request \(uid \d+\)",
                            jout(kvctl(cfg, "failover", "status", "--json"))["reason"])
    finally:
        server.stop(1.0)


def test_debug_section_wraps_the_ssd_io(env, tmp_path):
    cfg, store, cold, sched, m = env
    assert type(cold.primary.io).__name__ == "FileIO"  # off by default
    dbg = dataclasses.replace(cfg.debug, fault_write_eio_rate=1.0, fault_seed=3)
    c2 = dataclasses.replace(cfg, debug=dbg,
                             kv=dataclasses.replace(cfg.kv, cold_dir=tmp_path / "c2"),
                             maintenance=dataclasses.replace(cfg.maintenance,
                                                             shadow_dir=tmp_path / "s2"))
    tier = build_cold_tier(cold_tier_spec(c2), GEOM, NS)
    try:
        assert type(tier.primary.io).__name__ == "FaultyFileIO"
        assert tier.put(key(1), block(1)) and tier.serving is ServingTier.SHADOW
    finally:
        tier.close()


def test_scrub_routes_run_in_background(env):
    cfg, store, cold, sched, m = env
    for i in range(4):
        assert cold.put(key(i), block(i))
    server = serve(cfg, m)
    try:
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(cfg.control.socket)),
                          base_url="http://k", timeout=10) as c:
            assert c.post("/v1/scrub", json={}).json()["started"] is True
            m._scrub_thread.join(10)
            st = c.get("/v1/scrub").json()
            assert st["running"] is False and st["passes"] == 1 and st["checked"] == 4
            assert st["bad_records"] == 0
    finally:
        server.stop(1.0)


@pytest.mark.parametrize("idle", [False, True])
def test_dead_cold_records_are_compacted_away(tmp_path, idle):
    """Records evicted for capacity stay in their segment files until compaction; past
    `dead_limit` the health job drops the segments with nothing live at once, and rewrites the
    mostly dead ones only while the daemon is idle (the rewrite holds the cold tier's locks)."""
    from kvagentd.config import Config, KVConfig, MaintenanceConfig
    from kvagentd.config.values import ByteSize
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.maintenance.service import dead_limit

    cap = seg = 1 << 20
    cfg = Config(kv=KVConfig(cold_dir=tmp_path, cold_capacity_bytes=ByteSize(cap),
                             segment_bytes=ByteSize(seg)),
                 maintenance=MaintenanceConfig(health_status_file=tmp_path / "h.json",
                                               free_space_floor_bytes=ByteSize(0)))
    cold = ColdStore(tmp_path / "cold", GEOM, NS, capacity_bytes=cap, segment_bytes=seg,
                     o_direct=False)
    m = Maintenance(cfg, None, cold, None, is_idle=lambda: idle)
    limit = dead_limit(cfg)
    assert limit == 4 * seg
    n = 0
    while cold.stats()["dead_bytes"] <= limit:
        keys = [key(i) for i in range(n, n + 100)]
        assert all(cold.put_many(keys, [block(i) for i in range(n, n + 100)]))
        n += 100
    keep = key(n - 1)
    m.start()  # the check at start leaves a backlog for the timers
    backlog = cold.stats()
    assert backlog["dead_bytes"] > limit
    copied = []
    copy = cold.writer.copy
    cold.writer.copy = lambda k, buf: (copied.append(k), copy(k, buf))[1]
    m._health_job()
    st = cold.stats()
    assert st["disk_bytes"] < backlog["disk_bytes"]
    if idle:
        assert st["dead_bytes"] < limit and st["disk_bytes"] <= cap + limit
    else:  # only what needs no copying went
        assert not copied and all(u.live > 0 for u in cold.index.segment_use())
    assert st["bytes_used"] <= cap and cold.contains(keep)
    outs = [torch.empty(GEOM.block_shape)]
    assert cold.read_into([keep], outs) == [True] and torch.equal(outs[0], block(n - 1))
    before = st["disk_bytes"]
    m._health_job()
    assert cold.stats()["disk_bytes"] == before  # nothing more to do
    m.stop()
    cold.close()


def test_a_busy_daemon_past_twice_the_limit_rewrites_the_deadest_within_a_budget(
        tmp_path, monkeypatch):
    """A daemon never idle at a health check still bounds its cold files: past twice
    `dead_limit` it rewrites the deadest segments, no more than `BUSY_COPY_BYTES` of live
    records a check, and below that it leaves segments with live records alone."""
    from kvagentd.config import Config, KVConfig, MaintenanceConfig
    from kvagentd.config.values import ByteSize
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.maintenance import service
    from kvagentd.maintenance.service import dead_limit

    cap = seg = 1 << 20

    class KeepFirsts:  # one record of each segment must stay (pinned, in use)
        def __init__(self):
            self.keep = set()

        def cold_protected(self, keys):
            return {k for k in keys if k in self.keep}

        def cold_evicted(self, keys):
            pass

    heard = KeepFirsts()
    cfg = Config(kv=KVConfig(cold_dir=tmp_path, cold_capacity_bytes=ByteSize(cap),
                             segment_bytes=ByteSize(seg)),
                 maintenance=MaintenanceConfig(health_status_file=tmp_path / "h.json",
                                               free_space_floor_bytes=ByteSize(0)))
    cold = ColdStore(tmp_path / "cold", GEOM, NS, capacity_bytes=cap, segment_bytes=seg,
                     o_direct=False, listener=heard)
    m = Maintenance(cfg, None, cold, None, is_idle=lambda: False)
    limit = dead_limit(cfg)
    n = 0
    while cold.stats()["dead_bytes"] <= 2 * limit + 4 * seg:
        heard.keep.update([key(n)] if n % 192 else [key(n), key(n + 1)])  # some less dead
        keys = [key(i) for i in range(n, n + 64)]
        assert all(cold.put_many(keys, [block(i) for i in range(n, n + 64)]))
        n += 64
    use = cold.index.segment_use()
    assert all(u.live > 0 for u in use)  # nothing to drop for free
    deadest = min(use, key=lambda u: (u.live / u.size, u.segment)).segment
    expect = {r.key for r in cold.index.segment_rows(deadest)}
    copied = []
    copy = cold.writer.copy
    cold.writer.copy = lambda k, buf: (copied.append(k), copy(k, buf))[1]
    monkeypatch.setattr(service, "BUSY_COPY_BYTES", 1)  # one segment a check
    before = cold.stats()
    m._health_job()
    after = cold.stats()
    # the deadest segment's live records went to the write position, and only those
    assert copied and set(copied) == expect and expect <= heard.keep
    assert deadest not in {u.segment for u in cold.index.segment_use()}
    assert after["disk_bytes"] < before["disk_bytes"] and after["dead_bytes"] < before["dead_bytes"]
    # the checks go on until dead bytes are back under twice the limit, then stop copying
    for _ in range(200):
        if cold.stats()["dead_bytes"] <= 2 * limit:
            break
        m._health_job()
    assert cold.stats()["dead_bytes"] <= 2 * limit
    done = len(copied)
    m._health_job()
    assert len(copied) == done
    for j in range(n):  # every record that had to stay is there, and right
        if key(j) in heard.keep:
            out = [torch.empty(GEOM.block_shape)]
            assert cold.read_into([key(j)], out) == [True] and torch.equal(out[0], block(j))
    cold.close()
