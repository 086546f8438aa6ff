"""`kvagentd check-config` says what `run` would say on this machine: memory on the device run
would pick, the paths the service user must write or read, the broker's address form; an
unreadable file is a configuration error (78) naming the user, not a usage error."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from kvagentd.__main__ import main
from kvagentd.config import ConfigError, load_config
from kvagentd.config.host import Account, host_checks
from tests.daemon.conftest import write_config

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvagentd", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_an_unreadable_config_exits_78_naming_the_user(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:  # type: ignore[no-untyped-def]
    conf = write_config(tmp_path)
    real = Path.read_text

    def denied(self: Path, *a, **kw):  # type: ignore[no-untyped-def]
        if self == conf:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", denied)
    me = pwd.getpwuid(os.geteuid()).pw_name
    for argv in (["run", "--config", str(conf)], ["check-config", str(conf)]):
        assert main(argv) == 78
        err = capsys.readouterr().err
        assert str(conf) in err and f"user {me}" in err and "Permission denied" in err


def test_check_config_refuses_the_gpu_profile_where_it_would_run_on_the_cpu(tmp_path: Path
                                                                            ) -> None:
    import psutil
    import torch

    if torch.cuda.is_available():  # pragma: no cover - this check is about a box without one
        pytest.fail("this test needs a machine without CUDA (it checks the CPU fallback)")
    text = (ROOT / "configs/kvagentd.toml").read_text()
    gib = psutil.virtual_memory().available / 2**30
    big = tmp_path / "big.toml"
    big.write_text(text.replace('hot_bytes = "18GB"', f'hot_bytes = "{int(gib) + 8}GiB"'))
    assert f'hot_bytes = "{int(gib) + 8}GiB"' in big.read_text()
    r = _cli("check-config", str(big), "--user", "root")
    assert r.returncode == 78, r.stdout + r.stderr
    assert "kv.hot_bytes" in r.stderr and "available now" in r.stderr
    # a file made for another box (make install DESTDIR=...): its values only
    r = _cli("check-config", "--no-host", str(big))
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_paths_the_service_user_cannot_write_are_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    conf = write_config(tmp_path)
    conf.write_text(conf.read_text().replace(f'cold_dir = "{tmp_path}/cold"',
                                             f'cold_dir = "{locked}/cold"'))
    cfg = load_config(conf, env={})
    nobody = Account.named("nobody")
    with pytest.raises(ConfigError) as exc:
        host_checks(cfg, nobody)
    # the first path checked that nobody may not create: tmp_path itself is root's 0700 or so
    assert exc.value.path in ("daemon.state_dir", "kv.cold_dir")
    assert "nobody" in exc.value.allowed
    root = Account.named("root")
    notes = host_checks(cfg, root)
    assert any("kv.cold_dir" in n and "made at start" in n for n in notes)
    # a directory the user owns passes; one it does not is named with owner and mode
    _give(tmp_path, nobody)
    with pytest.raises(ConfigError) as exc:
        host_checks(cfg, nobody)
    assert exc.value.path == "kv.cold_dir" and str(locked) in exc.value.allowed
    os.chown(locked, nobody.uid, -1)
    assert any("paths checked for user nobody" in n for n in host_checks(cfg, nobody))
    r = _cli("check-config", str(conf), "--user", "nobody", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "paths checked for user nobody" in r.stdout


def _give(tmp_path: Path, account: Account) -> None:
    """The config's directories (write_config) owned by `account`."""
    os.chmod(tmp_path, 0o755)
    for d in ("state", "cache", "cold", "shm", "run"):
        (tmp_path / d).mkdir(exist_ok=True)
        os.chown(tmp_path / d, account.uid, -1)


def test_files_the_daemon_reads_must_be_readable_by_it(tmp_path: Path) -> None:
    _give(tmp_path, Account.named("nobody"))
    secret = tmp_path / "ca.pem"
    secret.write_text("x")
    os.chmod(secret, 0o600)
    conf = write_config(tmp_path, extra=f"[agent.mqtt]\ntls = true\nca_file = \"{secret}\"\n")
    cfg = load_config(conf, env={})
    with pytest.raises(ConfigError) as exc:
        host_checks(cfg, Account.named("nobody"))
    assert exc.value.path == "agent.mqtt.ca_file" and "mode 600" in exc.value.allowed
    host_checks(cfg, Account.named("root"))
    secret.unlink()
    with pytest.raises(ConfigError) as exc:
        host_checks(cfg, Account.named("root"))
    assert exc.value.path == "agent.mqtt.ca_file" and "existing file" in exc.value.allowed


