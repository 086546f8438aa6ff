"""Metrics: what a scrape reads of the services (names, units, labels), the optional
metrics-only TCP listener answered over real HTTP, and a busy port that degrades, not fails."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvagentd.agent.diagnosis.result import FAULTS
from kvagentd.agent.view import AssetView
from kvagentd.config import Config, ConfigError, load_config, parse_listen
from kvagentd.daemon.core import Daemon
from kvagentd.engine.metrics import EngineMetrics
from kvagentd.health import Acknowledgements, DaemonFacts, Facts, assess
from kvagentd.health.facts import WearFacts
from kvagentd.scheduling.jobwatch import JobRecord
from kvagentd.kvcache.cold import ColdView
from kvagentd.daemon.systemd import Notifier
from kvagentd.metrics.registry import CoreMetrics, new_registry
from kvagentd.metrics.scrape import Scrape, ScrapeCollector
from tests.control.conftest import make_config


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_scrape_names_units_and_labels() -> None:
    cold = ColdView(serving="shadow", since=1.7e9, reason="3 new cold I/O errors",
                    read_only=True, ssd_bytes=10 << 20, ssd_capacity_bytes=1 << 30,
                    shadow_bytes=2 << 20, shadow_capacity_bytes=16 << 20,
                    counters={"ssd": {"read_bytes": 4096, "write_bytes": 8192, "reads": 1,
                                      "writes": 2, "corrupt": 3, "missing": 1, "io_errors": 5,
                                      "write_failures": 2, "evicted": 0},
                              "shadow": {"write_bytes": 100, "writes": 1}},
                    index_discarded={"ssd": "not a database", "shadow": None},
                    failovers=1, failbacks=0)
    view = AssetView("pump-1", "mqtt", "mqtt h:1 t", False, 62.0, 600.0, 8.0, "C", 3.25, True,
                     {"stale": 18}, last_diagnosis=DIAGNOSIS)
    fresh = AssetView("pump-2", "simulated", "simulated", None, 1.5, 600.0, 8.0, "C", 4.5, True,
                      {}, last_diagnosis=DIAGNOSIS)
    facts = Facts(daemon=DaemonFacts("running", 9.0, 0.1, 5.0, True, 4), assets=(view, fresh),
                  cold=cold, lost_blocks=11, wear=WearFacts("ok", 42.0, None, 10.0, 3600.0),
                  memory_available=1 << 30, memory_total=2 << 30)
    report = assess(load_config(None, env={}), facts, Acknowledgements())
    store = {"tiers": {"hot": {"blocks": 5, "bytes": 500, "arena_bytes": 1000,
                               "fragmentation": 0.25},
                       "warm": {"blocks": 1, "bytes": 100, "arena_bytes": 2000,
                                "fragmentation": 0.0},
                       "cold": {"blocks": 7}},
             "pinned": 2, "loaded_cold": 4, "evicted": 1}
    ticks = {"pump-1": JobRecord(runs=10, skipped=73, missed=1)}
    reg = CollectorRegistry()
    reg.register(ScrapeCollector(lambda: Scrape(facts, report, store, ticks)))
    m = _samples(generate_latest(reg).decode())
    assert m[("kvagentd_kv_blocks", (("tier", "hot"),))] == 5
    assert m[("kvagentd_kv_capacity_bytes", (("tier", "warm"),))] == 2000
    assert m[("kvagentd_kv_fragmentation_ratio", (("tier", "hot"),))] == 0.25
    assert m[("kvagentd_kv_lost_blocks_total", ())] == 11
    assert m[("kvagentd_kv_loaded_blocks_total", (("tier", "cold"),))] == 4
    assert m[("kvagentd_cold_read_bytes_total", (("device", "ssd"),))] == 4096
    assert m[("kvagentd_cold_written_bytes_total", (("device", "shadow"),))] == 100
    assert m[("kvagentd_cold_checksum_failures_total", (("device", "ssd"),))] == 3
    assert m[("kvagentd_cold_io_errors_total", (("device", "ssd"), ("op", "write")))] == 2
    assert m[("kvagentd_cold_index_discarded", (("device", "ssd"),))] == 1
    assert m[("kvagentd_cold_serving", (("tier", "shadow"),))] == 1
    assert m[("kvagentd_cold_serving", (("tier", "ssd"),))] == 0
    assert m[("kvagentd_cold_read_only", ())] == 1
    assert m[("kvagentd_cold_failovers_total", ())] == 1
    assert m[("kvagentd_ssd_wear_ratio", ())] == 0.42
    assert m[("kvagentd_ssd_health", (("state", "ok"),))] == 1
    assert m[("kvagentd_asset_rms_velocity_meters_per_second", (("asset", "pump-2"),))] == 0.0045
    assert m[("kvagentd_asset_zone", (("asset", "pump-2"),))] == 3
    assert m[("kvagentd_asset_anomaly", (("asset", "pump-2"),))] == 1
    assert m[("kvagentd_asset_sensor_stale", (("asset", "pump-2"),))] == 0
    # pump-1's last window is 62 s old (stale after 8 s): its values are withdrawn, its age is not
    assert m[("kvagentd_asset_sensor_data_age_seconds", (("asset", "pump-1"),))] == 62
    assert m[("kvagentd_asset_sensor_stale", (("asset", "pump-1"),))] == 1
    assert not {k for k in m if ("asset", "pump-1") in k[1] and "_asset_" in k[0]} - {
        ("kvagentd_asset_sensor_data_age_seconds", (("asset", "pump-1"),)),
        ("kvagentd_asset_sensor_stale", (("asset", "pump-1"),)),
        ("kvagentd_asset_bad_windows_total", (("asset", "pump-1"), ("reason", "stale")))}
    assert m[("kvagentd_asset_bad_windows_total", (("asset", "pump-1"), ("reason", "stale")))] == 18
    assert m[("kvagentd_agent_ticks_total", (("asset", "pump-1"),))] == 10
    assert m[("kvagentd_agent_ticks_skipped_total", (("asset", "pump-1"),
                                                     ("reason", "overlap")))] == 73
    assert m[("kvagentd_health_status", ())] == 2  # the stale sensor is failing
    assert m[("kvagentd_health_check_status", (("check", "sensor:pump-1"),))] == 2
    assert m[("kvagentd_health_check_status", (("check", "cold-tier"),))] == 1


DIAGNOSIS = {"fault": "outer_race", "severity": "medium", "confidence": 0.8, "zone": "C",
             "rms_mm_s": 4.5, "kurtosis": 5.25,
             "ratios": {"BPFO": 9.5, "BPFI": 1.25, "2xBSF": 1.5, "FTF": 1.0},
             "thresholds": {"BPFO": 4.25, "BPFI": 4.5, "2xBSF": 4.5, "FTF": 4.0}}


def _asset_samples(*views: AssetView) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    facts = Facts(daemon=DaemonFacts("running", 9.0, 0.1, 5.0, True, 4), assets=views)
    report = assess(load_config(None, env={}), facts, Acknowledgements())
    reg = CollectorRegistry()
    reg.register(ScrapeCollector(lambda: Scrape(facts, report, None, {})))
    return _samples(generate_latest(reg).decode())


def test_asset_fault_severity_confidence_kurtosis_and_defect_lines() -> None:
    view = AssetView("pump-1", "simulated", "simulated", None, 1.0, 60.0, 8.0, "C", 4.5, True,
                     {}, last_diagnosis=DIAGNOSIS)
    m = _asset_samples(view)
    a = ("asset", "pump-1")
    faults = {k[1][1][1]: v for k, v in m.items() if k[0] == "kvagentd_asset_fault"}
    assert faults == {kind: (1 if kind == "outer_race" else 0) for kind in FAULTS}
    assert m[("kvagentd_asset_fault_severity", (a,))] == 2
    assert m[("kvagentd_asset_fault_confidence_ratio", (a,))] == 0.8
    assert m[("kvagentd_asset_kurtosis", (a,))] == 5.25
    assert m[("kvagentd_asset_defect_line_strength", (a, ("line", "BPFO")))] == 9.5
    assert m[("kvagentd_asset_defect_line_strength", (a, ("line", "2xBSF")))] == 1.5
    assert m[("kvagentd_asset_defect_line_threshold", (a, ("line", "FTF")))] == 4.0
    # the fault clears: the same series, none=1, severity 0
    healthy = dict(DIAGNOSIS, fault="none", severity="none")
    m = _asset_samples(view._replace(last_diagnosis=healthy, last_zone="A"))
    assert m[("kvagentd_asset_fault", (a, ("kind", "none")))] == 1
    assert m[("kvagentd_asset_fault", (a, ("kind", "outer_race")))] == 0
    assert m[("kvagentd_asset_fault_severity", (a,))] == 0
    assert m[("kvagentd_asset_zone", (a,))] == 1


def test_a_dead_sensor_withdraws_the_asset_values() -> None:
    """The sensor stops: while the last window is within the stale limit its values stand;
    past it, zone, RMS, fault and lines are gone (not held at zone A) and the stale gauge and
    the age say why. Before the first window since start nothing is shown, and a sensor that
    never delivered is stale once the limit has passed."""
    a = ("asset", "pump-1")
    view = AssetView("pump-1", "simulated", "simulated", None, 7.5, 600.0, 8.0, "A", 0.9, False,
                     {}, last_diagnosis=dict(DIAGNOSIS, fault="none", severity="none"))
    m = _asset_samples(view)
    assert m[("kvagentd_asset_zone", (a,))] == 1 and m[("kvagentd_asset_sensor_stale", (a,))] == 0
    m = _asset_samples(view._replace(data_age_s=8.5))
    assert m[("kvagentd_asset_sensor_stale", (a,))] == 1
    assert m[("kvagentd_asset_sensor_data_age_seconds", (a,))] == 8.5
    measured = {k[0] for k in m if a in k[1] and k[0].startswith("kvagentd_asset_")}
    assert measured == {"kvagentd_asset_sensor_stale", "kvagentd_asset_sensor_data_age_seconds"}
    # after a restart, before the first window: the last row is the previous run's
    never = view._replace(data_age_s=None)
    m = _asset_samples(never._replace(running_s=5.0))
    assert {k[0] for k in m if a in k[1] and k[0].startswith("kvagentd_asset_")} == {
        "kvagentd_asset_sensor_stale"}
    assert m[("kvagentd_asset_sensor_stale", (a,))] == 0
    assert _asset_samples(never._replace(running_s=60.0))[("kvagentd_asset_sensor_stale",
                                                           (a,))] == 1


def test_no_created_series() -> None:
    """Counters and histograms of the daemon's registry expose no `_created` (both formats)."""
    reg = new_registry()
    core = CoreMetrics(reg)
    core.loop_iterations.inc()
    core.tick_seconds.labels("pump-1").observe(0.2)
    EngineMetrics(reg).generated_tokens.inc(3)
    text = generate_latest(reg).decode()
    assert "kvagentd_main_loop_iterations_total 1.0" in text
    assert "_created" not in text
    assert b"_created" not in openmetrics.generate_latest(reg)


