"""`kvagentd run` as a subprocess: readiness, sd_notify order, signals, reload, exit codes."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.daemon.conftest import ROOT, write_config


def _json_events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_start_ready_stop_with_notify_order_and_socket_removed(spawn) -> None:
    p = spawn(env={"WATCHDOG_USEC": "300000"})
    ready = p.notify.wait_for("READY=1")
    assert p.socket.exists()
    assert p.get("/v1/readyz") == {"ready": True, "health": "ok"}
    assert any(f.startswith("STATUS=") for f in ready.split("\n"))
    p.notify.wait_for("WATCHDOG=1")  # half of WATCHDOG_USEC, from the main loop
    p.send_signal(signal.SIGTERM)
    assert p.wait() == 0
    p.notify.drain()
    fields = p.notify.fields()
    assert fields.index("READY=1") < fields.index("STOPPING=1")
    assert fields[0] == "STATUS=starting"
    assert not p.socket.exists()
    events = [e["event"] for e in _json_events(p.output())]
    assert events.index("daemon_ready") < events.index("daemon_stopping") < events.index(
        "daemon_stopped")


def test_sigint_is_graceful_too(spawn) -> None:
    p = spawn()
    p.notify.wait_for("READY=1")
    p.send_signal(signal.SIGINT)
    assert p.wait() == 0
    assert not p.socket.exists()


def test_shutdown_route_stops_the_daemon(spawn) -> None:
    p = spawn()
    p.notify.wait_for("READY=1")
    with p.client() as c:
        assert c.post("/v1/shutdown").json() == {"stopping": True}
    assert p.wait() == 0
    assert "STOPPING=1" in p.notify.drain() or "STOPPING=1" in p.notify.fields()


def test_sighup_reloads_log_level_and_keeps_old_config_on_error(spawn, short_dir: Path) -> None:
    config = write_config(short_dir, log_level="info")
    p = spawn(config)
    p.notify.wait_for("READY=1")
    p.notify.messages.clear()
    write_config(short_dir, log_level="debug",
                 extra="[placement]\npolicy = \"lru\"\ntrace_capacity = 10\n")
    p.send_signal(signal.SIGHUP)
    p.notify.wait_for("RELOADING=1")
    p.notify.wait_for("READY=1")
    cfg = p.get("/v1/config")["config"]
    assert cfg["daemon"]["log_level"] == "debug"
    assert cfg["placement"]["policy"] == "lru"  # placement's policy changes live ...
    assert cfg["placement"]["trace_capacity"] == 100_000  # ... its trace buffer's size does not
    reloaded = [e for e in _json_events(p.output()) if e.get("event") == "config_reloaded"]
    assert reloaded[-1]["applied"] == {"daemon.log_level": ["info", "debug"],
                                       "placement.policy": ["reuse", "lru"]}
    assert reloaded[-1]["restart_required"] == ["placement.trace_capacity"]
    assert _config_check(p)["status"] == "degraded"  # operators see what is not applied yet
    assert "applied at the next restart: placement.trace_capacity" in _config_check(p)["reason"]

    config.write_text(config.read_text().replace('log_level = "debug"',
                                                 'log_level = "loud"'))
    p.notify.messages.clear()
    p.send_signal(signal.SIGHUP)
    p.notify.wait_for("READY=1")
    assert p.get("/v1/config")["config"]["daemon"]["log_level"] == "debug"
    rejected = [e for e in _json_events(p.output()) if e.get("event") == "reload_rejected"]
    assert rejected and rejected[-1]["field"] == "daemon.log_level"
    check = _config_check(p)  # a restart would fail: said before it happens
    assert check["status"] == "degraded" and "no longer loads" in check["reason"]
    assert "daemon.log_level" in check["reason"]
    # the file fixed and back to what runs: nothing pending
    config.write_text(config.read_text().replace('log_level = "loud"', 'log_level = "debug"')
                      .replace("trace_capacity = 10\n", "trace_capacity = 100000\n"))
    p.notify.messages.clear()
    p.send_signal(signal.SIGHUP)
    p.notify.wait_for("READY=1")
    assert _config_check(p)["status"] == "ok"
    p.send_signal(signal.SIGTERM)
    assert p.wait() == 0


def _config_check(p) -> dict:
    return {c["name"]: c for c in p.get("/v1/health")["checks"]}["config"]


def test_second_signal_exits_at_once(spawn, short_dir: Path) -> None:
    config = write_config(short_dir)
    config.write_text(config.read_text().replace("drain_timeout_s = 5.0", "drain_timeout_s = 120.0")
                      + "")
    text = config.read_text().replace('socket_group = ""',
                                      'socket_group = ""\nheader_timeout_s = 120.0')
    config.write_text(text)
    p = spawn(config)
    p.notify.wait_for("READY=1")
    # A request that has started (request line sent) but never finishes keeps the drain busy.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(p.socket))
    s.sendall(b"GET /v1/status HTTP/1.1\r\nX-Partial: ")
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGTERM)  # an immediate duplicate (as from a process-group wrapper)
    p.notify.wait_for("STOPPING=1")
    time.sleep(1.0)
    assert p.proc.poll() is None  # still draining
    p.send_signal(signal.SIGTERM)
    assert p.wait(10) == 128 + signal.SIGTERM
    s.close()


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagentd", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_bad_config_exits_78_naming_the_field(short_dir: Path) -> None:
    config = write_config(short_dir)
    config.write_text(config.read_text().replace('hot_bytes = "16MiB"', 'hot_bytes = "lots"'))
    r = _run_cli("run", "--config", str(config))
    assert r.returncode == 78
    assert "kv.hot_bytes" in r.stderr and "'lots'" in r.stderr and "512MiB" in r.stderr
    assert not (short_dir / "run" / "kvagentd.sock").exists()


def test_missing_config_file_exits_78(short_dir: Path) -> None:
    r = _run_cli("run", "--config", str(short_dir / "absent.toml"))
    assert r.returncode == 78 and "absent.toml" in r.stderr


def test_check_config(short_dir: Path) -> None:
    good = write_config(short_dir)
    r = _run_cli("check-config", str(good))
    assert r.returncode == 0 and "ok" in r.stdout
    bad = short_dir / "bad.toml"
    bad.write_text("[control]\nmax_connections = 0\n")
    r = _run_cli("check-config", str(bad))
    assert r.returncode == 78 and "control.max_connections" in r.stderr and "[1, 4096]" in r.stderr
    # what `run` refuses against this machine, check-config refuses too (before any model)
    huge = short_dir / "huge.toml"
    assert 'hot_bytes = "16MiB"' in good.read_text()
    assert 'source = "none"' in good.read_text()
    huge.write_text(good.read_text().replace('hot_bytes = "16MiB"', 'hot_bytes = "64TiB"')
                    .replace('source = "none"', 'source = "none"\ndevice = "cpu"'))
    r = _run_cli("check-config", str(huge))
    assert r.returncode == 78 and "kv.hot_bytes" in r.stderr and "available now" in r.stderr


def test_usage_error_exits_64() -> None:
    assert _run_cli("frobnicate").returncode == 64


def test_socket_in_use_fails_startup_without_touching_the_running_daemon(spawn,
                                                                         short_dir: Path) -> None:
    p = spawn()
    p.notify.wait_for("READY=1")
    r = _run_cli("run", "--config", str(p.config))
    assert r.returncode == 73
    assert "another process is listening" in r.stdout + r.stderr
    assert p.get("/v1/livez") == {"alive": True}
    p.send_signal(signal.SIGTERM)
    assert p.wait() == 0
