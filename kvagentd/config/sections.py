"""The configuration tree: one frozen dataclass per TOML section, and `Config`, their root.

Every leaf has a default; a numeric field's metadata carries its range ("min"/"max"), which the
loader (`kvagentd.config.load`) checks. Field comments are the reference for what each does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvagentd.config.values import ByteSize, CronText


def _rng(lo: float | None = None, hi: float | None = None) -> dict[str, float | None]:
    return {"min": lo, "max": hi}


LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/kvagentd")
    cache_dir: Path = Path("/var/cache/kvagentd")
    log_level: LogLevel = "info"
    # auto: journald's native protocol where stdout is the journal, JSON lines off a
    # terminal, console lines on one
    log_format: Literal["auto", "json", "console", "journal"] = "auto"
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
    threads: int = field(default=0, metadata=_rng(0, 1024))  # 0 = every CPU of the process
    # int8: the Linear layers' weights int8, activations quantized per step (torch's dynamic
    # quantization: fbgemm, VNNI where the CPU has it); CPU only
    quantize: Literal["none", "int8"] = "none"


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
    io_threads: int = field(default=4, metadata=_rng(1, 64))
    # committed hot and warm blocks are written to the cold tier every interval (0 = only at
    # a graceful stop), so a power cut loses at most that interval of KV; at most this rate
    write_behind_interval_s: float = field(default=30.0, metadata=_rng(0.0, 86400.0))
    write_behind_rate_bytes_per_s: ByteSize = field(default=ByteSize(64 << 20),
                                                    metadata=_rng(1 << 20, None))
    # Bytes per day the store may write to the cold tier (write-behind and demotions; 0: no
    # limit): a 256 GB industrial SSD rated 150 TBW lasts 10 years at 41 GB a day, shared
    # with the OS and its logs; a quarter of that. What does not fit stays in RAM or is
    # recomputed from the session's token ids when needed again.
    ssd_write_budget_bytes_per_day: ByteSize = field(default=ByteSize(10 * 1000**3),
                                                     metadata=_rng(0, None))


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
    # continuous batching: sequences per step, tokens per step while decodes wait, prefill
    # chunk per sequence while decodes wait; a step with no decode waiting (a lone prefill)
    # runs up to prefill_tokens at once, as a one-shot prefill does
    max_batch: int = field(default=16, metadata=_rng(1, 1024))
    step_tokens: int = field(default=256, metadata=_rng(1, 65536))
    prefill_chunk: int = field(default=256, metadata=_rng(1, 65536))
    prefill_tokens: int = field(default=4096, metadata=_rng(1, 1 << 20))
    aging_s: float = field(default=10.0, metadata=_rng(0.0, 86400.0))  # 0 = strict priority
    # memory a running batch holds beyond the hot pool: the batch workspace (max_batch rows of
    # row_tokens, taken at start) and the working copies of longer sequences (or the paged
    # layout's attention scratch)
    batch_memory_bytes: ByteSize = field(default=ByteSize(3 << 30), metadata=_rng(1 << 20, None))
    # a row of the batch workspace holds a sequence of up to this many tokens (an agent
    # session: agent.session_token_budget 1536 plus a turn); 0: no batch workspace
    row_tokens: int = field(default=2048, metadata=_rng(0, 1 << 20))
    kv_layout: Literal["auto", "contiguous", "paged"] = "auto"  # auto: paged on CUDA
    # a working copy of this many tokens made ready (its pages taken) at start, contiguous
    # layout only; 0: none. A fresh daemon's first long request otherwise paged it in first.
    # 4096 holds an agent session (agent.session_token_budget 1536) and an adopted or resumed
    # operator session of up to 4k tokens; 187 MB for SmolLM2-135M, within batch_memory_bytes
    warm_workspace_tokens: int = field(default=4096, metadata=_rng(0, 1 << 20))


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
    # when a tick asks the model for a commentary: every tick, or when the diagnosis (fault,
    # severity) or the ISO zone changes and at least every comment_max_gap ticks otherwise;
    # every tick still measures, diagnoses and records
    comment_every: Literal["tick", "change"] = "tick"
    comment_max_gap: int = field(default=20, metadata=_rng(1, 1 << 20))
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


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """Thresholds of the health checks (`kvctl health`); every field reloads on SIGHUP.

    `raise_after_s` and `clear_after_s` are the hysteresis (`health.settle`): a check's new
    level counts once it has held that long. 15 s to raise is five ticks at the 3 s cadence,
    longer than the blips a busy box makes (one overrunning tick, a skip rate at its threshold
    as the window slides), yet short enough for an operator; evidence that is unambiguous and
    already spans its own limit (stale sensor data, a full disk, a stalled main loop, no tick
    for `tick_late_intervals`) counts at once, so those are failing within two ticks. 60 s to
    clear, four times the raise: a fault that comes and goes every few tens of seconds stays
    raised as one episode instead of flapping, and an alert on it is not paged again and again.
    """

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
    raise_after_s: float = field(default=15.0, metadata=_rng(0.0, 3600.0))  # worse: counts after
    clear_after_s: float = field(default=60.0, metadata=_rng(0.0, 86400.0))  # better: counts after


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

