from __future__ import annotations

import errno
import os

import pytest
import torch

from kvagentd.kvcache.cold.record import ALIGN
from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache.keys import block_keys, make_namespace


def _blocks(geometry, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(geometry.block_shape, generator=g) for _ in range(n)]


def _keys(namespace, n, start=0):
    return block_keys(namespace, list(range(start, start + 4 * n)), 4)


def _read(cs, keys, geometry):
    outs = [torch.empty(geometry.block_shape) for _ in keys]
    return cs.read_into(keys, outs), outs


def test_put_read_reopen(make_cold, geometry, namespace):
    cs = make_cold()
    keys, blocks = _keys(namespace, 6), _blocks(geometry, 6)
    assert cs.put_many(keys, blocks, session="s1") == [True] * 6
    assert cs.put(keys[0], blocks[0]) is True  # already there: no second record
    ok, outs = _read(cs, keys[::-1], geometry)
    assert all(ok) and all(torch.equal(o, b) for o, b in zip(outs, blocks[::-1]))
    used = cs.bytes_used
    cs.close()
    cs = make_cold()
    assert set(cs.keys()) == set(keys) and cs.bytes_used == used
    ok, outs = _read(cs, keys, geometry)
    assert all(ok) and torch.equal(outs[3], blocks[3])
    assert cs.verify() == {"checked": 6, "corrupt": 0, "missing": 0, "repaired": 0, "bytes": used,
                           "moved": 0}


def test_flipped_byte_is_detected_counted_and_repaired(make_cold, geometry, namespace, tmp_path):
    cs = make_cold()
    keys, blocks = _keys(namespace, 3), _blocks(geometry, 3)
    cs.put_many(keys, blocks)
    cs.close()
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    rec = os.path.getsize(seg) // 3
    with open(seg, "r+b") as f:  # one payload byte of the second record
        f.seek(rec + ALIGN + 100)
        b = f.read(1)
        f.seek(rec + ALIGN + 100)
        f.write(bytes([b[0] ^ 0x01]))
    cs = make_cold()
    ok, outs = _read(cs, keys, geometry)
    assert ok == [True, False, True]
    assert cs.stats()["corrupt"] == 1
    report = cs.verify(repair=True)
    assert (report["checked"], report["corrupt"], report["repaired"]) == (3, 1, 1)
    assert not cs.contains(keys[1]) and cs.contains(keys[0])


def test_header_tamper_is_detected(make_cold, geometry, namespace, tmp_path):
    cs = make_cold()
    keys = _keys(namespace, 1)
    cs.put_many(keys, _blocks(geometry, 1))
    cs.close()
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    with open(seg, "r+b") as f:
        f.seek(8)
        f.write(b"\x7f")
    cs = make_cold()
    assert _read(cs, keys, geometry)[0] == [False]


def test_torn_tail_is_ignored_and_never_overwritten(make_cold, geometry, namespace, tmp_path):
    cs = make_cold()
    keys, blocks = _keys(namespace, 2), _blocks(geometry, 2)
    cs.put_many(keys, blocks)
    cs.close()
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    with open(seg, "ab") as f:
        f.write(b"KVBR" + os.urandom(5000))  # a record torn mid-write
    cs = make_cold()
    assert set(cs.keys()) == set(keys)
    more, mblocks = _keys(namespace, 2, start=100), _blocks(geometry, 2, seed=1)
    assert cs.put_many(more, mblocks) == [True, True]
    assert len(list((tmp_path / "cold").glob("seg-*.kvs"))) == 2
    ok, outs = _read(cs, keys + more, geometry)
    assert all(ok) and torch.equal(outs[3], mblocks[1])


def test_other_namespace_is_invisible(make_cold, geometry, namespace):
    cs = make_cold()
    cs.put_many(_keys(namespace, 2), _blocks(geometry, 2))
    cs.close()
    other = make_namespace("another-model", torch.float32, 4)
    cs = make_cold(namespace=other)
    assert cs.keys() == [] and not cs.contains(_keys(namespace, 1)[0])
    assert _read(cs, _keys(namespace, 1), geometry)[0] == [False]


