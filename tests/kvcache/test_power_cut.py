"""A power cut never loses a block the cold store acknowledged and never serves a wrong one.

Unlike `kill -9` (test_crash.py), a power cut also loses what the kernel and the drive had not
made durable. `PowerCutIO` models that for the cold store's segment files: it keeps an undo
record of every write not yet followed by an fsync of its file, and of every file created
since the last fsync of its directory; the cut then undoes a random subset of those writes
(some whole, some torn halfway: the drive may have written part of one, in any order) and
removes a random subset of those files. The SQLite index does its own I/O and is taken as
durable once committed (WAL, synchronous=FULL); the store commits a block's row only after its
record was synced, which is what this test holds it to.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache.keys import block_keys, make_namespace

GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float32)
NS = make_namespace("power-cut-model", torch.float32, 4)
CUTS = 30


class PowerCut(BaseException):
    """The power went: raised out of a write (not an OSError: nothing may handle it)."""


@dataclass
class _Undo:
    path: str
    offset: int
    old: bytes  # what was there before (shorter where the write extended the file)
    length: int


@dataclass
class PowerCutIO(FileIO):
    """`FileIO` that remembers what a power cut may take back (see module docstring)."""

    cut_after: int = 1 << 62  # writes until the power goes
    writes: int = 0
    paths: dict[int, str] = field(default_factory=dict)
    unsynced: list[_Undo] = field(default_factory=list)
    new_files: set[str] = field(default_factory=set)

    def open(self, path: str, flags: int, mode: int = 0o640) -> int:
        existed = os.path.exists(path)
        fd = super().open(path, flags, mode)
        self.paths[fd] = path
        if not existed:
            self.new_files.add(path)
        return fd

    def close(self, fd: int) -> None:
        self.paths.pop(fd, None)
        super().close(fd)

    def pwrite(self, fd: int, data: memoryview | bytes, offset: int) -> int:
        self.writes += 1
        if self.writes > self.cut_after:
            raise PowerCut
        path = self.paths[fd]
        with open(path, "rb") as f:  # the store's descriptor may be write-only
            f.seek(offset)
            old = f.read(len(data))
        self.unsynced.append(_Undo(path, offset, old, len(data)))
        return super().pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        super().fsync(fd)
        path = self.paths[fd]
        self.unsynced = [u for u in self.unsynced if u.path != path]

    def fsync_dir(self, path: str) -> None:
        super().fsync_dir(path)
        self.new_files = {p for p in self.new_files if os.path.dirname(p) != path.rstrip("/")}

    def cut(self, rng: random.Random) -> dict[str, int]:
        """Take back a random part of what was not durable; returns what was taken. A write
        taken back leaves the old bytes where it overwrote some and zeros where it extended
        the file (blocks the drive had not written)."""
        undone = torn = 0
        for u in reversed(self.unsynced):
            fate = rng.random()
            if fate < 0.4 or not os.path.exists(u.path):
                continue  # it reached the media
            keep = u.length // 2 if fate < 0.6 else 0  # torn: only its first half did
            back = u.old[keep:] + bytes(u.length - keep - len(u.old[keep:]))
            with open(u.path, "r+b") as f:
                f.seek(u.offset + keep)
                f.write(back)
            undone += 1
            torn += bool(keep)
        gone = 0
        for p in sorted(self.new_files):
            if os.path.exists(p) and rng.random() < 0.5:
                os.unlink(p)
                gone += 1
        self.unsynced.clear()
        self.new_files.clear()
        return {"undone": undone, "torn": torn, "files_gone": gone}


def _content(key: bytes) -> torch.Tensor:
    base = float(int.from_bytes(key[:3], "little"))
    return torch.arange(GEOM.block_numel, dtype=torch.float32).view(GEOM.block_shape) + base


def _open(directory: str, io: FileIO | None = None) -> ColdStore:
    return ColdStore(directory, GEOM, NS, capacity_bytes=64 << 20, segment_bytes=64 << 10,
                     io_unit_bytes=8192, o_direct=False, file_io=io)


def _check(cs: ColdStore, acked: Sequence[bytes]) -> int:
    """Every acknowledged block reads back exactly; whatever else is listed is right too."""
    keys = list(dict.fromkeys([*acked, *cs.keys()]))
    outs = [torch.full(GEOM.block_shape, -1.0) for _ in keys]
    got = cs.read_into(keys, outs)
    for k, ok, o in zip(keys, got, outs):
        if k in acked:
            assert ok, f"an acknowledged block {k.hex()} was lost"
        if ok:
            assert torch.equal(o, _content(k)), f"block {k.hex()} served wrong data"
    return sum(got)


def test_a_power_cut_loses_no_acknowledged_block_and_serves_no_wrong_one(tmp_path):
    directory = str(tmp_path / "cold")
    rng = random.Random(11)
    acked: list[bytes] = []
    seq = 0
    taken = {"undone": 0, "torn": 0, "files_gone": 0}
    for _ in range(CUTS):
        io = PowerCutIO(cut_after=rng.randint(1, 40))
        cs = _open(directory, io)
        try:
            while True:
                n = rng.randint(1, 6)
                keys = block_keys(NS, list(range(seq, seq + 4 * n)), 4)
                seq += 4 * n
                ok = cs.put_many(keys, [_content(k) for k in keys], session="s")
                acked += [k for k, good in zip(keys, ok) if good]
                if rng.random() < 0.1 and acked:
                    gone = acked.pop(rng.randrange(len(acked)))
                    cs.delete([gone])
        except PowerCut:
            pass
        for name, n in io.cut(rng).items():
            taken[name] += n
        # the store object is abandoned as the process would be; a new one opens the files
        cs = _open(directory)
        try:
            assert _check(cs, acked) >= len(acked)
            report = cs.verify()
            assert report["corrupt"] == 0 and report["missing"] == 0, report
        finally:
            cs.close()
    assert len(acked) > 100
    assert taken["undone"] > 0 and taken["torn"] > 0, taken  # the cuts took something back


def test_the_sqlite_files_are_as_durable_as_this_test_assumes(tmp_path):
    """The index (and the session table) commit at synchronous=FULL in WAL mode: what the cut
    above takes as durable once committed is durable on the device."""
    from kvagentd.engine.sessions import SessionStore

    store = ColdStore(tmp_path / "cold", GEOM, NS, capacity_bytes=1 << 20,
                      segment_bytes=64 << 10, o_direct=False)
    try:
        db = store.index.db
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    finally:
        store.close()
    sessions = SessionStore(tmp_path / "state")
    try:
        assert sessions._db.execute("PRAGMA synchronous").fetchone()[0] == 2
    finally:
        sessions.close()
