"""Shadow failover and failback under every injected fault; nothing committed is lost."""

from __future__ import annotations

import errno

import pytest
import torch

from kvagentd.kvcache.cold.failover import FailoverError, ServingTier
from kvagentd.kvcache.cold.faults import FaultPlan, FaultyFileIO

from .conftest import GEOM, block, key


def read_all(fo, idx):
    outs = [torch.empty(GEOM.block_shape) for _ in idx]
    ok = fo.read_into([key(i) for i in idx], outs)
    return ok, outs


def assert_identical(fo, idx):
    ok, outs = read_all(fo, idx)
    bad = [i for i, good in zip(idx, ok) if not good]
    assert not bad, f"blocks not readable: {bad}"
    for i, out in zip(idx, outs):
        assert torch.equal(out, block(i)), f"block {i} differs"


WRITE_FAULTS = {
    "write_eio": dict(write_eio_rate=1.0),
    "enospc": dict(enospc=True),
    "erofs": dict(erofs=True),
    "torn_write": dict(torn_write_rate=1.0),
}


@pytest.mark.parametrize("fault", sorted(WRITE_FAULTS))
def test_write_fault_fails_over_and_back_without_loss(tiers, fault):
    fo, fio = tiers()
    before = list(range(20))
    assert all(fo.put(key(i), block(i)) for i in before)
    assert fo.serving is ServingTier.SSD
    fio.set(**WRITE_FAULTS[fault])
    during = list(range(20, 40))
    # The first failing write is retried on the shadow: every put still succeeds.
    assert all(fo.put(key(i), block(i), session="s") for i in during)
    assert fo.serving is ServingTier.SHADOW
    assert fio.counts, "the fault was never hit"
    st = fo.status()
    assert st["shadow_blocks"] == len(during) and 0 < st["shadow_fill"] <= 1
    # Everything committed before and during the fault reads back, byte for byte.
    assert_identical(fo, before + during)
    # The SSD is still failing: probes fail, no failback.
    assert fo.probe()["ok"] is False and fo.serving is ServingTier.SHADOW
    fio.clear()
    assert fo.probe()["ok"] is True and fo.serving is ServingTier.SHADOW  # 1 of 2
    out = fo.probe()
    assert out["restore"]["restored"] == len(during)
    assert fo.serving is ServingTier.SSD and fo.shadow.keys() == []
    assert sorted(fo.primary.keys()) == sorted(key(i) for i in before + during)
    assert_identical(fo, before + during)
    # And the SSD takes new writes again.
    assert fo.put(key(99), block(99)) and fo.primary.contains(key(99))


def test_read_eio_reports_missing_then_recovers(tiers):
    fo, fio = tiers()
    idx = list(range(10))
    assert all(fo.put(key(i), block(i)) for i in idx)
    fio.set(read_eio_rate=1.0)
    ok, outs = read_all(fo, idx)
    assert not any(ok)  # missing -> the engine recomputes; never wrong data
    assert fo.serving is ServingTier.SHADOW
    assert fo.put(key(50), block(50)) and fo.shadow.contains(key(50))
    fio.clear()
    assert fo.restore()["restored"] == 1
    assert_identical(fo, idx + [50])


def test_silent_torn_write_is_caught_by_the_checksum(tiers):
    fo, fio = tiers()
    fio.set(torn_write_rate=1.0, torn_silent=True)
    assert fo.put(key(1), block(1))  # the device lied
    fio.clear()
    ok, outs = read_all(fo, [1])
    assert ok == [False]  # reported missing, not served wrong
    st = fo.primary.stats()
    assert st["corrupt"] + st["missing"] >= 1


