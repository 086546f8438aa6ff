"""Leases: what running requests hold in the store.

A request (named by its session) holds a *use-reference* on every block it made resident or
committed, from `ensure_resident` / `commit` until `release`; a block in use is never moved,
demoted or evicted by anyone else. It also owns *private* hot slots, allocated for blocks it
is computing, until it commits them (they become blocks) or releases them.
Not thread-safe: the block table calls it under the store's owner lock.
"""

from __future__ import annotations

from kvagentd.kvcache.base import BlockKey


class Leases:
    def __init__(self) -> None:
        self._held: dict[str, list[BlockKey]] = {}
        self._private: dict[str, list[int]] = {}

    # -- use-references ------------------------------------------------------------------------
    def hold(self, holder: str, key: BlockKey) -> None:
        self._held.setdefault(holder, []).append(key)

    def unhold(self, holder: str, key: BlockKey) -> None:
        self._held[holder].remove(key)

    def take_held(self, holder: str) -> list[BlockKey]:
        """Every use-reference of `holder`, which no longer holds any."""
        return self._held.pop(holder, [])

    def counts(self) -> dict[BlockKey, int]:
        """Use-references per block, over all holders."""
        out: dict[BlockKey, int] = {}
        for keys in self._held.values():
            for k in keys:
                out[k] = out.get(k, 0) + 1
        return out

    # -- private hot slots -------------------------------------------------------------------
    def add_private(self, holder: str, slots: list[int]) -> None:
        self._private.setdefault(holder, []).extend(slots)

    def is_private(self, holder: str, slot: int) -> bool:
        return slot in self._private.get(holder, ())

    def claim_private(self, holder: str, slot: int) -> None:
        """`slot` stops being private (it now holds a committed block)."""
        self._private[holder].remove(slot)

    def take_private(self, holder: str) -> list[int]:
        return self._private.pop(holder, [])

    def private_slots(self) -> list[int]:
        return [s for v in self._private.values() for s in v]

    def private_count(self) -> int:
        return sum(len(v) for v in self._private.values())
