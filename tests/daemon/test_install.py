"""`make install` into a DESTDIR: the tree, the configuration kept, the units verified with the
paths they will have on the box, `make uninstall`; and the host-specific files from the
configuration (kvagentd.daemon.deploy) on fake sysfs trees."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvagentd.daemon import deploy
from kvagentd.config import Config, DaemonConfig, KVConfig, MaintenanceConfig
from tests.daemon.conftest import ROOT
from tests.daemon.test_systemd_units import MAX_EXPOSURE, exposure, tool, unit_settings
from tests.maintenance.test_tune import make_tree

PREFIX = "/opt/kvagentd"
UNITS = ("kvagentd.service", "kvagentd-tune.service", "kvagentd-health.service",
         "kvagentd-health.timer")


def make(target: str, destdir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([tool("make"), "-C", str(ROOT), target, f"DESTDIR={destdir}",
                        f"VENV_SOURCE={ROOT / '.venv'}", *extra],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def as_installed(destdir: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `command` in a private mount namespace where DESTDIR's /opt and units are the host's,
    so paths resolve exactly as on the installed box."""
    tool("unshare")
    script = (f"mkdir -p /opt && mount --bind {destdir}/opt /opt && "
              f"mount --bind {destdir}/etc/systemd/system /etc/systemd/system && "
              + " ".join(command))
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=180, cwd="/")
    if "unshare failed" in r.stderr or "permission denied" in r.stderr.lower():
        pytest.fail(f"this test needs root with mount namespaces: {r.stderr}")
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.fail("the install test runs as root (it checks ownership and mounts a namespace)")
    destdir = tmp_path_factory.mktemp("destdir")
    make("install", destdir)
    return destdir


