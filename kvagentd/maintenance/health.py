"""SSD health: a root oneshot writes a status file; the daemon's `HealthMonitor` acts on it.

Root side (`python -m kvagentd.maintenance.health --config PATH --write`, run by
`kvagentd-health.service` on a timer): reads `nvme smart-log -o json DEV` (or
`smartctl -j -a DEV`), classifies it and writes `maintenance.health_status_file` atomically
(temporary file, fsync, rename). SMART reads need CAP_SYS_ADMIN, which the daemon lacks.

Daemon side (`HealthMonitor.check()`, every `health_interval_s`): reads that file (missing or
garbled -> state "unknown", never a crash), the free space of the cold directory and the cold
store's own I/O error counters, then:
- wear >= `wear_readonly_percent` -> the cold tier becomes read-only (warning in status and log);
- SMART says failed, or new cold I/O errors -> failover to the shadow directory;
- free space below `free_space_floor_bytes` (or short of what a restore from the shadow needs
  on top of it) -> evict cold blocks, expired (TTL) first, then the coldest by last access,
  until the floor is met, and compact (on the SSD also while the shadow serves).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from kvagentd.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from kvagentd.kvcache.base import ColdTier
    from kvagentd.kvcache.store import TieredKVStore

log = structlog.get_logger(__name__)

STATUS_VERSION = 1

# NVMe critical_warning bits (NVMe base spec, SMART / Health log byte 0).
CW_SPARE_BELOW_THRESHOLD = 0x01
CW_TEMPERATURE = 0x02
CW_RELIABILITY_DEGRADED = 0x04
CW_READ_ONLY = 0x08
CW_VOLATILE_BACKUP_FAILED = 0x10
CW_PMR_READ_ONLY = 0x20
CW_FAILED_MASK = CW_RELIABILITY_DEGRADED | CW_READ_ONLY | CW_VOLATILE_BACKUP_FAILED | CW_PMR_READ_ONLY


class HealthState(enum.Enum):
    OK = "ok"
    WORN = "worn"  # wear at or past the read-only threshold: keep reading, stop writing
    FAILED = "failed"  # the device says it is failing or read-only: fail over
    UNKNOWN = "unknown"  # no status file, a garbled one, or no SMART tool


@dataclass(frozen=True, slots=True)
class SmartData:
    source: str  # "nvme-cli" | "smartctl"
    percent_used: float | None = None
    media_errors: int | None = None
    critical_warning: int | None = None
    available_spare: int | None = None
    available_spare_threshold: int | None = None
    passed: bool | None = None  # smartctl's overall verdict


def _int(v: Any) -> int | None:
    if isinstance(v, dict):  # newer nvme-cli prints some fields as {"value": N, ...}
        v = v.get("value", v.get("raw"))
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        return int(v)
    if isinstance(v, str):
        s = v.strip().rstrip("%").replace(",", "")
        try:
            return int(s, 0)
        except ValueError:
            return None
    return None


def _first(d: Mapping[str, Any], *names: str) -> Any:
    for n in names:
        if n in d:
            return d[n]
    return None


def parse_nvme_smart_log(doc: Mapping[str, Any]) -> SmartData:
    """`nvme smart-log -o json` (nvme-cli 1.x and 2.x field names)."""
    if not isinstance(doc, Mapping):
        raise ValueError("nvme smart-log JSON is not an object")
    pu = _int(_first(doc, "percent_used", "percentage_used", "percent_used "))
    if pu is None and not any(k in doc for k in ("critical_warning", "media_errors")):
        raise ValueError("not an nvme smart-log document")
    return SmartData("nvme-cli", pu, _int(doc.get("media_errors")), _int(doc.get("critical_warning")),
                     _int(_first(doc, "avail_spare", "available_spare")),
                     _int(_first(doc, "spare_thresh", "available_spare_threshold")))


def parse_smartctl(doc: Mapping[str, Any]) -> SmartData:
    """`smartctl -j -a DEV`: the NVMe health log when present, else the overall verdict and
    the SATA endurance figure (`endurance_used` or attribute 231/233 normalized values)."""
    if not isinstance(doc, Mapping):
        raise ValueError("smartctl JSON is not an object")
    passed = doc.get("smart_status", {}).get("passed") if isinstance(doc.get("smart_status"), dict) else None
    nv = doc.get("nvme_smart_health_information_log")
    if isinstance(nv, Mapping):
        return SmartData("smartctl", _int(nv.get("percentage_used")), _int(nv.get("media_errors")),
                         _int(nv.get("critical_warning")), _int(nv.get("available_spare")),
                         _int(nv.get("available_spare_threshold")), passed)
    used = None
    eu = doc.get("endurance_used")
    if isinstance(eu, Mapping):
        used = _int(eu.get("current_percent"))
    table = doc.get("ata_smart_attributes", {}).get("table", []) if isinstance(
        doc.get("ata_smart_attributes"), dict) else []
    media = None
    for attr in table:
        if not isinstance(attr, Mapping):
            continue
        aid = attr.get("id")
        if used is None and aid in (231, 233, 177):  # SSD life left / wear leveling: 100 = new
            v = _int(attr.get("value"))
            used = None if v is None else max(0, 100 - v)
        if aid in (5, 187):  # reallocated sectors, reported uncorrectable
            media = (media or 0) + (_int(attr.get("raw", {}).get("value")
                                         if isinstance(attr.get("raw"), dict) else 0) or 0)
    if passed is None and used is None and not table:
        raise ValueError("not a smartctl document")
    return SmartData("smartctl", used, media, None, None, None, passed)


def classify(s: SmartData, wear_readonly_percent: float) -> tuple[HealthState, list[str]]:
    """The state and the reasons behind it."""
    failed = []
    if s.critical_warning is not None and s.critical_warning & CW_FAILED_MASK:
        failed.append(f"critical_warning=0x{s.critical_warning:02x}")
    if s.passed is False:
        failed.append("SMART overall-health self-assessment failed")
    if (s.available_spare is not None and s.available_spare_threshold is not None
            and s.available_spare < s.available_spare_threshold):
        failed.append(f"available spare {s.available_spare}% below threshold "
                      f"{s.available_spare_threshold}%")
    if failed:
        return HealthState.FAILED, failed
    if s.percent_used is not None and s.percent_used >= wear_readonly_percent:
        return HealthState.WORN, [f"wear {s.percent_used}% >= {wear_readonly_percent}%"]
    return HealthState.OK, []


# --------------------------------------------------------------------------------------------
# Status file (written by root, read by the daemon)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class HealthStatus:
    state: HealthState
    written_at: float | None = None
    device: str | None = None
    smart: SmartData | None = None
    reasons: tuple[str, ...] = ()
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"version": STATUS_VERSION, "state": self.state.value, "written_at": self.written_at,
                "device": self.device, "smart": asdict(self.smart) if self.smart else None,
                "reasons": list(self.reasons), "error": self.error}


def write_status(path: Path, status: HealthStatus) -> None:
    """Atomically replace `path` (same-directory temp file, fsync, rename, fsync dir)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".health-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(status.as_dict(), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_status(path: Path) -> HealthStatus:
    """The status file; missing or garbled -> `HealthState.UNKNOWN` with the reason in `error`."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return HealthStatus(HealthState.UNKNOWN, error=f"no status file {path}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return HealthStatus(HealthState.UNKNOWN, error=f"unreadable status file {path}: {exc}")
    try:
        state = HealthState(doc["state"])
        sm = doc.get("smart")
        smart = SmartData(**{k: sm.get(k) for k in SmartData.__dataclass_fields__}) if sm else None
        wa = doc.get("written_at")
        return HealthStatus(state, float(wa) if wa is not None else None, doc.get("device"), smart,
                            tuple(str(r) for r in doc.get("reasons", ())), doc.get("error"))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return HealthStatus(HealthState.UNKNOWN, error=f"garbled status file {path}: {exc!r}")


def probe_smart(device: str, wear_readonly_percent: float, *,
                run: Callable[[list[str]], str] | None = None) -> HealthStatus:
    """Ask nvme-cli, then smartctl, about `device` (e.g. /dev/nvme0n1)."""
    run = run or _run_tool
    errors = []
    for tool, argv, parse in (
            ("nvme", ["nvme", "smart-log", "-o", "json", device], parse_nvme_smart_log),
            ("smartctl", ["smartctl", "-j", "-a", device], parse_smartctl)):
        try:
            out = run(argv)
            smart = parse(json.loads(out))
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            errors.append(f"{tool}: {exc}")
            continue
        state, reasons = classify(smart, wear_readonly_percent)
        return HealthStatus(state, time.time(), device, smart, tuple(reasons))
    return HealthStatus(HealthState.UNKNOWN, time.time(), device, error="; ".join(errors))


def _run_tool(argv: list[str]) -> str:
    exe = shutil.which(argv[0])
    if exe is None:
        raise FileNotFoundError(f"{argv[0]} not installed")
    r = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=30, check=False)
    # smartctl's exit status is a bit mask that is non-zero for mere warnings; trust the JSON.
    if not r.stdout.strip():
        raise OSError(f"exit {r.returncode}: {r.stderr.strip()[:200]}")
    return r.stdout


def device_of(cold_dir: Path, sysfs_root: Path) -> str | None:
    """/dev/<whole disk> under the cold directory, or None."""
    from kvagentd.maintenance.tune import existing_dir, find_disk

    disk = find_disk(os.stat(existing_dir(cold_dir)).st_dev, sysfs_root)
    return f"/dev/{disk.name}" if disk is not None else None


# --------------------------------------------------------------------------------------------
# Daemon side
# --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class HealthReport:
    state: str
    cold_read_only: bool
    free_bytes: int | None
    free_floor_bytes: int
    io_errors: int
    evicted_blocks: int
    failover_requested: bool
    status_file: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    checked_at: float = 0.0
    wear_percent: float | None = None  # SMART percentage used, when the status file has it


class HealthMonitor:
    """Acts on the SSD status file, free space and cold I/O errors; one `check()` per interval.

    `cold` is the cold tier (`set_read_only`, `compact`, `stats()` counters `io_errors` and
    `write_failures`); `store` the KV store (`snapshot()`, `evict()`); `on_failure(reason)` is
    called when the cold tier should fail over (a `FailoverColdStore.activate`), `on_probe()`
    when the SSD looks healthy (its good-probe counter for failback), `space_wanted()` says how
    many bytes a restore deferred for space still needs freed on the SSD.
    """

    def __init__(self, cfg: Config, *, store: TieredKVStore | None = None,
                 cold: ColdTier | None = None,
                 on_failure: Callable[[str], object] | None = None,
                 on_probe: Callable[[], object] | None = None,
                 space_wanted: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.time,
                 disk_usage: Callable[[Path], int] | None = None) -> None:
        self.cfg = cfg
        self.store, self.cold = store, cold
        self.on_failure, self.on_probe = on_failure, on_probe
        self.space_wanted = space_wanted
        self.clock = clock
        self.disk_usage = disk_usage or _free_bytes
        self._io_errors_seen = 0
        self._read_only_by_wear = False
        self.last: HealthReport | None = None

    def _cold_io_errors(self) -> int:
        if self.cold is None:
            return 0
        st = self.cold.stats()
        if not isinstance(st, dict):
            return 0
        return int(st.get("io_errors", 0) or 0) + int(st.get("write_failures", 0) or 0)

    def check(self) -> HealthReport:
        m = self.cfg.maintenance
        status = read_status(m.health_status_file)
        warnings: list[str] = []
        if status.state is HealthState.UNKNOWN:
            warnings.append(status.error or "SSD health unknown")
        stale_after = max(3 * m.health_interval_s, 3600.0)
        if status.written_at is not None and self.clock() - status.written_at > stale_after:
            warnings.append(f"SSD status file is {self.clock() - status.written_at:.0f} s old")
        # Wear -> read-only (sticky until the status says otherwise).
        wear = status.smart.percent_used if status.smart is not None else None
        worn = status.state in (HealthState.WORN, HealthState.FAILED) and (
            wear is not None and wear >= m.wear_readonly_percent)
        if worn != self._read_only_by_wear and self.cold is not None:
            self.cold.set_read_only(worn)
            self._read_only_by_wear = worn
            if worn:
                log.warning("cold_tier_read_only", reason="wear", percent_used=wear,
                            limit=m.wear_readonly_percent)
            else:
                log.info("cold_tier_writable", reason="wear below limit")
        if self._read_only_by_wear:
            warnings.append(f"cold tier read-only: SSD wear {wear}% >= "
                            f"{m.wear_readonly_percent}%")
        # Failures -> failover; a clean interval -> a good probe.
        errors = self._cold_io_errors()
        new_errors = errors - self._io_errors_seen
        self._io_errors_seen = errors
        failover = False
        if status.state is HealthState.FAILED:
            failover = True
            reason = "SSD health failed: " + "; ".join(status.reasons)
        elif new_errors > 0:
            failover = True
            reason = f"{new_errors} new cold I/O errors"
        if failover:
            warnings.append(reason)
            if self.on_failure is not None:
                self.on_failure(reason)
        elif self.on_probe is not None and status.state is not HealthState.FAILED:
            self.on_probe()
        # Free space floor, or room for a restore deferred for space -> evict and compact
        # (on the SSD, also while the shadow serves).
        free = self._free()
        evicted = 0
        below = m.free_space_floor_bytes - free if free is not None else 0
        wanted = int(self.space_wanted()) if self.space_wanted is not None else 0
        if self.store is not None:  # copies wait while the disk is short of room
            self.store.pause_write_behind(
                f"cold disk free {free} B below floor {m.free_space_floor_bytes} B"
                if below > 0 else None)
        if below > 0 or wanted > 0:
            evicted = self.evict_for(max(below, wanted))
            reclaimed = 0
            if self.cold is not None:
                # Dropping index rows frees nothing on disk until the segments are rewritten.
                reclaimed = int(self.cold.compact(0.25) or 0)
            why = (f"free space {free} B below floor {m.free_space_floor_bytes} B" if below > 0
                   else f"a restore from the shadow waits for {wanted} B more free space")
            warnings.append(f"{why}: evicted {evicted} cold blocks, compaction reclaimed "
                            f"{reclaimed} B")
        for w in warnings:
            log.warning("ssd_health", warning=w)
        self.last = HealthReport(status.state.value, self._read_only_by_wear, free,
                                 int(m.free_space_floor_bytes), errors, evicted, failover,
                                 status.as_dict(), warnings, self.clock(), wear)
        return self.last

    def _free(self) -> int | None:
        from kvagentd.maintenance.tune import existing_dir

        try:
            return self.disk_usage(existing_dir(self.cfg.kv.cold_dir))
        except OSError:
            return None

    def evict_for(self, deficit: int) -> int:
        """Free `deficit` bytes of the cold disk, cheapest first: the cold copies of blocks
        resident in hot or warm (nothing is lost), then cold-only blocks, TTL-expired first
        then least recently used; pinned and in-use blocks are kept. Returns the records
        dropped and blocks evicted."""
        if self.store is None or deficit <= 0:
            return 0
        from kvagentd.kvcache.base import Tier

        copies, freed = self.store.drop_cold_copies(deficit)
        deficit -= freed
        if deficit <= 0:
            return copies

        now = self.clock()
        ttl = self.cfg.kv.cold_ttl_s
        rows = [b for b in self.store.snapshot()
                if b.tier is Tier.COLD and not b.pinned and not b.in_use]
        rows.sort(key=lambda b: (not (now - b.last_access > ttl), b.last_access))
        chosen, total = [], 0
        for b in rows:
            if total >= deficit:
                break
            chosen.append(b.key)
            total += b.nbytes
        n = self.store.evict(chosen) if chosen else 0
        if n:
            log.warning("cold_evicted_for_space", blocks=n, bytes=total, deficit=deficit)
        return copies + n

    def status(self) -> dict[str, Any]:
        return asdict(self.last) if self.last is not None else {"state": "not checked yet"}


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# --------------------------------------------------------------------------------------------
# Root oneshot: python -m kvagentd.maintenance.health --config PATH [--write] [--device DEV]
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvagentd-health", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--device", default=None, help="block device (default: the cold tier's disk)")
    ap.add_argument("--write", action="store_true", help="write maintenance.health_status_file")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"kvagentd-health: {exc}", file=sys.stderr)
        return 78
    m = cfg.maintenance
    device = args.device or device_of(cfg.kv.cold_dir, m.sysfs_root)
    if device is None:
        status = HealthStatus(HealthState.UNKNOWN, time.time(), None,
                              error=f"no block device under {cfg.kv.cold_dir}")
    else:
        status = probe_smart(device, m.wear_readonly_percent)
    if args.write:
        write_status(m.health_status_file, status)
    print(json.dumps(status.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
