"""What placement and prefetch need of a block store, declared (implemented by `TieredKVStore`
and by the placement simulator's store).

Placement never probes a store for optional members: everything it calls is listed here, with
the contract it relies on. Accesses do not come through this protocol: the store reports them to
its access listener (an `AccessFeed`, passed to both at construction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..base import BlockInfo, BlockKey, Tier


class TierPool(Protocol):
    """Capacity and free slots of the hot or the warm tier, in blocks."""

    @property
    def capacity(self) -> int: ...

    @property
    def num_free(self) -> int: ...


class PlacementStore(Protocol):
    """The store surface of placement. Moves are best effort: each returns how many blocks it
    moved and skips, without raising, blocks that are unknown, pinned (demote), in use or
    already moving; capacity limits are a status, not an error."""

    def pool(self, tier: Tier) -> TierPool:
        """The hot or warm tier's slots (`Tier.COLD` is not a pool: bounded by bytes)."""
        ...

    def snapshot(self) -> list[BlockInfo]:
        """Metadata of every known block."""
        ...

    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        """Move blocks up to `tier` into free slots only; `background=True` goes through the
        store's low-priority, bounded queue and returns how many were queued."""
        ...

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        """Move idle, unpinned blocks down to `tier`, making room there as the store does."""
        ...

    def evict(self, keys: Sequence[BlockKey]) -> int:
        """Forget idle, unpinned blocks entirely."""
        ...
