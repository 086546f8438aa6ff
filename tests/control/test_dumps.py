"""Routes write files only under `<state_dir>/dumps`, with plain names, never through a symlink."""

from __future__ import annotations

import dataclasses
import os
import stat
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvagentd.control.dumps import DumpDir, DumpDirUnsafe, DumpExists, DumpNameError
from kvagentd.control.handlers import placement as placement_routes
from kvagentd.control.router import Router
from kvagentd.control.server import ControlServer
from kvagentd.kvcache.placement.trace_recorder import TraceRecorder, load_trace
from tests.control.conftest import make_config

KEYS = [bytes([i]) * 16 for i in range(1, 4)]


class Box:
    def __init__(self, root: Path, server: ControlServer) -> None:
        self.root, self.server = root, server
        self.state = root / "state"
        self.dumps = self.state / "dumps"

    def dump(self, body: dict[str, object]) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.server.path)),
                          base_url="http://kvagentd", timeout=10) as c:
            return c.post("/v1/trace/dump", json=body)


@pytest.fixture
def box(short_dir: Path) -> Iterator[Box]:
    cfg = make_config(short_dir)
    cfg = dataclasses.replace(cfg, daemon=dataclasses.replace(cfg.daemon,
                                                              state_dir=short_dir / "state"))
    (short_dir / "state").mkdir()
    trace = TraceRecorder(100)
    trace.record(1, 10.0, "pump-1-1", KEYS)
    placement = types.SimpleNamespace(trace=trace, ingest=lambda: 0)  # nothing pending
    daemon = types.SimpleNamespace(config=cfg, services=types.SimpleNamespace(placement=placement))
    router = Router()
    placement_routes.register(router, daemon)
    server = ControlServer(cfg.control, router)
    server.start()
    yield Box(short_dir, server)
    server.stop(1.0)


def test_a_path_in_the_request_is_refused(box: Box) -> None:
    cold = box.root / "cold"
    cold.mkdir()
    index = cold / "index.sqlite3"
    index.write_bytes(b"SQLite format 3\x00the real index")
    r = box.dump({"path": str(index)})
    assert r.status_code == 400 and "only under" in r.json()["error"]["message"]
    assert index.read_bytes() == b"SQLite format 3\x00the real index"


@pytest.mark.parametrize("name", ["../cold/index.sqlite3", "/etc/passwd", "a/b.jsonl",
                                  ".hidden.jsonl", "index.sqlite3", "x", "x..jsonl", ""])
def test_only_plain_names_with_a_trace_suffix(box: Box, name: str) -> None:
    r = box.dump({"name": name})
    assert r.status_code == 400, r.text
    assert not box.dumps.exists() or list(box.dumps.iterdir()) == []


def test_the_daemon_names_and_writes_the_dump(box: Box) -> None:
    r = box.dump({})
    assert r.status_code == 200, r.text
    out = r.json()
    path = Path(out["path"])
    assert path.parent == box.dumps and out["events"] == 3
    assert path.name.startswith("trace-") and path.suffix == ".jsonl"
    assert [e.key for e in load_trace(path)] == KEYS
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert stat.S_IMODE(box.dumps.stat().st_mode) == 0o750
    r = box.dump({"name": "week-12.npz"})
    assert r.status_code == 200 and [e.key for e in load_trace(box.dumps / "week-12.npz")] == KEYS
    assert box.dump({"name": "week-12.npz"}).status_code == 409  # never replaced
    assert sorted(p.name for p in box.dumps.iterdir()) == sorted([path.name, "week-12.npz"])


def test_symlinks_are_not_followed(box: Box) -> None:
    victim = box.root / "victim"
    victim.write_text("daemon-owned secret")
    os.chmod(victim, 0o600)
    box.dumps.mkdir(mode=0o750)
    (box.dumps / "t.jsonl").symlink_to(victim)
    r = box.dump({"name": "t.jsonl"})
    assert r.status_code == 409
    assert victim.read_text() == "daemon-owned secret"
    assert [p.name for p in box.dumps.iterdir()] == ["t.jsonl"]  # no temporary left behind


def test_a_dump_dir_that_is_a_symlink_or_shared_is_refused(box: Box) -> None:
    elsewhere = box.root / "elsewhere"
    elsewhere.mkdir()
    box.dumps.symlink_to(elsewhere)
    r = box.dump({})
    assert r.status_code == 507 and r.json()["error"]["kind"] == "insufficient_storage"
    assert str(box.dumps) in r.json()["error"]["message"]
    assert list(elsewhere.iterdir()) == []
    box.dumps.unlink()
    box.dumps.mkdir()
    os.chmod(box.dumps, 0o1777)  # a sticky world-writable directory, like /tmp
    r = box.dump({})
    assert r.status_code == 507 and "writable by it alone" in r.json()["error"]["message"]


def test_a_full_state_disk_is_507_naming_the_path_and_recovers(
        box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    real = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvagentd.control.dumps.os.fsync", full)
    r = box.dump({"name": "t.jsonl"})
    assert r.status_code == 507 and r.json()["error"]["kind"] == "insufficient_storage"
    assert str(box.dumps / "t.jsonl") in r.json()["error"]["message"]
    assert "No space left" in r.json()["error"]["message"]
    assert list(box.dumps.iterdir()) == []  # nothing half-written is left
    monkeypatch.setattr("kvagentd.control.dumps.os.fsync", real)  # space is back
    assert box.dump({"name": "t.jsonl"}).status_code == 200


def test_temporary_file_is_created_exclusively(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    d = DumpDir(tmp_path / "dumps")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    monkeypatch.setattr("kvagentd.control.dumps.secrets.token_hex", lambda n: "f" * 16)
    (tmp_path / "dumps").mkdir(mode=0o750)
    (tmp_path / "dumps" / f".x.jsonl.{'f' * 16}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        d.write("x.jsonl", lambda f: f.write(b"data"))
    assert victim.read_text() == "keep" and not (tmp_path / "dumps" / "x.jsonl").exists()
    (tmp_path / "dumps" / f".x.jsonl.{'f' * 16}.tmp").unlink()
    assert d.write("x.jsonl", lambda f: f.write(b"data")).read_bytes() == b"data"
    with pytest.raises(DumpExists):
        d.write("x.jsonl", lambda f: f.write(b"other"))
    with pytest.raises(DumpNameError):
        d.check_name("../x.jsonl", (".jsonl",))
    assert d.check_name("ok_1.jsonl", (".jsonl",)) == "ok_1.jsonl"
    os.chmod(tmp_path / "dumps", 0o770)
    with pytest.raises(DumpDirUnsafe):
        d.write("y.jsonl", lambda f: f.write(b"data"))
