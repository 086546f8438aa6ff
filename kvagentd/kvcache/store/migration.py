"""Moving blocks between tiers: prepare -> copy -> complete (or revert).

`Migrator.prepare` (owner lock held) marks each block MIGRATING and reserves its destination
slot; `copy` (no lock) moves the bytes — pool to pool in contiguous runs (on a side CUDA stream
with non-blocking copies when the hot pool is on a GPU), cold reads batched into large
sequential reads, cold writes in one synced batch; `complete` (owner lock held) publishes the
new location and version, or reverts, and wakes waiters. A block whose cold read fails becomes
LOST: its tokens are recomputed by the caller.

GPU <-> SSD always goes through the warm pool: the store splits such a move into two
migrations. When the hot pool is on the CPU, hot <-> cold moves are direct.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from collections.abc import Sequence

import structlog
import torch

from kvagentd.kvcache.base import BlockKey, ColdTier, Tier
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import TIER_STATE, BlockMeta, BlockState, transition

log = structlog.get_logger(__name__)

LOGGED_KEYS = 4  # keys a `migration_failed` line names (it counts them all)


@dataclass(slots=True)
class Transfer:
    """One block's bytes in flight between tiers; `src_slot` / `dst_slot` are None for the
    cold tier."""

    meta: BlockMeta
    src: Tier
    dst: Tier
    src_slot: int | None
    dst_slot: int | None
    wrote: bool = False  # a cold write stored it now (not an existing cold copy)


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs where both src and dst slots are consecutive."""
    out: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def _slots(tr: Transfer) -> tuple[int, int]:
    """Source and destination slot of a pool-to-pool transfer."""
    assert tr.src_slot is not None and tr.dst_slot is not None
    return tr.src_slot, tr.dst_slot


