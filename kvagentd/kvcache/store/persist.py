"""The store's state across restarts, through its cold tier.

`persist_blocks` (at a graceful stop) writes hot and warm blocks that sessions reference to
the cold tier and saves the session -> keys map; `load_table` (at start) rebuilds the block
table from the cold tier's records and that map, so `match_prefix` finds those blocks after a
restart. After a crash the map may be older than the records: a record's writing session
stands in for its references then.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from kvagentd.kvcache.base import BlockKey, ColdTier, Tier
from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import BlockMeta, BlockState, transition
from kvagentd.kvcache.store.table import POOL_TIERS, BlockTable

log = structlog.get_logger(__name__)

PERSIST_HOLDER = "\x00persist"  # holder of the use-references taken while persisting
SCAN_CHUNK = 2048  # blocks looked at per hold of the owner lock by whole-table scans


def load_table(table: BlockTable, cold: ColdTier) -> None:
    """Index every cold record as a COLD block, with the sessions that referenced it."""
    rows = cold.entries()
    refs = cold.load_refs()
    with table.cond:
        for key, last_access, _session in rows:
            m = BlockMeta(key, in_cold=True, last_access=last_access)
            transition(m, BlockState.COLD)
            table.meta[key] = m
        for session, ks in refs.items():
            for k in ks:
                if k in table.meta:
                    table.meta[k].sessions.add(session)
        for key, _last, session in rows:  # after a crash: the writer's session, if any
            m = table.meta[key]
            if session and not m.sessions:
                m.sessions.add(session)
    log.info("store_index_loaded", blocks=len(rows), sessions=len(refs))


def persist_blocks(table: BlockTable, pools: dict[Tier, BlockPool], cold: ColdTier, *,
                   release: Callable[[str], None], batch: int = 64) -> int:
    """Write hot and warm blocks that sessions reference and that have no cold copy yet (from
    their slots, held against moves meanwhile and released with `release`; GPU blocks staged
    through host memory a batch at a time), then save the session map. Returns how many
    blocks were written."""
    written = 0
    with table.cond:
        todo = [m for m in table.meta.values()
                if m.tier in POOL_TIERS and m.sessions and not m.in_cold]
        for m in todo:
            table.hold(PERSIST_HOLDER, m)
    try:
        for i in range(0, len(todo), batch):
            part = todo[i:i + batch]
            blocks = []
            for m in part:
                assert m.tier is not None and m.slot is not None
                b = pools[m.tier].arena[m.slot]
                blocks.append(b if b.device.type == "cpu" else b.to("cpu"))
            res = cold.put_many([m.key for m in part], blocks)
            with table.cond:
                for m, r in zip(part, res):
                    if r:
                        m.in_cold = True
                        written += 1
    finally:
        release(PERSIST_HOLDER)
    cold.save_refs({s: list(ks) for s, ks in collect_refs(table).items()})
    log.info("store_persisted", written=written, of=len(todo))
    return written


def collect_refs(table: BlockTable) -> dict[str, tuple[BlockKey, ...]]:
    """Session -> keys of its blocks that have a cold copy. The owner lock is taken per
    chunk of blocks, so a large table never holds it long."""
    with table.cond:
        metas = list(table.meta.values())
    refs: dict[str, list[BlockKey]] = {}
    for i in range(0, len(metas), SCAN_CHUNK):
        with table.cond:
            for m in metas[i:i + SCAN_CHUNK]:
                if m.in_cold:
                    for s in m.sessions:
                        refs.setdefault(s, []).append(m.key)
    return {s: tuple(ks) for s, ks in refs.items()}
