"""Unit files in systemd/: `systemd-analyze verify`, the sandbox rating, sysusers and tmpfiles."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.daemon.conftest import ROOT

UNIT_DIR = ROOT / "systemd"
UNITS = sorted(p for p in UNIT_DIR.iterdir()
               if p.suffix in (".service", ".timer", ".socket", ".path", ".target"))
MAX_EXPOSURE = 2.5
ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run([ANALYZE, *args], cwd=UNIT_DIR, capture_output=True, text=True,
                          timeout=120)


def _unit_settings(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_unit_files_exist() -> None:
    names = {p.name for p in UNITS}
    assert "kvagentd.service" in names


@needs_analyze
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify(unit: Path) -> None:
    r = _analyze("verify", f"./{unit.name}")
    assert r.returncode == 0, r.stderr
    # verify also prints problems of *this* unit without failing; there must be none.
    own = [line for line in r.stderr.splitlines() if unit.name in line]
    assert own == [], own


@needs_analyze
def test_kvagentd_service_security_rating() -> None:
    r = _analyze("security", "--offline=yes", f"--threshold={int(MAX_EXPOSURE * 10)}",
                 "./kvagentd.service")
    m = re.search(r"Overall exposure level for kvagentd\.service: (\d+\.\d+)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    exposure = float(m.group(1))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}"
    assert r.returncode == 0


def test_kvagentd_service_contract() -> None:
    s = _unit_settings(UNIT_DIR / "kvagentd.service")
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
    assert "kvagentd run --config /etc/kvagentd/kvagentd.toml" in s["ExecStart"][0]


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None
                    or shutil.which("systemd-tmpfiles") is None,
                    reason="systemd-sysusers / systemd-tmpfiles not installed")
def test_sysusers_and_tmpfiles_apply_to_an_empty_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for d in ("etc", "dev/shm", "usr/lib/sysusers.d", "usr/lib/tmpfiles.d"):
        (root / d).mkdir(parents=True)
    shutil.copy(UNIT_DIR / "kvagentd.sysusers", root / "usr/lib/sysusers.d/kvagentd.conf")
    shutil.copy(UNIT_DIR / "kvagentd.tmpfiles", root / "usr/lib/tmpfiles.d/kvagentd.conf")
    r = subprocess.run(["systemd-sysusers", f"--root={root}", "kvagentd.conf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    assert re.search(r"^kvagent:x:\d+:\d+:", passwd, re.M)
    assert re.search(r"^kvagent-operators:x:\d+:", group, re.M)
    uid = int(re.search(r"^kvagent:x:(\d+):", passwd, re.M).group(1))
    r = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create", "kvagentd.conf"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    shm = root / "dev/shm/kvagentd"
    st = shm.stat()
    assert (st.st_mode & 0o777) == 0o750 and st.st_uid == uid
