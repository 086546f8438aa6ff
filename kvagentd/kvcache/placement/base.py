"""Contracts of placement: what it needs of a block store, and the plans it makes.

Placement never probes a store for optional members: everything it calls is in
`PlacementStore`, with the contract it relies on; `TieredKVStore` and the placement simulator's
store implement it. Accesses do not come through this protocol: the store reports them to its
access listener (an `AccessFeed`, passed to both at construction).

A round costs O(blocks accessed or moved since the last round + a bounded sample): the store
answers for a few named blocks (`block_states`, as columns), its own idle LRU order
(`least_recent_idle`) and random idle blocks (`sample_idle`), never with a scan of every block.
Plans are batches of keys with one source, destination and reason each: no object per block.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from ..base import BlockKey, Tier

# Column codes of a tier inside numpy arrays: `Tier.rank + 1` (0: no tier), so comparing codes
# compares ranks. NOTE: codes live only in columns; they become tiers through these tables.
NONE = 0
HOT, WARM, COLD = (t.rank + 1 for t in (Tier.HOT, Tier.WARM, Tier.COLD))
CODE_OF: dict[Tier | None, int] = {None: NONE, Tier.HOT: HOT, Tier.WARM: WARM, Tier.COLD: COLD}
TIER_OF: dict[int, Tier] = {HOT: Tier.HOT, WARM: Tier.WARM, COLD: Tier.COLD}


class BlockStates(NamedTuple):
    """What the store says of a few blocks, as columns in the order asked."""

    known: np.ndarray  # bool: the store has the block
    tier: np.ndarray  # int8 code (`CODE_OF`); NONE for a block unknown, moving or lost
    idle: np.ndarray  # bool: settled in its tier, unused by any request, unpinned
    last_access: np.ndarray  # float64 seconds of its last use (0 when unknown)


def block_states(known: Sequence[bool], tiers: Sequence[Tier | None], idle: Sequence[bool],
                 last_access: Sequence[float]) -> BlockStates:
    """Columns from per-block values (a store that builds them one block at a time)."""
    n = len(tiers)
    return BlockStates(np.fromiter(known, bool, n),
                       np.fromiter(map(CODE_OF.__getitem__, tiers), np.int8, n),
                       np.fromiter(idle, bool, n), np.fromiter(last_access, np.float64, n))


class TierPool(Protocol):
    """Capacity and free slots of the hot or the warm tier, in blocks."""

    @property
    def capacity(self) -> int: ...

    @property
    def num_free(self) -> int: ...


class PlacementStore(Protocol):
    """The store surface of placement. Moves are best effort: each returns how many blocks it
    moved and skips, without raising, blocks that are unknown, pinned (demote, evict), in use
    or already moving; capacity limits are a status, not an error. `tier` arguments of the
    pool-level members are `Tier.HOT` or `Tier.WARM`."""

    def pool(self, tier: Tier) -> TierPool:
        """The tier's slots (cold is bounded by bytes, not slots)."""
        ...

    def block_states(self, keys: Sequence[BlockKey]) -> BlockStates:
        """Tier, idleness and last use of each of `keys`, in O(len(keys))."""
        ...

    def least_recent_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        """Up to `n` idle (settled, unused, unpinned) blocks of `tier`, least recently used
        first: the order in which the store's own room-making would demote them."""
        ...

    def sample_idle(self, tier: Tier, n: int) -> list[BlockKey]:
        """At most `n` distinct idle blocks of `tier` drawn at random, in O(n)."""
        ...

    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        """Move blocks up to `tier`, into free slots only; `background=True` goes through the
        store's low-priority, bounded queue and returns how many were queued."""
        ...

    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        """Move idle, unpinned blocks down to `tier`, making room there as the store does."""
        ...

    def evict(self, keys: Sequence[BlockKey]) -> int:
        """Forget idle, unpinned blocks entirely."""
        ...


class Reason(enum.Enum):
    LRU = "lru"
    HEAT = "heat"
    REUSE = "reuse"  # predicted reuse (the `reuse` policy)
    CAPACITY = "capacity"  # room for a better block
    PREDICT = "prefetch-predict"
    COACCESS = "prefetch-coaccess"
    NEIGHBOUR = "prefetch-neighbour"
    WARMUP = "warmup"

    @property
    def is_prefetch(self) -> bool:
        return self in _PREFETCH


_PREFETCH = frozenset({Reason.PREDICT, Reason.COACCESS, Reason.NEIGHBOUR, Reason.WARMUP})


class Action(enum.Enum):
    PROMOTE = "promote"
    DEMOTE = "demote"
    EVICT = "evict"


@dataclass(frozen=True, slots=True)
class Move:
    """Move `key` from `src` to `dst`; `dst=None` means evict (forget the block)."""

    key: BlockKey
    src: Tier
    dst: Tier | None
    reason: Reason

    @property
    def action(self) -> Action:
        return _action(self.src, self.dst)

    @property
    def background(self) -> bool:
        """Use the store's low-priority I/O queue (prefetch, or anything read from cold)."""
        return self.reason.is_prefetch or self.src is Tier.COLD


def _action(src: Tier, dst: Tier | None) -> Action:
    if dst is None:
        return Action.EVICT
    return Action.PROMOTE if dst.above(src) else Action.DEMOTE


@dataclass(frozen=True, slots=True)
class MoveBatch:
    """Move every one of `keys` from `src` to `dst` (None: evict), for `reason`; `rows` are
    their `AccessStats` rows where the policy knows them."""

    keys: tuple[BlockKey, ...]
    src: Tier
    dst: Tier | None
    reason: Reason
    rows: np.ndarray | None = None

    @property
    def action(self) -> Action:
        return _action(self.src, self.dst)

    @property
    def background(self) -> bool:
        return self.reason.is_prefetch or self.src is Tier.COLD

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True, slots=True)
class Plan:
    """Batches of moves in order: those that free room come before those that use it, and
    no step takes a tier over its capacity (given a start within it)."""

    batches: tuple[MoveBatch, ...]
    policy: str
    considered: int = 0  # blocks looked at
    # rows of hot's runners-up: the lowest-ranked candidates that stay, looked at again in the
    # next round that makes room there (scoring policies; `PolicyParams.carry_per_victim`)
    runners_up: np.ndarray | None = None

    @property
    def moves(self) -> tuple[Move, ...]:
        """One `Move` per block, in order (for inspection; rounds apply batches)."""
        return tuple(Move(k, b.src, b.dst, b.reason) for b in self.batches for k in b.keys)

    def __iter__(self) -> Iterator[Move]:
        return iter(self.moves)

    def __len__(self) -> int:
        return sum(len(b) for b in self.batches)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for b in self.batches:
            k = f"{b.action.value}:{b.reason.value}"
            out[k] = out.get(k, 0) + len(b)
        return out


@dataclass(frozen=True, slots=True)
class Capacities:
    """Tier capacities in blocks (cold is bounded by bytes in the store, not here)."""

    hot: int
    warm: int

    def of(self, tier: Tier) -> int:
        return self.hot if tier is Tier.HOT else self.warm


@dataclass(frozen=True, slots=True)
class Want:
    """A prefetch wish: bring `key` up to `tier` (never down)."""

    tier: Tier
    reason: Reason
