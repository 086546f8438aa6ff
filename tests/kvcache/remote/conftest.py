"""Remote-tier fixtures: a real redis-server, and block stores of two "boxes" over it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kvagentd.kvcache.base import ColdListener, ColdTier, KVGeometry
from kvagentd.kvcache.cold import ColdTierSpec, build_cold_tier
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.remote import RemoteColdTier, RemoteSpec, RemoteStore
from kvagentd.kvcache.store import TieredKVStore
from tests.redisd import RedisServer, redis_fixture

GEOM = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float32)
NS = make_namespace("remote-test-model", torch.float32, 16)


@pytest.fixture
def rdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def redis(rdir: Path) -> Iterator[RedisServer]:
    yield from redis_fixture(rdir / "redis")


def spec_for(server: RedisServer, **kw: Any) -> RemoteSpec:
    base = RemoteSpec(url=server.url, read_timeout_s=2.0, write_timeout_s=2.0, retry_max_s=0.5)
    return replace(base, **kw)


@dataclass
class Box:
    """One box's block store over its own cold tier and the shared remote."""

    store: TieredKVStore
    tier: RemoteColdTier
    remote: RemoteStore
    root: Path

    def close(self) -> None:
        self.store.close()


def make_box(root: Path, spec: RemoteSpec, *, namespace: bytes = NS, blocks: int = 32) -> Box:
    remote = RemoteStore(spec, GEOM, namespace)
    built: list[RemoteColdTier] = []

    def cold(listener: ColdListener) -> ColdTier:
        local = build_cold_tier(ColdTierSpec(cold_dir=root / "cold", shadow_dir=root / "shm",
                                             capacity_bytes=64 << 20, segment_bytes=4 << 20,
                                             shadow_bytes=8 << 20, o_direct=False),
                                GEOM, namespace, listener)
        built.append(RemoteColdTier(local, remote))
        return built[-1]

    store = TieredKVStore(GEOM, namespace, hot_bytes=blocks * GEOM.block_bytes,
                          warm_bytes=blocks * GEOM.block_bytes, cold=cold)
    return Box(store, built[0], remote, root)


def compute(box: Box, session: str, ids: list[int], seed: int = 0) -> list[bytes]:
    """Commit every full block of `ids` on `box` with deterministic data (as if computed)."""
    n = len(ids) // GEOM.block_tokens
    slots = box.store.allocate_hot(n, session)
    assert slots is not None
    g = torch.Generator().manual_seed(seed)
    arena = box.store.hot_arena()
    for j, s in enumerate(slots):
        arena[s].copy_(torch.randn(GEOM.block_shape, generator=g) + j)
    keys = box.store.commit(session, ids, slots, 0)
    box.store.release(session)
    return keys


def expected(ids: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(GEOM.block_shape, generator=g) + j
            for j in range(len(ids) // GEOM.block_tokens)]
