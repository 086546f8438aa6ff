"""Unit files in systemd/: `systemd-analyze verify` with real paths, sandbox ratings, the
contract of each unit, sysusers and tmpfiles, and README agreeing with sysusers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvagentd.config import ControlConfig
from tests.daemon.conftest import ROOT

UNIT_DIR = ROOT / "systemd"
UNITS = sorted(p for p in UNIT_DIR.iterdir()
               if p.suffix in (".service", ".timer", ".socket", ".path", ".target"))
# systemd-analyze security --offline=yes: the daemon, and the root helpers (issue 13: <= 4.0).
MAX_EXPOSURE = {"kvagentd.service": 2.5, "kvagentd-tune.service": 4.0,
                "kvagentd-health.service": 4.0}
PREFIX = "/opt/kvagentd/"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (make test installs it with apt-get: package "
                    "systemd)")
    return path


def unit_settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def exposure(unit: Path) -> float:
    r = subprocess.run([tool("systemd-analyze"), "security", "--offline=yes", str(unit)],
                       capture_output=True, text=True, timeout=120)
    m = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    return float(m.group(1))


def test_unit_files_exist() -> None:
    assert {p.name for p in UNITS} == {"kvagentd.service", "kvagentd-tune.service",
                                       "kvagentd-health.service", "kvagentd-health.timer"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_with_real_paths(unit: Path, tmp_path: Path) -> None:
    """The unit as installed with this checkout's venv as PREFIX/venv: every Exec path exists."""
    venv = ROOT / ".venv"
    text = unit.read_text().replace(PREFIX + "venv/", f"{venv}/")
    (tmp_path / unit.name).write_text(text)
    r = subprocess.run([tool("systemd-analyze"), "verify", f"./{unit.name}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    own = [line for line in r.stderr.splitlines() if unit.name in line]
    assert own == [], own


@pytest.mark.parametrize("name", sorted(MAX_EXPOSURE))
def test_security_rating(name: str) -> None:
    value = exposure(UNIT_DIR / name)
    assert value <= MAX_EXPOSURE[name], f"{name}: exposure {value} > {MAX_EXPOSURE[name]}"


def test_exec_paths_are_absolute_under_the_prefix() -> None:
    for unit in UNITS:
        s = unit_settings(unit)
        for key in ("ExecStart", "ExecStartPre", "ExecStop", "ExecReload"):
            for cmd in s.get(key, []):
                exe = cmd.lstrip("-@:+!").split()[0]
                assert exe.startswith("/") and not exe.startswith("/usr/bin/env"), (unit, cmd)
        for cmd in s.get("ExecStart", []):
            assert cmd.startswith(PREFIX + "venv/bin/"), (unit.name, cmd)


def test_kvagentd_service_contract() -> None:
    s = unit_settings(UNIT_DIR / "kvagentd.service")
    assert s["Type"] == ["notify"] and s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"] and "78" in s["RestartPreventExitStatus"][0].split()
    assert s["User"] == ["kvagent"] and s["Group"] == ["kvagent"]
    assert s["RuntimeDirectory"] == ["kvagentd"] and s["StateDirectory"] == ["kvagentd"]
    assert s["CacheDirectory"] == ["kvagentd"] and s["RuntimeDirectoryMode"] == ["0750"]
    assert s["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert int(s["WatchdogSec"][0]) > 0
    assert s["MemoryDenyWriteExecute"] == ["no"]
    assert "RemoveIPC" not in s or s["RemoveIPC"] == ["no"]
    # The GPU and /dev/shm stay reachable: /dev is not private, NVIDIA device classes allowed.
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert any("nvidia-uvm" in v for v in s["DeviceAllow"])
    assert any(v.startswith("char-nvidia") and "frontend" in v for v in s["DeviceAllow"])
    assert s["ExecStart"] == [PREFIX + "venv/bin/kvagentd run --config /etc/kvagentd/kvagentd.toml"]
    # MQTT brokers sit on the plant network.
    assert "network-online.target" in s["Wants"][0] and "network-online.target" in s["After"][0]


def test_root_helpers_are_confined() -> None:
    tune = unit_settings(UNIT_DIR / "kvagentd-tune.service")
    assert tune["CapabilityBoundingSet"] == [""] and tune["ProtectSystem"] == ["strict"]
    assert tune["PrivateDevices"] == ["yes"] and tune["PrivateNetwork"] == ["yes"]
    assert "@system-service" in tune["SystemCallFilter"]
    assert tune.get("RemainAfterExit", ["no"]) == ["no"]  # the udev rule can start it again
    health = unit_settings(UNIT_DIR / "kvagentd-health.service")
    assert health["User"] == ["kvagent"]
    assert set(health["CapabilityBoundingSet"][0].split()) == {"CAP_SYS_ADMIN", "CAP_SYS_RAWIO"}
    assert health["DevicePolicy"] == ["closed"]
    assert all(v.endswith(" r") for v in health["DeviceAllow"])  # read-only device access
    assert health["ReadWritePaths"] == ["/var/lib/kvagentd"]
    # Runs as kvagent: RemoveIPC=yes would wipe the daemon's shadow tier in /dev/shm.
    assert health["RemoveIPC"] == ["no"]
    assert "@system-service" in health["SystemCallFilter"]


def test_no_static_udev_rule_for_every_nvme_disk() -> None:
    """The rule is written at install for the cold tier's disk (kvagentd.daemon.deploy)."""
    for rule in UNIT_DIR.glob("*.rules"):
        assert "nvme[0-9]" not in rule.read_text(), rule


def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for d in ("etc", "dev/shm", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d"):
        (root / d).mkdir(parents=True)
    shutil.copy(UNIT_DIR / "kvagentd.sysusers", root / "usr/lib/sysusers.d/kvagentd.conf")
    shutil.copy(UNIT_DIR / "kvagentd.tmpfiles", root / "usr/lib/tmpfiles.d/kvagentd.conf")
    conf = root / "etc/kvagentd/kvagentd.toml"  # as a DESTDIR tree leaves it: root:root 0644
    conf.parent.mkdir()
    conf.write_text("[daemon]\n")
    os.chmod(conf, 0o644)
    r = subprocess.run([tool("systemd-sysusers"), f"--root={root}", "kvagentd.conf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    assert re.search(r"^kvagent:x:\d+:\d+:", passwd, re.M)
    assert re.search(r"^kvagent-operators:x:\d+:", group, re.M)
    uid = int(re.search(r"^kvagent:x:(\d+):", passwd, re.M).group(1))
    r = subprocess.run([tool("systemd-tmpfiles"), f"--root={root}", "--create", "kvagentd.conf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shm = root / "dev/shm/kvagentd"
    st = shm.stat()
    assert (st.st_mode & 0o777) == 0o750 and st.st_uid == uid
    gid = int(re.search(r"^kvagent:x:(\d+):", group, re.M).group(1))
    st = conf.stat()  # readable by the service user's group, by nobody else
    assert (st.st_mode & 0o777) == 0o640 and st.st_gid == gid and st.st_uid == 0


def test_readme_sysusers_and_config_name_the_same_groups() -> None:
    """Finding 4 of issue 13: README told operators to join one group, the socket needed two."""
    sysusers = (UNIT_DIR / "kvagentd.sysusers").read_text()
    made = set(re.findall(r"^[ug]\s+(\S+)", sysusers, re.M))
    readme = (ROOT / "README.md").read_text()
    joins = re.findall(r"usermod -aG (\S+) (\w+)\s+#(.*)", readme)
    assert len(joins) == 2
    by_user = {user: (group, comment) for group, user, comment in joins}
    assert by_user["alice"][0] == ControlConfig().socket_group == "kvagent"
    assert by_user["bob"][0] == ControlConfig().operator_group == "kvagent-operators"
    assert "," not in by_user["bob"][0]  # one group is enough for an operator
    assert {g for g, _ in by_user.values()} <= made
