"""Real filesystem conditions for tests: a read-only directory, a small (fillable) disk.

Each runs a command in a private mount namespace (`unshare -m`; a user namespace too when not
root), so the mounts vanish with the process and need no cleanup. Root's permission checks
would ignore a mode of 0555, so a read-only *mount* is the way to get EROFS for real.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def unshare_prefix() -> list[str]:
    exe = shutil.which("unshare")
    if exe is None:
        raise AssertionError("these tests need unshare (util-linux): apt-get install util-linux")
    return [exe, "-m"] if os.geteuid() == 0 else [exe, "-r", "-m"]


def read_only(path: Path) -> str:
    """Shell lines that make `path` a read-only bind mount of itself."""
    p = shlex.quote(str(path))
    return f"mount --bind {p} {p} && mount -o remount,bind,ro {p}"


def small_disk(path: Path, size: str) -> str:
    """Shell lines that mount a tmpfs of `size` (e.g. "4m") on `path`."""
    return f"mkdir -p {shlex.quote(str(path))} && mount -t tmpfs -o size={size} tmpfs " \
           f"{shlex.quote(str(path))}"


def run_isolated(argv: list[str], mounts: list[str], *, env: dict[str, str] | None = None,
                 **popen: Any) -> subprocess.Popen[bytes]:
    """Start `argv` after `mounts` (shell lines) in a private mount namespace."""
    script = " && ".join([*mounts, "exec " + " ".join(shlex.quote(a) for a in argv)])
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([*unshare_prefix(), "sh", "-c", script], env=full_env, **popen)


def python_isolated(code: str, mounts: list[str], timeout: float = 120.0) -> dict[str, Any]:
    """Run Python `code` after `mounts`; it prints one JSON object last, which is returned."""
    proc = run_isolated([sys.executable, "-c", code], mounts, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=timeout)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return dict(json.loads(text.strip().splitlines()[-1]))
