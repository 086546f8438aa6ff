"""Fixtures of the maintenance tests: a small geometry, cold stores in tmp dirs."""

from __future__ import annotations


from pathlib import Path

import pytest
import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.cold.failover import FailoverColdStore
from kvagentd.kvcache.cold.faults import FaultyFileIO

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=torch.float32)
NS = make_namespace("maintenance-test", torch.float32, 4)


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(GEOM.block_shape, generator=g)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


@pytest.fixture
def geom() -> KVGeometry:
    return GEOM


@pytest.fixture
def tiers(tmp_path: Path):
    """(FailoverColdStore, FaultyFileIO of the SSD side) over two tmp directories."""
    fio = FaultyFileIO(seed=1)
    made = []

    def make(shadow_bytes: int = 4 << 20, probes: int = 2, listener=None):
        """A failover pair; `listener` is the store when a store builds it (`cold=` factory)."""
        ssd = ColdStore(tmp_path / "ssd", GEOM, NS, capacity_bytes=64 << 20,
                        segment_bytes=1 << 20, io_unit_bytes=64 << 10, o_direct=True, file_io=fio,
                        listener=listener)
        shadow = ColdStore(tmp_path / "shm", GEOM, NS, capacity_bytes=shadow_bytes,
                           segment_bytes=1 << 20, io_unit_bytes=64 << 10, o_direct=False,
                           listener=listener)
        fo = FailoverColdStore(ssd, shadow, GEOM, probe_dir=tmp_path / "ssd", file_io=fio,
                               failback_good_probes=probes, shadow_capacity_bytes=shadow_bytes,
                               listener=listener)
        made.append(fo)
        return fo, fio

    yield make
    for fo in made:
        fo.close()

