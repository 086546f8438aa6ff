"""Building the cold tier: the SSD store behind its /dev/shm shadow, with fault injection when
a drill asks for it. The composition root (`kvagentd.services`) maps the configuration to a
`ColdTierSpec`; this package does not read the configuration itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog

from kvagentd.kvcache.base import ColdListener, KVGeometry
from kvagentd.kvcache.cold.failover import FailoverColdStore
from kvagentd.kvcache.cold.faults import FaultPlan, FaultyFileIO
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.fileio import FileIO, FileOps

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ColdTierSpec:
    """Everything that shapes the cold tier (from `kv`, `maintenance` and `debug`)."""

    cold_dir: Path
    shadow_dir: Path
    codec: str = "raw"
    capacity_bytes: int = 1 << 30
    segment_bytes: int = 256 << 20
    io_unit_bytes: int = 128 << 10
    o_direct: bool = True
    ttl_s: float = 3600.0
    io_threads: int = 1
    shadow_bytes: int = 1 << 30
    failback_good_probes: int = 3
    free_floor_bytes: int = 0  # a restore waits for this much room above the shadow's records
    faults: FaultPlan = field(default_factory=FaultPlan)
    fault_seed: int = 0


def build_cold_tier(spec: ColdTierSpec, geometry: KVGeometry, namespace: bytes,
                    listener: ColdListener | None = None, *,
                    file_io: FileOps | None = None) -> FailoverColdStore:
    """The SSD cold store behind a shadow stand-in in `spec.shadow_dir`. An active fault plan
    wraps the SSD store's file I/O in a `FaultyFileIO` (seeded by `spec.fault_seed`). A cold
    directory that cannot be written (read-only, a full disk) does not fail the build: the
    pair starts on the shadow (`FailoverColdStore.cause` says why)."""
    fio: FileOps = file_io if file_io is not None else FileIO()
    if spec.faults.active:
        fio = FaultyFileIO(fio, spec.faults, seed=spec.fault_seed)
        log.warning("fault_injection_on", plan=str(spec.faults))
    primary = ColdStore(spec.cold_dir, geometry, namespace, codec=spec.codec,
                        capacity_bytes=spec.capacity_bytes, segment_bytes=spec.segment_bytes,
                        io_unit_bytes=spec.io_unit_bytes, o_direct=spec.o_direct, file_io=fio,
                        ttl_s=spec.ttl_s, io_threads=spec.io_threads, listener=listener)
    shadow_seg = max(1 << 20, min(int(spec.segment_bytes), int(spec.shadow_bytes) // 4))
    shadow = ColdStore(spec.shadow_dir, geometry, namespace, codec=spec.codec,
                       capacity_bytes=spec.shadow_bytes, segment_bytes=shadow_seg,
                       io_unit_bytes=spec.io_unit_bytes, o_direct=False, ttl_s=spec.ttl_s,
                       listener=listener)
    return FailoverColdStore(primary, shadow, geometry, probe_dir=spec.cold_dir, file_io=fio,
                             failback_good_probes=spec.failback_good_probes,
                             shadow_capacity_bytes=int(spec.shadow_bytes), listener=listener,
                             free_floor_bytes=int(spec.free_floor_bytes))
