"""TieredKVStore: the block store facade (hot / warm pools, cold store). Body in progress."""

from __future__ import annotations

from typing import Callable

from kvagentd.kvcache.base import BlockKey, ColdBackend, KVGeometry, KVStore

AccessListener = Callable[[list[BlockKey], str], None]


class TieredKVStore(KVStore):  # type: ignore[misc]
    def __init__(self, geometry: KVGeometry, namespace: bytes, *, hot_bytes: int, warm_bytes: int,
                 cold: ColdBackend | None = None, device: str = "cpu",
                 access_listener: AccessListener | None = None, persist_on_shutdown: bool = True,
                 io_threads: int = 2, prefetch_queue: int = 64) -> None:
        raise NotImplementedError
