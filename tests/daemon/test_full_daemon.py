"""The whole daemon as an operator runs it: model, tiers, agent ticks, ask, restart, resume.

`kvagentd run` in a subprocess on the tiny random model (an hf_dir), with the agent ticking every
second. After a graceful stop and a fresh start on the same directories, a session resumes from
the cold tier: its prompt is matched, not recomputed.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from kvagentd.engine.tiny import tiny_model_dir

from .conftest import ROOT, DaemonProcess, write_config


def _config(d: Path) -> Path:
    model_dir = tiny_model_dir(ROOT / "var" / "test-cache")
    path = write_config(d)
    text = path.read_text().replace('[model]\nsource = "none"', f'''[model]
source = "hf_dir"
path = "{model_dir}"
device = "cpu"
dtype = "float32"
threads = 1''').replace("[agent]\nenabled = false", '''[agent]
enabled = true
tick_interval_s = 1.0
assessment_max_tokens = 4

[[agent.assets]]
name = "pump-1"
seed = 3''')
    path.write_text(text)
    return path


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _ask(p: DaemonProcess, session: str, question: str) -> dict[str, Any]:
    with p.client() as c:
        c.timeout = 60
        r = c.post(f"/v1/sessions/{session}/ask",
                   json={"question": question, "max_tokens": 4, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()["result"]


def _wait_ticks(p: DaemonProcess, n: int, timeout: float = 90.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        asset = p.get("/v1/status")["agent"]["assets"]["pump-1"]
        if asset["ticks"] >= n:
            return asset
        time.sleep(0.5)
    raise AssertionError(f"fewer than {n} ticks in {timeout} s:\n{p.output()[-3000:]}")


def test_ticks_ask_restart_and_resume_from_cold(short_dir: Path) -> None:
    config = _config(short_dir)
    first = DaemonProcess(short_dir, config)
    try:
        first.notify.wait_for("READY=1", timeout=120)
        status = first.get("/v1/status")
        assert {"store", "placement", "engine", "maintenance", "agent"} <= set(status["services"])
        asset = _wait_ticks(first, 2)
        assert asset["last_zone"] in ("A", "B", "C", "D") and asset["llm_errors"] == 0

        answer = _ask(first, "op-1", "How is pump-1 doing?")
        assert answer["new_tokens"] > 0 and answer["prompt_tokens"] > 16
        again = _ask(first, "op-1", "And now?")
        assert again["reused_tokens"] >= 16  # the first turn's full blocks, from the hot tier
        sessions = {s["id"] for s in first.get("/v1/sessions")["sessions"]}
        assert "op-1" in sessions

        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0
        assert not first.socket.exists()
        # log_format = "json": stdout and stderr together are JSON lines only (no progress
        # bars of the model loader, no library lines of their own)
        not_json = [x for x in first.output().splitlines() if x.strip() and not _is_json(x)]
        assert not not_json, not_json[:3]
    finally:
        first.stop()

    (short_dir / "notify.sock").unlink()
    second = DaemonProcess(short_dir, config)
    try:
        second.notify.wait_for("READY=1", timeout=120)
        resumed = _ask(second, "op-1", "Still fine?")
        store = second.get("/v1/status")["store"]
        # Every full block of the session so far came back from the SSD tier (directly, or
        # staged in warm by the start-up warm-up): matched, not recomputed.
        assert resumed["reused_tokens"] >= again["prompt_tokens"] // 16 * 16
        assert resumed["recomputed_tokens"] == 0
        assert store["tiers"]["cold"]["reads"] > 0
        _wait_ticks(second, 1)  # an asset's zone is shown from a window of this run only
        with second.client() as c:
            metrics = c.get("/v1/metrics").text
        for line in ('kvagentd_kv_blocks{tier="hot"}', 'kvagentd_kv_capacity_bytes{tier="warm"}',
                     'kvagentd_cold_serving{tier="ssd"} 1.0', "kvagentd_kv_lost_blocks_total 0.0",
                     'kvagentd_cold_checksum_failures_total{device="ssd"} 0.0',
                     'kvagentd_health_check_status{check="service:engine"} 0.0',
                     'kvagentd_asset_zone{asset="pump-1"}'):
            assert line in metrics, line
        read = [x for x in metrics.splitlines()
                if x.startswith('kvagentd_cold_read_bytes_total{device="ssd"}')]
        assert read and float(read[0].split()[-1]) > 0
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        second.stop()
