"""One frozen, typed configuration tree.

`load_config(path)` reads TOML, applies `KVAGENTD_SECTION__FIELD=value` environment overrides
and validates every field. Any problem raises `ConfigError` naming the field path, the bad value
and what is allowed; the daemon turns that into exit code 78 (EX_CONFIG).

Sizes (`*_bytes` fields) accept an integer or a string such as "18GiB", "512 MB", "128KiB".
Relative paths are resolved against the current working directory at load time.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit
from collections.abc import Mapping

from kvagentd import cron

DEFAULT_CONFIG_PATH = Path("/etc/kvagentd/kvagentd.toml")
ENV_PREFIX = "KVAGENTD_"


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""

    def __init__(self, path: str, value: object, allowed: str) -> None:
        self.path, self.value, self.allowed = path, value, allowed
        super().__init__(f"{path}: {value!r} is not valid; allowed: {allowed}")


def _rng(lo: float | None = None, hi: float | None = None) -> dict[str, float | None]:
    return {"min": lo, "max": hi}


class ByteSize(int):
    """An int that config files may write as "18GiB" / "512 MB"."""


class CronText(str):
    """A schedule: a crontab expression ("0 6 * * 1") or "<day-of-week> HH:MM" (`kvagentd.cron`),
    checked when the configuration is loaded."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "ki": 1024,
               "mib": 1024**2, "mi": 1024**2, "gib": 1024**3, "gi": 1024**3, "tib": 1024**4,
               "ti": 1024**4}


