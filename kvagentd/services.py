"""The composition root: every service of the daemon, built from the configuration by one
function. The daemon, the benchmarks and the tests build through here, so tests exercise the
composition production runs.

    services = build_services(config, BuildContext(scheduler, registry))
    for name, service in services.in_order(): service.start()
    ... reversed: service.stop()

What is built where it applies (None otherwise):
- `model` unless `model.source = "none"`; then the `store` over its cold tier (`cold`: the SSD
  store behind its /dev/shm shadow), `placement` and the `engine`;
- `maintenance` where there are KV tiers to maintain;
- with `[remote]` (and a model): the remote tier below the cold tier, and the `remote` service
  (session hand-over, fleet heartbeat) whose guard the engine's session table asks;
- the `agent` when `agent.enabled`.

Heavy imports (torch, transformers) happen inside the builders, so a daemon without a model
starts without loading them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvagentd.config import Config, ConfigError, DebugConfig
from kvagentd.config.secrets import read_secret

if TYPE_CHECKING:
    import torch
    from apscheduler.schedulers.base import BaseScheduler
    from prometheus_client import CollectorRegistry

    from kvagentd.agent.agent import Agent
    from kvagentd.engine.executor import Executor
    from kvagentd.engine.model import LoadedModel
    from kvagentd.engine.service import Engine
    from kvagentd.fleet.handover import AssetGate, SessionHandover
    from kvagentd.fleet.service import FleetService
    from kvagentd.kvcache.base import KVGeometry
    from kvagentd.kvcache.cold import ColdTierSpec, FailoverColdStore, FaultPlan
    from kvagentd.kvcache.fileio import FileOps
    from kvagentd.kvcache.placement import PlacementService
    from kvagentd.kvcache.remote import ClientFactory, RemoteSpec, RemoteStore
    from kvagentd.kvcache.store import TieredKVStore
    from kvagentd.kvcache.store.tiered import AccessListener
    from kvagentd.kvcache.store.writebehind import WriteBehindPolicy
    from kvagentd.maintenance.service import Maintenance

SERVICE_ORDER = ("store", "placement", "engine", "maintenance", "remote", "agent")
"""Start order; services stop in reverse."""


class Service(Protocol):
    """What the daemon does with every service."""

    def start(self) -> None: ...

    def stop(self) -> None:
        """Flush what must survive and release resources; called once, in reverse order."""
        ...

    def status(self) -> dict[str, Any]:
        """JSON-ready state for `/v1/status`."""
        ...

    def health(self) -> dict[str, Any] | None:
        """`{"status": "ok"|"degraded"|"failing", "detail": str}`, or None without a check."""
        ...

    def reload(self, config: Config) -> None:
        """Apply the reloadable fields of a new configuration (SIGHUP)."""
        ...


@dataclass(frozen=True, slots=True)
class Services:
    """The daemon's services; a field is None where the service does not apply."""

    model: LoadedModel | None = None
    store: TieredKVStore | None = None
    cold: FailoverColdStore | None = None
    placement: PlacementService | None = None
    engine: Engine | None = None
    maintenance: Maintenance | None = None
    remote: FleetService | None = None
    agent: Agent | None = None

    def in_order(self) -> list[tuple[str, Service]]:
        """The present services in start order."""
        present: list[tuple[str, Service | None]] = [
            ("store", self.store), ("placement", self.placement), ("engine", self.engine),
            ("maintenance", self.maintenance), ("remote", self.remote), ("agent", self.agent)]
        return [(n, s) for n, s in present if s is not None]

    @property
    def executor(self) -> Executor | None:
        return self.engine.executor if self.engine is not None else None


@dataclass(frozen=True)
class BuildContext:
    """What the daemon lends the services it builds."""

    scheduler: BaseScheduler | None = None
    registry: CollectorRegistry | None = None
    on_phase: Callable[[str], None] = field(default=lambda _text: None)
    """Told before a slow phase ("loading model"): the daemon extends its start timeout."""
    health: Callable[[], dict[str, Any]] | None = None
    """The daemon's health report (the fleet heartbeat publishes its summary)."""
    job_record: Callable[[str], Any] | None = None
    """The daemon's count of a job's runs, skips and misses (`JobWatch.record`): the one count
    of skipped ticks that status, health and metrics show."""
    cancelled: Callable[[], bool] = field(default=lambda: False)
    """True once a stop was asked for: slow build steps (the model load) stop early."""