def test_explicit_activate_and_restore(tiers):
    fo, fio = tiers()
    assert fo.put(key(1), block(1))
    assert fo.activate("drill") is True and fo.activate("again") is False
    assert fo.status()["reason"] == "drill"
    assert fo.put(key(2), block(2)) and fo.shadow.contains(key(2))
    assert not fo.primary.contains(key(2))
    assert fo.restore()["restored"] == 1
    assert fo.status()["failovers"] == 1 and fo.status()["failbacks"] == 1
    assert_identical(fo, [1, 2])


def test_restore_on_a_still_failing_ssd_keeps_the_shadow(tiers):
    fo, fio = tiers()
    fo.activate("drill")
    assert all(fo.put(key(i), block(i)) for i in range(5))
    fio.set(write_eio_rate=1.0)
    with pytest.raises(FailoverError):
        fo.restore()
    assert fo.serving is ServingTier.SHADOW and len(fo.shadow.keys()) == 5
    fio.clear()
    assert fo.restore()["restored"] == 5
    assert_identical(fo, list(range(5)))


def test_shadow_is_size_capped(tiers):
    fo, fio = tiers(shadow_bytes=1 << 20)
    fo.activate("drill")
    rec = 8192  # one record: 4 KiB header + payload padded to 4 KiB
    for i in range(200):
        fo.put(key(i), block(i))
    assert fo.shadow.bytes_used <= 1 << 20
    assert len(fo.shadow.keys()) <= (1 << 20) // rec


def test_shadow_contents_survive_a_restart(tmp_path, tiers):
    fo, fio = tiers()
    fo.activate("drill")
    assert fo.put(key(7), block(7))
    fo.close()
    again, _ = tiers()
    assert again.serving is ServingTier.SHADOW
    assert_identical(again, [7])
    assert again.restore()["restored"] == 1


def test_wear_read_only_is_not_a_failover(tiers):
    fo, fio = tiers()
    fo.set_read_only(True)
    assert fo.put(key(1), block(1)) is False
    assert fo.serving is ServingTier.SSD
    fo.set_read_only(False)
    assert fo.put(key(1), block(1))


def test_delete_and_keys_span_both(tiers):
    fo, fio = tiers()
    fo.put(key(1), block(1))
    fo.activate("x")
    fo.put(key(2), block(2))
    assert set(fo.keys()) == {key(1), key(2)}
    assert {b.key for b in fo.snapshot()} == {key(1), key(2)}
    assert fo.delete([key(1), key(2)]) == 2 and fo.keys() == []


@pytest.mark.parametrize("plan,op,code", [
    (FaultPlan(erofs=True), "open_w", errno.EROFS),
    (FaultPlan(enospc=True), "pwrite", errno.ENOSPC),
    (FaultPlan(write_eio_rate=1.0), "fsync", errno.EIO),
    (FaultPlan(read_eio_rate=1.0), "preadv", errno.EIO),
])
def test_fault_plan_maps_operations_to_errnos(tmp_path, plan, op, code):
    import os

    fio = FaultyFileIO(plan=FaultPlan())
    fd = fio.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT, 0o600)
    fio.pwrite(fd, memoryview(b"x" * 4096), 0)
    fio.set(**{f: getattr(plan, f) for f in plan.__dataclass_fields__})
    with pytest.raises(OSError) as ei:
        if op == "open_w":
            fio.open(str(tmp_path / "g"), os.O_WRONLY | os.O_CREAT, 0o600)
        elif op == "pwrite":
            fio.pwrite(fd, memoryview(b"y" * 4096), 0)
        elif op == "fsync":
            fio.fsync(fd)
        else:
            fio.preadv(fd, [memoryview(bytearray(4096))], 0)
    assert ei.value.errno == code
    fio.clear()
    fio.close(fd)


def test_faults_are_seeded():
    a, b = FaultyFileIO(seed=5, plan=FaultPlan(read_eio_rate=0.5)), \
        FaultyFileIO(seed=5, plan=FaultPlan(read_eio_rate=0.5))
    assert [a._roll(0.5) for _ in range(50)] == [b._roll(0.5) for _ in range(50)]
