"""NVMe / block-device tuning of the cold tier: inspect, compare with the recommendation, apply.

`inspect(cold_dir, cfg)` finds the whole disk under the cold directory (its `st_dev`
major:minor -> `<sysfs_root>/dev/block/M:m`, a partition walks up to its disk), reads
`queue/nr_requests`, `queue/scheduler`, `queue/discard_max_bytes`, `queue/rotational`, the
mount options of the cold directory from `<proc_root>/self/mountinfo` and whether
`fstrim.timer` is enabled. Recommended: nr_requests >= `maintenance.nr_requests_min`, the `none`
scheduler on NVMe, no continuous `discard` mount option, a periodic fstrim.

`apply(report)` writes the two fixable sysfs values. It needs root: the daemon runs
unprivileged (and systemd makes /sys read-only for it), so it gets `TunePermissionError`; the
root oneshot `kvagentd-tune.service` (`python -m kvagentd.maintenance.tune --apply`) and the
udev rule `60-kvagentd-cold.rules` (written by `make install` for the cold tier's disk) start
it at boot and whenever that disk appears.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable

import structlog

from kvagentd.config import Config, ConfigError, MaintenanceConfig, load_config

log = structlog.get_logger(__name__)

FSTRIM_WANTS = "timers.target.wants/fstrim.timer"


class TuneError(RuntimeError):
    """Tuning could not be inspected or applied."""


class TunePermissionError(TuneError):
    """Writing sysfs was refused (not root, EACCES, EPERM or a read-only /sys)."""


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    current: str | int | bool | None
    recommended: str
    ok: bool
    fixable: bool  # apply() can set it (a sysfs value)
    path: str | None = None  # the sysfs file, for fixable checks
    target: str | None = None  # the value apply() writes
    advice: str = ""


@dataclass(frozen=True, slots=True)
class TuneReport:
    cold_dir: str
    device: str | None  # whole-disk name, e.g. "nvme0n1"; None when not found
    dev: str | None  # "major:minor" of the cold directory's filesystem
    mount_point: str | None
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["ok"] = self.ok
        d["checks"] = [asdict(c) for c in self.checks]
        return d


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------

def existing_dir(path: Path) -> Path:
    """`path` or its nearest existing ancestor (the cold dir may not exist before first start)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def find_disk(dev: int, sysfs_root: Path) -> Path | None:
    """The sysfs directory of the whole disk holding device number `dev`, or None."""
    link = sysfs_root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    if not link.exists():
        return None
    node = link.resolve()
    if (node / "partition").exists():
        node = node.parent
    # A device-mapper or md device over exactly one disk: tune the disk under it.
    for _ in range(4):
        slaves = node / "slaves"
        if (node / "queue").exists() and not (slaves.is_dir() and any(slaves.iterdir())):
            break
        kids = sorted(slaves.iterdir()) if slaves.is_dir() else []
        if len(kids) != 1:
            break
        node = kids[0].resolve()
        if (node / "partition").exists():
            node = node.parent
    return node


def read_sysfs(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None


def active_scheduler(text: str | None) -> str | None:
    """`none [mq-deadline] kyber` -> `mq-deadline`; a single word is the active one."""
    if text is None:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    words = text.split()
    return words[0] if len(words) == 1 else None


def available_schedulers(text: str | None) -> list[str]:
    return [w.strip("[]") for w in (text or "").split()]


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True, slots=True)
class MountEntry:
    mount_point: str
    dev: str  # "major:minor"
    fstype: str
    options: tuple[str, ...]  # per-mount and super-block options together


def parse_mountinfo(text: str) -> list[MountEntry]:
    out = []
    for line in text.splitlines():
        if " - " not in line:
            continue
        left, right = line.split(" - ", 1)
        lf, rf = left.split(), right.split()
        if len(lf) < 6 or len(rf) < 3:
            continue
        opts = tuple(lf[5].split(",")) + tuple(rf[2].split(","))
        out.append(MountEntry(_unescape(lf[4]), lf[2], rf[0], opts))
    return out


