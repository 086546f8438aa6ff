"""The contract of one sequence's KV storage in the batched step.

Two implementations: `cache.HotPoolCache` (a contiguous working copy, a row of the batch
workspace or a private buffer, whose full blocks are written back to private hot slots: the
CPU layout) and `paged.PagedKV` (reads and writes the hot pool's blocks in place through a
block table: the CUDA layout, no second copy).
"""

from __future__ import annotations

from typing import Protocol

import torch


class SequenceKV(Protocol):
    """KV of one sequence. A step appends the new tokens' K/V to every layer at `length`
    (`append`), reads them back with its past (`view`), then advances once (`end_step`).

    `written` lists `(block_index, hot_slot)` of every block this sequence completed and
    stored in a private hot slot, in order from the first block it computed: what
    `KVStore.commit` publishes.
    """

    written: list[tuple[int, int]]

    @property
    def row(self) -> int | None:
        """Its row in the batch workspace (`rows.py`), or None when its KV lives elsewhere."""

    @property
    def length(self) -> int:
        """Positions whose K/V are stored (the same for every layer between steps)."""

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store `key`/`value` `(kv_heads, t, head_dim)` of `layer` at `[length, length + t)`."""

    def view(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions `[0, tokens)` of `layer`, each `(1, kv_heads, tokens, D)`;
        valid until the next `view` of any sequence of the step."""

    def end_step(self, tokens: int) -> None:
        """Every layer received `tokens` new positions: advance `length`; store full blocks."""

    def truncate(self, tokens: int) -> None:
        """Forget positions from `tokens` on (they will be computed again)."""

    def nbytes(self) -> int:
        """Bytes this sequence holds outside the hot pool."""

    def close(self) -> None:
        """Return buffers (the hot slots are released by the store, not here)."""
