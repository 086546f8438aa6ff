"""Block states, the one table of allowed transitions, and per-block metadata.

All state changes go through `transition()`, called by the store while it holds its owner lock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import structlog

from kvagentd.kvcache.base import BlockKey, Tier
from kvagentd.kvcache.transitions import IllegalTransition, check_transition

__all__ = ["ALLOWED", "STATE_TIER", "TIER_STATE", "BlockMeta", "BlockState", "IllegalTransition",
           "IntegrityError", "transition"]

log = structlog.get_logger(__name__)


class BlockState(enum.Enum):
    FREE = "free"            # known key, no data anywhere yet / about to be forgotten
    HOT = "hot"              # data in a hot pool slot
    WARM = "warm"            # data in a warm pool slot
    COLD = "cold"            # data only in the cold store
    MIGRATING = "migrating"  # being copied; readers wait
    LOST = "lost"            # unreadable; its tokens must be recomputed


S = BlockState
ALLOWED: dict[BlockState, frozenset[BlockState]] = {
    S.FREE: frozenset({S.HOT, S.WARM, S.COLD}),
    S.HOT: frozenset({S.MIGRATING, S.FREE}),
    S.WARM: frozenset({S.MIGRATING, S.FREE}),
    S.COLD: frozenset({S.MIGRATING, S.FREE, S.LOST}),
    S.MIGRATING: frozenset({S.HOT, S.WARM, S.COLD, S.LOST}),
    S.LOST: frozenset({S.FREE}),
}

TIER_STATE = {Tier.HOT: S.HOT, Tier.WARM: S.WARM, Tier.COLD: S.COLD}
STATE_TIER = {v: k for k, v in TIER_STATE.items()}


class IntegrityError(AssertionError):
    """A broken invariant found by `check_integrity()`."""


@dataclass(slots=True, eq=False)
class BlockMeta:
    """Everything the store knows about one block. Mutated only under the store's lock."""

    key: BlockKey
    state: BlockState = BlockState.FREE
    slot: int | None = None          # slot in the pool of the current tier (HOT/WARM)
    in_cold: bool = False            # a verified-on-read durable copy exists in the cold store
    version: int = 0                 # bumped on every completed move
    pins: int = 0
    users: int = 0                   # use-references of running requests
    sessions: set[str] = field(default_factory=set)
    last_access: float = 0.0
    # cold copies on a device that failed (see the store's `cold_failed_over`)
    stale_cold: bool = False    # a record there to delete when the block is forgotten
    recheck_cold: bool = False  # read from there while moving: settle when the move completes
    # while MIGRATING: where it was and where it goes
    src_state: BlockState | None = None
    dst_tier: Tier | None = None
    dst_slot: int | None = None

    @property
    def tier(self) -> Tier | None:
        return STATE_TIER.get(self.state)


def transition(meta: BlockMeta, new: BlockState) -> None:
    """Move `meta` to state `new`; raises IllegalTransition on an edge not in `ALLOWED`."""
    check_transition(ALLOWED, meta.state, new, f"block {meta.key.hex()} state")
    log.debug("block_transition", key=meta.key.hex(), old=meta.state.value, new=new.value)
    meta.state = new
