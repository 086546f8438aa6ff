"""Platform and storage checks on fake sysfs/procfs trees: each fault becomes a health reason
(memory errors, throttling, a narrow PCIe link, a cold directory on tmpfs, a network
filesystem or risky mount options)."""

from __future__ import annotations

from pathlib import Path

from kvagentd.config import HealthConfig
from kvagentd.health import Acknowledgements, DaemonFacts, Facts, assess
from kvagentd.health.report import Level
from kvagentd.maintenance.platform import PlatformWatch, storage_issues
from kvagentd.maintenance.tune import MountEntry

MOUNTINFO = ("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
             "30 22 0:40 / /cold rw,nosuid shared:2 - {fs} {src} {opts}\n")


def _tree(root: Path, *, fs: str = "ext4", src: str = "/dev/nvme0n1p1", opts: str = "rw",
          rotational: int = 0) -> tuple[Path, Path]:
    sysfs, proc = root / "sys", root / "proc"
    mc = sysfs / "devices/system/edac/mc/mc0"
    mc.mkdir(parents=True)
    (mc / "ce_count").write_text("5\n")
    (mc / "ue_count").write_text("0\n")
    for cpu in ("cpu0", "cpu1"):
        t = sysfs / "devices/system/cpu" / cpu / "thermal_throttle"
        t.mkdir(parents=True)
        (t / "core_throttle_count").write_text("7\n")
        (t / "package_throttle_count").write_text("1\n")
    for name, cls, cur, top in (("0000:01:00.0", "0x030000", 16, 16),
                                ("0000:02:00.0", "0x010802", 4, 4),
                                ("0000:03:00.0", "0x020000", 1, 4)):  # a NIC: not watched
        d = sysfs / "bus/pci/devices" / name
        d.mkdir(parents=True)
        (d / "class").write_text(cls + "\n")
        (d / "current_link_width").write_text(f"{cur}\n")
        (d / "max_link_width").write_text(f"{top}\n")
    q = sysfs / "dev/block/0:40/queue"
    q.mkdir(parents=True)
    (q / "rotational").write_text(f"{rotational}\n")
    (proc / "self").mkdir(parents=True)
    (proc / "self/mountinfo").write_text(MOUNTINFO.format(fs=fs, src=src, opts=opts))
    (root / "cold").mkdir(exist_ok=True)
    return sysfs, proc


def _checks(facts_platform, acks: Acknowledgements | None = None) -> dict[str, object]:
    from kvagentd.config import Config

    daemon = DaemonFacts(phase="running", uptime_s=10.0, main_loop_age_s=0.1,
                         main_loop_limit_s=5.0, scheduler_running=True, scheduler_jobs=1)
    report = assess(Config(health=HealthConfig()), Facts(daemon=daemon,
                                                         platform=facts_platform),
                    acks or Acknowledgements())
    return {c.name: c for c in report.checks}


def test_a_healthy_box_reads_ok_and_counters_start_at_the_watch(tmp_path: Path) -> None:
    sysfs, proc = _tree(tmp_path)
    w = PlatformWatch(sysfs, proc, Path("/cold"))
    p = w.read()
    assert (p.edac_corrected, p.edac_uncorrected, p.throttled) == (0, 0, 0)  # since boot: 5, 16
    assert p.pcie_degraded == () and p.storage == () and p.edac_present
    checks = _checks(p)
    for name in ("memory-errors", "thermal", "storage:cold"):
        assert checks[name].level is Level.OK, checks[name]
    assert "pcie" not in checks


def test_each_fault_becomes_a_reason(tmp_path: Path) -> None:
    sysfs, proc = _tree(tmp_path)
    w = PlatformWatch(sysfs, proc, Path("/cold"))
    (sysfs / "devices/system/edac/mc/mc0/ce_count").write_text("9\n")
    (sysfs / "devices/system/cpu/cpu1/thermal_throttle/core_throttle_count").write_text("10\n")
    (sysfs / "bus/pci/devices/0000:01:00.0/current_link_width").write_text("8\n")
    p = w.read()
    assert (p.edac_corrected, p.throttled) == (4, 3)
    assert p.pcie_degraded == ("0000:01:00.0 (GPU): x8 of x16",)
    acks = Acknowledgements()
    checks = _checks(p, acks)
    assert checks["memory-errors"].level is Level.DEGRADED and "4 since start" in \
        checks["memory-errors"].reason
    assert checks["thermal"].level is Level.DEGRADED and "3 since start" in \
        checks["thermal"].reason
    assert checks["pcie"].level is Level.DEGRADED and "x8 of x16" in checks["pcie"].reason
    # acknowledged, the counters read ok until they grow again
    acks.ack(Facts(daemon=None, platform=p).counters(), 0.0)  # type: ignore[arg-type]
    checks = _checks(p, acks)
    assert checks["memory-errors"].level is Level.OK and checks["thermal"].level is Level.OK
    (sysfs / "devices/system/edac/mc/mc0/ue_count").write_text("1\n")
    checks = _checks(w.read(), acks)
    assert checks["memory-errors"].level is Level.FAILING and "uncorrected" in \
        checks["memory-errors"].reason


def test_the_cold_directory_filesystem(tmp_path: Path) -> None:
    for fs, src, opts, want in (("tmpfs", "tmpfs", "rw", "tmpfs: cold records do not survive"),
                                ("nfs4", "nas:/kv", "rw", "network"),
                                ("ext4", "/dev/sdb1", "rw,data=writeback", "data=writeback"),
                                ("xfs", "/dev/sdb1", "rw,nobarrier", "nobarrier")):
        root = tmp_path / fs / opts.replace(",", "_")
        root.mkdir(parents=True)
        sysfs, proc = _tree(root, fs=fs, src=src, opts=opts)
        p = PlatformWatch(sysfs, proc, Path("/cold")).read()
        check = _checks(p)["storage:cold"]
        assert check.level is Level.DEGRADED and want in check.reason, (fs, check.reason)
    root = tmp_path / "spinning"
    root.mkdir()
    sysfs, proc = _tree(root, rotational=1)
    p = PlatformWatch(sysfs, proc, Path("/cold")).read()
    check = _checks(p)["storage:cold"]  # a note, not a fault: virtual disks say so by default
    assert check.level is Level.OK and "rotational" in check.reason
    assert storage_issues(MountEntry("/", "8:1", "ext4", ("rw",)), None) == ([], [])
