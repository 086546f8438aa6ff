"""A running sequence's blocks over the tiered store, and the memory a batch holds beyond it.

`admit`: match_prefix(all ids) -> ensure_resident(matched blocks: warm -> hot, cold reads;
a block that is lost or corrupt ends the usable prefix, and its tokens are recomputed inside
the batch) -> allocate_hot(every block it will compute) -> its KV (`SequenceKV`) over those
slots. `commit` publishes the blocks it completed; `release` gives everything back (after a
commit, a preempted sequence resumes from whichever tier then holds its blocks).

Memory beyond the hot pool, counted against `budget_bytes`: the contiguous layout's batch
workspace (`rows.py`: one row per running sequence that fits one, taken at start) and the
private working copies of longer sequences, or the paged layout's one-layer gather scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import structlog

from kvagentd.engine.attention import SPLIT_MIN_QUERIES
from kvagentd.engine.cache import HotPoolCache, Workspaces
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.memo import LogitsMemo
from kvagentd.engine.paged import PagedKV, PagedScratch
from kvagentd.engine.rows import BatchRows
from kvagentd.engine.scheduler import Need, Resources
from kvagentd.engine.sequence import Sequence
from kvagentd.kvcache.base import BlockKey, KVStore, MatchResult

log = structlog.get_logger(__name__)

Layout = Literal["contiguous", "paged"]


def _recompute_cheaper(stored: int, total: int) -> bool:
    """A long prompt behind a short stored prefix (a new session's first turn behind a shared
    template header) is prefilled whole: recomputing the few stored tokens costs less than
    attending a long chunk past them (`attention.SPLIT_MIN_QUERIES`: two flash calls and a
    merge, about 35 % more attention time than one causal call at 2,000 tokens)."""
    rest = total - stored
    return 0 < stored * 8 <= rest and rest >= SPLIT_MIN_QUERIES


class BatchMemoryExceeded(RuntimeError):
    """One sequence alone needs more memory than `executor.batch_memory_bytes`."""


class BlockManager:
    """Admission of sequences onto hot blocks; not thread-safe (the model worker calls it)."""

    def __init__(self, store: KVStore, *, layout: Layout, budget_bytes: int,
                 rows: BatchRows | None = None, memo: LogitsMemo | None = None,
                 on_recompute: Callable[[int], None] | None = None) -> None:
        self.store = store
        self.geometry = store.geometry
        self.arena = store.hot_arena()
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.rows = rows if layout == "contiguous" else None
        self.rows_bytes = self.rows.nbytes() if self.rows is not None else 0
        if self.rows_bytes > budget_bytes:
            raise BatchMemoryExceeded(
                f"the batch workspace ({self.rows_bytes} bytes) exceeds "
                f"executor.batch_memory_bytes ({budget_bytes})")
        self.on_recompute = on_recompute
        self.memo = memo
        # the private working copies of sequences longer than a row share what rows leave
        self.workspaces = Workspaces(self.geometry, self.arena.device,
                                     budget_bytes - self.rows_bytes)
        self.scratch = PagedScratch(self.geometry, self.arena.device)
        self.held_blocks = 0

    # -- accounting -------------------------------------------------------------------------

    def need(self, seq: Sequence) -> Need:
        """What `seq` holds once admitted: every full block of its final length and its
        working copy (contiguous), or every block incl. the partial one and a private copy of
        a re-run block (paged)."""
        total, bt = seq.final_tokens, self.geometry.block_tokens
        if self.layout == "contiguous":
            if self.rows is not None and self.rows.fits(total):
                return Need(total // bt, 0)  # a row: every running sequence can have one
            return Need(total // bt, self.workspaces.bytes_for(total))
        return Need(-(-total // bt) + 1, 0)

    def resources(self) -> Resources:
        cap = int(self.arena.shape[0])
        used = (self.workspaces.in_use_bytes() if self.layout == "contiguous"
                else self.scratch.nbytes())
        room = self.budget_bytes - self.rows_bytes
        return Resources(cap, cap - self.held_blocks, room, max(0, room - used))

    def status(self) -> dict[str, Any]:
        rows = self.rows
        return {"layout": self.layout, "budget_bytes": self.budget_bytes,
                "batch_rows": rows.rows if rows is not None else 0,
                "row_tokens": rows.row_tokens if rows is not None else 0,
                "rows_in_use": rows.in_use if rows is not None else 0,
                "rows_bytes": self.rows_bytes,
                "working_copy_bytes": self.workspaces.in_use_bytes(),
                "idle_buffer_bytes": self.workspaces.nbytes(),
                "paged_scratch_bytes": self.scratch.nbytes(),
                "held_hot_blocks": self.held_blocks,
                "hot_capacity_blocks": int(self.arena.shape[0])}

    # -- the sequence's blocks --------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Bring `seq`'s stored prefix hot and bind its KV; False (holding nothing) when the
        hot pool or the memory budget has no room now."""
        g, sid, ids = self.geometry, seq.session_id, seq.tokens
        bt = g.block_tokens
        res = seq.result
        t0 = time.perf_counter()
        match = self.store.match_prefix(ids)
        if _recompute_cheaper(len(match.keys) * bt, len(ids)):
            match = MatchResult([], 0)
        t1 = time.perf_counter()
        residency = self.store.ensure_resident(match.keys, sid)
        t2 = time.perf_counter()
        n_ok = len(match.keys) if residency.missing_from is None else residency.missing_from
        usable = residency.slots[:n_ok]
        total = seq.final_tokens
        all_cached = len(usable) * bt >= len(ids)
        if self.layout == "contiguous":
            n_new = total // bt - len(usable)
        else:
            n_new = -(-total // bt) - len(usable) + (1 if all_cached else 0)
            if self.scratch.bytes_for(total) > self.budget_bytes:
                self.store.release(sid)
                raise BatchMemoryExceeded(
                    f"a sequence of {total} tokens needs {self.scratch.bytes_for(total)} bytes of "
                    f"attention scratch; executor.batch_memory_bytes is {self.budget_bytes}")
        slots = self.store.allocate_hot(n_new, sid) if n_new > 0 else []
        if slots is None:
            self.store.release(sid)
            return False
        # every id stored: the logits that followed them, when known, give the first token
        # without running the last id again (contiguous layout)
        memo = (self.memo.get(ids) if all_cached and self.memo is not None
                and self.layout == "contiguous" and len(usable) * bt == len(ids) else None)
        kv = self._bind(seq, usable, slots, all_cached and memo is None, total)
        seq.first_logits = memo
        if kv is None:
            self.store.release(sid)
            return False
        seq.kv = kv
        seq.used_keys = list(match.keys[:n_ok])
        seq.blocks_held = len(usable) + len(slots)
        seq.bytes_held = kv.nbytes()
        self.held_blocks += seq.blocks_held
        for tier, n in residency.loaded.items():
            res.loaded[tier] = res.loaded.get(tier, 0) + n
        if seq.first_admitted_at is None:
            res.reused_tokens = kv.length
            res.prefill_tokens = len(ids) - kv.length
        # NOTE: blocks this session had stored count too when they are no longer matched (a
        # block found LOST earlier, e.g. by a prefetch or a scrub, or evicted): their tokens
        # are recomputed just the same, not prefilled as new ones.
        stored = len(seq.session.block_keys) if seq.session is not None else 0
        recomputed = (max(len(match.keys), min(stored, len(ids) // bt)) - n_ok) * bt
        if recomputed:
            res.recomputed_tokens += recomputed
            if self.on_recompute is not None:
                self.on_recompute(recomputed)
            log.warning("blocks_recomputed", session=sid, first_missing=n_ok, tokens=recomputed)
        for name, dt in (("match_s", t1 - t0), ("resident_s", t2 - t1),
                         ("gather_s", time.perf_counter() - t2)):
            res.timings[name] = res.timings.get(name, 0.0) + dt
        return True

    def commit(self, seq: Sequence) -> list[BlockKey]:
        """Publish the blocks `seq` completed; returns every stored key of its ids."""
        assert seq.kv is not None
        written = seq.kv.written
        if not written:
            return list(seq.used_keys)
        first = written[0][0]
        if first != len(seq.used_keys):
            raise RuntimeError(f"session {seq.session_id!r}: written blocks start at {first}, "
                               f"after {len(seq.used_keys)} stored ones")
        new = self.store.commit(seq.session_id, seq.tokens, [s for _, s in written], first)
        return list(seq.used_keys) + list(new)

    def release(self, seq: Sequence) -> None:
        """Give back every hot slot and buffer `seq` holds (uncommitted blocks are dropped)."""
        self.store.release(seq.session_id)
        if seq.kv is not None:
            seq.kv.close()
        self.held_blocks -= seq.blocks_held
        seq.kv = None
        seq.used_keys = []
        seq.blocks_held = seq.bytes_held = 0

    # -- internals --------------------------------------------------------------------------

    def _row_cache(self, total: int) -> HotPoolCache | None:
        """A working copy in a free row of the batch workspace, when `total` tokens fit one."""
        rows = self.rows
        if rows is None or not rows.fits(total):
            return None
        g, arena = self.geometry, self.arena

        def bind(row: int, work: Any) -> HotPoolCache:
            return HotPoolCache(g, arena, work, rows=rows, row=row)

        owner = rows.acquire(bind)
        assert owner is None or isinstance(owner, HotPoolCache)
        return owner

    def _bind(self, seq: Sequence, usable: list[int], slots: list[int], all_cached: bool,
              total: int) -> SequenceKV | None:
        g, n_ids = self.geometry, len(seq.tokens)
        if self.layout == "contiguous":
            cache = self._row_cache(total)
            if cache is None:
                work = self.workspaces.acquire(total)
                if work is None:
                    return None
                cache = HotPoolCache(g, self.arena, work, workspaces=self.workspaces)
            cache.load_blocks(usable)
            if all_cached:  # every id is stored: re-run the last one for its logits
                cache.truncate(n_ids - 1)
            cache.bind_new_slots(slots)
            return cache
        self.scratch.reserve(total)
        if all_cached:  # re-run the last id in a private copy of its (shared) block
            self.arena[slots[0]].copy_(self.arena[usable[-1]])
            return PagedKV(g, self.arena, usable[:-1] + slots, length=n_ids - 1,
                           first_new=len(usable) - 1, stored=len(usable), scratch=self.scratch)
        return PagedKV(g, self.arena, usable + slots, length=len(usable) * g.block_tokens,
                       first_new=len(usable), scratch=self.scratch)