def parse_size(text: str) -> int:
    """Parse "18GiB" / "512 MB" / "4096" into bytes; raises ValueError."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


# --------------------------------------------------------------------------------------------
# The tree. Every leaf has a default; metadata carries ranges ("min"/"max").
# --------------------------------------------------------------------------------------------

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/kvagentd")
    cache_dir: Path = Path("/var/cache/kvagentd")
    log_level: LogLevel = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    drain_timeout_s: float = field(default=10.0, metadata=_rng(0.0, 600.0))
    main_loop_interval_s: float = field(default=1.0, metadata=_rng(0.05, 60.0))
    # The same warning again within this many seconds is counted, not written (0: all).
    log_repeat_interval_s: float = field(default=60.0, metadata=_rng(0.0, 86400.0))


@dataclass(frozen=True, slots=True)
class ControlConfig:
    socket: Path = Path("/run/kvagentd/kvagentd.sock")
    socket_group: str = "kvagent"  # "" keeps the daemon's primary group
    operator_group: str = "kvagent-operators"  # may change state; "" = only root / daemon uid
    socket_mode: int = field(default=0o660, metadata=_rng(0, 0o777))
    max_body_bytes: ByteSize = field(default=ByteSize(1 << 20), metadata=_rng(1024, 1 << 30))
    header_timeout_s: float = field(default=5.0, metadata=_rng(0.1, 300.0))
    read_timeout_s: float = field(default=10.0, metadata=_rng(0.1, 300.0))
    max_connections: int = field(default=64, metadata=_rng(1, 4096))
    # One uid never holds more than this many connections, so a flood by one peer leaves the
    # rest of max_connections to everyone else.
    max_connections_per_uid: int = field(default=8, metadata=_rng(1, 4096))
    # New connections per second one uid may open (bursts of max_connections_per_uid above).
    connect_rate_per_uid: float = field(default=50.0, metadata=_rng(0.1, 1e6))
    listen_backlog: int = field(default=1024, metadata=_rng(16, 65535))  # capped by somaxconn
    # Session ids (fnmatch globs) written only by the daemon, besides the agent's own
    # (`<asset>-<n>`, `report-<asset>-*`): nobody may ask in them, operators may fork them.
    daemon_sessions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MqttConfig:
    """How the agent's MQTT sources authenticate to brokers (`[agent.mqtt]`; the broker address
    and topic are per asset). The password is never a configuration value: it is read from
    `password_file` or from the systemd credential `password_credential`
    (`$CREDENTIALS_DIRECTORY/<name>`, `LoadCredential=` in the unit)."""

    username: str = ""
    password_file: Path | None = None
    password_credential: str = ""
    tls: bool = False
    ca_file: Path | None = None  # None: the system's CA store
    cert_file: Path | None = None  # a client certificate (with key_file), for brokers that ask
    key_file: Path | None = None
    client_id_prefix: str = "kvagentd"
    box_id: str = ""  # the per-box part of the client id; "": this host's name
    qos: int = field(default=0, metadata=_rng(0, 2))
    clean_session: bool = True
    keepalive_s: int = field(default=30, metadata=_rng(5, 3600))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # none: no LLM (control + features only)
    source: Literal["embedded", "hf_dir", "gguf", "none"] = "embedded"
    path: Path | None = None  # hf_dir: a directory; gguf: a .gguf file
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = field(default=0, metadata=_rng(0, 1024))  # 0 = torch default


@dataclass(frozen=True, slots=True)
class KVConfig:
    block_tokens: int = field(default=16, metadata=_rng(1, 1024))
    hot_bytes: ByteSize = field(default=ByteSize(18 * 1000**3), metadata=_rng(1 << 20, None))
    warm_ratio: float = field(default=0.35, metadata=_rng(0.0, 16.0))
    cold_dir: Path = Path("/var/lib/kvagentd/cold")
    cold_capacity_bytes: ByteSize = field(default=ByteSize(200 * 1000**3),
                                          metadata=_rng(1 << 20, None))
    segment_bytes: ByteSize = field(default=ByteSize(256 << 20), metadata=_rng(1 << 20, None))
    io_unit_bytes: ByteSize = field(default=ByteSize(128 << 10), metadata=_rng(4096, 64 << 20))
    cold_codec: Literal["raw", "int8", "fp8"] = "raw"
    cold_ttl_s: float = field(default=3600.0, metadata=_rng(1.0, None))
    o_direct: bool = True
    persist_on_shutdown: bool = True
    io_threads: int = field(default=2, metadata=_rng(1, 64))
    # committed hot and warm blocks are written to the cold tier every interval (0 = only at
    # a graceful stop), so a power cut loses at most that interval of KV; at most this rate
    write_behind_interval_s: float = field(default=30.0, metadata=_rng(0.0, 86400.0))
    write_behind_rate_bytes_per_s: ByteSize = field(default=ByteSize(64 << 20),
                                                    metadata=_rng(1 << 20, None))


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    policy: Literal["lru", "heat", "heat+prefetch", "reuse"] = "reuse"
    heatmap_window: int = field(default=200, metadata=_rng(1, 100_000))
    hot_factor: float = field(default=1.8, metadata=_rng(0.0, 100.0))
    warm_factor: float = field(default=0.9, metadata=_rng(0.0, 100.0))
    window_fraction: float = field(default=0.25, metadata=_rng(0.01, 1.0))
    hysteresis: float = field(default=0.2, metadata=_rng(0.0, 10.0))
    headroom_fraction: float = field(default=0.03, metadata=_rng(0.0, 0.5))
    interval_s: float = field(default=1.0, metadata=_rng(0.05, 3600.0))
    prefetch_lead_s: float = field(default=1.0, metadata=_rng(0.0, 3600.0))
    prefetch_max_inflight: int = field(default=8, metadata=_rng(1, 1024))
    trace_capacity: int = field(default=100_000, metadata=_rng(0, 100_000_000))
    warmup_sessions: int = field(default=8, metadata=_rng(0, 100_000))


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    queue_size: int = field(default=32, metadata=_rng(1, 100_000))
    ask_max_tokens: int = field(default=128, metadata=_rng(1, 32768))
    ask_deadline_s: float = field(default=120.0, metadata=_rng(0.1, 86400.0))
    report_deadline_s: float = field(default=600.0, metadata=_rng(0.1, 86400.0))
    # continuous batching: sequences per step, tokens per step, prefill chunk per sequence
    max_batch: int = field(default=16, metadata=_rng(1, 1024))
    step_tokens: int = field(default=256, metadata=_rng(1, 65536))
    prefill_chunk: int = field(default=256, metadata=_rng(1, 65536))
    aging_s: float = field(default=10.0, metadata=_rng(0.0, 86400.0))  # 0 = strict priority
    # memory a running batch holds beyond the hot pool (working copies or attention scratch)
    batch_memory_bytes: ByteSize = field(default=ByteSize(2 << 30), metadata=_rng(1 << 20, None))
    kv_layout: Literal["auto", "contiguous", "paged"] = "auto"  # auto: paged on CUDA


@dataclass(frozen=True, slots=True)
class BearingConfig:
    """Rolling-element bearing geometry (defaults: SKF 6205)."""

    balls: int = field(default=9, metadata=_rng(3, 100))
    ball_diameter_mm: float = field(default=7.94, metadata=_rng(0.1, 1000.0))
    pitch_diameter_mm: float = field(default=39.04, metadata=_rng(0.1, 10000.0))
    contact_angle_deg: float = field(default=0.0, metadata=_rng(0.0, 89.0))


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """A simulated fault (source = "simulated" only)."""

    kind: Literal["none", "outer_race", "inner_race", "ball", "cage", "imbalance", "misalignment",
                  "looseness"] = "none"
    onset_s: float = field(default=120.0, metadata=_rng(0.0, None))
    growth_per_hour: float = field(default=4.0, metadata=_rng(0.0, 1e6))
    severity: float = field(default=1.0, metadata=_rng(0.0, 1e6))


@dataclass(frozen=True, slots=True)
class AssetConfig:
    name: str = "pump-1"
    description: str = "centrifugal pump, 15 kW, rigid foundation"
    source: Literal["simulated", "replay", "mqtt"] = "simulated"
    llm: bool = True
    rpm: float = field(default=1797.0, metadata=_rng(1.0, 1e6))
    sample_rate_hz: float = field(default=12000.0, metadata=_rng(100.0, 1e7))
    window_s: float = field(default=1.0, metadata=_rng(0.01, 600.0))
    signal: Literal["acceleration", "velocity"] = "acceleration"
    zone_limits_mm_s: tuple[float, float, float] = (1.4, 2.8, 4.5)  # A/B, B/C, C/D
    seed: int = 1
    bearing: BearingConfig = BearingConfig()
    fault: FaultConfig = FaultConfig()
    # Fraction by which the true shaft speed may differ from `rpm` (slip, drive setpoint): the
    # diagnosis measures the speed within it, and refuses a window whose spectrum points to a
    # speed outside it (a wrong sample rate or rpm).
    rpm_tolerance: float = field(default=0.03, metadata=_rng(0.001, 0.5))
    # The first `baseline_s` seconds of healthy windows teach the asset's normal levels.
    baseline_s: float = field(default=4 * 3600.0, metadata=_rng(0.0, None))
    replay_path: Path | None = None
    # Unit of a replay file's samples when the file does not say ("" = the unit of `signal`).
    replay_unit: Literal["", "g", "m/s^2", "mm/s"] = ""
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = field(default=1883, metadata=_rng(1, 65535))
    mqtt_topic: str = ""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    enabled: bool = True
    mqtt: MqttConfig = MqttConfig()
    tick_interval_s: float = field(default=3.0, metadata=_rng(0.1, 3600.0))
    assessment_max_tokens: int = field(default=24, metadata=_rng(1, 4096))
    session_token_budget: int = field(default=1536, metadata=_rng(64, 1 << 20))
    report_max_tokens: int = field(default=200, metadata=_rng(1, 32768))
    weekly_report_cron: CronText = CronText("0 6 * * 1")  # crontab (MIN HOUR DAY MONTH DOW), local
    report_period_s: float = field(default=7 * 86400.0, metadata=_rng(60.0, None))
    # Event log retention: every row for `events_raw_retention_s`, then anomalies only (and the
    # per-minute summaries) until `events_retention_s`.
    events_raw_retention_s: float = field(default=2 * 86400.0, metadata=_rng(3600.0, None))
    events_retention_s: float = field(default=90 * 86400.0, metadata=_rng(3600.0, None))
    # Raw windows kept for reports: anomalies (at most one per asset per
    # `anomaly_window_interval_s`) and one normal window per `normal_window_interval_s`.
    windows_store_bytes: ByteSize = field(default=ByteSize(256 << 20), metadata=_rng(1 << 20, None))
    anomaly_window_interval_s: float = field(default=60.0, metadata=_rng(0.0, None))
    normal_window_interval_s: float = field(default=3600.0, metadata=_rng(1.0, None))
    assets: tuple[AssetConfig, ...] = (AssetConfig(),)


@dataclass(frozen=True, slots=True)
class MaintenanceConfig:
    defrag_interval_s: float = field(default=7200.0, metadata=_rng(1.0, None))
    defrag_max_pause_s: float = field(default=0.1, metadata=_rng(0.001, 60.0))
    health_interval_s: float = field(default=60.0, metadata=_rng(1.0, 86400.0))
    health_status_file: Path = Path("/var/lib/kvagentd/ssd-health.json")
    wear_readonly_percent: float = field(default=80.0, metadata=_rng(1.0, 100.0))
    free_space_floor_bytes: ByteSize = field(default=ByteSize(2 * 1000**3),
                                             metadata=_rng(0, None))
    shadow_dir: Path = Path("/dev/shm/kvagentd")
    shadow_bytes: ByteSize = field(default=ByteSize(1 << 30), metadata=_rng(1 << 20, None))
    failback_good_probes: int = field(default=3, metadata=_rng(1, 1000))
    scrub_interval_s: float = field(default=3600.0, metadata=_rng(1.0, None))
    scrub_rate_bytes_per_s: ByteSize = field(default=ByteSize(64 << 20),
                                             metadata=_rng(1 << 10, None))
    sysfs_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    nr_requests_min: int = field(default=64, metadata=_rng(1, 1 << 16))
    systemd_dir: Path = Path("/etc/systemd/system")  # where fstrim.timer's enablement link lives


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The optional metrics-only TCP listener (GET /metrics, nothing else)."""

    listen: str = ""  # "" off; "9464" = 127.0.0.1:9464; "HOST:PORT", "[::1]:9464"