class Migrator:
    """Executes moves for the store. `prepare` and `complete` must be called with the store's
    owner lock (`cond`) held; `copy` without it."""

    def __init__(self, pools: dict[Tier, BlockPool], owners: dict[Tier, dict[int, BlockKey]],
                 cold: ColdTier | None, cond: threading.Condition) -> None:
        self.pools = pools
        self.owners = owners
        self.cold = cold
        self.cond = cond
        hot = pools[Tier.HOT]
        self.stream = (torch.cuda.Stream(hot.device)  # type: ignore[no-untyped-call]
                       if hot.device.type == "cuda" else None)
        self.moved = 0
        self.failed = 0

    def prepare(self, metas: Sequence[BlockMeta], dst: Tier) -> list[Transfer] | None:
        """Reserve destinations and mark MIGRATING; None when `dst` lacks room for all."""
        slots: list[int | None]
        if dst is Tier.COLD:
            slots = [None] * len(metas)
        else:
            got = self.pools[dst].allocate(len(metas))
            if got is None:
                return None
            slots = list(got)
        moves = []
        for m, s in zip(metas, slots):
            src = m.tier
            assert src is not None, "only resident blocks are prepared"
            moves.append(Transfer(m, src, dst, m.slot, s))
            m.src_state, m.dst_tier, m.dst_slot = m.state, dst, s
            transition(m, BlockState.MIGRATING)
        return moves

    def copy(self, moves: Sequence[Transfer]) -> list[bool]:
        """Move the bytes; returns success per move. Never raises for a storage fault."""
        ok = [False] * len(moves)
        groups: dict[tuple[Tier, Tier], list[int]] = {}
        for i, mv in enumerate(moves):
            groups.setdefault((mv.src, mv.dst), []).append(i)
        for (src, dst), idx in groups.items():
            if src is not Tier.COLD and dst is not Tier.COLD:
                self._copy_pools(src, dst, [_slots(moves[i]) for i in idx])
                for i in idx:
                    ok[i] = True
            elif dst is Tier.COLD:
                for i, r in zip(idx, self._write_cold(src, [moves[i] for i in idx])):
                    ok[i] = r
            else:
                arena = self.pools[dst].arena
                keys = [moves[i].meta.key for i in idx]
                outs = [arena[moves[i].dst_slot] for i in idx]
                assert self.cold is not None and arena.device.type == "cpu"
                for i, r in zip(idx, self.cold.read_into(keys, outs)):
                    ok[i] = r
        return ok

    def _copy_pools(self, src: Tier, dst: Tier, pairs: list[tuple[int, int]]) -> None:
        a, b = self.pools[src].arena, self.pools[dst].arena
        if self.stream is None:
            for s, d, n in _runs(pairs):
                b[d:d + n].copy_(a[s:s + n])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.pools[Tier.HOT].device))
        with torch.cuda.stream(self.stream):
            for s, d, n in _runs(pairs):
                b[d:d + n].copy_(a[s:s + n], non_blocking=True)
        self.stream.synchronize()

    def _write_cold(self, src: Tier, moves: list[Transfer]) -> list[bool]:
        if self.cold is None:
            return [False] * len(moves)
        todo = [mv for mv in moves if not mv.meta.in_cold]
        if not todo:
            return [True] * len(moves)
        arena = self.pools[src].arena
        assert arena.device.type == "cpu", "GPU -> SSD stages through warm"
        sessions = {s for mv in todo for s in mv.meta.sessions}
        session = next(iter(sessions)) if len(sessions) == 1 else ""
        blocks = [arena[mv.src_slot] for mv in todo]
        keys = [mv.meta.key for mv in todo]
        res = self.cold.put_many(keys, blocks, session=session)
        done = {mv.meta.key for mv, r in zip(todo, res) if r}
        for mv in todo:
            mv.wrote = mv.meta.key in done
        return [mv.meta.in_cold or mv.meta.key in done for mv in moves]

    def complete(self, moves: Sequence[Transfer], ok: Sequence[bool]) -> list[BlockMeta]:
        """Publish or revert each move; returns the blocks that became LOST. Wakes waiters."""
        lost = []
        failed: dict[tuple[Tier, Tier], list[BlockKey]] = {}
        for mv, good in zip(moves, ok):
            m = mv.meta
            if good:
                if mv.src_slot is not None:
                    self.pools[mv.src].free([mv.src_slot])
                    del self.owners[mv.src][mv.src_slot]
                if mv.dst_slot is not None:
                    self.owners[mv.dst][mv.dst_slot] = m.key
                if mv.dst is Tier.COLD:
                    m.in_cold = True
                m.slot = mv.dst_slot
                m.version += 1
                transition(m, TIER_STATE[mv.dst])
                self.moved += 1
            else:
                self.failed += 1
                if mv.dst_slot is not None:
                    self.pools[mv.dst].free([mv.dst_slot])
                if mv.src is Tier.COLD:
                    m.in_cold = False
                    transition(m, BlockState.LOST)
                    lost.append(m)
                    log.warning("block_lost", key=m.key.hex())
                else:
                    transition(m, TIER_STATE[mv.src])
                    failed.setdefault((mv.src, mv.dst), []).append(m.key)
            m.src_state = m.dst_tier = m.dst_slot = None
        for (src, dst), keys in failed.items():  # one line per batch, not one per block
            log.warning("migration_failed", blocks=len(keys), src=src.value, dst=dst.value,
                        keys=[k.hex() for k in keys[:LOGGED_KEYS]], reason=self._refusal(dst))
        self.cond.notify_all()
        return lost

    def _refusal(self, dst: Tier) -> str:
        """Why `dst` did not take blocks (only a cold write can fail)."""
        if dst is not Tier.COLD or self.cold is None:
            return "the copy failed"
        why = getattr(self.cold, "unwritable", None)
        if isinstance(why, str):
            return f"the cold tier takes no records: {why}"
        if self.cold.read_only:
            return "the cold tier is read-only"
        return ("the cold tier refused the write: full of pinned or in-use records (cold_full) "
                "or an I/O error (cold_write_failed)")
