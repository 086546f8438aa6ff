"""`kv.io_threads`: how many sequential cold reads one batched read keeps in flight."""

from __future__ import annotations

import threading

import torch

from kvagentd.kvcache.fileio import FileIO


class OverlapIO(FileIO):
    """Records the most reads in flight at once. The first read waits (bounded) for a second
    one to start, so reads issued concurrently are seen concurrently."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight = 0
        self.most = 0
        self.second = threading.Event()
        self.reads = 0

    def preadv(self, fd, buffers, offset):
        with self.lock:
            self.inflight += 1
            self.reads += 1
            first = self.reads == 1
            self.most = max(self.most, self.inflight)
            if self.inflight >= 2:
                self.second.set()
        try:
            if first:
                self.second.wait(timeout=10.0)
            return super().preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.inflight -= 1


def _blocks(geometry, n):
    return [torch.full(geometry.block_shape, float(i + 1)) for i in range(n)]


def _keys(n):
    return [i.to_bytes(2, "big") * 8 for i in range(n)]


def test_reads_overlap_up_to_io_threads_and_verify(make_cold, geometry):
    fio = OverlapIO()
    cs = make_cold(io_threads=3, file_io=fio, o_direct=False)
    keys, blocks = _keys(12), _blocks(geometry, 12)
    assert all(cs.put_many(keys, blocks))
    want = list(range(0, 12, 2))  # not adjacent on disk: one read per record
    outs = [torch.empty(geometry.block_shape) for _ in want]
    assert cs.read_into([keys[i] for i in want], outs) == [True] * len(want)
    for o, i in zip(outs, want):
        assert torch.equal(o, blocks[i])
    assert fio.reads == len(want)
    assert 2 <= fio.most <= 3
    # and again: buffers are reused safely across calls
    outs = [torch.empty(geometry.block_shape) for _ in keys]
    assert cs.read_into(keys[::-1], outs) == [True] * 12
    for o, b in zip(outs, blocks[::-1]):
        assert torch.equal(o, b)
    cs.close()


def test_one_io_thread_reads_one_at_a_time(make_cold, geometry):
    class Serial(OverlapIO):
        def preadv(self, fd, buffers, offset):
            self.second.set()  # nothing to wait for
            return super().preadv(fd, buffers, offset)

    fio = Serial()
    cs = make_cold(io_threads=1, file_io=fio, o_direct=False)
    keys, blocks = _keys(6), _blocks(geometry, 6)
    assert all(cs.put_many(keys, blocks))
    outs = [torch.empty(geometry.block_shape) for _ in range(3)]
    assert cs.read_into(keys[::2], outs) == [True] * 3
    assert fio.most == 1 and fio.reads == 3
    cs.close()


def test_composition_root_passes_io_threads(tmp_path, geometry, namespace):
    from kvagentd.config import Config, KVConfig, MaintenanceConfig
    from kvagentd.services import build_tiers

    cfg = Config(kv=KVConfig(cold_dir=tmp_path / "cold", hot_bytes=1 << 20,
                             cold_capacity_bytes=1 << 20, segment_bytes=1 << 20, o_direct=False,
                             io_threads=4),
                 maintenance=MaintenanceConfig(shadow_dir=tmp_path / "shm", shadow_bytes=1 << 20))
    tiers = build_tiers(cfg, geometry, namespace)
    assert tiers.cold.primary.io_threads == 4
    tiers.store.close()
