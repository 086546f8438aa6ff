"""kvctl against an in-process control server: output, --json, exit codes."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from kvagentd.config import config_to_dict
from kvagentd.control.errors import BadConfig, Busy, Forbidden, NotFound, NotReady
from kvagentd.control.handlers import fleet as fleet_routes
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvctl.common import Opts, stream
from kvctl.main import main
from tests.control.conftest import FakeDaemon, Harness, make_config, start_harness


@pytest.fixture
def h(short_dir: Path) -> Iterator[Harness]:
    harness = start_harness(make_config(short_dir))
    yield harness
    harness.server.stop(1.0)


def kvctl(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def _status_raises(h: Harness, exc: BaseException | None = None, sleep: float = 0.0) -> None:
    def status() -> dict[str, Any]:
        if sleep:
            time.sleep(sleep)
        if exc is not None:
            raise exc
        return {}
    h.daemon.status = status  # type: ignore[method-assign]


def test_status_human_and_json(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    h.daemon.status = lambda: {  # type: ignore[method-assign]
        "version": "0.1.0", "pid": 42, "phase": "running", "ready": True, "uptime_s": 3725.0,
        "host": {"memory": {"total_bytes": 64 << 30, "available_bytes": 40 << 30,
                            "used_percent": 37.5},
                 "disks": [{"path": "/var/lib/kvagentd", "total_bytes": 1 << 40,
                            "free_bytes": 1 << 39, "used_percent": 50.0}]},
        "gpu": None, "gpu_reason": "NVML unavailable: no library",
        "store": {"hot_blocks": 10, "tiers": {"warm": 5}},
        "commentary": {"pump-1": {"asset": "pump-1", "state": "missing", "failed": 1, "cut": 2,
                                  "withheld": 3, "reason": "the last 3 model turns gave none"},
                       "fan-2": {"asset": "fan-2", "state": "ok", "failed": 0, "cut": 0,
                                 "withheld": 0, "reason": "commenting"}},
    }
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "status")
    assert code == 0
    assert ("comment  pump-1: missing  withheld 3  failed 1  cut 2  (the last 3 model turns "
            "gave none)") in out
    assert "comment  fan-2: ok  withheld 0  failed 0  cut 0\n" in out
    assert "kvagentd 0.1.0  running, ready  up 1h 2m  pid 42" in out
    assert "40.0 GiB available of 64.0 GiB" in out
    assert "gpu      none (NVML unavailable: no library)" in out
    assert "store:" in out and "hot_blocks: 10" in out
    code, out, _ = kvctl(capsys, "status", "--socket", str(h.path), "--json")
    assert code == 0 and json.loads(out)["store"] == {"hot_blocks": 10, "tiers": {"warm": 5}}


def test_options_before_or_after_the_command_and_env_socket(
        h: Harness, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = kvctl(capsys, "--json", "--socket", str(h.path), "health")
    assert code == 0 and json.loads(out)["status"] == "ok"
    monkeypatch.setenv("KVAGENTD_SOCKET", str(h.path))
    code, out, _ = kvctl(capsys, "health", "--json", "--timeout", "5")
    assert code == 0 and json.loads(out)["checks"][0]["name"] == "x"


def test_health_table_and_nagios_exit_codes(h: Harness,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """0 ok, 1 degraded, 2 failing (as a Nagios check), with --json too."""
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "health")
    assert code == 0 and out.splitlines()[0] == "health: ok" and "CHECK" in out
    h.daemon.health = lambda: {  # type: ignore[method-assign]
        "status": "degraded", "checks": [
            {"name": "memory", "status": "degraded", "reason": "900 MiB available"},
            {"name": "disk:/var", "status": "ok", "pending": "degraded", "pending_s": 6.0,
             "reason": "1 GiB free (degraded for 6 s; counts after 15 s)"}],
        "commentary": [{"asset": "pump-1", "state": "missing", "failed": 0, "cut": 0,
                        "withheld": 3, "reason": "the last 3 model turns gave no commentary"}]}
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "health")
    assert code == 1 and out.startswith("health: degraded") and "900 MiB available" in out
    assert "counts after 15 s" in out
    notes = out.split("commentary (the model's text on each tick; not part of health)\n")[1]
    assert "pump-1" in notes and "missing" in notes and "3 model turns" in notes
    assert kvctl(capsys, "--socket", str(h.path), "--json", "health")[0] == 1
    h.daemon.health = lambda: {"status": "failing", "checks": [  # type: ignore[method-assign]
        {"name": "disk", "status": "failing", "detail": "cold tier read-only"}]}
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "health")
    assert code == 2 and "cold tier read-only" in out and "commentary" not in out
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "--json", "health")
    assert code == 2 and json.loads(out)["status"] == "failing"


def test_config_show_is_valid_toml_of_the_running_config(
        h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "config", "show")
    assert code == 0
    parsed = tomllib.loads(out)
    expected = config_to_dict(h.daemon.config)
    assert parsed["kv"] == expected["kv"]
    assert parsed["agent"]["assets"][0]["name"] == expected["agent"]["assets"][0]["name"]
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "--json", "config", "show", "control")
    assert code == 0 and set(json.loads(out)["config"]) == {"control"}
    code, _, err = kvctl(capsys, "--socket", str(h.path), "config", "show", "nope")
    assert code == 64 and "no config section 'nope'" in err


@pytest.mark.parametrize("exc,code,kind", [
    (NotFound("no session 'nosuch'"), 1, "not_found"),
    (NotFound("no remote store is configured", kind="not_configured"), 69, "not_configured"),
    (Busy("queue full"), 75, "busy"),
    (NotReady("starting"), 75, "not_ready"),
    (Forbidden("only operators"), 77, "forbidden"),
    (BadConfig("kv.hot_bytes: bad"), 78, "bad_config"),
    (KeyError("bug"), 1, "internal"),
])
def test_api_errors_map_to_exit_codes(h: Harness, capsys: pytest.CaptureFixture[str],
                                      exc: BaseException, code: int, kind: str) -> None:
    _status_raises(h, exc)
    got, _, err = kvctl(capsys, "--socket", str(h.path), "status")
    assert got == code and err.startswith("kvctl: ")
    got, out, _ = kvctl(capsys, "--socket", str(h.path), "--json", "status")
    assert got == code and json.loads(out)["error"]["kind"] == kind


def test_timeout_exits_75(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    _status_raises(h, sleep=2.0)
    code, _, err = kvctl(capsys, "--socket", str(h.path), "--timeout", "0.3", "status")
    assert code == 75 and "no reply within 0.3 s" in err


def test_no_daemon_exits_69_with_a_hint(short_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = short_dir / "absent.sock"
    code, _, err = kvctl(capsys, "--socket", str(path), "status")
    assert code == 69
    assert str(path) in err and "is the daemon running? systemctl status kvagentd" in err
    code, out, _ = kvctl(capsys, "--socket", str(path), "--json", "status")
    assert code == 69 and json.loads(out)["error"]["kind"] == "unreachable"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_dir / "stale.sock"))
    stale.close()  # a socket file nobody listens on
    code, _, _ = kvctl(capsys, "--socket", str(short_dir / "stale.sock"), "health")
    assert code == 69


def test_usage_errors_exit_64(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvctl(capsys, "frobnicate")[0] == 64
    assert kvctl(capsys, "status", "--timeout", "0")[0] == 64
    assert kvctl(capsys, "status", "--no-such-flag")[0] == 64
    code, out, _ = kvctl(capsys, "--version")
    assert code == 0 and out.startswith("kvctl ")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
def test_socket_permission_denied_exits_77(h: Harness) -> None:
    os.chmod(h.path.parent.parent, 0o755)  # the socket's directory itself stays 0750
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                os.dup2(null.fileno(), 2)
            code = main(["--socket", str(h.path), "status"])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 77


def test_an_unreadable_socket_file_exits_77_not_64(h: Harness) -> None:
    """The socket file itself 0600 (not its directory): the connect is refused, so 77 with
    the socket named, never click's "path is not readable" usage error (64)."""
    assert os.geteuid() == 0, "dropping to another uid needs root"
    os.chmod(h.path.parent.parent, 0o755)
    os.chmod(h.path.parent, 0o755)
    os.chmod(h.path, 0o600)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            sys.stderr = open(w, "w", closefd=False)  # pytest holds the real one
            sys.stdout = open(os.devnull, "w")
            code = main(["--socket", str(h.path), "health"])
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as err:
        message = err.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 77, message
    assert f"may not connect to {h.path}" in message and "kvagent group" in message


