"""Contracts of the tiered KV cache. Implementations live beside this file.

Layout (fixed, layout version 1): a block is the K and V of `block_tokens` consecutive tokens
for all layers, contiguous, shape `(num_layers, 2, num_kv_heads, block_tokens, head_dim)`
(index 0 = K, 1 = V). A pool is one preallocated tensor `(capacity, *block_shape)`; a block
lives in a *slot* of a pool. Only full blocks are stored and content-addressed; the tokens of a
session's last, partial block are recomputed by the engine on the next request (as vLLM does),
so they are private to that request by construction.

Slots handed out by `ensure_resident` / `allocate_hot` are valid only until the matching
`release`; between requests blocks may move (placement, defrag), so the engine never keeps slot
numbers across requests.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

LAYOUT_VERSION = 1


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def from_model_config(cls, config: Any, block_tokens: int, dtype: torch.dtype) -> KVGeometry:
        """From a transformers PretrainedConfig (Llama-style attributes)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, block_tokens, dtype)


class Tier(enum.Enum):
    """Where a block's data lives, fastest first. `rank` orders them: promoting a block moves
    it to a lower rank, demoting to a higher one (the one tier order of the project)."""

    HOT = "hot"
    WARM = "warm"
    COLD = "cold"

    @property
    def rank(self) -> int:
        return _TIER_RANK[self]

    def above(self, other: Tier) -> bool:
        """True when `self` is a faster tier than `other`."""
        return self.rank < other.rank


_TIER_RANK = {Tier.HOT: 0, Tier.WARM: 1, Tier.COLD: 2}


BlockKey = bytes  # 16-byte content hash; hex for display


class MatchResult(NamedTuple):
    """Longest run of full blocks, from the start of the token ids, known to the store."""

    keys: list[BlockKey]
    num_tokens: int  # len(keys) * block_tokens


class Residency(NamedTuple):
    """Outcome of `ensure_resident`.

    `slots[i]` is the hot slot of `keys[i]` for i < len(slots). If a block could not be made
    resident (lost, corrupt, unreadable), `slots` stops before it and `missing_from` is its
    index: the caller recomputes the tokens from that block on. Blocks after a missing one are
    not loaded. `loaded` counts blocks by the tier they came from.
    """

    slots: list[int]
    missing_from: int | None
    loaded: dict[str, int]