def parse_listen(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "9464", "HOST:PORT" or "[V6]:PORT"; raises ValueError."""
    text = text.strip()
    if text.isdigit():
        host, port_text = "127.0.0.1", text
    elif text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise ValueError("an IPv6 address needs brackets and a port: [::1]:9464")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise ValueError("expected PORT, HOST:PORT or [IPV6]:PORT")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"port {port_text!r} is not in 1-65535")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Thresholds of the health checks (`kvctl health`); every field reloads on SIGHUP."""

    window_s: float = field(default=600.0, metadata=_rng(10.0, 86400.0))  # skips, p99, job failures
    tick_late_intervals: float = field(default=3.0, metadata=_rng(1.0, 1000.0))
    skip_rate_degraded: float = field(default=0.05, metadata=_rng(0.0, 1.0))
    skip_rate_failing: float = field(default=0.5, metadata=_rng(0.0, 1.0))
    min_due_ticks: int = field(default=5, metadata=_rng(1, 100_000))  # fewer: too few to judge
    tick_p99_degraded: float = field(default=1.0, metadata=_rng(0.01, 1000.0))  # x tick interval
    tick_p99_failing: float = field(default=3.0, metadata=_rng(0.01, 1000.0))
    sensor_stale_s: float = field(default=0.0, metadata=_rng(0.0, 86400.0))  # 0: the agent's
    shadow_fill_degraded: float = field(default=0.8, metadata=_rng(0.0, 1.0))
    shadow_fill_failing: float = field(default=0.95, metadata=_rng(0.0, 1.0))
    wear_degraded_percent: float = field(default=70.0, metadata=_rng(0.0, 100.0))
    wear_unknown: Literal["ok", "degraded"] = "ok"  # no SMART status file (yet)
    memory_available_degraded: float = field(default=0.05, metadata=_rng(0.0, 1.0))


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """The shared remote tier on Redis / Valkey (off while `url` is "")."""

    url: str = ""  # redis://host:6379/0, rediss://host:6380/0 (TLS), unix:///run/redis.sock
    cluster: bool = False  # Redis / Valkey Cluster: `url` names one seed node
    username: str = ""  # ACL user ("" = the default user)
    password_file: Path | None = None  # a file holding the password (never the TOML itself)
    password_credential: str = ""  # a systemd credential: $CREDENTIALS_DIRECTORY/<name>
    tls_ca_file: Path | None = None  # rediss: CA bundle that signed the server certificate
    tls_cert_file: Path | None = None  # rediss: client certificate (mutual TLS), optional
    tls_key_file: Path | None = None
    box_id: str = ""  # this box's name in the fleet ("" = the host name)
    key_prefix: str = "kvagentd"
    ttl_s: float = field(default=7 * 86400.0, metadata=_rng(60.0, None))
    read_timeout_s: float = field(default=0.25, metadata=_rng(0.001, 60.0))
    write_timeout_s: float = field(default=2.0, metadata=_rng(0.001, 600.0))
    write_rate_bytes_per_s: ByteSize = field(default=ByteSize(64 << 20),
                                             metadata=_rng(1 << 10, None))
    write_queue_bytes: ByteSize = field(default=ByteSize(256 << 20), metadata=_rng(1 << 20, None))
    retry_max_s: float = field(default=30.0, metadata=_rng(0.1, 3600.0))
    heartbeat_interval_s: float = field(default=10.0, metadata=_rng(0.1, 3600.0))
    publish_sessions: Literal["daemon", "all", "none"] = "daemon"


@dataclass(frozen=True, slots=True)
class DebugConfig:
    """Fault injection for tests and drills; everything off by default."""

    fault_read_eio_rate: float = field(default=0.0, metadata=_rng(0.0, 1.0))
    fault_write_eio_rate: float = field(default=0.0, metadata=_rng(0.0, 1.0))
    fault_enospc: bool = False
    fault_erofs: bool = False
    fault_torn_write_rate: float = field(default=0.0, metadata=_rng(0.0, 1.0))
    fault_latency_s: float = field(default=0.0, metadata=_rng(0.0, 60.0))
    fault_seed: int = 0


@dataclass(frozen=True, slots=True)
class Config:
    daemon: DaemonConfig = DaemonConfig()
    control: ControlConfig = ControlConfig()
    model: ModelConfig = ModelConfig()
    kv: KVConfig = KVConfig()
    placement: PlacementConfig = PlacementConfig()
    executor: ExecutorConfig = ExecutorConfig()
    agent: AgentConfig = AgentConfig()
    maintenance: MaintenanceConfig = MaintenanceConfig()
    health: HealthConfig = HealthConfig()
    metrics: MetricsConfig = MetricsConfig()
    remote: RemoteConfig = RemoteConfig()
    debug: DebugConfig = DebugConfig()

    @property
    def warm_bytes(self) -> int:
        return int(self.kv.hot_bytes * self.kv.warm_ratio)


# Settings that SIGHUP may change without a restart (field paths).
RELOADABLE = frozenset({
    "daemon.log_level", "daemon.log_repeat_interval_s", "agent.tick_interval_s",
    "agent.weekly_report_cron",
    "maintenance.defrag_interval_s", "maintenance.health_interval_s",
    "maintenance.scrub_interval_s", "placement.interval_s",
    *(f"health.{f.name}" for f in dataclasses.fields(HealthConfig)),
})


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read TOML at `path` (None: built-in defaults only), apply env overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("<file>", str(p), "an existing readable TOML file") from None
        except OSError as exc:
            raise ConfigError("<file>", str(p), f"a readable file ({exc.strerror})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("<file>", str(p), f"valid TOML ({exc})") from None
    _apply_env(raw, os.environ if env is None else env)
    cfg = _build(Config, raw, "")
    _cross_checks(cfg)
    return cfg


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        try:
            value: Any = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(parts), text, "a field inside a table")
        node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix or "<root>", raw, "a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(where, raw[unknown[0]], f"known fields: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        fpath = f"{prefix}.{f.name}" if prefix else f.name
        kwargs[f.name] = _convert(hints[f.name], raw[f.name], fpath, f.metadata)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None or value == "":
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, meta)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, value, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", {}) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, value, f"a list of {len(args)} values")
        out = tuple(_convert(a, v, f"{path}[{i}]", {}) for i, (a, v) in enumerate(zip(args, value)))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "true or false")
        return value
    if tp is ByteSize:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError:
                raise ConfigError(path, value, 'a size such as 1048576, "512MiB" or "18GB"') from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, 'a size such as 1048576, "512MiB" or "18GB"')
        return ByteSize(_check_range(value, path, meta))
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "an integer" + _range_text(meta))
        return _check_range(value, path, meta)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise ConfigError(path, value, "a number" + _range_text(meta))
        return float(_check_range(value, path, meta))
    if tp is CronText:
        if not isinstance(value, str):
            raise ConfigError(path, value, f"a schedule such as {cron.EXAMPLE}")
        try:
            cron.trigger(value)
        except cron.CronError as exc:
            raise ConfigError(path, value, f"a schedule such as {cron.EXAMPLE} ({exc})") from None
        return CronText(value.strip())
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "a string")
        return value
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(path, value, "a non-empty path string")
        return Path(value).expanduser().absolute()
    raise TypeError(f"unsupported config type {tp!r} at {path}")  # a bug in this module


