"""A cold disk filled to the last byte while the daemon runs, then freed: it serves from the
SSD again and its health returns to ok without a restart, within three health intervals (plus
the configured hold) of the space returning, with write-behind running; every session still
answers from what it had."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from tests.mounts import small_disk

from .conftest import DaemonProcess
from .test_full_daemon import _ask, _config

INTERVAL_S = 1.0  # maintenance.health_interval_s


def _ok(health: dict[str, Any]) -> bool:
    """Every check ok but `storage:cold`, which rightly says the stand-in disk is a tmpfs."""
    return all(c["status"] == "ok" for c in health["checks"] if c["name"] != "storage:cold")


def _wait(p: DaemonProcess, what: str, ok: Any, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < end:
        status = p.get("/v1/status")
        if ok(status, p.get("/v1/health")):
            return status
        time.sleep(0.25)
    raise AssertionError(f"not {what} within {timeout} s: {status.get('maintenance')}\n"
                         f"{p.output()[-3000:]}")


def test_a_full_cold_disk_recovers_while_running(short_dir: Path) -> None:
    config = _config(short_dir)
    text = config.read_text().replace("[agent]\nenabled = true", "[agent]\nenabled = false")
    text = text.replace("o_direct = false", "o_direct = false\nwrite_behind_interval_s = 1.0")
    text = text.replace('shadow_bytes = "16MiB"', f'shadow_bytes = "16MiB"\n'
                        f'health_interval_s = {INTERVAL_S}\nfailback_good_probes = 1\n'
                        f'free_space_floor_bytes = "2MiB"')
    config.write_text(text + "\n[health]\nraise_after_s = 1.0\nclear_after_s = 2.0\n")
    cold = short_dir / "cold"
    cold.mkdir()
    p = DaemonProcess(short_dir, config, mounts=[small_disk(cold, "96m")])
    try:
        p.notify.wait_for("READY=1", timeout=120)
        first = [_ask(p, f"op-{i}", f"How is pump {i} doing?") for i in range(3)]
        assert all(r["new_tokens"] > 0 for r in first)
        time.sleep(2.5)  # write-behind copies them to the SSD
        seen = Path(f"/proc/{p.proc.pid}/root") / str(cold).lstrip("/")
        filler = seen / "other-tenant"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
        for i in range(3):  # the daemon keeps answering on a full disk
            assert _ask(p, f"op-{i}", "And now?")["new_tokens"] > 0
        _wait(p, "degraded for the full disk", lambda s, h: not _ok(h),
              timeout=10 * INTERVAL_S + 5)
        bad = {c["name"]: c["reason"] for c in p.get("/v1/health")["checks"]
               if c["status"] != "ok" and c["name"] != "storage:cold"}
        assert any(n == "cold-tier" or n.startswith("disk:") for n in bad), bad
        filler.unlink()
        freed = time.monotonic()
        status = _wait(p, "back on the SSD and ok", lambda s, h: _ok(h) and (
            (s["maintenance"].get("failover") or {}).get("serving", "ssd") == "ssd"),
            timeout=3 * INTERVAL_S + 2.0 + 10.0)
        took = time.monotonic() - freed
        assert took <= 3 * INTERVAL_S + 2.0 + 5.0, took  # three intervals and the hold
        wb = status["store"]["write_behind"]
        assert not wb["paused"] and wb["errors"] == 0
        for i in range(3):  # what was answered before is still there
            r = _ask(p, f"op-{i}", "Still fine?")
            assert r["new_tokens"] > 0 and r["reused_tokens"] >= 16
    finally:
        p.stop()
