"""`RemoteColdTier`: the shared remote store below this box's cold tier, as one `ColdTier`.

Why a wrapper of the cold tier (and not a tier of its own in the block store): a record in the
remote store *is* a cold record (same format, same checks), and reading one is a cold read that
can fail the same way. So the block table's COLD state keeps its meaning, "readable through
the cold tier", and the store's state machine, mover and migrator are unchanged: a remote
record that is missing or fails its checks makes the block LOST, and its tokens are recomputed.
The two things a wrapper cannot see reach it through two members of `ColdTier`:
`lookup` (blocks another box wrote, which the store's table does not list: the store asks on
a local miss) and `offer` (blocks just computed, which may never reach the cold tier: they are
written behind at once, so a box that dies loses nothing another box needs).

- reads: the local cold tier first; what it does not hold is read from the remote (pipelined
  GETEX, which also refreshes the key's TTL; each reply read from the socket straight into a
  record buffer by `wire` where the client allows) and verified as it arrives. The records
  read are then written to the local cold tier behind the request (`LocalFill`), so a later
  read is local and the block survives a restart of this box; until then (and if this box
  stops first) the remote still holds them.
- writes: `put_many` stores locally and queues the records for the remote; `offer` queues only.
  Blocks recently sent are not sent again (see `RemoteStore.publish_blocks`).
- nothing is deleted from the remote by this box: other boxes may rely on a record; keys
  expire by their TTL or the server's `maxmemory-policy` (allkeys-lru), and a bad record is
  overwritten by the recomputed block.
- faults: a down or slow remote makes `lookup` answer 0 and remote reads fail fast (the
  `read_timeout_s` of the link, and nothing at all while the link is down).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import structlog
import torch

from kvagentd.kvcache.base import BlockInfo, BlockKey, ColdEntry, ColdTier, VerifyProgress
from kvagentd.kvcache.remote import wire
from kvagentd.kvcache.remote.fill import LocalFill
from kvagentd.kvcache.remote.link import Reply
from kvagentd.kvcache.remote.store import RemoteStore

log = structlog.get_logger(__name__)

LOOKUP_MAX = 1024  # keys asked about per lookup
READ_BATCH_BYTES = 16 << 20  # record bytes per pipelined read


class RemoteColdTier:
    """`ColdTier` over `local` (the failover cold tier) and `remote`. Closing it closes both."""

    def __init__(self, local: ColdTier, remote: RemoteStore) -> None:
        if local.namespace != remote.namespace:
            raise ValueError("the cold tier and the remote store hold different namespaces")
        self.local = local
        self.remote = remote
        self.fill = LocalFill(local, remote.records, remote.count)

    # -- what only this tier does ------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        keys = list(keys[:LOOKUP_MAX])
        if not keys:
            return 0
        self.remote.count("lookups")
        self.remote.count("lookup_keys", len(keys))
        names = [self.remote.names.block(k) for k in keys]

        def exists(client: Any) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return list(pipe.execute())

        reply = self.remote.link.read(exists)
        if not reply.ok or reply.value is None:
            return 0
        n = 0
        for found in reply.value:
            if not found:
                break
            n += 1
        self.remote.count("lookup_found", n)
        return n

    def offer(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], *,
              session: str = "") -> None:
        try:
            self.remote.publish_blocks(keys, blocks)
        except Exception:  # a publishing bug must not fail the request that computed them
            log.exception("remote_offer_failed", blocks=len(keys))

    # -- ColdTier: reads ---------------------------------------------------------------------
    def read_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        local = [i for i, k in enumerate(keys) if self.local.contains(k)]
        ok = [False] * len(keys)
        if local:
            got = self.local.read_into([keys[i] for i in local], [outs[i] for i in local])
            for i, g in zip(local, got):
                ok[i] = g
        rest = [i for i in range(len(keys)) if not ok[i]]
        if rest:
            served: list[tuple[BlockKey, bytes]] = []
            got = self.read_remote([keys[i] for i in rest], [outs[i] for i in rest], served)
            for i, g in zip(rest, got):
                ok[i] = g
            if served and not self.local.read_only:
                self.fill.submit(served)
        return ok

    def read_remote(self, keys: list[BlockKey], outs: list[torch.Tensor],
                    served: list[tuple[BlockKey, bytes]] | None = None) -> list[bool]:
        """Read, verify and decode records from the remote only (batched, pipelined GETEX);
        True per record served into its `outs` tensor. `served` collects (key, record) of
        every record served."""
        ok = [False] * len(keys)
        per = max(1, READ_BATCH_BYTES // self.remote.records.length)
        for s in range(0, len(keys), per):
            part = range(s, min(len(keys), s + per))
            reply = self._fetch(keys, outs, part, ok, served)
            if not reply.ok:
                self.remote.count("remote_unavailable", len(keys) - s)
                return ok
        return ok

    def _fetch(self, keys: list[BlockKey], outs: list[torch.Tensor], part: range,
               ok: list[bool], served: list[tuple[BlockKey, bytes]] | None) -> Reply[None]:
        """One pipelined read of `keys[part]`, each record served into its `outs` as it
        arrives (`ok[i]` set), straight from the socket where the client allows it (`wire`)."""
        names = [self.remote.names.block(keys[i]) for i in part]
        ttl = self.remote.ttl
        length = self.remote.records.length
        scratch = bytearray(length) if served is None else None

        def serve(j: int, value: Any) -> None:
            i = part[j]
            ok[i] = self._serve(keys[i], value, outs[i])
            if ok[i] and served is not None:
                served.append((keys[i], value.obj))

        def buffer_for(j: int) -> bytearray:
            return scratch if scratch is not None else bytearray(length)

        def getex(client: Any) -> None:
            if wire.usable(client):
                wire.getex_into(client, names, ttl, length, buffer_for, serve)
                return
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.getex(name, ex=ttl)
            for j, value in enumerate(pipe.execute()):
                serve(j, None if value is None else memoryview(value))

        self.remote.count("remote_reads", len(names))
        return self.remote.link.read(getex)

    def _serve(self, key: BlockKey, value: memoryview | None, out: torch.Tensor) -> bool:
        if value is None:
            self.remote.count("remote_missing")
            return False
        why = self.remote.records.decode_into(key, value, out)
        if why is None:
            self.remote.count("remote_hits")
            return True
        self.remote.count("remote_corrupt")
        self.remote.forget_sent([key])
        self.remote.noted(f"corrupt remote record {key.hex()} ({why})")
        log.error("remote_checksum_failed", key=key.hex(), reason=why)
        return False

    def contains(self, key: BlockKey) -> bool:
        return self.local.contains(key)

    # -- ColdTier: writes --------------------------------------------------------------------
    def put_many(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor] | torch.Tensor,
                 *, session: str = "", num_tokens: int = 0) -> list[bool]:
        ok = self.local.put_many(keys, blocks, session=session, num_tokens=num_tokens)
        self.offer(keys, [blocks[i] for i in range(len(keys))], session=session)
        return ok

    # -- ColdTier: the rest is the local tier's ------------------------------------------------
    @property
    def namespace(self) -> bytes:
        return self.local.namespace

    @property
    def ttl_s(self) -> float:
        return self.local.ttl_s

    @property
    def read_only(self) -> bool:
        return self.local.read_only

    @property
    def durable(self) -> bool:
        return self.local.durable

    def set_read_only(self, flag: bool) -> None:
        self.local.set_read_only(flag)

    @property
    def bytes_used(self) -> int:
        return self.local.bytes_used

    def keys(self) -> list[BlockKey]:
        return self.local.keys()

    def entries(self) -> list[ColdEntry]:
        return self.local.entries()

    def snapshot(self) -> list[BlockInfo]:
        return self.local.snapshot()

    def delete(self, keys: Iterable[BlockKey]) -> int:
        return self.local.delete(keys)

    def evict(self, keys: Sequence[BlockKey]) -> int:
        return self.local.evict(keys)

    def expired(self, now: float | None = None) -> list[BlockKey]:
        return self.local.expired(now)

    def touch(self, keys: Sequence[BlockKey], now: float | None = None) -> None:
        self.local.touch(keys, now)

    def save_refs(self, refs: dict[str, Iterable[BlockKey]]) -> None:
        self.local.save_refs(refs)

    def load_refs(self) -> dict[str, list[BlockKey]]:
        return self.local.load_refs()

    def verify(self, repair: bool = False, rate_bytes_per_s: float | None = None,
               progress: VerifyProgress | None = None) -> dict[str, int]:
        """The local records' scrub (the remote's records are verified on every read)."""
        return self.local.verify(repair=repair, rate_bytes_per_s=rate_bytes_per_s,
                                 progress=progress)

    def compact(self, min_dead_ratio: float = 0.5, *, max_copy_bytes: int | None = None) -> int:
        return self.local.compact(min_dead_ratio, max_copy_bytes=max_copy_bytes)

    def stats(self) -> dict[str, Any]:
        return {**self.local.stats(),
                "remote": {**self.remote.status(), "fill_pending_bytes": self.fill.pending()}}

    def close(self) -> None:
        try:
            self.fill.close()
            self.remote.close()
        finally:
            self.local.close()
