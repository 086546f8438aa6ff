"""Core routes against a real in-process Daemon (no services)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvagentd.daemon.core import Daemon
from kvagentd.daemon.systemd import Notifier
from tests.control.conftest import Harness, make_config, start_harness


@pytest.fixture
def daemon(short_dir: Path) -> Iterator[Daemon]:
    cfg = make_config(short_dir)
    cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(
        cfg.daemon, state_dir=short_dir / "state", cache_dir=short_dir / "cache"))
    d = Daemon(cfg, None, notifier=Notifier(env={}))
    d.startup()
    yield d
    d.shutdown()


def _client(d: Daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.config.control.socket)),
                        base_url="http://kvagentd", timeout=10)


def test_livez_and_readyz(daemon: Daemon) -> None:
    with _client(daemon) as c:
        assert c.get("/v1/livez").json() == {"alive": True}
        assert c.get("/v1/readyz").json()["ready"] is True


def test_readyz_is_503_until_ready(short_dir: Path) -> None:
    h: Harness = start_harness(make_config(short_dir))
    try:
        h.daemon.ready, h.daemon.phase = False, "starting"
        r = h.get("/v1/readyz")
        assert r.status_code == 503
        assert r.json()["error"] == {"kind": "not_ready", "message": "kvagentd is starting"}
        # Service routes wait for readiness; the core routes answer during a slow start.
        r = h.get("/test/items/pump/1")
        assert r.status_code == 503 and "GET /v1/readyz" in r.json()["error"]["message"]
        for path in ("/v1/livez", "/v1/status", "/v1/health", "/v1/config", "/v1/metrics"):
            assert h.get(path).status_code == 200, path
        h.daemon.ready = True
        assert h.get("/test/items/pump/1").status_code == 200
    finally:
        h.server.stop(1.0)


def test_status_reports_version_uptime_host_and_gpu_reason(daemon: Daemon) -> None:
    with _client(daemon) as c:
        s = c.get("/v1/status").json()
    assert s["version"] == "0.1.0" and s["ready"] is True and s["phase"] == "running"
    assert s["uptime_s"] >= 0 and s["pid"] > 0
    assert s["host"]["memory"]["total_bytes"] > 0
    assert s["host"]["disks"] and s["host"]["disks"][0]["free_bytes"] > 0
    if s["gpu"] is None:
        assert s["gpu_reason"]
    else:
        assert s["gpu"][0]["memory_total_bytes"] > 0
    assert s["control"]["socket"] == str(daemon.config.control.socket)
    assert s["scheduler"]["running"] is True
    assert s["services"] == []
    for absent in ("store", "engine", "agent", "maintenance"):
        assert absent not in s


def test_health_lists_checks(daemon: Daemon) -> None:
    with _client(daemon) as c:
        h = c.get("/v1/health").json()
    names = {c["name"] for c in h["checks"]}
    assert {"daemon", "scheduler", "memory"} <= names
    assert h["status"] in ("ok", "degraded")


def test_config_route_shows_effective_config(daemon: Daemon) -> None:
    with _client(daemon) as c:
        body = c.get("/v1/config").json()
    assert body["config"]["control"]["socket"] == str(daemon.config.control.socket)
    assert body["config"]["kv"]["hot_bytes"] == daemon.config.kv.hot_bytes
    assert "daemon.log_level" in body["reloadable"]


def test_metrics_route_is_prometheus_text(daemon: Daemon) -> None:
    with _client(daemon) as c:
        c.get("/v1/livez")
        r = c.get("/v1/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert "kvagentd_ready 1.0" in r.text
    assert 'kvagentd_build_info{version="0.1.0"} 1.0' in r.text
    assert "process_resident_memory_bytes" in r.text


def test_shutdown_route_asks_the_main_loop_to_stop(daemon: Daemon) -> None:
    with _client(daemon) as c:
        assert c.post("/v1/shutdown").json() == {"stopping": True}
    assert daemon.requests.stop_reason is not None and "uid 0" in daemon.requests.stop_reason
