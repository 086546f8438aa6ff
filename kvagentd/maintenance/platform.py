"""The box under the daemon: memory errors, thermal throttling, PCIe links and the cold disk's
filesystem, read from sysfs and procfs (roots configurable: `maintenance.sysfs_root`,
`maintenance.proc_root`, so tests run on fake trees).

Hot and warm KV carry no checksum (only cold records do), so "never wrong KV" rests on memory
nobody else watches: corrected ECC errors are a warning of a failing DIMM, an uncorrected one
is data the box may have computed wrong. A CPU that throttles makes every tick slower; a GPU or
NVMe link trained below its width moves KV at a fraction of its speed; a cold directory on
tmpfs or a network filesystem is not the durable SSD tier the design assumes.

`PlatformWatch.read()` returns `PlatformFacts`; counters are since the watch was made (the
daemon's start), sysfs keeps them since boot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvagentd.maintenance.tune import MountEntry, mount_of, parse_mountinfo

# PCI classes whose link width matters for KV: display controllers (GPUs, 0x03xxxx) and NVMe
# (0x010802). Link *speed* is left out: GPUs drop to Gen1 at idle by design (ASPM).
_PCI_CLASSES = ("0x03", "0x010802")
# filesystems that are not the durable, local SSD the cold tier is meant for
_VOLATILE_FS = frozenset({"tmpfs", "ramfs"})
_NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "sshfs", "fuse.sshfs", "9p", "ceph",
                         "glusterfs", "fuse.glusterfs"})
# mount options that trade durability for speed: a power cut can lose or tear what the cold
# tier synced (its index and records rely on fsync reaching the device)
_RISKY_OPTIONS = frozenset({"nobarrier", "barrier=0", "data=writeback"})


@dataclass(frozen=True, slots=True)
class PlatformFacts:
    edac_corrected: int = 0  # since the watch started
    edac_uncorrected: int = 0
    throttled: int = 0  # CPU core and package throttle events since the watch started
    pcie_degraded: tuple[str, ...] = ()  # "0000:01:00.0 (GPU): x8 of x16"
    storage: tuple[str, ...] = ()  # what is wrong with the cold directory's filesystem
    storage_notes: tuple[str, ...] = ()  # what may be (a disk that reports itself rotational)
    edac_present: bool = False
    read_errors: tuple[str, ...] = field(default=())


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip() or "0")
    except (OSError, ValueError):
        return None


def edac_counts(sysfs: Path) -> tuple[int, int, bool]:
    """(corrected, uncorrected, any controller) over `devices/system/edac/mc/mc*`."""
    ce = ue = 0
    mcs = sorted((sysfs / "devices/system/edac/mc").glob("mc[0-9]*"))
    for mc in mcs:
        ce += _read_int(mc / "ce_count") or 0
        ue += _read_int(mc / "ue_count") or 0
    return ce, ue, bool(mcs)


def throttle_count(sysfs: Path) -> int:
    """Core and package thermal throttle events of every CPU since boot."""
    n = 0
    for cpu in (sysfs / "devices/system/cpu").glob("cpu[0-9]*"):
        t = cpu / "thermal_throttle"
        n += (_read_int(t / "core_throttle_count") or 0) + (
            _read_int(t / "package_throttle_count") or 0)
    return n


def pcie_degraded(sysfs: Path) -> list[str]:
    """GPUs and NVMe drives whose PCIe link runs narrower than it can."""
    out = []
    for dev in sorted((sysfs / "bus/pci/devices").glob("*")):
        try:
            cls = (dev / "class").read_text().strip()
        except OSError:
            continue
        if not cls.startswith(_PCI_CLASSES):
            continue
        cur, top = _read_int(dev / "current_link_width"), _read_int(dev / "max_link_width")
        if cur and top and cur < top:
            kind = "GPU" if cls.startswith("0x03") else "NVMe"
            out.append(f"{dev.name} ({kind}): x{cur} of x{top}")
    return out


def storage_issues(mount: MountEntry | None, rotational: bool | None
                   ) -> tuple[list[str], list[str]]:
    """(what makes the cold directory's filesystem a poor durable tier, what may: a disk
    that reports itself rotational, which virtual disks (virtio) do by default)."""
    if mount is None:
        return [], []
    out, notes = [], []
    if mount.fstype in _VOLATILE_FS:
        out.append(f"{mount.mount_point} is {mount.fstype}: cold records do not survive a reboot")
    elif mount.fstype in _NETWORK_FS or mount.fstype.startswith("fuse."):
        out.append(f"{mount.mount_point} is {mount.fstype}, a network or user-space "
                   "filesystem: reads and fsync take the network's time")
    risky = sorted(set(mount.options) & _RISKY_OPTIONS)
    if risky:
        out.append(f"{mount.mount_point} is mounted {','.join(risky)}: a power cut can lose "
                   "what the cold tier synced")
    if rotational:
        notes.append(f"{mount.mount_point} is on a disk that reports itself rotational: a hard "
                     "disk's seeks are far from the SSD figures the tier is sized for (virtual "
                     "disks report this by default)")
    return out, notes


class PlatformWatch:
    """Reads the platform facts; counters relative to when it was made."""

    def __init__(self, sysfs: Path, proc: Path, cold_dir: Path) -> None:
        self.sysfs, self.proc, self.cold_dir = Path(sysfs), Path(proc), Path(cold_dir)
        ce, ue, _ = edac_counts(self.sysfs)
        self._base = (ce, ue, throttle_count(self.sysfs))

    def read(self) -> PlatformFacts:
        ce, ue, present = edac_counts(self.sysfs)
        throttled = throttle_count(self.sysfs)
        errors: list[str] = []
        mount, rotational = None, None
        try:
            text = (self.proc / "self/mountinfo").read_text(encoding="utf-8", errors="replace")
            mount = mount_of(self.cold_dir, parse_mountinfo(text))  # by path prefix
            if mount is not None:
                rotational = self._rotational(mount.dev)
        except OSError as exc:
            errors.append(f"mountinfo: {exc.strerror or exc}")
        problems, notes = storage_issues(mount, rotational)
        return PlatformFacts(
            edac_corrected=max(0, ce - self._base[0]), edac_uncorrected=max(0, ue - self._base[1]),
            throttled=max(0, throttled - self._base[2]), pcie_degraded=tuple(pcie_degraded(
                self.sysfs)), storage=tuple(problems), storage_notes=tuple(notes),
            edac_present=present, read_errors=tuple(errors))

    def _rotational(self, dev: str) -> bool | None:
        """`queue/rotational` of the block device `major:minor` (its parent disk's for a
        partition); None when sysfs does not say."""
        real = (self.sysfs / "dev/block" / dev).resolve()
        for q in (real / "queue/rotational", real.parent / "queue/rotational"):
            v = _read_int(q)
            if v is not None:
                return v == 1
        return None
