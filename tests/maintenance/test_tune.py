"""NVMe tuning on fake sysfs / proc / systemd trees."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
from pathlib import Path

import pytest

from kvagentd.config import MaintenanceConfig
from kvagentd.maintenance import tune


def make_tree(root: Path, cold: Path, *, disk: str = "nvme0n1", partition: bool = True,
              nr: int = 1023, sched: str = "[none] mq-deadline", discard_max: int = 2199023255040,
              rotational: int = 0, mount_opts: str = "rw,relatime", super_opts: str = "rw",
              fstrim: bool = True) -> MaintenanceConfig:
    """A fake /sys, /proc and /etc/systemd/system describing the device under `cold`."""
    dev = os.stat(cold).st_dev
    mm = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = root / "sys"
    diskdir = sysfs / "devices" / "pci0000:00" / "0000:00:1d.0" / "nvme" / "nvme0" / disk
    q = diskdir / "queue"
    q.mkdir(parents=True)
    (q / "nr_requests").write_text(f"{nr}\n")
    (q / "scheduler").write_text(f"{sched}\n")
    (q / "discard_max_bytes").write_text(f"{discard_max}\n")
    (q / "rotational").write_text(f"{rotational}\n")
    node = diskdir
    if partition:
        node = diskdir / f"{disk}p1"
        node.mkdir()
        (node / "partition").write_text("1\n")
    (sysfs / "dev" / "block").mkdir(parents=True)
    (sysfs / "dev" / "block" / mm).symlink_to(os.path.relpath(node, sysfs / "dev" / "block"))
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text(
        f"22 1 0:21 / /proc rw,relatime - proc proc rw\n"
        f"27 1 {mm} / {cold} {mount_opts} shared:1 - ext4 /dev/{disk}p1 {super_opts}\n")
    sd = root / "etc" / "systemd" / "system"
    sd.mkdir(parents=True)
    if fstrim:
        (sd / "timers.target.wants").mkdir()
        (sd / "timers.target.wants" / "fstrim.timer").symlink_to("/lib/systemd/system/fstrim.timer")
    return MaintenanceConfig(sysfs_root=sysfs, proc_root=proc, systemd_dir=sd, nr_requests_min=64)


@pytest.fixture
def cold(tmp_path: Path) -> Path:
    d = tmp_path / "cold"
    d.mkdir()
    return d


def test_all_good_values_pass(tmp_path, cold):
    cfg = make_tree(tmp_path, cold)
    r = tune.inspect(cold, cfg)
    assert r.device == "nvme0n1"
    assert r.mount_point == str(cold)
    assert r.ok, r.as_dict()
    assert tune.apply(r, euid=1000) == []  # nothing to do needs no privilege


@pytest.mark.parametrize("nr,sched,opts,super_opts,fstrim,rot", list(itertools.product(
    (32, 64, 256), ("[none] mq-deadline", "none [mq-deadline] kyber"),
    ("rw,relatime", "rw,relatime,discard"), ("rw", "rw,discard"), (True, False), (0, 1))))
def test_every_combination(tmp_path, cold, nr, sched, opts, super_opts, fstrim, rot):
    cfg = make_tree(tmp_path, cold, nr=nr, sched=sched, mount_opts=opts, super_opts=super_opts,
                    fstrim=fstrim, rotational=rot)
    r = tune.inspect(cold, cfg)
    assert r.check("nr_requests").ok == (nr >= 64)
    assert r.check("nr_requests").current == nr
    assert r.check("scheduler").ok == sched.startswith("[none]")
    discard = "discard" in opts or "discard" in super_opts
    assert r.check("continuous_discard").current is discard
    assert r.check("continuous_discard").ok is not discard
    assert r.check("fstrim_timer").ok is fstrim
    assert r.check("rotational").ok == (rot == 0)
    assert r.ok == (nr >= 64 and sched.startswith("[none]") and not discard and fstrim and rot == 0)
    changed = tune.apply(r)  # root in the test environment writes the fake tree
    expect = [n for n, bad in (("scheduler", not sched.startswith("[none]")),
                               ("nr_requests", nr < 64)) if bad]
    assert changed == expect
    after = tune.inspect(cold, cfg)
    assert after.check("nr_requests").ok and after.check("scheduler").ok


def test_not_nvme_has_no_scheduler_recommendation(tmp_path, cold):
    cfg = make_tree(tmp_path, cold, disk="sda", partition=True, sched="none [mq-deadline]")
    r = tune.inspect(cold, cfg)
    assert r.device == "sda" and r.check("scheduler").ok and not r.check("scheduler").fixable


def test_missing_device_is_a_status(tmp_path, cold):
    cfg = make_tree(tmp_path, cold)
    for p in (cfg.sysfs_root / "dev" / "block").iterdir():
        p.unlink()
    r = tune.inspect(cold, cfg)
    assert r.device is None and not r.check("device").ok


def test_apply_refused_when_not_root(tmp_path, cold):
    cfg = make_tree(tmp_path, cold, nr=16)
    r = tune.inspect(cold, cfg)
    with pytest.raises(tune.TunePermissionError, match="root"):
        tune.apply(r, euid=1000)
    assert tune.inspect(cold, cfg).check("nr_requests").current == 16


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_apply_kernel_refusal_is_a_permission_error(tmp_path, cold, code):
    cfg = make_tree(tmp_path, cold, nr=16)

    def refuse(path: str, value: str) -> None:
        raise OSError(code, os.strerror(code), path)

    with pytest.raises(tune.TunePermissionError, match=os.strerror(code)):
        tune.apply(tune.inspect(cold, cfg), writer=refuse, euid=0)


def test_apply_other_errors(tmp_path, cold):
    cfg = make_tree(tmp_path, cold, nr=16)

    def invalid(path: str, value: str) -> None:
        raise OSError(errno.EINVAL, "Invalid argument", path)

    with pytest.raises(tune.TuneError) as ei:
        tune.apply(tune.inspect(cold, cfg), writer=invalid, euid=0)
    assert not isinstance(ei.value, tune.TunePermissionError)


def test_apply_on_a_read_only_mount_gives_erofs(tmp_path, cold):
    """A real read-only filesystem under the fake sysfs (as /sys is inside the daemon's unit)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    cfg = make_tree(tmp_path, cold, nr=16)
    qdir = next(cfg.sysfs_root.rglob("queue"))
    b = subprocess.run(["mount", "--bind", str(qdir), str(qdir)], capture_output=True)
    if b.returncode != 0:
        pytest.skip(f"bind mount not permitted here: {b.stderr.decode().strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(qdir)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"read-only remount not permitted here: {ro.stderr.decode().strip()}")
        with pytest.raises(tune.TunePermissionError, match="Read-only"):
            tune.apply(tune.inspect(cold, cfg))
    finally:
        subprocess.run(["umount", str(qdir)], capture_output=True)


def test_mountinfo_escapes_and_longest_prefix(tmp_path):
    text = ("1 0 8:1 / / rw - ext4 /dev/sda1 rw,discard\n"
            "2 1 259:1 / /var/lib/kv\\040store rw,noatime - xfs /dev/nvme0n1p1 rw\n")
    ents = tune.parse_mountinfo(text)
    m = tune.mount_of(Path("/var/lib/kv store/cold"), ents)
    assert m.mount_point == "/var/lib/kv store" and "discard" not in m.options
    assert "discard" in tune.mount_of(Path("/var/lib/other"), ents).options


def test_scheduler_parsing():
    assert tune.active_scheduler("none [mq-deadline] kyber bfq") == "mq-deadline"
    assert tune.active_scheduler("[none] mq-deadline") == "none"
    assert tune.active_scheduler("none") == "none"
    assert tune.available_schedulers("[none] mq-deadline") == ["none", "mq-deadline"]


def test_cli_json(tmp_path, cold, capsys, monkeypatch):
    cfg = make_tree(tmp_path, cold, nr=16)
    toml = tmp_path / "k.toml"
    toml.write_text(f'[kv]\ncold_dir = "{cold}"\n[maintenance]\nsysfs_root = "{cfg.sysfs_root}"\n'
                    f'proc_root = "{cfg.proc_root}"\nsystemd_dir = "{cfg.systemd_dir}"\n')
    assert tune.main(["--config", str(toml), "--json"]) == 0
    assert '"nr_requests"' in capsys.readouterr().out
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert tune.main(["--config", str(toml), "--apply"]) == 77
    assert "root" in capsys.readouterr().err
