"""A sequence's KV as a contiguous working copy over the store's hot pool (the CPU layout).

Each sequence has a block table: the hot slots of its reused blocks (filled by `load_blocks`)
followed by private slots for the blocks it computes (`bind_new_slots`). The working copy is
laid out block-compatible, `(layers, 2, 1, kv_heads, capacity, head_dim)`: it is filled once
from the hot blocks at admission (one gather), new K/V are appended in place (no `torch.cat`
per step), and every block that becomes full is written back to its private hot slot at the
end of the step that completed it. Between requests the hot pool is the storage; the working
copy is scratch that `Workspaces` reuses within a byte budget, so steady state allocates nothing.

`HotPoolCache` is both a `SequenceKV` (the batched step appends per layer, then `end_step`) and
a transformers `Cache` (`cache=` of a model's forward or `generate`, for single-sequence tools
and tests). On CPU the working copy measured faster than reading blocks through a block table
at every step (see `paged.py`): attention then reads each sequence's KV once, contiguously.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
)

from kvagentd.engine.rows import BatchRows
from kvagentd.kvcache.base import KVGeometry

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROUND_TOKENS = 256  # working copies are sized in steps of this many tokens, for reuse


class HotPoolExhausted(RuntimeError):
    """More blocks became full than private hot slots were bound for this sequence."""


class Workspaces:
    """Reusable working-copy buffers, counted against `budget_bytes` (None: unbounded).

    Contract: `in_use_bytes + idle_bytes <= budget_bytes` at all times; `acquire` drops idle
    buffers before it allocates, and returns None when the buffers in use leave no room.
    """

    def __init__(self, geometry: KVGeometry, device: torch.device | str,
                 budget_bytes: int | None = None) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._lock = threading.Lock()

    def capacity_for(self, tokens: int) -> int:
        """Token capacity of the buffer `acquire(tokens)` would allocate."""
        r = max(_ROUND_TOKENS, self.geometry.block_tokens)
        return max(1, -(-tokens // r)) * r

    def bytes_for(self, tokens: int) -> int:
        g = self.geometry
        return (g.num_layers * 2 * g.num_kv_heads * self.capacity_for(tokens) * g.head_dim
                * torch.empty((), dtype=g.dtype).element_size())

    def can_acquire(self, tokens: int) -> bool:
        with self._lock:
            return self._fits(self.bytes_for(tokens))

    def acquire(self, tokens: int) -> torch.Tensor | None:
        """A buffer of at least `tokens` tokens, or None when the budget has no room."""
        need = self.bytes_for(tokens)
        cap = self.capacity_for(tokens)
        with self._lock:  # NOTE: by index, never list.remove: tensors compare elementwise
            fits = [i for i, b in enumerate(self._free) if b.shape[4] >= cap]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].shape[4]))
                self._in_use += _nbytes(buf)
                return buf
            if not self._fits(need):
                return None
            while self._free and self._in_use + self._idle() + need > self._budget():
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].shape[4]))
            self._in_use += need
        g = self.geometry
        return torch.empty((g.num_layers, 2, 1, g.num_kv_heads, cap, g.head_dim),
                           dtype=g.dtype, device=self.device)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._in_use -= _nbytes(buf)
            self._free.append(buf)

    def warm(self, tokens: int) -> int:
        """Keep an idle buffer of `tokens` tokens with its pages taken now (zeroed), so the
        first request that needs one does not page it in: 0.3 s for 2k SmolLM2 tokens in a
        busy process on the development machine, against 0.02 s to fill a touched one.
        Returns its bytes (0: none, or no room in the budget)."""
        if tokens <= 0:
            return 0
        need = self.bytes_for(tokens)
        with self._lock:
            if self._in_use + self._idle() + need > self._budget():
                return 0
        g = self.geometry
        buf = torch.zeros((g.num_layers, 2, 1, g.num_kv_heads, self.capacity_for(tokens),
                           g.head_dim), dtype=g.dtype, device=self.device)
        with self._lock:
            self._free.append(buf)
        return need

    def nbytes(self) -> int:
        """Bytes of idle buffers kept for reuse."""
        with self._lock:
            return self._idle()

    def in_use_bytes(self) -> int:
        with self._lock:
            return self._in_use

    def _budget(self) -> float:
        return float("inf") if self.budget_bytes is None else self.budget_bytes

    def _idle(self) -> int:
        return sum(_nbytes(b) for b in self._free)

    def _fits(self, need: int) -> bool:
        return self._in_use + need <= self._budget()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HotPoolLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's view of the working copy."""

    is_sliding = False
    is_croppable = True

    def __init__(self, owner: HotPoolCache, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
        self.index = index
        self.length = 0
        self.is_initialized = True
        self.device = owner.work.device
        self._bind()

    def _bind(self) -> None:
        self.k_buf = self.owner.work[self.index, 0]  # (1, H, cap, D)
        self.v_buf = self.owner.work[self.index, 1]
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n, new = self.length, key_states.shape[-2]
        if n + new > self.k_buf.shape[-2]:
            self.owner._grow(n + new)
        self.k_buf[:, :, n: n + new].copy_(key_states)
        self.v_buf[:, :, n: n + new].copy_(value_states)
        self.length = n + new
        self.keys = self.k_buf[:, :, : self.length]
        self.values = self.v_buf[:, :, : self.length]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self._bind()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # transformers' legacy form: the absolute length to keep
            self.length = min(self.length, tokens_to_remove)
        else:
            self.length = max(0, self.length + tokens_to_remove)
        self._bind()


class HotPoolCache(Cache):
    """KV of one sequence over the hot pool `arena` (`(capacity, *geometry.block_shape)`).

    Contract: slots passed to `load_blocks` / `bind_new_slots` stay valid (held by the store)
    for the lifetime of this object; `written` lists `(block_index, slot)` of every block this
    sequence wrote back, in order, for `KVStore.commit`.
    """

    def __init__(self, geometry: KVGeometry, arena: torch.Tensor | None,
                 work: torch.Tensor, *, workspaces: Workspaces | None = None,
                 rows: BatchRows | None = None, row: int | None = None) -> None:
        self.geometry = geometry
        self.arena = arena
        self.work = work
        self.workspaces = workspaces
        self.rows = rows  # with `row`: the working copy is that row of the batch workspace
        self.row = row
        self.pool_layers = [HotPoolLayer(self, i) for i in range(geometry.num_layers)]
        layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer] = [
            *self.pool_layers]
        super().__init__(layers=layers)
        self.new_slots: list[int] | None = None
        self.written: list[tuple[int, int]] = []
        self._stored_blocks = 0  # blocks [0, _stored_blocks) are already in the hot pool

    # -- sequence setup ---------------------------------------------------------------------

    def load_blocks(self, slots: Sequence[int]) -> None:
        """Fill the working copy with the hot blocks `slots` (token order) and mark them stored."""
        if self.arena is None:
            raise ValueError("load_blocks needs the hot arena")
        g, n = self.geometry, len(slots)
        if n == 0:
            return
        tokens = n * g.block_tokens
        if tokens > self.work.shape[4]:
            self._grow(tokens)
        # NOTE: one copy per block straight into place; an index_select + permute would
        # allocate a temporary the size of the whole KV and was 3-4x slower on CPU. On CPU the
        # copies run single-threaded through numpy: torch's parallel copy stalls badly when
        # the cores are shared with other processes, and one thread saturates memory anyway.
        dst = self.work[:, :, 0, :, :tokens].view(g.num_layers, 2, g.num_kv_heads, n,
                                                    g.block_tokens, g.head_dim)
        if self.work.device.type == "cpu" and self.arena.device.type == "cpu":
            as_int = _INT_OF_SIZE[self.work.element_size()]
            d_np, a_np = dst.view(as_int).numpy(), self.arena.view(as_int).numpy()
            for i, slot in enumerate(slots):
                np.copyto(d_np[:, :, :, i], a_np[slot])
        else:
            for i, slot in enumerate(slots):
                dst[:, :, :, i].copy_(self.arena[slot])
        for layer in self.pool_layers:
            layer.length = tokens
            layer._bind()
        self._stored_blocks = n

    def bind_new_slots(self, slots: Sequence[int]) -> None:
        """Private hot slots that receive, in order, each block that becomes full from now on."""
        self.new_slots = list(slots)

    def release_workspace(self) -> None:
        if self.workspaces is not None:
            self.workspaces.release(self.work)
            self.workspaces = None
        if self.rows is not None and self.row is not None:
            rows, row = self.rows, self.row
            self.rows = self.row = None
            rows.release(row)

    def rebind(self, row: int, work: torch.Tensor) -> None:
        """The batch workspace moved this sequence's KV to row `row` (`work` is its view)."""
        self.row = row
        self.work = work
        for layer in self.pool_layers:
            layer._bind()

    # -- SequenceKV (the batched step) ------------------------------------------------------

    @property
    def length(self) -> int:
        return self.pool_layers[-1].length

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write `key`/`value` (`(kv_heads, t, head_dim)`) of layer `layer` at `length`."""
        n, t = self.pool_layers[layer].length, key.shape[-2]
        if n + t > self.work.shape[4]:
            self._grow(n + t)
        self.work[layer, 0, 0, :, n: n + t].copy_(key)
        self.work[layer, 1, 0, :, n: n + t].copy_(value)

    def view(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `tokens` positions of `layer`, `(1, kv_heads, tokens, D)`."""
        return self.work[layer, 0, :, :, :tokens], self.work[layer, 1, :, :, :tokens]

    def end_step(self, tokens: int) -> None:
        """`tokens` positions were appended to every layer: advance and write full blocks back."""
        for layer in self.pool_layers:
            layer.length += tokens
            layer._bind()
        self._write_back()

    def truncate(self, tokens: int) -> None:
        """Forget every position from `tokens` on (they are recomputed)."""
        for layer in self.pool_layers:
            layer.length = min(layer.length, tokens)
            layer._bind()

    def nbytes(self) -> int:
        """Bytes held beyond the hot pool and the batch workspace (a row is counted there)."""
        return 0 if self.row is not None else _nbytes(self.work)

    def close(self) -> None:
        self.release_workspace()

    # -- Cache API --------------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool_layers[layer_idx].update(key_states, value_states)
        if layer_idx == len(self.pool_layers) - 1:
            self._write_back()
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)

    # -- internals --------------------------------------------------------------------------

    def _write_back(self) -> None:
        """Copy every block that became full into its private hot slot."""
        if self.new_slots is None or self.arena is None:
            return
        bt = self.geometry.block_tokens
        full = self.pool_layers[-1].length // bt
        while self._stored_blocks < full:
            b = self._stored_blocks
            j = len(self.written)
            if j >= len(self.new_slots):
                raise HotPoolExhausted(f"block {b} is full but only {len(self.new_slots)} "
                                       f"private hot slots were bound")
            slot = self.new_slots[j]
            self.arena[slot].copy_(self.work[:, :, 0, :, b * bt:(b + 1) * bt])
            self.written.append((b, slot))
            self._stored_blocks += 1

    def _grow(self, tokens: int) -> None:
        if self.row is not None:
            raise HotPoolExhausted(f"{tokens} tokens do not fit a batch row of "
                                   f"{self.work.shape[4]}")
        g = self.geometry
        cap = self.work.shape[4]
        while cap < tokens:
            cap *= 2
        new = torch.empty((*self.work.shape[:4], cap, g.head_dim), dtype=self.work.dtype,
                          device=self.work.device)
        n = max(layer.length for layer in self.pool_layers)
        new[:, :, :, :, :n].copy_(self.work[:, :, :, :, :n])
        if self.workspaces is not None:  # the old buffer goes back for a smaller sequence
            self.workspaces.release(self.work)
            self.workspaces._in_use += _nbytes(new)
        self.work = new
        for layer in self.pool_layers:
            layer._bind()


def new_cache(geometry: KVGeometry, arena: torch.Tensor | None, tokens: int,
              workspaces: Workspaces | None = None,
              device: torch.device | str = "cpu") -> HotPoolCache:
    """A cache for a sequence of at most about `tokens` tokens (it grows if needed).
    With `workspaces`, raises `MemoryError` when its budget has no room (check
    `can_acquire` first)."""
    if workspaces is not None:
        work = workspaces.acquire(tokens)
        if work is None:
            raise MemoryError(f"working copy of {tokens} tokens exceeds the batch memory budget")
    else:
        bt = geometry.block_tokens
        cap = max(bt, -(-tokens // bt) * bt)
        work = torch.empty((geometry.num_layers, 2, 1, geometry.num_kv_heads, cap,
                            geometry.head_dim), dtype=geometry.dtype,
                           device=arena.device if arena is not None else device)
    return HotPoolCache(geometry, arena, work, workspaces=workspaces)