def test_listen_values() -> None:
    assert parse_listen("9464") == ("127.0.0.1", 9464)  # loopback unless a host is named
    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    for bad in ("", "host", "host:0", "host:70000", "::1:9464", "[::1]"):
        try:
            parse_listen(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")
    try:
        load_config(None, env={"KVAGENTD_METRICS__LISTEN": '"localhost:99999"'})
    except ConfigError as exc:
        assert exc.path == "metrics.listen" and "1-65535" in exc.allowed
    else:
        raise AssertionError("a bad listen address was accepted")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _daemon(d: Path, listen: str) -> Daemon:
    cfg: Config = make_config(d)
    base = load_config(None, env={})
    cfg = dataclasses.replace(
        cfg, daemon=dataclasses.replace(cfg.daemon, state_dir=d / "state", cache_dir=d / "c",
                                        main_loop_interval_s=0.1),
        agent=dataclasses.replace(base.agent, tick_interval_s=0.5),
        metrics=dataclasses.replace(cfg.metrics, listen=listen))
    daemon = Daemon(cfg, None, notifier=Notifier(env={}))
    daemon.startup()
    threading.Thread(target=daemon.main_loop, daemon=True).start()
    return daemon


def test_metrics_listener_serves_only_metrics_over_tcp(short_dir: Path) -> None:
    port = _free_port()
    d = _daemon(short_dir, f"127.0.0.1:{port}")
    try:
        end = time.monotonic() + 30
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            while True:
                r = c.get("/metrics")
                assert r.status_code == 200
                m = _samples(r.text)
                if m.get(("kvagentd_agent_ticks_total", (("asset", "pump-1"),)), 0) >= 2 \
                        or time.monotonic() > end:
                    break
                time.sleep(0.3)
            assert r.headers["content-type"].startswith("text/plain")
            assert m[("kvagentd_ready", ())] == 1
            assert m[("kvagentd_agent_ticks_total", (("asset", "pump-1"),))] >= 2
            assert m[("kvagentd_asset_zone", (("asset", "pump-1"),))] in (1, 2, 3, 4)
            assert m[("kvagentd_health_check_status", (("check", "sensor:pump-1"),))] == 0
            assert ("kvagentd_agent_tick_duration_seconds_count", (("asset", "pump-1"),)) in m
            assert "process_resident_memory_bytes" in r.text
            om = c.get("/metrics", headers={"Accept": "application/openmetrics-text"})
            assert om.headers["content-type"].startswith("application/openmetrics-text")
            assert om.text.rstrip().endswith("# EOF")
            for path in ("/", "/v1/status", "/v1/metrics", "/v1/shutdown", "/metrics/x"):
                assert c.get(path).status_code == 404, path
            assert c.post("/metrics").status_code == 405
            assert c.post("/v1/shutdown").status_code == 405
        assert d.ready and d.requests.stop_reason is None
        assert d.status()["metrics_listener"] == f"http://127.0.0.1:{port}/metrics"
    finally:
        d.request_shutdown("test")
        d.shutdown()
    with socket.socket() as s:  # closed with the daemon
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_busy_port_degrades_health_and_the_daemon_runs(short_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        d = _daemon(short_dir, f"127.0.0.1:{port}")
        try:
            assert d.ready
            checks: dict[str, Any] = {c["name"]: c for c in d.health()["checks"]}
            assert checks["metrics-listener"]["status"] == "degraded"
            assert f"127.0.0.1:{port}" in checks["metrics-listener"]["reason"]
        finally:
            d.request_shutdown("test")
            d.shutdown()