class Tiers(NamedTuple):
    store: TieredKVStore
    cold: FailoverColdStore


# -- the KV tiers ------------------------------------------------------------------------------

def fault_plan(debug: DebugConfig) -> FaultPlan:
    """The `[debug]` fault-injection plan (all off by default)."""
    from kvagentd.kvcache.cold import FaultPlan

    return FaultPlan(read_eio_rate=debug.fault_read_eio_rate,
                     write_eio_rate=debug.fault_write_eio_rate, enospc=debug.fault_enospc,
                     erofs=debug.fault_erofs, torn_write_rate=debug.fault_torn_write_rate,
                     latency_s=debug.fault_latency_s)


def cold_tier_spec(config: Config) -> ColdTierSpec:
    from kvagentd.kvcache.cold import ColdTierSpec

    kv, m = config.kv, config.maintenance
    return ColdTierSpec(cold_dir=Path(kv.cold_dir), shadow_dir=Path(m.shadow_dir),
                        codec=kv.cold_codec, capacity_bytes=int(kv.cold_capacity_bytes),
                        segment_bytes=int(kv.segment_bytes), io_unit_bytes=int(kv.io_unit_bytes),
                        o_direct=kv.o_direct, ttl_s=kv.cold_ttl_s, io_threads=kv.io_threads,
                        shadow_bytes=int(m.shadow_bytes),
                        failback_good_probes=m.failback_good_probes,
                        free_floor_bytes=int(m.free_space_floor_bytes),
                        faults=fault_plan(config.debug), fault_seed=config.debug.fault_seed)


def box_id(config: Config) -> str:
    """This box's name in the fleet: `remote.box_id`, else the host name."""
    return config.remote.box_id or socket.gethostname()


def remote_password(config: Config, env: Mapping[str, str] | None = None) -> str | None:
    """The remote store's password (`remote.password_file` or the systemd credential
    `remote.password_credential`); None without either; ConfigError naming the field."""
    r = config.remote
    return read_secret("remote", r.password_file, r.password_credential,
                       os.environ if env is None else env)


def remote_spec(config: Config, env: Mapping[str, str] | None = None) -> RemoteSpec | None:
    """The `[remote]` section as the remote tier uses it; None while `remote.url` is ""."""
    from kvagentd.kvcache.remote import RemoteSpec

    r = config.remote
    if not r.url:
        return None
    try:
        import redis  # noqa: F401 - the client library is an optional dependency
    except ImportError:
        raise ConfigError("remote.url", r.url, "a remote store only with the redis client "
                          "installed: pip install 'kvagentd[remote]'") from None
    return RemoteSpec(url=r.url, cluster=r.cluster, username=r.username,
                      password=remote_password(config, env), tls_ca_file=r.tls_ca_file,
                      tls_cert_file=r.tls_cert_file, tls_key_file=r.tls_key_file,
                      client_name=f"kvagentd-{box_id(config)}", key_prefix=r.key_prefix,
                      ttl_s=r.ttl_s, read_timeout_s=r.read_timeout_s,
                      write_timeout_s=r.write_timeout_s,
                      write_rate_bytes_per_s=int(r.write_rate_bytes_per_s),
                      write_queue_bytes=int(r.write_queue_bytes), retry_max_s=r.retry_max_s)


def build_remote(config: Config, geometry: KVGeometry, namespace: bytes,
                 factory: ClientFactory | None = None) -> RemoteStore | None:
    """The remote store of `[remote]` for this namespace (None while `remote.url` is "");
    `factory` builds its redis-py clients."""
    from kvagentd.kvcache.remote import RemoteStore, make_client

    rspec = remote_spec(config)
    if rspec is None:
        return None
    return RemoteStore(rspec, geometry, namespace, codec=config.kv.cold_codec,
                       factory=factory or make_client)


