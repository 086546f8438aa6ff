"""A real redis-server for tests: started on a free loopback port in a temp directory, with
optional TLS (certificates made with openssl here), ACL users and single-node cluster mode;
killed, restarted and flushed by the tests. No persistence (`save ""`, no AOF).

A missing redis-server binary is a test failure that says how to install it, never a skip
(`make test` installs it through its system-deps step).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SERVER = shutil.which("redis-server") or next(
    (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if Path(p).is_file()),
    None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Tls:
    ca: Path
    cert: Path
    key: Path


def make_tls(d: Path) -> Tls:
    """A CA and a server certificate for 127.0.0.1 / localhost, made with openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is needed to make test certificates (apt-get install openssl)")
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=kvagentd-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    return Tls(d / "ca.crt", d / "server.crt", d / "server.key")


@dataclass
class RedisServer:
    """One redis-server process. `users`: ACL users as {name: password} (then the default
    user is off); `tls`: serve TLS only; `cluster`: one node owning every slot."""

    dir: Path
    users: dict[str, str] = field(default_factory=dict)
    tls: Tls | None = None
    cluster: bool = False
    maxmemory: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        if SERVER is None:
            pytest.fail("redis-server not found: install it (apt-get install redis-server; "
                        "make test does so in its system-deps step)")
        a = [SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--protected-mode", "no", "--loglevel", "warning"]
        if self.tls:
            a += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                  "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                  "--tls-auth-clients", "no"]
        else:
            a += ["--port", str(self.port)]
        for name, password in self.users.items():
            a += ["--user", name, "on", f">{password}", "~*", "&*", "+@all"]
        if self.users:
            a += ["--user", "default", "off"]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        return a

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.cluster:
            (self.dir / "nodes.conf").unlink(missing_ok=True)
            while self.port + 10000 > 65535:  # the cluster bus listens on port + 10000
                self.port = free_port()
        self.proc = subprocess.Popen(self.args(), cwd=self.dir, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self._wait_listening()
        if self.cluster:
            self.cli("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            end = time.monotonic() + 20
            while "cluster_state:ok" not in self.cli("CLUSTER", "INFO"):
                if time.monotonic() > end:
                    pytest.fail("single-node cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        return self

    def _wait_listening(self) -> None:
        assert self.proc is not None
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode() if self.proc.stdout else ""
                pytest.fail(f"redis-server exited ({self.proc.returncode}): {out}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"redis-server did not listen on {self.port}")

    def client(self):  # noqa: ANN201 - a redis.Redis
        import redis

        kw: dict[str, object] = {}
        if self.users:
            name, password = next(iter(self.users.items()))
            kw.update(username=name, password=password)
        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=str(self.tls.ca))
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kw)

    def cli(self, *args: str) -> str:
        with self.client() as c:
            return _text(c.execute_command(*args))

    def kill(self) -> None:
        """SIGKILL, as a crash (no shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def redis_fixture(d: Path, **kw: object) -> Iterator[RedisServer]:
    server = RedisServer(d, **kw).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