def test_the_tree(installed: Path) -> None:
    d = installed
    venv = d / PREFIX.lstrip("/") / "venv"
    assert venv.is_symlink() and (venv / "bin" / "kvagentd").exists()
    assert (d / PREFIX.lstrip("/") / "README.md").read_text() == (ROOT / "README.md").read_text()
    assert os.readlink(d / "usr/local/bin/kvctl") == f"{PREFIX}/venv/bin/kvctl"
    man = d / "usr/local/share/man/man1"
    assert {"kvagentd.1", "kvctl.1", "kvctl-health.1", "kvagentd-check-config.1"} <= {
        p.name for p in man.glob("*.1")}
    assert (d / "usr/lib/sysusers.d/kvagentd.conf").read_text() == \
        (ROOT / "systemd/kvagentd.sysusers").read_text()
    assert (d / "usr/lib/tmpfiles.d/kvagentd.conf").exists()
    conf = d / "etc/kvagentd/kvagentd.toml"
    assert conf.stat().st_mode & 0o777 == 0o640
    assert conf.read_text() == (ROOT / "configs/kvagentd.toml").read_text()
    units = d / "etc/systemd/system"
    for name in UNITS:
        text = (units / name).read_text()
        assert "/usr/bin/env" not in text
    assert unit_settings(units / "kvagentd.service")["ExecStart"] == [
        f"{PREFIX}/venv/bin/kvagentd run --config /etc/kvagentd/kvagentd.toml"]
    # enabled: the daemon, the tune oneshot, the health timer (else SSD health stays unknown)
    assert (units / "multi-user.target.wants/kvagentd.service").is_symlink()
    assert (units / "multi-user.target.wants/kvagentd-tune.service").is_symlink()
    assert (units / "timers.target.wants/kvagentd-health.timer").is_symlink()
    # nothing of the build machine: its disk, serial or device path (the target's own are
    # written there by `kvagentd deploy`)
    assert not (d / "etc/udev/rules.d/60-kvagentd-cold.rules").exists()
    assert not (units / "kvagentd-health.service.d/50-device.conf").exists()
    disks = {p.name for p in Path("/sys/block").iterdir()}
    for f in d.rglob("*"):
        if f.is_file() and not f.is_symlink() and "venv" not in f.parts and f.suffix != ".1":
            text = f.read_text(errors="replace")
            assert not any(f"/dev/{disk}" in text for disk in disks), f
    r = subprocess.run([str(d / PREFIX.lstrip("/") / "venv/bin/kvagentd"), "deploy", "--config",
                        str(conf), "--root", str(d)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rule = (d / "etc/udev/rules.d/60-kvagentd-cold.rules").read_text()
    assert "kvagentd-tune.service" in rule and "nvme[0-9]" not in rule
    assert (units / "kvagentd.service.d/50-paths.conf").exists()
    dropin = (units / "kvagentd-health.service.d/50-device.conf").read_text()
    assert "DeviceAllow=\n" in dropin


def test_units_verify_with_their_installed_paths(installed: Path) -> None:
    r = as_installed(installed, ["systemd-analyze", "verify", *UNITS])
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stderr.splitlines() if "kvagentd" in line], r.stderr
    # the same check fails when the program is not where the units say
    r = subprocess.run([tool("systemd-analyze"), "verify",
                        str(installed / "etc/systemd/system/kvagentd.service")],
                       capture_output=True, text=True, timeout=120)
    if not Path(f"{PREFIX}/venv/bin/kvagentd").exists():
        assert r.returncode != 0 and "not executable" in r.stderr


def test_installed_units_keep_their_ratings(installed: Path) -> None:
    for name, limit in MAX_EXPOSURE.items():
        assert exposure(installed / "etc/systemd/system" / name) <= limit, name


def test_the_configuration_is_never_overwritten(installed: Path) -> None:
    conf = installed / "etc/kvagentd/kvagentd.toml"
    edited = conf.read_text() + "\n# edited by the operator\n"
    conf.write_text(edited)
    r = make("install", installed)
    assert "kept" in r.stdout
    assert conf.read_text() == edited
    assert (installed / "etc/kvagentd/kvagentd.toml.default").read_text() == \
        (ROOT / "configs/kvagentd.toml").read_text()


def test_uninstall_keeps_configuration(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the install test runs as root")
    make("install", tmp_path)
    make("uninstall", tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not p.is_dir())
    assert left == ["etc/kvagentd/kvagentd.toml", "etc/kvagentd/kvagentd.toml.default"]


# -- host-specific files ------------------------------------------------------------------------

def _config(tmp_path: Path, cold: Path, maint: MaintenanceConfig) -> Config:
    return Config(daemon=DaemonConfig(), kv=KVConfig(cold_dir=cold),
                  maintenance=dataclasses.replace(maint, shadow_dir=Path("/dev/shm/kvagentd")))


def test_udev_rule_names_only_the_cold_disk(tmp_path: Path) -> None:
    cold = tmp_path / "cold"
    cold.mkdir()
    maint = make_tree(tmp_path, cold, disk="nvme1n1")
    disk = next(maint.sysfs_root.rglob("nvme1n1"))
    (disk / "wwid").write_text("eui.0025388b91b2a3c4\n")
    rule, device = deploy.udev_rule(_config(tmp_path, cold, maint), "/etc/kvagentd/kvagentd.toml")
    assert device == "/dev/nvme1n1"
    lines = [line for line in rule.splitlines() if line and not line.startswith("#")]
    assert lines == ['ACTION=="add|change", SUBSYSTEM=="block", ENV{DEVTYPE}=="disk", '
                     'ATTR{wwid}=="eui.0025388b91b2a3c4", TAG+="systemd", '
                     'ENV{SYSTEMD_WANTS}+="kvagentd-tune.service"']
    (disk / "wwid").unlink()
    rule, _ = deploy.udev_rule(_config(tmp_path, cold, maint), "x")
    assert 'KERNEL=="nvme1n1"' in rule and "by kernel name" in rule
    # not on a block device: a rule file that says so and matches nothing
    for link in (maint.sysfs_root / "dev" / "block").iterdir():
        link.unlink()
    rule, device = deploy.udev_rule(_config(tmp_path, cold, maint), "x")
    assert device is None and "ACTION" not in rule


def test_dropins_for_a_cold_tier_on_its_own_mount(tmp_path: Path) -> None:
    cold = tmp_path / "srv" / "kvcold"
    cold.mkdir(parents=True)
    maint = make_tree(tmp_path, cold)
    cfg = _config(tmp_path, cold, maint)
    cfg = dataclasses.replace(cfg, maintenance=dataclasses.replace(
        cfg.maintenance, health_status_file=Path("/var/lib/kvagentd/ssd-health.json")))
    files = deploy.write_all(cfg, "/etc/kvagentd/kvagentd.toml", tmp_path / "root")
    assert [f.relative_to(tmp_path / "root") for f in files] == [
        deploy.UDEV_RULE, deploy.DAEMON_DROPIN, deploy.TMPFILES, deploy.HEALTH_DROPIN]
    dropin = (tmp_path / "root" / deploy.DAEMON_DROPIN).read_text()
    assert f"ReadWritePaths={cold}\n" in dropin and f"RequiresMountsFor={cold}\n" in dropin
    assert "/var/lib/kvagentd" not in re.sub(r"#.*", "", dropin)
    assert f"d {cold} 0750 kvagent kvagent -" in (tmp_path / "root" / deploy.TMPFILES).read_text()
    health = (tmp_path / "root" / deploy.HEALTH_DROPIN).read_text()
    assert "DeviceAllow=\nDeviceAllow=/dev/nvme0n1 r\n" in health
    assert "ReadWritePaths" not in health


def test_deploy_dropins_verify(tmp_path: Path) -> None:
    """Drop-ins as the installed unit loads them: systemd-analyze accepts them."""
    cold = tmp_path / "srv" / "kvcold"
    cold.mkdir(parents=True)
    maint = make_tree(tmp_path, cold)
    root = tmp_path / "root"
    deploy.write_all(_config(tmp_path, cold, maint), "x", root)
    units = root / "etc/systemd/system"
    for name in ("kvagentd.service", "kvagentd-health.service"):
        text = (ROOT / "systemd" / name).read_text().replace(f"{PREFIX}/venv/", f"{ROOT}/.venv/")
        (units / name).write_text(text)
        shutil.copytree(units / f"{name}.d", tmp_path / f"{name}.d")
        (tmp_path / name).write_text(text)
    r = subprocess.run([tool("systemd-analyze"), "verify", "./kvagentd.service",
                        "./kvagentd-health.service"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stderr.splitlines() if ".service.d/" in line], r.stderr
