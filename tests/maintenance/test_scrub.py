"""Scrub finds a flipped byte; real ENOSPC from a small tmpfs fails over to the shadow."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.cold.failover import FailoverColdStore, ServingTier
from kvagentd.maintenance.scrub import Scrubber

from .conftest import GEOM, NS, block, key


def test_scrub_finds_a_flipped_byte(tmp_path):
    cold = ColdStore(tmp_path, GEOM, NS, capacity_bytes=16 << 20, segment_bytes=1 << 20,
                     o_direct=False)
    for i in range(8):
        assert cold.put(key(i), block(i))
    s = Scrubber(cold, 1 << 30)
    clean = s.run()
    assert (clean.checked, clean.corrupt, clean.missing) == (8, 0, 0)
    seg = sorted(tmp_path.glob("seg-*.kvs"))[0]
    data = bytearray(seg.read_bytes())
    pos = 3 * 8192 + 4096 + 100  # inside the payload of the 4th record
    data[pos] ^= 0x01
    seg.write_bytes(bytes(data))
    dirty = s.run()
    assert dirty.checked == 8 and dirty.corrupt == 1
    assert s.status()["bad_records"] == 1 and s.status()["passes"] == 2
    outs = [torch.empty(GEOM.block_shape) for _ in range(8)]
    ok = cold.read_into([key(i) for i in range(8)], outs)
    assert ok == [i != 3 for i in range(8)]  # the flipped record is never served
    cold.close()


def test_scrub_passes_its_rate_to_the_store():
    seen = {}

    class Cold:
        def verify(self, repair, rate_bytes_per_s):
            seen.update(repair=repair, rate=rate_bytes_per_s)
            return {"checked": 1, "corrupt": 0, "missing": 0, "bytes": 10}

    rep = Scrubber(Cold(), 12345).run()
    assert seen == {"repair": False, "rate": 12345.0} and rep.checked == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_enospc_fails_over_to_the_shadow(tmp_path, small_tmpfs):
    ssd = ColdStore(small_tmpfs, GEOM, NS, capacity_bytes=64 << 20, segment_bytes=8 << 20,
                    io_unit_bytes=64 << 10, o_direct=True)
    shadow = ColdStore(tmp_path / "shm", GEOM, NS, capacity_bytes=4 << 20, o_direct=False)
    fo = FailoverColdStore(ssd, shadow, GEOM, probe_dir=small_tmpfs, failback_good_probes=1,
                           shadow_capacity_bytes=4 << 20)
    try:
        n = 120  # 120 x 8 KiB records > 512 KiB of tmpfs
        assert all(fo.put(key(i), block(i)) for i in range(n))
        assert fo.serving is ServingTier.SHADOW
        # ENOSPC shows up as a failed segment write or as the index's "disk is full".
        assert ssd.stats()["write_failures"] >= 1 or "full" in fo.status()["reason"]
        on_ssd = [i for i in range(n) if ssd.contains(key(i))]
        in_shadow = [i for i in range(n) if shadow.contains(key(i))]
        assert on_ssd and in_shadow and len(on_ssd) + len(in_shadow) == n
        outs = [torch.empty(GEOM.block_shape) for _ in range(n)]
        ok = fo.read_into([key(i) for i in range(n)], outs)
        # Shadow blocks read; blocks on the full SSD read or report missing, never wrong data.
        assert all(ok[i] for i in in_shadow)
        assert all(torch.equal(outs[i], block(i)) for i in range(n) if ok[i])
        # The disk is still full: a restore cannot drain the shadow, nothing is lost.
        fo.probe()
        assert fo.serving is ServingTier.SHADOW
        assert sorted(fo.keys()) == sorted(key(i) for i in range(n))
    finally:
        fo.close()
