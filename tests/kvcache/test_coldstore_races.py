"""Maintenance racing itself on one cold directory: a scrub with repair while compaction moves
records must neither report nor remove a valid record."""

from __future__ import annotations

import threading
import time

import torch

from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache.keys import block_keys


class SlowSync(FileIO):
    """Real file operations with a slow fsync (a busy SSD): compaction takes its time."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def fsync(self, fd: int) -> None:
        time.sleep(self.delay_s)
        super().fsync(fd)


def test_verify_repair_racing_compaction_keeps_every_valid_record(make_cold, geometry,
                                                                  namespace):
    seg = 8 * 8192  # eight records per segment
    cs = make_cold(segment_bytes=seg, o_direct=False)
    keys = block_keys(namespace, list(range(4 * 200)), 4)
    g = torch.Generator().manual_seed(7)
    blocks = [torch.randn(geometry.block_shape, generator=g) for _ in keys]
    for k, b in zip(keys, blocks):
        assert cs.put(k, b)
    assert cs.delete(keys[1::2]) == 100  # every segment half dead: compaction moves the rest
    cs.close()

    cs = make_cold(segment_bytes=seg, o_direct=False, file_io=SlowSync(0.01))
    live, want = keys[0::2], blocks[0::2]
    report: dict[str, int] = {}
    listed = threading.Event()

    def scrub() -> None:
        listed.set()
        # about one second for the whole pass: compaction runs in its gaps
        report.update(cs.verify(repair=True, rate_bytes_per_s=100 * 8192))

    t = threading.Thread(target=scrub)
    t.start()
    listed.wait()
    time.sleep(0.1)
    reclaimed = cs.compact(0.5)
    t.join()

    assert reclaimed > 0 and cs.stats()["compacted_bytes"] == reclaimed
    assert report["missing"] == 0 and report["corrupt"] == 0, report
    assert report["repaired"] == 0
    assert report["moved"] > 0  # the scrub did find records where compaction had moved them
    assert set(cs.keys()) == set(live)
    outs = [torch.empty(geometry.block_shape) for _ in live]
    assert all(cs.read_into(live, outs))
    assert all(torch.equal(o, b) for o, b in zip(outs, want))
    cs.close()
