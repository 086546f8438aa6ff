"""The monitoring files under deploy/ against the real exposition and promtool.

`exposition` is the text of `GET /metrics` of a daemon started in this process on the tiny
random model with one simulated asset ticking, the SMART status file written and the
write-behind running, so every family the agent, the tiers, the engine and the health checks
export is there; the remote tier's collector is registered on it over a status of the
remote service's shape (a Redis server is not what this test is about).
`promtool()` is the path of promtool, or a failure that says how to install it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvagentd.config import load_config
from kvagentd.daemon.core import Daemon
from kvagentd.engine.tiny import tiny_model_dir
from kvagentd.fleet.metrics import register as register_remote
from kvagentd.maintenance.health import HealthState, HealthStatus, SmartData, write_status
from kvagentd.daemon.systemd import Notifier
from tests.control.conftest import make_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTALL = "install it with `make system-deps` (Debian: apt-get install prometheus)"

# What the remote service's status() holds (kvagentd.kvcache.remote.store), for its collector.
REMOTE_STATUS = {"link": {"state": "up", "downs": 1, "full": 0},
                 "reads": {"remote_hits": 3, "lookups": 4, "lookup_found": 3},
                 "write_behind": {"written": 5, "written_bytes": 5 << 16, "dropped": 2,
                                  "failed": 0, "queued_bytes": 0},
                 "sessions": {"published": 1, "fenced": 0}}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(f"promtool not found on PATH: {INSTALL}")
    return path


def sample_names(text: str) -> set[str]:
    """Every sample name an exposition can hold, empty families included (a counter family
    `x` is `x_total`, a histogram `x` is `x_bucket`, `x_sum`, `x_count`)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count"), "info": ("_info",)}
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.update(fam.name + s for s in suffixes.get(fam.type, ("",)))
        names.update(s.name for s in fam.samples)
    return names


@pytest.fixture(scope="module")
def exposition() -> Iterator[str]:
    d = Path(tempfile.mkdtemp(prefix="kvd", dir="/tmp"))
    base = load_config(None, env={})
    cfg = make_config(d)
    cfg = dataclasses.replace(
        cfg,
        daemon=dataclasses.replace(cfg.daemon, state_dir=d / "state", cache_dir=d / "c",
                                   main_loop_interval_s=0.1),
        model=dataclasses.replace(cfg.model, source="hf_dir", device="cpu", dtype="float32",
                                  path=tiny_model_dir(ROOT / "var" / "test-cache"), threads=1),
        kv=dataclasses.replace(cfg.kv, write_behind_interval_s=0.5),
        agent=dataclasses.replace(base.agent, tick_interval_s=0.5, assessment_max_tokens=4))
    write_status(cfg.maintenance.health_status_file,
                 HealthStatus(HealthState.OK, time.time(), "/dev/nvme0n1",
                              SmartData("nvme-cli", percent_used=12.0)))
    daemon = Daemon(cfg, None, notifier=Notifier(env={}))
    try:
        daemon.startup()
        threading.Thread(target=daemon.main_loop, daemon=True).start()
        register_remote(daemon.metrics, lambda: REMOTE_STATUS)
        end = time.monotonic() + 60
        while True:
            text = generate_latest(daemon.metrics).decode()
            names = sample_names(text)
            if {"kvagentd_asset_fault", "kvagentd_kv_write_behind_round_seconds",
                    "kvagentd_ssd_wear_ratio"} <= names or time.monotonic() > end:
                break
            time.sleep(0.3)
        yield text
    finally:
        daemon.request_shutdown("test")
        daemon.shutdown()
        shutil.rmtree(d, ignore_errors=True)
