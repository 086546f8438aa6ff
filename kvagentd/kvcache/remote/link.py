"""The connection to the shared remote store (Redis or Valkey), and whether it is usable now.

`RemoteLink` holds two redis-py clients of one server or cluster: a *read* client whose socket
timeouts are `read_timeout_s` (reads sit in a request's path, so they fail fast) and a *write*
client with `write_timeout_s` (used by the write-behind thread and the fleet jobs only). Neither
client retries by itself: a failed command is an outcome here, never a wait.

State machine (one table, `_TRANSITIONS`):

    UP --(connection error or timeout)--> DOWN --(probe answered PONG)--> UP

While DOWN, reads and writes are not even tried (`Outcome.SKIPPED`), so a dead or unreachable
remote costs a request nothing. `probe()` is called by background threads only (write-behind,
heartbeat), at most once per backoff (0.5 s doubling to `retry_max_s`); a request never probes.
The clients are rebuilt on recovery (a restarted or failed-over server gets fresh connections).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar
from urllib.parse import urlsplit

import structlog

from kvagentd.kvcache.transitions import check_transition

log = structlog.get_logger(__name__)

T = TypeVar("T")

FIRST_BACKOFF_S = 0.5


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    """How to reach the remote store and how to use it (mapped from `[remote]` by the
    composition root, which also resolves the password from its file or credential)."""

    url: str
    cluster: bool = False
    username: str = ""
    password: str | None = field(default=None, repr=False)
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    client_name: str = "kvagentd"
    key_prefix: str = "kvagentd"
    ttl_s: float = 7 * 86400.0
    read_timeout_s: float = 0.25
    write_timeout_s: float = 2.0
    write_rate_bytes_per_s: int = 64 << 20
    write_queue_bytes: int = 256 << 20
    retry_max_s: float = 30.0

    def display_url(self) -> str:
        """The URL as shown in status and logs (never a password: the config refuses those)."""
        parts = urlsplit(self.url)
        user = f"{self.username}@" if self.username else ""
        host = parts.netloc.rsplit("@", 1)[-1]
        return f"{parts.scheme}://{user}{host}{parts.path}" + (" (cluster)" if self.cluster else "")


class LinkState(enum.Enum):
    UP = "up"
    DOWN = "down"


_TRANSITIONS: dict[LinkState, frozenset[LinkState]] = {
    LinkState.UP: frozenset({LinkState.DOWN}),
    LinkState.DOWN: frozenset({LinkState.UP}),
}


class Outcome(enum.Enum):
    """How one remote operation went."""

    OK = "ok"
    SKIPPED = "skipped"  # the link is down: not tried
    DOWN = "down"        # failed now with a connection error or timeout (the link went down)
    FULL = "full"        # the server refused a write for memory (maxmemory, noeviction)
    FAILED = "failed"    # the server answered an error (ACL, wrong type, script error ...)


class Reply(NamedTuple, Generic[T]):
    outcome: Outcome
    value: T | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


ClientFactory = Callable[[RemoteSpec, float], Any]
"""Builds one redis-py client (`redis.Redis` or `redis.cluster.RedisCluster`) with the given
socket timeout."""


def make_client(spec: RemoteSpec, timeout_s: float) -> Any:
    """A redis-py client for `spec`: TLS from a rediss:// URL plus the CA / client files, the
    ACL user and password, no retries of its own, `timeout_s` for connects and commands."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
                          "retry": Retry(NoBackoff(), 0), "client_name": spec.client_name}
    if spec.username:
        kw["username"] = spec.username
    if spec.password is not None:
        kw["password"] = spec.password
    if spec.url.startswith("rediss://"):
        if spec.tls_ca_file is not None:
            kw["ssl_ca_certs"] = str(spec.tls_ca_file)
        if spec.tls_cert_file is not None:
            kw["ssl_certfile"] = str(spec.tls_cert_file)
            kw["ssl_keyfile"] = str(spec.tls_key_file)
    if spec.cluster:
        from redis.cluster import RedisCluster

        # NOTE: RedisCluster passes no command packer to its nodes' connections
        return RedisCluster.from_url(spec.url, **kw)
    packer = command_packer()
    if packer is not None:
        kw["command_packer"] = packer
    return redis.Redis.from_url(spec.url, **kw)


def command_packer() -> Any | None:
    """redis-py's Python command packer, for a client whose replies hiredis parses.

    With hiredis installed (the `remote` extra installs it), redis-py parses replies with it,
    3x faster GETs of 0.7 MB records than its Python parser on this machine, but also packs
    commands with it, which copies every value into one new buffer: SETs of the same records
    were 4x slower. The Python packer hands large values to the socket as they are. None where
    this redis-py lacks it (its default packer is used)."""
    try:
        from redis._parsers import Encoder
        from redis.connection import PythonRespSerializer
    except ImportError:
        return None
    encoder = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
    return PythonRespSerializer(PACK_BUFFER_CUTOFF, encoder.encode)


PACK_BUFFER_CUTOFF = 6000  # redis-py's own: values longer than this are sent unjoined


def _faults() -> tuple[type[BaseException], ...]:
    """What a remote operation may raise for a fault of the remote (not a bug here).
    NOTE: redis-py's cluster errors (no reachable node, a slot nobody serves) derive from
    `Exception`, not `RedisError`."""
    from redis.exceptions import RedisClusterException, RedisError

    return RedisError, RedisClusterException, OSError


