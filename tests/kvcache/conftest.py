"""Fixtures of the block store tests: a tiny geometry, a namespace, store builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable

import pytest
import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

BT = 4


@pytest.fixture
def geometry() -> KVGeometry:
    return KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=BT, dtype=torch.float32)


@pytest.fixture
def namespace() -> bytes:
    return make_namespace("test-model@1", torch.float32, BT)


@pytest.fixture
def make_cold(tmp_path: Path, geometry: KVGeometry, namespace: bytes) -> Callable[..., ColdStore]:
    def build(directory: Path | None = None, **kw) -> ColdStore:
        kw.setdefault("capacity_bytes", 8 << 20)
        kw.setdefault("segment_bytes", 1 << 20)
        kw.setdefault("io_unit_bytes", 8192)
        return ColdStore(directory or tmp_path / "cold", kw.pop("geometry", geometry),
                         kw.pop("namespace", namespace), **kw)
    return build


@pytest.fixture
def make_store(geometry: KVGeometry, namespace: bytes,
               make_cold: Callable[..., ColdStore]) -> Callable[..., TieredKVStore]:
    def build(hot: int = 8, warm: int = 8, cold: bool | dict[str, Any] = True,
              **kw: Any) -> TieredKVStore:
        """`cold`: True for a default cold store, a dict of `make_cold` arguments, or False.
        The store builds it (it is the cold store's listener); reach it as `store.cold`."""
        bb = geometry.block_bytes
        cold_kw = {} if cold is True else cold
        factory = None if cold is False else (
            lambda listener: make_cold(listener=listener, **cold_kw))  # type: ignore[arg-type]
        return TieredKVStore(geometry, kw.pop("namespace", namespace), hot_bytes=hot * bb,
                             warm_bytes=warm * bb, cold=factory, **kw)
    return build


def fill_value(key: bytes) -> float:
    """A per-block constant derived from its key, so a test can tell blocks apart."""
    return float(int.from_bytes(key[:2], "little") % 1000) + 1.0


def compute_blocks(store: TieredKVStore, session: str, tokens: list[int], first_block: int,
                   n: int) -> list[bytes] | None:
    """Stand-in for the engine: allocate, fill each block with its key's value, commit."""
    slots = store.allocate_hot(n, session)
    if slots is None:
        return None
    keys = store.block_keys(tokens)[first_block:first_block + n]
    for s, k in zip(slots, keys):
        store.hot_arena()[s].fill_(fill_value(k))
    return store.commit(session, tokens, slots, first_block)