def test_fleet_without_a_remote_tier_exits_69_not_75(
        short_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Retrying cannot help a daemon that runs without `[remote]`: not 75 (try again)."""
    cfg = make_config(short_dir)
    router = Router()
    fleet_routes.register(router, FakeDaemon(cfg))
    server = ControlServer(cfg.control, router)
    server.start()
    try:
        code, _, err = kvctl(capsys, "--socket", str(server.path), "fleet")
        assert code == 69 and "no remote store is configured ([remote] url)" in err
        code, out, _ = kvctl(capsys, "--socket", str(server.path), "--json", "fleet")
        assert code == 69 and json.loads(out)["error"]["kind"] == "not_configured"
    finally:
        server.stop(1.0)


def _collect(o: Opts, path: str) -> list[Any]:
    return list(stream(o, "GET", path))


def test_stream_helper_yields_items_and_maps_failures(h: Harness,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    o = Opts(socket=h.path, json=False, timeout=5.0)
    assert _collect(o, "/test/stream/3") == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert "".join(_collect(o, "/test/text")) == "hello world"
    assert _collect(o, "/test/sse") == [{"token": "hel"}, "lo\nworld"]
    with pytest.raises(typer.Exit) as exc:
        _collect(o, "/test/stream-busy")
    assert exc.value.exit_code == 75
    items: list[Any] = []
    with pytest.raises(typer.Exit) as exc:
        for item in stream(o, "GET", "/test/stream-fails"):
            items.append(item)
    assert items == [{"i": 0}] and exc.value.exit_code == 1
    assert "internal" in capsys.readouterr().err
    with pytest.raises(typer.Exit) as exc:
        _collect(Opts(socket=h.path.parent / "absent.sock"), "/test/text")
    assert exc.value.exit_code == 69


def test_status_summarizes_services_it_knows(h: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    h.daemon.status = lambda: {  # type: ignore[method-assign]
        "version": "0.1.0", "pid": 42, "phase": "running", "ready": True, "uptime_s": 60.0,
        "gpu": None, "gpu_reason": "no GPU",
        "store": {"tiers": {"hot": {"blocks": 27, "capacity": 364, "bytes": 19906560,
                                    "fragmentation": 0.25, "device": "cpu"},
                            "warm": {"blocks": 0, "capacity": 364, "bytes": 0,
                                     "fragmentation": 0.0, "device": "cpu"},
                            "cold": {"blocks": 5, "bytes_used": 1 << 20,
                                     "capacity_bytes": 1 << 30, "codec": "raw",
                                     "read_only": True, "failover": {"serving": "shadow"}}},
                  "loaded_hot": 1, "loaded_warm": 2, "loaded_cold": 3, "lost": 4},
        "agent": {"assets": {"pump-1": {"last_zone": "C", "last_assessment_age_s": 2.0,
                                        "tick_latency_p50_s": 1.5, "tick_latency_p99_s": 2.5,
                                        "ticks": 9, "skipped_ticks": 1, "missed_ticks": 6,
                                        "bad_samples_total": 0, "session": "pump-1-2"}}},
        "engine": {"model": "SmolLM2", "executor": "not a dict"},
        "placement": {"policy": "heat+prefetch", "rounds": 7, "errors": 0,
                      "last_round": {"moves": {"demote:heat": 3}, "decision_s": 0.0012},
                      "blocks": 1200, "memory_bytes": {"stats": 3 << 20, "heat": 1 << 20},
                      "prefetched_blocks": {"raised": 40, "used": 31, "wasted": 6,
                                            "waiting": 3}},
    }
    code, out, _ = kvctl(capsys, "--socket", str(h.path), "status")
    assert code == 0
    assert "hot      27 / 364 blocks" in out and "fragmentation 25.0%" in out
    assert "READ-ONLY" in out and "serving shadow" in out
    assert "cold 3  lost 4" in out
    row = next(line for line in out.splitlines() if line.startswith("pump-1"))
    assert row.split()[:2] == ["pump-1", "C"] and "pump-1-2" in row
    assert row.split()[-3:-1] == ["7", "0"]  # skipped: 1 overlapping + 6 missed; bad samples
    assert "engine:" in out and "executor: not a dict" in out  # unexpected shape: every field
    assert "placement heat+prefetch  rounds 7" in out and "last round 3 moves" in out
    assert "1200 blocks known in 4.0 MiB" in out
    assert "prefetched 40 blocks: 31 used, 6 moved down or dropped unused, 3 waiting" in out