class KVStore(ABC):
    """The store facade used by the engine, placement and maintenance.

    Thread-safe: one internal owner lock guards metadata; copies and I/O run outside it.
    Nothing raises out of these methods for a storage fault: faults become `missing`.
    """

    geometry: KVGeometry

    @abstractmethod
    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Keys of every full block of `token_ids` in this store's namespace."""

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest prefix of full blocks present in any tier (not LOST)."""

    @abstractmethod
    def ensure_resident(self, keys: Sequence[BlockKey], session: str) -> Residency:
        """Bring `keys` into the hot pool (warm->hot copy, batched cold reads staged via warm)
        and hold a use-reference on each until `release`. May demote idle blocks to make room,
        or drop idle unpinned ones for recompute where no lower tier takes them."""

    @abstractmethod
    def hot_arena(self) -> torch.Tensor:
        """The hot pool tensor `(capacity, *block_shape)`; index it with slots."""

    @abstractmethod
    def allocate_hot(self, n: int, session: str) -> list[int] | None:
        """`n` private hot slots for blocks being computed, or None when the hot pool cannot
        provide them even after demoting idle blocks and, where no lower tier takes them,
        dropping idle unpinned blocks for recompute (counted in `stats()["dropped"]`): only
        pinned blocks and blocks in use can stand in the way. Held until `commit` or
        `release`."""

    @abstractmethod
    def commit(self, session: str, token_ids: Sequence[int], slots: Sequence[int],
               first_block: int) -> list[BlockKey]:
        """Publish freshly computed full blocks: `slots[j]` holds block `first_block + j` of
        `token_ids`. A key that already exists keeps its existing copy and the duplicate slot
        is freed. Returns the keys. The use-references stay until `release`."""

    @abstractmethod
    def release(self, session: str) -> None:
        """Drop every use-reference and private slot that `session` holds."""

    @abstractmethod
    def record_access(self, keys: Iterable[BlockKey], session: str) -> None:
        """Tell the heat map / trace that these blocks were used by one inference event."""

    @abstractmethod
    def promote(self, keys: Sequence[BlockKey], tier: Tier, *, background: bool = False) -> int:
        """Move blocks up to `tier`; returns how many moved. Capacity limits are a status.
        `background=True` (prefetch) uses the low-priority, bounded I/O queue and never delays
        a foreground `ensure_resident`."""

    @abstractmethod
    def demote(self, keys: Sequence[BlockKey], tier: Tier) -> int:
        """Move blocks down to `tier` (hot->warm->cold); returns how many moved."""

    @abstractmethod
    def pin(self, keys: Sequence[BlockKey]) -> None: ...

    @abstractmethod
    def unpin(self, keys: Sequence[BlockKey]) -> None: ...

    @abstractmethod
    def drop_session(self, session: str, keys: Sequence[BlockKey]) -> None:
        """Forget the session's reference to `keys`; blocks no session references are freed."""

    @abstractmethod
    def snapshot(self) -> list[BlockInfo]:
        """Metadata of every known block, for placement / prefetch / defrag planning."""

    @abstractmethod
    def keys_of_session(self, session: str) -> list[BlockKey]:
        """Keys of every block `session` references (read-only)."""

    @abstractmethod
    def relocate(self, tier: Tier, moves: Sequence[tuple[int, int]]) -> int:
        """Defrag primitive: move idle blocks between slots of one pool (src, dst) atomically
        with respect to readers; skips blocks in use; returns how many moved."""

    @abstractmethod
    def evict(self, keys: Sequence[BlockKey]) -> int:
        """Forget blocks entirely (cold TTL expiry, space floor); skips pinned or in-use."""

    @abstractmethod
    def stats(self) -> dict[str, object]:
        """JSON-ready counters: per tier blocks/bytes/capacity, hits, lost, migrations."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError-like `IntegrityError` on any broken invariant."""

    @abstractmethod
    def close(self) -> None:
        """Persist what must survive (config `kv.persist_on_shutdown`) and release files."""


class BlockInfo(NamedTuple):
    """One row of `KVStore.snapshot()`: what policy code needs to plan, nothing more."""

    key: BlockKey
    tier: Tier | None  # None while MIGRATING or LOST
    pinned: bool
    in_use: bool  # held by a running request (must stay hot)
    sessions: tuple[str, ...]
    last_access: float  # wall-clock seconds (time.time()) of the last access
    nbytes: int


class ColdListener(Protocol):
    """What a cold tier tells (and asks) its owner, the block store, passed to it at
    construction. Never called with the owner's lock held (the owner never calls the cold
    tier under its lock). `cold_evicted` and `cold_failed_over` are called without any of the
    cold tier's locks held by the caller's thread of control; `cold_protected` may be called
    with them held and must not call back into the cold tier."""

    def cold_protected(self, keys: Sequence[BlockKey]) -> set[BlockKey]:
        """Which of `keys` must keep their records: pinned blocks, blocks a request holds
        and blocks being read from the cold tier now. Capacity eviction never picks them."""
        ...

    def cold_evicted(self, keys: list[BlockKey]) -> None:
        """These records were dropped to stay under the cold tier's capacity (never one that
        `cold_protected` named at the time)."""

    def cold_failed_over(self) -> None:
        """The cold tier now writes to a stand-in device because the SSD failed: copies made
        before on the SSD may be unreadable, so they must not be relied on any more."""


class ColdEntry(NamedTuple):
    """One record, as the owner rebuilds its block table from it after a restart."""

    key: BlockKey
    last_access: float
    session: str  # the session that wrote the record ("" when several or none)