def test_an_unknown_service_user_is_named() -> None:
    with pytest.raises(ConfigError) as exc:
        Account.named("no-such-user-here")
    assert exc.value.path == "--user"


@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("::1", True), ("broker", True),
                                      ("mqtt.plant.example.", True), ("mqtt://broker", False),
                                      ("broker:1883", False), ("", False), ("-bad.example", False)])
def test_the_broker_address_form(tmp_path: Path, host: str, ok: bool) -> None:
    conf = write_config(tmp_path, extra=f'[[agent.assets]]\nname = "p1"\nmqtt_host = "{host}"\n')
    if ok:
        assert load_config(conf, env={}).agent.assets[0].mqtt_host == host
    else:
        with pytest.raises(ConfigError) as exc:
            load_config(conf, env={})
        assert exc.value.path == "agent.assets[0].mqtt_host"
        assert "without scheme or port" in exc.value.allowed


def _variants(tmp_path: Path) -> dict[str, tuple[dict[str, str], str, str]]:
    """Configurations `run` used to refuse only after it started (exit 70) or never:
    name -> (environment overrides, TOML added to [agent], the field the refusal names)."""
    afile = tmp_path / "afile"
    long_dir = tmp_path / ("d" * 100)
    q = '"{}"'.format
    return {
        "nul in state_dir": ({"KVAGENTD_DAEMON__STATE_DIR": q("/var/lib/kv\\u0000agentd")}, "",
                             "daemon.state_dir"),
        "socket path too long": ({"KVAGENTD_CONTROL__SOCKET": q(f"{long_dir}/kvagentd.sock")},
                                 "", "control.socket"),
        "missing hf_dir": ({"KVAGENTD_MODEL__SOURCE": "hf_dir",
                            "KVAGENTD_MODEL__PATH": q(f"{tmp_path}/nomodel")}, "", "model.path"),
        "missing gguf": ({"KVAGENTD_MODEL__SOURCE": "gguf",
                          "KVAGENTD_MODEL__PATH": q(f"{tmp_path}/m.gguf")}, "", "model.path"),
        "hf_dir is a file": ({"KVAGENTD_MODEL__SOURCE": "hf_dir",
                              "KVAGENTD_MODEL__PATH": q(str(afile))}, "", "model.path"),
        "cron never fires": ({}, 'weekly_report_cron = "0 6 31 2 *"\n',
                             "agent.weekly_report_cron"),
        "replay file missing": ({"KVAGENTD_AGENT__ENABLED": "true"},
                                f'[[agent.assets]]\nname = "p1"\nsource = "replay"\n'
                                f'replay_path = "{tmp_path}/rec.npy"\n',
                                "agent.assets[0].replay_path"),
        "zone limit inf": ({}, '[[agent.assets]]\nname = "p1"\nzone_limits_mm_s = [1.4, 2.8, inf]\n',
                           "agent.assets[0].zone_limits_mm_s"),
    }


@pytest.mark.parametrize("name", sorted(_variants(Path("/tmp"))))
def test_check_config_and_run_refuse_each_variant_with_78(tmp_path: Path, name: str) -> None:
    env, extra, field = _variants(tmp_path)[name]
    (tmp_path / "afile").write_text("x")
    conf = write_config(tmp_path, extra=extra)
    full = {**os.environ, **env}
    for args in (("check-config", str(conf), "--user", "root"), ("run", "--config", str(conf))):
        r = subprocess.run([sys.executable, "-m", "kvagentd", *args], capture_output=True,
                           text=True, timeout=120, cwd=ROOT, env=full)
        assert r.returncode == 78, (args, r.stdout, r.stderr[-2000:])
        assert field in r.stderr, r.stderr[-2000:]