def mount_of(path: Path, entries: list[MountEntry], dev: str | None = None) -> MountEntry | None:
    """The mount holding `path`: the longest mount point prefix (last one wins on stacking),
    preferring entries whose device number matches `dev`."""
    target = os.path.abspath(path)
    best: MountEntry | None = None
    for e in entries:
        mp = e.mount_point.rstrip("/") or "/"
        if target == mp or target.startswith(mp if mp == "/" else mp + "/"):
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                if dev is None or e.dev == dev or best is None or best.dev != dev:
                    best = e
    return best


def fstrim_timer_enabled(systemd_dir: Path, *, use_systemctl: bool) -> bool | None:
    """True/False, or None when it cannot be told. The enablement link under `systemd_dir`
    is authoritative; `systemctl is-enabled` is asked when the link is absent on a real root."""
    if (systemd_dir / FSTRIM_WANTS).exists():
        return True
    if not use_systemctl:
        return False if systemd_dir.is_dir() else None
    exe = shutil.which("systemctl")
    if exe is None:
        return False if systemd_dir.is_dir() else None
    try:
        r = subprocess.run([exe, "is-enabled", "fstrim.timer"], capture_output=True, text=True,
                           timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = r.stdout.strip()
    if state in ("enabled", "enabled-runtime", "static", "alias", "indirect"):
        return True
    if state in ("disabled", "masked", "masked-runtime", "not-found", "linked"):
        return False
    return None


def inspect(cold_dir: Path, cfg: MaintenanceConfig, *, dev: int | None = None) -> TuneReport:
    """Read the current settings of the cold tier's device and compare with the recommendation."""
    where = existing_dir(cold_dir)
    if dev is None:
        dev = os.stat(where).st_dev
    devstr = f"{os.major(dev)}:{os.minor(dev)}"
    disk = find_disk(dev, cfg.sysfs_root)
    checks: list[Check] = []
    name = disk.name if disk is not None else None
    if disk is None:
        checks.append(Check("device", None, "a block device under the cold directory", False,
                            False, advice=f"no {cfg.sysfs_root}/dev/block/{devstr} (tmpfs, overlay "
                                          "or a network filesystem): nothing to tune"))
    else:
        q = disk / "queue"
        nvme = disk.name.startswith("nvme")
        rot = read_sysfs(q / "rotational")
        checks.append(Check("rotational", None if rot is None else int(rot), "0 (solid state)",
                            rot == "0", False,
                            advice="" if rot == "0" else "the cold tier wants an SSD"))
        nr = read_sysfs(q / "nr_requests")
        nr_val = int(nr) if nr is not None and nr.isdigit() else None
        checks.append(Check("nr_requests", nr_val, f">= {cfg.nr_requests_min}",
                            nr_val is not None and nr_val >= cfg.nr_requests_min, True,
                            path=str(q / "nr_requests"), target=str(cfg.nr_requests_min)))
        sched_text = read_sysfs(q / "scheduler")
        sched = active_scheduler(sched_text)
        if nvme:
            avail = available_schedulers(sched_text)
            checks.append(Check("scheduler", sched, "none (NVMe)", sched == "none",
                                "none" in avail or not avail, path=str(q / "scheduler"),
                                target="none"))
        else:
            checks.append(Check("scheduler", sched, "any (not NVMe)", True, False))
        dmax = read_sysfs(q / "discard_max_bytes")
        dmax_val = int(dmax) if dmax is not None and dmax.isdigit() else None
        checks.append(Check("discard_max_bytes", dmax_val, "> 0 (TRIM supported)",
                            dmax_val is None or dmax_val > 0, False,
                            advice="" if dmax_val else "the device does not accept TRIM"))
    try:
        mi = (cfg.proc_root / "self" / "mountinfo").read_text(encoding="utf-8", errors="replace")
        mount = mount_of(where, parse_mountinfo(mi), devstr)
    except OSError:
        mount = None
    cont = None if mount is None else "discard" in mount.options
    checks.append(Check("continuous_discard", cont, "off (periodic fstrim instead)", cont is False,
                        False, advice="remove `discard` from the cold-tier mount options in "
                                      "/etc/fstab and remount" if cont else ""))
    real_root = Path(cfg.systemd_dir) == Path("/etc/systemd/system")
    trim = fstrim_timer_enabled(Path(cfg.systemd_dir), use_systemctl=real_root)
    checks.append(Check("fstrim_timer", trim, "enabled", trim is True, False,
                        advice="" if trim else "systemctl enable --now fstrim.timer"))
    return TuneReport(str(cold_dir), name, devstr, mount.mount_point if mount else None,
                      tuple(checks))


# --------------------------------------------------------------------------------------------
# Applying
# --------------------------------------------------------------------------------------------

def _write_sysfs(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def apply(report: TuneReport, *, writer: Callable[[str, str], None] = _write_sysfs,
          euid: int | None = None) -> list[str]:
    """Write every failing fixable check; returns the names changed.

    Raises `TunePermissionError` when not root or when the kernel refuses (EACCES, EPERM,
    EROFS), `TuneError` for other write failures. The scheduler is set before nr_requests
    (the allowed nr_requests depends on the scheduler).
    """
    todo = [c for c in report.checks if c.fixable and not c.ok and c.path and c.target]
    todo.sort(key=lambda c: 0 if c.name == "scheduler" else 1)
    if not todo:
        return []
    if (os.geteuid() if euid is None else euid) != 0:
        raise TunePermissionError(
            "writing block-queue settings in sysfs needs root; the kvagentd-tune.service "
            "oneshot and the 60-kvagentd-nvme udev rule apply them at boot")
    done = []
    for c in todo:
        assert c.path is not None and c.target is not None  # selected above
        try:
            writer(c.path, c.target)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise TunePermissionError(
                    f"cannot write {c.path}: {os.strerror(exc.errno or 0)} (sysfs is read-only "
                    "for this process; run kvagentd-tune.service as root)") from exc
            raise TuneError(f"cannot write {c.target!r} to {c.path}: {exc.strerror}") from exc
        log.info("tune_applied", check=c.name, path=c.path, value=c.target, was=c.current)
        done.append(c.name)
    return done


# --------------------------------------------------------------------------------------------
# Root oneshot: python -m kvagentd.maintenance.tune [--apply] [--config PATH] [--json]
# --------------------------------------------------------------------------------------------

def render(report: TuneReport) -> str:
    rows = [("check", "current", "recommended", "ok")]
    rows += [(c.name, "-" if c.current is None else str(c.current), c.recommended,
              "yes" if c.ok else "NO") for c in report.checks]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"cold dir {report.cold_dir}: device {report.device or '?'} ({report.dev}), "
             f"mount {report.mount_point or '?'}"]
    lines += ["  ".join(v.ljust(w[i]) for i, v in enumerate(r)).rstrip() for r in rows]
    lines += [f"  {c.name}: {c.advice}" for c in report.checks if c.advice and not c.ok]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvagentd-tune", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="kvagentd TOML config")
    ap.add_argument("--apply", action="store_true", help="write the fixable sysfs values (root)")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    try:
        cfg: Config = load_config(args.config)
    except ConfigError as exc:
        print(f"kvagentd-tune: {exc}", file=sys.stderr)
        return 78
    report = inspect(cfg.kv.cold_dir, cfg.maintenance)
    changed: list[str] = []
    rc = 0
    if args.apply:
        try:
            changed = apply(report)
        except TunePermissionError as exc:
            print(f"kvagentd-tune: {exc}", file=sys.stderr)
            rc = 77
        except TuneError as exc:
            print(f"kvagentd-tune: {exc}", file=sys.stderr)
            rc = 1
        if changed:
            report = inspect(cfg.kv.cold_dir, cfg.maintenance)
    if args.json:
        print(json.dumps({**report.as_dict(), "applied": changed}, indent=2))
    else:
        print(render(report))
        if changed:
            print("applied: " + ", ".join(changed))
    return rc


if __name__ == "__main__":
    sys.exit(main())
