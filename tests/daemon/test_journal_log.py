"""Logs under systemd: journald's native protocol with a priority and one field per key
(`journalctl -p warning`, `journalctl ASSET=pump-1` work), else `<N>`-prefixed JSON lines."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import structlog

from kvagentd.daemon import log as logsetup
from tests.mounts import python_isolated

ROOT = Path(__file__).resolve().parents[2]

# In a private mount namespace with a tmpfs on /run: a stand-in journald socket that reads
# what libsystemd sends (the native protocol: KEY=value lines, or KEY, a 64-bit length and a
# value for one with a newline).
_READER = r"""
import json, os, socket, struct, sys
sys.path.insert(0, %(root)r)
os.makedirs("/run/systemd/journal")
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind("/run/systemd/journal/socket")
s.settimeout(5)
from kvagentd.daemon import log as L
import structlog
L.configure("info", "journal")
log = structlog.get_logger("kvagentd.test")
log.debug("not_written")
log.info("tick_done", asset="pump-1", ticks=3)
log.warning("health_changed", check="sensor:pump-1", old="ok", new="failing")
try:
    raise ValueError("boom\nsecond line")
except ValueError:
    log.exception("step_failed", session="op-1")
out = []
for _ in range(3):
    data = s.recv(1 << 20)
    entry, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            i = nl + 1
        else:
            k = line
            n = struct.unpack("<Q", data[nl + 1:nl + 9])[0]
            v = data[nl + 9:nl + 9 + n]
            i = nl + 9 + n + 1
        entry.setdefault(k.decode(), v.decode())
    out.append(entry)
print(json.dumps({"entries": out}))
"""


def test_records_reach_journald_with_priority_and_fields() -> None:
    entries = python_isolated(_READER % {"root": str(ROOT)},
                              ["mount -t tmpfs tmpfs /run"])["entries"]
    info, warning, error = entries  # debug is below the level: not sent
    assert info["PRIORITY"] == "6" and info["ASSET"] == "pump-1" and info["TICKS"] == "3"
    assert info["MESSAGE"] == "tick_done asset=pump-1 ticks=3"
    assert info["SYSLOG_IDENTIFIER"] == "kvagentd" and info["LOGGER"] == "kvagentd.test"
    assert warning["PRIORITY"] == "4" and warning["CHECK"] == "sensor:pump-1"
    assert warning["NEW"] == "failing"
    assert error["PRIORITY"] == "3" and error["SESSION"] == "op-1"
    assert "ValueError: boom" in error["EXCEPTION"] and "second line" in error["MESSAGE"]
    assert "cysystemd" not in error["CODE_FILE"]  # the caller's place, not the binding's


def test_without_the_binding_lines_carry_their_priority(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    buf = io.StringIO()
    monkeypatch.setattr(logsetup, "journal_send", lambda: None)
    try:
        logsetup.configure("info", "journal", stream=buf)
        log = structlog.get_logger("kvagentd.test")
        log.info("tick_done", asset="pump-1")
        log.warning("sensor_stale", asset="pump-1")
        logging.getLogger("apscheduler.test").error("a library's record")
    finally:
        logsetup.configure("info", "json", stream=sys.stderr)
    lines = buf.getvalue().splitlines()
    assert [ln[:3] for ln in lines] == ["<6>", "<4>", "<3>"]
    assert json.loads(lines[1][3:])["asset"] == "pump-1"


def test_journal_stream_names_stdout(tmp_path: Path) -> None:
    """`auto` takes the journal only where JOURNAL_STREAM is stdout's own device and inode."""
    out = tmp_path / "out"
    code = ("from kvagentd.daemon import log; print(log.stdout_is_journal())")
    with out.open("w") as f:
        st = os.fstat(f.fileno())
        for stream, want in ((f"{st.st_dev}:{st.st_ino}", "True"), ("1:2", "False"), ("", "False")):
            f.seek(0)
            f.truncate()
            subprocess.run([sys.executable, "-c", code], stdout=f, cwd=ROOT, check=True,
                           env={**os.environ, "JOURNAL_STREAM": stream})
            f.flush()
            assert out.read_text().strip() == want, stream
