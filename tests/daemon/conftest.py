"""Fixtures: a temp-dir config and a `kvagentd run` subprocess with a test NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvd", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def write_config(d: Path, *, log_level: str = "info", extra: str = "") -> Path:
    path = d / "kvagentd.toml"
    path.write_text(f"""
[daemon]
state_dir = "{d}/state"
cache_dir = "{d}/cache"
log_level = "{log_level}"
log_format = "json"
drain_timeout_s = 5.0
main_loop_interval_s = 0.1

[control]
socket = "{d}/run/kvagentd.sock"
socket_group = ""
operator_group = ""

[model]
source = "none"

[kv]
cold_dir = "{d}/cold"
hot_bytes = "16MiB"
warm_ratio = 1.0
cold_capacity_bytes = "64MiB"
segment_bytes = "16MiB"
o_direct = false

[maintenance]
shadow_dir = "{d}/shm"
shadow_bytes = "16MiB"
health_status_file = "{d}/state/ssd-health.json"

[agent]
enabled = false
{extra}
""")
    return path


class NotifyListener:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def wait_for(self, field: str, timeout: float = 60.0) -> str:
        """Read datagrams until one contains `field` (e.g. "READY=1"); keep all of them."""
        for m in self.messages:
            if field in m.split("\n"):
                return m
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                msg = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.messages.append(msg)
            if field in msg.split("\n"):
                return msg
        raise AssertionError(f"no {field} within {timeout} s; got {self.messages}")

    def drain(self) -> list[str]:
        self.sock.settimeout(0.2)
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                return self.messages

    def fields(self) -> list[str]:
        return [f for m in self.messages for f in m.split("\n")]

    def close(self) -> None:
        self.sock.close()


class DaemonProcess:
    """`kvagentd run --config CONFIG` in `d`; with `mounts` (shell lines, see tests/mounts.py)
    in a private mount namespace set up by them first."""

    def __init__(self, d: Path, config: Path, env: dict[str, str] | None = None,
                 mounts: list[str] | None = None) -> None:
        self.dir, self.config = d, config
        self.notify = NotifyListener(d / "notify.sock")
        self.socket = d / "run" / "kvagentd.sock"
        self.log = (d / "daemon.log").open("w+")
        full_env = {**os.environ, "NOTIFY_SOCKET": str(self.notify.path),
                    "PYTHONPATH": str(ROOT), **(env or {})}
        full_env = {k: v for k, v in full_env.items() if not k.startswith("KVAGENTD_")
                    or k in (env or {})}
        argv = [sys.executable, "-m", "kvagentd", "run", "--config", str(config)]
        if mounts:
            from tests.mounts import run_isolated

            self.proc = run_isolated(argv, mounts, env=full_env, cwd=d, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        else:
            self.proc = subprocess.Popen(argv, cwd=d, env=full_env, stdout=self.log,
                                         stderr=subprocess.STDOUT)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)),
                            base_url="http://kvagentd", timeout=10)

    def get(self, path: str) -> Any:
        with self.client() as c:
            return c.get(path).json()

    def send_signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()
        self.log.close()


@pytest.fixture
def spawn(short_dir: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def _spawn(config: Path | None = None, env: dict[str, str] | None = None) -> DaemonProcess:
        p = DaemonProcess(short_dir, config or write_config(short_dir), env)
        started.append(p)
        return p

    yield _spawn
    for p in started:
        p.stop()