def _classify(exc: BaseException) -> Outcome:
    from redis import exceptions as rex

    if isinstance(exc, rex.OutOfMemoryError):
        return Outcome.FULL
    if isinstance(exc, rex.AuthenticationError | rex.AuthorizationError | rex.NoPermissionError):
        return Outcome.FAILED  # wrong user, password or ACL: not a transient fault
    if isinstance(exc, rex.ConnectionError | rex.TimeoutError | rex.ClusterError
                  | rex.RedisClusterException | rex.MasterDownError | OSError):
        return Outcome.DOWN
    return Outcome.FAILED


class RemoteLink:
    """See the module docstring. Thread-safe. `factory` builds the clients (tests may pass
    their own); `clock` is monotonic seconds."""

    def __init__(self, spec: RemoteSpec, *, factory: ClientFactory = make_client,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self._factory = factory
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        self.state = LinkState.UP  # optimistic: the first operation finds out
        self.since = time.time()
        self.last_error = ""
        self._backoff = FIRST_BACKOFF_S
        self._next_probe = 0.0
        self.counters = dict(reads=0, read_failures=0, reads_skipped=0, writes=0,
                             write_failures=0, writes_skipped=0, full=0, downs=0, probes=0)

    # -- state -------------------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self.state is LinkState.UP

    def _set(self, new: LinkState, reason: str) -> None:
        """Caller holds the lock."""
        check_transition(_TRANSITIONS, self.state, new, "remote link")
        self.state, self.since = new, time.time()
        if new is LinkState.DOWN:
            self.counters["downs"] += 1
            self.last_error = reason
            self._next_probe = self._clock() + self._backoff
            log.warning("remote_down", url=self.spec.display_url(), error=reason,
                        retry_in_s=self._backoff)
        else:
            self._backoff = FIRST_BACKOFF_S
            log.warning("remote_up", url=self.spec.display_url())

    def _fault(self, exc: BaseException, kind: str) -> Reply[Any]:
        outcome = _classify(exc)
        text = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.counters[f"{kind}_failures"] += 1
            if outcome is Outcome.FULL:
                self.counters["full"] += 1
            if outcome is not Outcome.DOWN:
                self.last_error = text
            elif self.state is LinkState.UP:
                self._set(LinkState.DOWN, text)
                stale, self._clients = self._clients, {}
            else:
                stale = {}
        if outcome is Outcome.DOWN:
            _close_all(stale)
        else:
            log.warning("remote_error", op=kind, error=text)
        return Reply(outcome, None, text)

    def _client(self, kind: str) -> Any:
        with self._lock:
            c = self._clients.get(kind)
        if c is not None:
            return c
        timeout = self.spec.read_timeout_s if kind == "read" else self.spec.write_timeout_s
        c = self._factory(self.spec, timeout)  # a cluster client connects here (may raise)
        with self._lock:
            self._clients.setdefault(kind, c)
            return self._clients[kind]

    # -- operations --------------------------------------------------------------------------
    def read(self, op: Callable[[Any], T]) -> Reply[T]:
        """Run `op(read client)` unless the link is down; never raises for a remote fault."""
        return self._run("read", op)

    def write(self, op: Callable[[Any], T]) -> Reply[T]:
        """Run `op(write client)` unless the link is down; never raises for a remote fault."""
        return self._run("write", op)

    def _run(self, kind: str, op: Callable[[Any], T]) -> Reply[T]:
        if self.state is not LinkState.UP:
            with self._lock:
                self.counters[f"{kind}s_skipped"] += 1
            return Reply(Outcome.SKIPPED, None, self.last_error)
        try:
            value = op(self._client(kind))
        except _faults() as exc:
            return self._fault(exc, kind)
        with self._lock:
            self.counters[f"{kind}s"] += 1
        return Reply(Outcome.OK, value)

    def probe(self, *, force: bool = False) -> bool:
        """While down and a probe is due (or `force`): PING with fresh clients; True when the
        link is up (afterwards). For background threads only."""
        with self._lock:
            if self.state is LinkState.UP:
                return True
            if not force and self._clock() < self._next_probe:
                return False
            self.counters["probes"] += 1
            stale, self._clients = self._clients, {}
        _close_all(stale)
        try:
            ok = bool(self._client("write").ping())
            error = "no PONG"
        except _faults() as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        with self._lock:
            if ok and self.state is LinkState.DOWN:
                self._set(LinkState.UP, "pong")
            elif not ok:
                self.last_error = error
                self._backoff = min(self._backoff * 2, self.spec.retry_max_s)
                self._next_probe = self._clock() + self._backoff
            return self.up

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"url": self.spec.display_url(), "state": self.state.value,
                    "since": self.since, "last_error": self.last_error or None,
                    **self.counters}

    def close(self) -> None:
        with self._lock:
            stale, self._clients = self._clients, {}
        _close_all(stale)


def _close_all(clients: dict[str, Any]) -> None:
    for c in clients.values():
        try:
            c.close()
        except Exception:  # noqa: BLE001 - closing a broken client must not hide the fault
            log.debug("remote_client_close_failed", exc_info=True)