class _Evictions:
    """A cold-tier listener that records evictions."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def cold_protected(self, keys: list[bytes]) -> set[bytes]:
        return set()

    def cold_evicted(self, keys: list[bytes]) -> None:
        self.keys.extend(keys)

    def cold_failed_over(self) -> None:
        raise AssertionError("a single cold store never fails over")


def test_capacity_evicts_oldest_and_reports(make_cold, geometry, namespace):
    heard = _Evictions()
    probe = make_cold(capacity_bytes=1 << 30)
    rec = ALIGN + ((geometry.block_bytes + ALIGN - 1) // ALIGN) * ALIGN
    probe.close()
    cs = make_cold(directory=None, capacity_bytes=4 * rec, listener=heard)
    keys = _keys(namespace, 6)
    for k, b in zip(keys, _blocks(geometry, 6)):
        assert cs.put(k, b)
    assert cs.bytes_used <= 4 * rec
    assert heard.keys == keys[:2] and set(cs.keys()) == set(keys[2:])


def test_ttl_expiry_refreshed_on_read(make_cold, geometry, namespace):
    import time
    cs = make_cold(ttl_s=1000.0)
    keys = _keys(namespace, 2)
    cs.put_many(keys, _blocks(geometry, 2))
    later = time.time() + 2000
    assert set(cs.expired(later)) == set(keys)
    cs.touch([keys[0]], now=later)
    assert cs.expired(later + 1) == [keys[1]]


def test_compaction_reclaims_deleted_space(make_cold, geometry, namespace, tmp_path):
    cs = make_cold()
    keys, blocks = _keys(namespace, 6), _blocks(geometry, 6)
    cs.put_many(keys, blocks)
    cs.close()
    cs = make_cold()
    assert cs.delete(keys[:4]) == 4
    reclaimed = cs.compact(min_dead_ratio=0.5)
    assert reclaimed > 0
    ok, outs = _read(cs, keys[4:], geometry)
    assert all(ok) and torch.equal(outs[1], blocks[5])
    assert cs.stats()["disk_bytes"] == cs.bytes_used


class _NoDirect(FileIO):
    def open(self, path, flags, mode=0o640):
        if flags & FileIO.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return super().open(path, flags, mode)


@pytest.mark.skipif(not FileIO.O_DIRECT, reason="no O_DIRECT on this platform")
def test_o_direct_refused_falls_back_to_buffered(make_cold, geometry, namespace):
    cs = make_cold(file_io=_NoDirect())
    keys, blocks = _keys(namespace, 3), _blocks(geometry, 3)
    assert cs.put_many(keys, blocks) == [True] * 3
    ok, outs = _read(cs, keys, geometry)
    assert all(ok) and torch.equal(outs[2], blocks[2])
    assert cs.o_direct_active is False


class _Faulty(FileIO):
    def __init__(self):
        self.read_errno = self.write_errno = None

    def preadv(self, fd, buffers, offset):
        if self.read_errno:
            raise OSError(self.read_errno, os.strerror(self.read_errno))
        return super().preadv(fd, buffers, offset)

    def pwrite(self, fd, data, offset):
        if self.write_errno:
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        return super().pwrite(fd, data, offset)


def test_read_eio_fails_counts_and_retires_segment(make_cold, geometry, namespace):
    fio = _Faulty()
    cs = make_cold(file_io=fio)
    keys = _keys(namespace, 2)
    cs.put_many(keys, _blocks(geometry, 2))
    fio.read_errno = errno.EIO
    assert _read(cs, keys, geometry)[0] == [False, False]
    st = cs.stats()
    assert st["io_errors"] == 2 and st["retired_segments"] == 1
    fio.read_errno = None
    more = _keys(namespace, 1, start=50)
    assert cs.put_many(more, _blocks(geometry, 1)) == [True]
    assert cs.stats()["segments"] == {"retired": 1, "active": 1}


def test_write_faults(make_cold, geometry, namespace):
    fio = _Faulty()
    cs = make_cold(file_io=fio)
    keys = _keys(namespace, 3)
    fio.write_errno = errno.ENOSPC
    assert cs.put_many(keys[:1], _blocks(geometry, 1)) == [False]
    assert not cs.contains(keys[0]) and cs.stats()["write_failures"] == 1
    fio.write_errno = errno.EROFS
    assert cs.put_many(keys[1:2], _blocks(geometry, 1)) == [False]
    assert cs.read_only
    fio.write_errno = None
    assert cs.put_many(keys[2:], _blocks(geometry, 1)) == [False]  # read-only now
    cs.read_only = False
    assert cs.put_many(keys[2:], _blocks(geometry, 1)) == [True]


def test_refs_persist(make_cold, geometry, namespace):
    cs = make_cold()
    keys = _keys(namespace, 3)
    cs.put_many(keys, _blocks(geometry, 3))
    cs.save_refs({"a": keys[:2], "b": keys[1:], "c": [b"x" * 16]})
    cs.close()
    cs = make_cold()
    refs = cs.load_refs()
    assert sorted(refs) == ["a", "b"] and set(refs["b"]) == set(keys[1:])


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_quantized_records(make_cold, geometry, namespace, codec):
    cs = make_cold(codec=codec)
    keys, blocks = _keys(namespace, 2), _blocks(geometry, 2)
    cs.put_many(keys, blocks)
    ok, outs = _read(cs, keys, geometry)
    assert all(ok)
    err = max(((o - b).norm() / b.norm()).item() for o, b in zip(outs, blocks))
    assert 0 < err < 0.05


@pytest.mark.parametrize("o_direct", [True, False])
def test_page_sized_blocks_read_straight_into_pool_slots(make_cold, namespace, tmp_path, o_direct):
    from kvagentd.kvcache.base import KVGeometry
    from kvagentd.kvcache.store.pool import BlockPool

    g = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=64, block_tokens=4, dtype=torch.float32)
    assert g.block_bytes % ALIGN == 0
    cs = make_cold(geometry=g, o_direct=o_direct)
    keys, blocks = _keys(namespace, 5), _blocks(g, 5)
    src = BlockPool("hot", 5, g.block_shape, g.dtype)
    for s, b in zip(src.allocate(5), blocks):
        src.arena[s].copy_(b)
    assert all(cs.writer._direct_src_ok(src.arena[s]) for s in range(5))
    assert cs.put_many(keys, [src.arena[s] for s in range(5)]) == [True] * 5
    pool = BlockPool("warm", 8, g.block_shape, g.dtype)
    slots = pool.allocate(5)
    assert pool.arena.data_ptr() % ALIGN == 0
    outs = [pool.arena[s] for s in slots]
    assert all(cs.reader.direct_ok(r, o) for r, o in zip(cs.index.rows(keys).values(), outs))
    assert cs.read_into(keys, outs) == [True] * 5
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    cs.close()
    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    with open(seg, "r+b") as f:
        f.seek(2 * (ALIGN + g.block_bytes) + ALIGN + 12)
        f.write(b"\x00\x01\x02")
    cs = make_cold(geometry=g, o_direct=o_direct)
    assert cs.read_into(keys, outs) == [True, True, False, True, True]
    assert torch.equal(outs[3], blocks[3]) and cs.stats()["corrupt"] == 1


def test_unreadable_index_is_set_aside_and_never_trusted(make_cold, geometry, namespace, tmp_path):
    cs = make_cold()
    keys = _keys(namespace, 2)
    cs.put_many(keys, _blocks(geometry, 2))
    cs.close()
    (tmp_path / "cold" / "index.sqlite3").write_bytes(b"this is not a database" * 100)
    cs = make_cold()
    assert cs.keys() == [] and cs.bytes_used == 0
    assert list((tmp_path / "cold").glob("index.sqlite3.corrupt-*"))
    assert not list((tmp_path / "cold").glob("seg-*.kvs"))
    assert cs.put_many(keys, _blocks(geometry, 2, seed=3)) == [True, True]


def test_capacity_evicts_other_models_records_first(make_cold, geometry, namespace):
    rec = ALIGN + ((geometry.block_bytes + ALIGN - 1) // ALIGN) * ALIGN
    ours = make_cold(capacity_bytes=3 * rec)
    keys = _keys(namespace, 3)
    ours.put_many(keys[:2], _blocks(geometry, 2))
    ours.close()
    other_ns = make_namespace("retired-model", torch.float32, 4)
    other = make_cold(capacity_bytes=3 * rec, namespace=other_ns)
    other_keys = _keys(other_ns, 1)
    assert other.put_many(other_keys, _blocks(geometry, 1)) == [True]  # the newest record
    other.close()
    ours = make_cold(capacity_bytes=3 * rec)
    assert ours.put(keys[2], _blocks(geometry, 1)[0])
    assert set(ours.keys()) == set(keys) and ours.bytes_used == 3 * rec
