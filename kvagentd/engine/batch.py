"""One model step over many sequences, packed into one row of tokens.

A step is a list of work items `(kv, token_ids, wants_logits)`: the decode token of a running
sequence, or a prefill chunk of a new or resumed one. Their ids go into one `(1, T)` row with
each token's own position, so every weight matmul runs once for the whole step; attention is
per sequence (`attend`): each sequence's queries see only its own KV.

Buffers (ids, positions, logit rows, the attention output, the prefill mask) are allocated at
the first step and reused; they grow only when a step is larger than any before it, so a
steady state allocates none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvagentd.engine.attention import attend_one
from kvagentd.engine.kv import SequenceKV


@dataclass(slots=True)
class _Item:
    kv: SequenceKV
    start: int  # first row of its tokens in the packed step
    count: int


class StepBatch:
    """The packed inputs of one step and the per-sequence attention (see module docstring).

    Contract: `build` then one model forward with `kv_step=self` (every layer calls `attend`
    once), then `end_step`. `logits_rows` are the rows whose logits the step returns, in the
    order of the items that asked for them.
    """

    def __init__(self, max_tokens: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.items: list[_Item] = []
        self.tokens = 0
        self.layers_attended = 0
        self._cap = 0
        self._out: torch.Tensor | None = None
        self._mask = torch.empty(0, dtype=torch.bool, device=self.device)
        self._grow(max(1, max_tokens))

    # -- inputs -----------------------------------------------------------------------------

    def build(self, work: Sequence[tuple[SequenceKV, Sequence[int], bool]]) -> None:
        total = sum(len(ids) for _, ids, _ in work)
        if total == 0:
            raise ValueError("a step needs at least one token")
        if total > self._cap:
            self._grow(total)
        ids, pos, rows = self._ids_np, self._pos_np, self._rows_np
        self.items.clear()
        n_rows = 0
        at = 0
        for kv, token_ids, wants_logits in work:
            n = len(token_ids)
            ids[at: at + n] = token_ids
            pos[at: at + n] = range(kv.length, kv.length + n)
            self.items.append(_Item(kv, at, n))
            at += n
            if wants_logits:
                rows[n_rows] = at - 1
                n_rows += 1
        self.tokens = total
        self.n_logits = n_rows
        self.layers_attended = 0
        if self.device.type != "cpu":
            self._ids_dev[:total].copy_(self._ids_host[:total], non_blocking=True)
            self._pos_dev[:total].copy_(self._pos_host[:total], non_blocking=True)
            self._rows_dev[:n_rows].copy_(self._rows_host[:n_rows], non_blocking=True)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._ids_dev[: self.tokens].unsqueeze(0)

    @property
    def position_ids(self) -> torch.Tensor:
        return self._pos_dev[: self.tokens].unsqueeze(0)

    @property
    def logits_rows(self) -> torch.Tensor:
        return self._rows_dev[: self.n_logits]

    def nbytes(self) -> int:
        bufs = [self._ids_host, self._pos_host, self._rows_host, self._mask]
        if self.device.type != "cpu":
            bufs += [self._ids_dev, self._pos_dev, self._rows_dev]
        if self._out is not None:
            bufs.append(self._out)
        return sum(b.numel() * b.element_size() for b in bufs)

    # -- attention (called by every layer) ---------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *, scaling: float, sliding_window: int | None, softcap: float | None
               ) -> torch.Tensor:
        heads, head_dim = query.shape[1], query.shape[3]
        out = self._out
        if (out is None or out.shape[0] < self._cap or out.shape[1:] != (heads, head_dim)
                or out.dtype != query.dtype):
            out = self._out = torch.empty((self._cap, heads, head_dim), dtype=query.dtype,
                                          device=query.device)
        for it in self.items:
            a, b = it.start, it.start + it.count
            it.kv.append(layer, key[0, :, a:b], value[0, :, a:b])
            k, v = it.kv.view(layer, it.kv.length + it.count)
            o = attend_one(query[:, :, a:b], k, v, scaling=scaling, sliding_window=sliding_window,
                           softcap=softcap, mask_buf=self._mask_for(it.count, k.shape[2]))
            out[a:b].copy_(o[0].transpose(0, 1))
        self.layers_attended += 1
        return out[: self.tokens].unsqueeze(0)

    def end_step(self) -> None:
        for it in self.items:
            it.kv.end_step(it.count)

    # -- internals --------------------------------------------------------------------------

    def _mask_for(self, t: int, n_keys: int) -> torch.Tensor | None:
        if t == 1:
            return None
        if self._mask.numel() < t * n_keys:
            self._mask = torch.empty(t * n_keys, dtype=torch.bool, device=self.device)
        return self._mask

    def _grow(self, tokens: int) -> None:
        cap = max(tokens, 2 * self._cap)
        pin = self.device.type == "cuda"
        self._ids_host = torch.zeros(cap, dtype=torch.long, pin_memory=pin)
        self._pos_host = torch.zeros(cap, dtype=torch.long, pin_memory=pin)
        self._rows_host = torch.zeros(cap, dtype=torch.long, pin_memory=pin)
        self._ids_np = self._ids_host.numpy()
        self._pos_np = self._pos_host.numpy()
        self._rows_np = self._rows_host.numpy()
        if self.device.type == "cpu":
            self._ids_dev, self._pos_dev, self._rows_dev = (self._ids_host, self._pos_host,
                                                            self._rows_host)
        else:
            self._ids_dev = torch.zeros(cap, dtype=torch.long, device=self.device)
            self._pos_dev = torch.zeros(cap, dtype=torch.long, device=self.device)
            self._rows_dev = torch.zeros(cap, dtype=torch.long, device=self.device)
        self._cap = cap
        self._out = None