class ColdTier(Protocol):
    """A directory of checksummed cold records: the SSD cold store, the /dev/shm shadow, or
    the failover pair of both. Every member its users (the block store, the migrator,
    maintenance) call is listed here.

    Expected outcomes are return values, never exceptions: `put_many` returns False for a
    record it could not store (full, read-only, I/O error), `read_into` False for one that is
    missing, unreadable or fails its checksum (counted in `stats()`).
    """

    @property
    def namespace(self) -> bytes: ...

    @property
    def ttl_s(self) -> float:
        """Seconds a record lives after its last access (refreshed by reads and `touch`)."""
        ...

    @property
    def read_only(self) -> bool:
        """True while new records are refused (SSD wear limit, EROFS)."""
        ...

    def set_read_only(self, flag: bool) -> None: ...

    @property
    def durable(self) -> bool:
        """New records land on non-volatile storage now (not a RAM stand-in while the SSD
        fails): the write-behind writes only then."""
        ...

    @property
    def bytes_used(self) -> int: ...

    def put_many(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor,
                 *, session: str = "", num_tokens: int = 0) -> list[bool]:
        """Encode each block (CPU tensor of `geometry.block_shape`) and store it durably:
        written, synced, then indexed. A key already present is left as it is (True)."""
        ...

    def read_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read and verify each record into its CPU destination tensor; batched I/O."""
        ...

    def contains(self, key: BlockKey) -> bool: ...

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, this tier can read although its owner does not
        list them: records other boxes wrote to a shared (remote) tier. 0 for a tier of this
        box alone. Bounded in time (a remote that is down or slow answers 0); never raises
        for a storage fault."""
        ...

    def offer(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], *,
              session: str = "") -> None:
        """Blocks just computed (tensors valid only during the call, on any device): a shared
        tier copies them now and writes them behind, so other boxes can use them; a tier of
        this box alone ignores them. Never waits for I/O, never raises."""
        ...

    def keys(self) -> list[BlockKey]: ...

    def entries(self) -> list[ColdEntry]:
        """Every record of this namespace (the owner's table after a restart)."""
        ...

    def snapshot(self) -> list[BlockInfo]:
        """One row per record (tier COLD, sessions from the stored references)."""
        ...

    def delete(self, keys: Iterable[BlockKey]) -> int:
        """Forget records (their space returns with `compact`); returns how many went."""
        ...

    def evict(self, keys: Sequence[BlockKey]) -> int:
        """`delete`, counted as an eviction (TTL expiry, space)."""
        ...

    def expired(self, now: float | None = None) -> list[BlockKey]:
        """Keys whose TTL has run out at `now`."""
        ...

    def touch(self, keys: Sequence[BlockKey], now: float | None = None) -> None:
        """Refresh the TTL of records that were used without being read."""
        ...

    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        """Replace the stored session -> keys map, and make what the tier stored so far
        durable (records and their index rows survive a power cut once this returns)."""
        ...

    def load_refs(self) -> dict[str, list[BlockKey]]: ...

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """Read and check every record now (the scrub): checked, corrupt, missing, repaired,
        bytes, moved (records compaction moved during the pass, checked where they went).
        `repair` forgets the bad ones, never a record that was moved meanwhile. `progress`
        hears how far the pass is, from time to time."""
        ...

    def compact(self, min_dead_ratio: float = 0.5, *, max_copy_bytes: int | None = None) -> int:
        """Rewrite mostly-dead segments (deadest first; with `max_copy_bytes`, stop starting
        rewrites once that many live bytes were copied); returns bytes reclaimed."""
        ...

    def stats(self) -> dict[str, Any]:
        """JSON-ready figures and counters (`io_errors`, `write_failures`, `corrupt`, ...)."""
        ...

    def close(self) -> None: ...


VerifyProgress = Callable[[int, int], None]
"""`progress(done, total)`: records read so far by a scrub, of how many."""

ColdTierFactory = Callable[[ColdListener], ColdTier]
"""Builds a cold tier that reports to the given listener (the store passes itself)."""
