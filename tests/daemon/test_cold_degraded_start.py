"""A cold directory that cannot be written when the daemon starts (a read-only mount, a full
disk) starts the daemon on the shadow, not exit 70: it answers, its health says why (a full
disk failing, a read-only one degraded), and sessions work (their blocks go to the shadow)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.mounts import read_only, small_disk

from .conftest import DaemonProcess
from .test_full_daemon import _ask, _config


def _fill(path: Path) -> str:
    """Shell lines that fill the filesystem of `path` (a tmpfs) to the last byte."""
    return f"(dd if=/dev/zero of={path}/other-tenant bs=4k 2>/dev/null || true)"


@pytest.mark.parametrize("condition", ["read_only", "full_disk"])
def test_daemon_starts_degraded_on_the_shadow(short_dir: Path, condition: str) -> None:
    config = _config(short_dir)
    config.write_text(config.read_text().replace("[agent]\nenabled = true",
                                                 "[agent]\nenabled = false"))
    cold = short_dir / "cold"
    cold.mkdir()
    mounts = [read_only(cold)] if condition == "read_only" else [small_disk(cold, "1m"),
                                                                 _fill(cold)]
    p = DaemonProcess(short_dir, config, mounts=mounts)
    try:
        p.notify.wait_for("READY=1", timeout=120)
        failover = p.get("/v1/status")["maintenance"]["failover"]
        cause = "read_only" if condition == "read_only" else "no_space"
        assert failover["serving"] == "shadow" and failover["cause"] == cause, failover
        assert "could not be written at start" in failover["reason"]
        assert failover["ssd_unwritable"]
        health = p.get("/v1/health")
        checks = {c["name"]: c for c in health["checks"]}
        # a full cold disk is failing (its records go to RAM), a read-only one degraded
        want = "degraded" if condition == "read_only" else "failing"
        assert checks["cold-tier"]["status"] == want
        assert "could not be written at start" in checks["cold-tier"]["reason"]
        assert checks["read-only"]["status"] == "degraded"
        first = _ask(p, "op-1", "How is pump-1 doing?")
        again = _ask(p, "op-1", "And now?")
        assert first["new_tokens"] > 0 and again["reused_tokens"] >= 16
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, p.output()[-3000:]
        # what had to survive went to the shadow (the SSD took nothing)
        assert any((short_dir / "shm").glob("seg-*.kvs"))
    finally:
        p.stop()