def _range_text(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _check_range(value: int | float, path: str, meta: Mapping[str, Any]) -> Any:
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(path, value, "a number" + _range_text(meta))
    return value


def _cross_checks(cfg: Config) -> None:
    lim = [tuple(a.zone_limits_mm_s) for a in cfg.agent.assets]
    for i, z in enumerate(lim):
        if not (0 < z[0] < z[1] < z[2]):
            raise ConfigError(f"agent.assets[{i}].zone_limits_mm_s", list(z),
                              "three increasing positive limits (A/B, B/C, C/D)")
    names = [a.name for a in cfg.agent.assets]
    for i, n in enumerate(names):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", n):
            raise ConfigError(f"agent.assets[{i}].name", n, "1-64 of letters, digits, _ . -")
        if names.index(n) != i:
            raise ConfigError(f"agent.assets[{i}].name", n, "a name not used by another asset")
    for i, a in enumerate(cfg.agent.assets):
        if a.source == "replay" and a.replay_path is None:
            raise ConfigError(f"agent.assets[{i}].replay_path", None,
                              "a .npy, .csv or .wav file when source = 'replay'")
        if a.replay_path is not None and a.replay_path.suffix.lower() not in (".npy", ".csv",
                                                                             ".wav"):
            raise ConfigError(f"agent.assets[{i}].replay_path", str(a.replay_path),
                              "a .npy, .csv or .wav file")
        if a.source == "mqtt" and not a.mqtt_topic:
            raise ConfigError(f"agent.assets[{i}].mqtt_topic", "",
                              "a topic when source = 'mqtt'")
    if cfg.agent.events_retention_s < cfg.agent.events_raw_retention_s:
        raise ConfigError("agent.events_retention_s", cfg.agent.events_retention_s,
                          f"a number >= agent.events_raw_retention_s "
                          f"({cfg.agent.events_raw_retention_s})")
    if cfg.placement.warm_factor > cfg.placement.hot_factor:
        raise ConfigError("placement.warm_factor", cfg.placement.warm_factor,
                          f"a number <= placement.hot_factor ({cfg.placement.hot_factor})")
    if cfg.metrics.listen:
        try:
            parse_listen(cfg.metrics.listen)
        except ValueError as exc:
            raise ConfigError("metrics.listen", cfg.metrics.listen,
                              f'"" (off), a port ("9464", on 127.0.0.1) or "HOST:PORT" ({exc})'
                              ) from None
    h = cfg.health
    for low, high in (("skip_rate_degraded", "skip_rate_failing"),
                      ("tick_p99_degraded", "tick_p99_failing"),
                      ("shadow_fill_degraded", "shadow_fill_failing")):
        if getattr(h, low) > getattr(h, high):
            raise ConfigError(f"health.{low}", getattr(h, low),
                              f"a number <= health.{high} ({getattr(h, high)})")
    if h.wear_degraded_percent > cfg.maintenance.wear_readonly_percent:
        raise ConfigError("health.wear_degraded_percent", h.wear_degraded_percent,
                          "a number <= maintenance.wear_readonly_percent "
                          f"({cfg.maintenance.wear_readonly_percent})")
    if cfg.model.source in ("hf_dir", "gguf") and cfg.model.path is None:
        raise ConfigError("model.path", None, f"a path when model.source = {cfg.model.source!r}")
    _remote_checks(cfg.remote)
    if cfg.kv.io_unit_bytes % 4096:
        raise ConfigError("kv.io_unit_bytes", cfg.kv.io_unit_bytes, "a multiple of 4096")
    if cfg.executor.step_tokens < cfg.executor.max_batch:
        raise ConfigError("executor.step_tokens", cfg.executor.step_tokens,
                          f"a number >= executor.max_batch ({cfg.executor.max_batch}): every "
                          f"running sequence decodes one token per step")
    _check_mqtt(cfg.agent.mqtt)


def _check_mqtt(m: MqttConfig) -> None:
    if m.password_file is not None and m.password_credential:
        raise ConfigError("agent.mqtt.password_credential", m.password_credential,
                          "empty when agent.mqtt.password_file is set (one source of the password)")
    if (m.password_file is not None or m.password_credential) and not m.username:
        raise ConfigError("agent.mqtt.username", "", "a user name when a password is configured")
    if (m.cert_file is None) != (m.key_file is None):
        raise ConfigError("agent.mqtt.key_file" if m.key_file is None else "agent.mqtt.cert_file",
                          None, "both cert_file and key_file, or neither")
    for name in ("ca_file", "cert_file"):
        if getattr(m, name) is not None and not m.tls:
            raise ConfigError(f"agent.mqtt.{name}", str(getattr(m, name)),
                              "unset unless agent.mqtt.tls = true")
    if m.password_credential and not re.fullmatch(r"[A-Za-z0-9_.-]{1,255}", m.password_credential):
        raise ConfigError("agent.mqtt.password_credential", m.password_credential,
                          "a credential name (letters, digits, _ . -)")
    for name, least in (("client_id_prefix", 1), ("box_id", 0)):
        if not re.fullmatch(rf"[A-Za-z0-9_.-]{{{least},64}}", getattr(m, name)):
            raise ConfigError(f"agent.mqtt.{name}", getattr(m, name),
                              f"{least}-64 of letters, digits, _ . -")


_REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")


def _remote_checks(r: RemoteConfig) -> None:
    if not r.url:
        return
    if not r.url.startswith(_REMOTE_SCHEMES):
        raise ConfigError("remote.url", r.url, "a URL starting with " + ", ".join(_REMOTE_SCHEMES))
    if r.cluster and r.url.startswith("unix://"):
        raise ConfigError("remote.cluster", True, "false with a unix:// URL")
    if r.password_file is not None and r.password_credential:
        raise ConfigError("remote.password_credential", r.password_credential,
                          "empty when remote.password_file is set (one source of the password)")
    if urlsplit(r.url).password is not None:
        raise ConfigError("remote.url", "<a URL with a password>",
                          "a URL without a password; use remote.password_file or "
                          "remote.password_credential")
    tls = (r.tls_ca_file, r.tls_cert_file, r.tls_key_file)
    if any(t is not None for t in tls) and not r.url.startswith("rediss://"):
        raise ConfigError("remote.url", r.url, "a rediss:// URL when TLS files are set")
    if (r.tls_cert_file is None) != (r.tls_key_file is None):
        raise ConfigError("remote.tls_key_file", str(r.tls_key_file),
                          "set together with remote.tls_cert_file")
    if r.box_id and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", r.box_id):
        raise ConfigError("remote.box_id", r.box_id, "1-64 of letters, digits, _ . : -")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", r.key_prefix):
        raise ConfigError("remote.key_prefix", r.key_prefix, "1-64 of letters, digits, _ . : -")


def config_to_dict(cfg: Any) -> Any:
    """JSON-ready view of a config (paths as strings)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def diff_reloadable(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Changed fields between two configs: {path: (old, new)} for every changed leaf."""
    a, b = _flatten(config_to_dict(old)), _flatten(config_to_dict(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}