def build_tiers(config: Config, geometry: KVGeometry, namespace: bytes,
                device: str | torch.device = "cpu", *,
                access_listener: AccessListener | None = None,
                file_io: FileOps | None = None,
                remote: RemoteStore | None = None) -> Tiers:
    """The tiered store over its failover cold tier, as the daemon runs it; with `[remote]`,
    the remote store (`remote`, or one built here) below the cold tier."""
    from kvagentd.kvcache.base import ColdListener, ColdTier
    from kvagentd.kvcache.cold import build_cold_tier
    from kvagentd.kvcache.remote import RemoteColdTier
    from kvagentd.kvcache.store import TieredKVStore
    from kvagentd.kvcache.store.budget import WriteBudget

    import torch

    spec = cold_tier_spec(config)
    check_host_memory(config, torch.device(device))
    if remote is None:
        remote = build_remote(config, geometry, namespace)
    built: list[FailoverColdStore] = []

    def cold(listener: ColdListener) -> ColdTier:
        built.append(build_cold_tier(spec, geometry, namespace, listener, file_io=file_io))
        return built[-1] if remote is None else RemoteColdTier(built[-1], remote)

    store = TieredKVStore(geometry, namespace, hot_bytes=int(config.kv.hot_bytes),
                          warm_bytes=config.warm_bytes, cold=cold, device=device,
                          access_listener=access_listener,
                          persist_on_shutdown=config.kv.persist_on_shutdown,
                          prefetch_queue=config.placement.prefetch_max_inflight,
                          write_behind=write_behind_policy(config),
                          write_budget=WriteBudget(int(config.kv.ssd_write_budget_bytes_per_day)))
    return Tiers(store, built[0])


def check_host_memory(config: Config, device: torch.device,
                      available: int | None = None) -> None:
    """The host arenas (warm, and hot when it is on the CPU) are taken at start: a budget that
    does not fit in the memory available now is a ConfigError naming the field, not an OOM kill
    while they are touched (or days later)."""
    import psutil

    need = config.warm_bytes + (int(config.kv.hot_bytes) if device.type == "cpu" else 0)
    have = psutil.virtual_memory().available if available is None else available
    if need > have:
        field = "kv.hot_bytes" if device.type == "cpu" else "kv.warm_ratio"
        raise ConfigError(field, f"{int(config.kv.hot_bytes) / 2**30:.1f} GiB"
                          if device.type == "cpu" else config.kv.warm_ratio,
                          f"host KV arenas (hot on {device.type} + warm) that fit in the "
                          f"{have / 2**30:.1f} GiB of memory available now; they need "
                          f"{need / 2**30:.1f} GiB")


def write_behind_policy(config: Config) -> WriteBehindPolicy:
    """`kv.write_behind_*` as the store's write-behind policy."""
    from kvagentd.kvcache.store.writebehind import WriteBehindPolicy

    return WriteBehindPolicy(interval_s=config.kv.write_behind_interval_s,
                             rate_bytes_per_s=int(config.kv.write_behind_rate_bytes_per_s))


# -- everything --------------------------------------------------------------------------------

def build_services(config: Config, ctx: BuildContext) -> Services:
    """Every service that applies to `config`, constructed (not started) in start order."""
    if config.model.source == "none":
        return Services(maintenance=None,
                        agent=_build_agent(config, ctx, None, None))
    from kvagentd.engine.model import load_model, model_geometry
    from kvagentd.engine.service import Engine
    from kvagentd.kvcache.keys import make_namespace
    from kvagentd.kvcache.placement import AccessFeed, PlacementService
    from kvagentd.kvcache.placement.trace_recorder import BlockSize
    from kvagentd.maintenance.service import Maintenance

    state_dir = Path(config.daemon.state_dir)
    ctx.on_phase("loading model")
    calibration = []
    if config.agent.enabled and config.model.dtype == "auto":
        from kvagentd.agent.calibration import calibration_prompts
        calibration = calibration_prompts(config.agent)  # the precision check's prompts
    model = load_model(config.model, Path(config.daemon.cache_dir), calibration,
                       cancelled=ctx.cancelled)
    geometry = model_geometry(model.model, config.kv.block_tokens, model.dtype)
    namespace = make_namespace(model.fingerprint, model.dtype, config.kv.block_tokens)
    feed = AccessFeed()  # the store reports accesses to it, placement drains it
    remote = build_remote(config, geometry, namespace)
    tiers = build_tiers(config, geometry, namespace, model.device, access_listener=feed.record,
                        remote=remote)
    placement = PlacementService(tiers.store, feed, config.placement, ctx.scheduler,
                                 summary_path=state_dir / "heat-summary.json",
                                 registry=ctx.registry,
                                 block_size=BlockSize(geometry.block_tokens, geometry.block_bytes))
    handover = gate = None
    if remote is not None:
        handover, gate = _build_handover(config, remote)
    engine = Engine(model, tiers.store, state_dir=state_dir, executor_config=config.executor,
                    registry=ctx.registry, session_guard=handover)
    maintenance = Maintenance(config, tiers.store, tiers.cold, ctx.scheduler,
                              is_idle=idle_probe(engine.executor, ctx.scheduler))
    agent = _build_agent(config, ctx, engine.executor, tiers.store, gate)
    fleet = None
    if remote is not None and handover is not None and gate is not None:
        fleet = _build_fleet(config, ctx, remote, handover, gate, engine, agent)
    return Services(model=model, store=tiers.store, cold=tiers.cold, placement=placement,
                    engine=engine, maintenance=maintenance, remote=fleet, agent=agent)


