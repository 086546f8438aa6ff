"""The batch workspace: one padded tensor of working copies, one row per running sequence.

`BatchRows` holds `(layers, 2, rows, kv_heads, row_tokens, head_dim)`, allocated and paged in
once at start and counted in `executor.batch_memory_bytes`. A running sequence whose whole
length fits a row takes one (`acquire`) and its KV is the row's view
`(layers, 2, 1, kv_heads, row_tokens, head_dim)`: the same shape as a private working copy,
so `cache.HotPoolCache` serves both. Because every row of a layer lies in one tensor, the
decode tokens of a step attend in ONE call per layer over `[:R]` rows (see `batch.py`).

Rows in use stay packed at the bottom: when a row is released, the highest row in use moves
down into it (one copy of that sequence's KV, once per request that ends), so a step's decode
rows are `[0, R)` with no holes but the rows still prefilling.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvagentd.kvcache.base import KVGeometry


class RowOwner(Protocol):
    """What the workspace needs of the sequence KV bound to a row."""

    @property
    def length(self) -> int:
        """Positions stored in the row."""

    def rebind(self, row: int, work: torch.Tensor) -> None:
        """The sequence's KV now lives in row `row`, viewed as `work`."""


class BatchRows:
    """`rows` working copies of `row_tokens` tokens each in one tensor (see module docstring).
    Not thread-safe: the model worker acquires, releases and reads rows."""

    def __init__(self, geometry: KVGeometry, rows: int, row_tokens: int,
                 device: torch.device | str) -> None:
        g = geometry
        self.geometry = g
        self.rows = rows
        self.row_tokens = row_tokens
        # zeroed, so its pages are taken now and a masked read never meets a NaN
        self.tensor = torch.zeros((g.num_layers, 2, rows, g.num_kv_heads, row_tokens,
                                   g.head_dim), dtype=g.dtype, device=device)
        self._owners: list[RowOwner | None] = [None] * rows

    @staticmethod
    def bytes_for(geometry: KVGeometry, rows: int, row_tokens: int) -> int:
        g = geometry
        return (g.num_layers * 2 * rows * g.num_kv_heads * row_tokens * g.head_dim
                * torch.empty((), dtype=g.dtype).element_size())

    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.row_tokens

    @property
    def in_use(self) -> int:
        return sum(o is not None for o in self._owners)

    def view(self, row: int) -> torch.Tensor:
        return self.tensor[:, :, row: row + 1]

    def acquire(self, owner_factory: _Factory) -> RowOwner | None:
        """Bind the lowest free row to the owner `owner_factory(row, view)` builds; None when
        every row is taken."""
        for row, o in enumerate(self._owners):
            if o is None:
                owner = owner_factory(row, self.view(row))
                self._owners[row] = owner
                return owner
        return None

    def release(self, row: int) -> None:
        """Free `row`; the highest row in use moves into it, keeping rows packed."""
        if self._owners[row] is None:
            raise ValueError(f"row {row} is not in use")
        self._owners[row] = None
        top = max((r for r, o in enumerate(self._owners) if o is not None), default=-1)
        if top > row:
            owner = self._owners[top]
            assert owner is not None
            n = owner.length
            if n:
                self.tensor[:, :, row, :, :n].copy_(self.tensor[:, :, top, :, :n])
            self._owners[top] = None
            self._owners[row] = owner
            owner.rebind(row, self.view(row))

    def owner(self, row: int) -> RowOwner | None:
        return self._owners[row]


class _Factory(Protocol):
    def __call__(self, row: int, work: torch.Tensor) -> RowOwner: ...
