"""A sequence's KV read and written in place in the store's hot pool, through a block table.

The CUDA layout: no second copy of a sequence's KV exists. New K/V go straight into the
block's hot slot (private slots for the blocks this sequence computes, its partial last block
included); attention reads one layer of one sequence at a time through `PagedScratch`, a
transient buffer of one layer of the longest sequence, shared by the whole batch (attention
runs sequence after sequence). What a batch needs beyond the hot pool is that scratch.

On CPU this path measured slower than a contiguous working copy (`cache.py`): the per-layer
gather of 16 sequences of 1.5k tokens cost about 1.7x the attention itself. It runs on CPU all
the same, so its tests run everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvagentd.engine.cache import HotPoolExhausted
from kvagentd.kvcache.base import KVGeometry


class PagedScratch:
    """The gather buffers of one layer of one sequence; grows only when told (`reserve`)."""

    def __init__(self, geometry: KVGeometry, device: torch.device | str) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.blocks = 0
        self._rows = torch.empty(0, dtype=geometry.dtype, device=self.device)
        self._k = torch.empty(0, dtype=geometry.dtype, device=self.device)
        self._v = torch.empty(0, dtype=geometry.dtype, device=self.device)

    def bytes_for(self, tokens: int) -> int:
        g = self.geometry
        blocks = -(-tokens // g.block_tokens)
        per_block = 2 * g.num_kv_heads * g.block_tokens * g.head_dim
        return 2 * blocks * per_block * torch.empty((), dtype=g.dtype).element_size()

    def reserve(self, tokens: int) -> None:
        """Make room for a sequence of `tokens` tokens (allocates only when it grows)."""
        g = self.geometry
        blocks = -(-tokens // g.block_tokens)
        if blocks <= self.blocks:
            return
        per_block = 2 * g.num_kv_heads * g.block_tokens * g.head_dim
        self._rows = torch.empty(blocks * per_block, dtype=g.dtype, device=self.device)
        self._k = torch.empty(blocks * per_block // 2, dtype=g.dtype, device=self.device)
        self._v = torch.empty(blocks * per_block // 2, dtype=g.dtype, device=self.device)
        self.blocks = blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._rows, self._k, self._v))

    def buffers(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views for `blocks` blocks: rows `(n, 2*H*bt*D)`, K and V `(H, n, bt, D)`."""
        g = self.geometry
        if blocks > self.blocks:
            raise HotPoolExhausted(f"paged scratch holds {self.blocks} blocks, {blocks} needed")
        per = g.num_kv_heads * g.block_tokens * g.head_dim
        shape = (g.num_kv_heads, blocks, g.block_tokens, g.head_dim)
        return (self._rows[: blocks * 2 * per].view(blocks, 2 * per),
                self._k[: blocks * per].view(shape), self._v[: blocks * per].view(shape))


class PagedKV:
    """KV of one sequence in the hot pool: `table[b]` is the slot of block `b`.

    Contract: blocks `[0, first_new)` are shared, stored blocks and are never written; the
    slots from `first_new` on are private to this sequence and receive its new K/V; `written`
    lists `(block_index, slot)` of each block from `stored` on that became full, for
    `KVStore.commit` (`stored` > `first_new` when the last stored block was copied into a
    private slot to re-run its last token). All slots stay held by the store until the
    sequence's `release`.
    """

    def __init__(self, geometry: KVGeometry, arena: torch.Tensor, table: Sequence[int], *,
                 length: int, first_new: int, stored: int | None = None,
                 scratch: PagedScratch) -> None:
        self.geometry = geometry
        self.arena = arena
        self.table = list(table)
        self.table_t = torch.tensor(self.table, dtype=torch.long, device=arena.device)
        self._length = length
        self.first_new = first_new
        self.stored = first_new if stored is None else stored
        self.scratch = scratch
        self.written: list[tuple[int, int]] = []
        g = geometry
        self._rows = arena.view(arena.shape[0], g.num_layers, -1)  # (slots, L, 2*H*bt*D)

    @property
    def length(self) -> int:
        return self._length

    @property
    def row(self) -> int | None:
        return None  # read in place through the block table, never a batch row

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write `key`/`value` (`(kv_heads, t, head_dim)`) of `layer` at `length` on."""
        bt, t, i = self.geometry.block_tokens, key.shape[-2], 0
        while i < t:
            pos = self._length + i
            b, off = divmod(pos, bt)
            n = min(bt - off, t - i)
            if b >= len(self.table):
                raise HotPoolExhausted(f"position {pos} is past the {len(self.table)} "
                                       f"blocks bound to this sequence")
            if b < self.first_new:
                raise ValueError(f"block {b} is a shared stored block; it is never written")
            slot = self.table[b]
            self.arena[slot, layer, 0, :, off: off + n].copy_(key[:, i: i + n])
            self.arena[slot, layer, 1, :, off: off + n].copy_(value[:, i: i + n])
            i += n

    def view(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `tokens` positions of `layer`, `(1, kv_heads, tokens, D)`,
        gathered into the shared scratch (valid until the next `view` of any sequence)."""
        g = self.geometry
        n = -(-tokens // g.block_tokens)
        rows, k, v = self.scratch.buffers(n)
        torch.index_select(self._rows[:, layer], 0, self.table_t[:n], out=rows)
        blocks = rows.view(n, 2, g.num_kv_heads, g.block_tokens, g.head_dim)
        k.copy_(blocks[:, 0].permute(1, 0, 2, 3))
        v.copy_(blocks[:, 1].permute(1, 0, 2, 3))
        shape = (1, g.num_kv_heads, n * g.block_tokens, g.head_dim)
        return k.view(shape)[:, :, :tokens], v.view(shape)[:, :, :tokens]

    def end_step(self, tokens: int) -> None:
        self._length += tokens
        full = self._length // self.geometry.block_tokens
        b = self.stored + len(self.written)
        while b < full:
            self.written.append((b, self.table[b]))
            b += 1

    def truncate(self, tokens: int) -> None:
        if tokens < self.first_new * self.geometry.block_tokens:
            raise ValueError("cannot truncate into shared blocks")
        self._length = min(self._length, tokens)

    def nbytes(self) -> int:
        return 0  # lives in the hot pool; the scratch is counted once per batch

    def close(self) -> None:
        return None