def _build_agent(config: Config, ctx: BuildContext, executor: Executor | None,
                 store: TieredKVStore | None, gate: AssetGate | None = None) -> Agent | None:
    if not config.agent.enabled:
        return None
    from kvagentd.agent.agent import Agent

    agent = Agent(config.agent, executor, ctx.scheduler, Path(config.daemon.state_dir),
                  store_stats=store.stats if store is not None else None, llm_gate=gate,
                  job_record=ctx.job_record)
    if ctx.registry is not None:
        from kvagentd.agent.broker import MqttCollector
        from kvagentd.agent.sensors import MqttSource

        ctx.registry.register(MqttCollector(lambda: {
            name: st.source.broker for name, st in agent.assets.items()
            if isinstance(st.source, MqttSource)}))
    return agent


# -- the fleet (with `[remote]`) ---------------------------------------------------------------

def asset_of(config: Config) -> Callable[[str], str | None]:
    """`session id -> asset` for the agent's sessions (`<asset>-<n>`) of configured assets."""
    import re

    names = [a.name for a in config.agent.assets]
    pattern = re.compile("(?P<asset>" + "|".join(re.escape(n) for n in names) + r")-\d+") \
        if names else None

    def of(session: str) -> str | None:
        m = pattern.fullmatch(session) if pattern is not None else None
        return m.group("asset") if m else None

    return of


def _build_handover(config: Config, remote: RemoteStore) -> tuple[SessionHandover, AssetGate]:
    from kvagentd.fleet.handover import AssetGate, SessionHandover
    from kvagentd.fleet.leases import LeaseBook

    gate = AssetGate()
    handover = SessionHandover(remote, LeaseBook(Path(config.daemon.state_dir)), box_id(config),
                               policy=config.remote.publish_sessions, asset_of=asset_of(config),
                               gate=gate)
    return handover, gate


def _build_fleet(config: Config, ctx: BuildContext, remote: RemoteStore,
                 handover: SessionHandover, gate: AssetGate, engine: Engine,
                 agent: Agent | None) -> FleetService:
    from kvagentd.fleet import metrics
    from kvagentd.fleet.heartbeat import Heartbeat
    from kvagentd.fleet.service import FleetService

    heartbeat = Heartbeat(remote, handover.box, config.remote.heartbeat_interval_s)
    llm_assets = tuple(a.name for a in config.agent.assets if a.llm) if agent is not None else ()
    fleet = FleetService(remote, handover.leases, handover, heartbeat, gate, engine=engine,
                         scheduler=ctx.scheduler, assets=llm_assets, agent=agent,
                         health=ctx.health)
    metrics.register(ctx.registry, fleet.status)
    return fleet


def idle_probe(executor: Executor | None,
               scheduler: BaseScheduler | None) -> Callable[[float], bool]:
    """`is_idle(expected_s)`: no generation runs or waits and no sensor tick is due within
    `expected_s` seconds: the moment for maintenance that pauses admission (defrag)."""
    from kvagentd.agent.jobs import TICK_PREFIX

    def is_idle(expected_s: float = 0.0) -> bool:
        if executor is not None:
            st = executor.status()
            if st["active"] or any(st["queued"].values()):
                return False
        if scheduler is None:
            return True
        horizon = time.time() + expected_s
        for job in scheduler.get_jobs():
            if job.id.startswith(TICK_PREFIX) and job.next_run_time is not None \
                    and job.next_run_time.timestamp() <= horizon:
                return False
        return True

    return is_idle
