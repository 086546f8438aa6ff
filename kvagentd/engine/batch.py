"""One model step over many sequences, packed into one row of tokens.

A step is a list of work items `(kv, token_ids, wants_logits)`: the decode token of a running
sequence, or a prefill chunk of a new or resumed one. Their ids go into one `(1, T)` row with
each token's own position, so every weight matmul runs once for the whole step.

Attention, per layer:
- **Rows.** Every one-token item whose KV is a row of the batch workspace (`rows.py`) is a
  decode row. The packed step puts them first, in row order; their new K/V are written into
  the workspace with one indexed copy each for K and V, and all of them attend in ONE call
  over rows `[0, R)` and keys `[0, Lmax)`, with a `(R, 1, 1, Lmax)` length mask built once per
  step (none when every row has the same length). Rows in that range that do not decode this
  step (a sequence still prefilling) get a dummy query whose output is not used.
- **Apart.** Prefill chunks, and sequences without a row (longer than a row, or the paged
  layout), attend on their own: causal within the chunk, over their own KV.

Everything that depends on the step's shape (index tensors, the mask, which rows take part)
is computed in `build`, once per step; a layer's attention is a fixed handful of torch calls.
Buffers are allocated at the first step and reused; they grow only when a step is larger than
any before it, so a steady state allocates none of them.

Shape buckets (`buckets=True`): the step's row of tokens is padded to one of a few widths
(`bucket_width`), so the weight matmuls see a bounded set of shapes. oneDNN's bf16 path keeps
memory per matmul shape that it never gives back (the embedded model in bf16, 400 forwards of
1-512 tokens: RSS +801 MiB and still growing; padded to these widths: +91 MiB, flat after the
first 100; fp32 stays flat either way, see BENCHMARKS.md). Padding tokens attend to nothing
and their logits are never read; they cost at most 1/8 of a step's width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvagentd.engine.attention import attend_one
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.rows import BatchRows


def bucket_width(tokens: int) -> int:
    """`tokens` rounded up to one of 8 widths per octave (16 and below: exact, since decode
    steps are that wide and must not pay for padding): at most 12.5 % padding, 72 widths up
    to 2,048 tokens."""
    if tokens <= 16:
        return tokens
    grain = 1 << (tokens.bit_length() - 4)
    return -(-tokens // grain) * grain


@dataclass(slots=True)
class _Item:
    kv: SequenceKV
    start: int  # first row of its tokens in the packed step
    count: int


class StepBatch:
    """The packed inputs of one step and its attention (see module docstring).

    Contract: `build` then one model forward with `kv_step=self` (every layer calls `attend`
    once), then `end_step`. `logits_rows` are the rows whose logits the step returns, in the
    order of the items (as given to `build`) that asked for them.
    """

    def __init__(self, max_tokens: int, device: torch.device | str,
                 rows: BatchRows | None = None, *, buckets: bool = False) -> None:
        self.device = torch.device(device)
        self.rows = rows
        self.buckets = buckets
        self.items: list[_Item] = []
        self.apart: list[_Item] = []  # items that attend on their own
        self.tokens = 0
        self.width = 0  # tokens plus padding (shape buckets)
        self.n_rows = 0  # decode rows: the step's tokens [0, n_rows)
        self.layers_attended = 0
        self._cap = 0
        self._out: torch.Tensor | None = None
        self._mask = torch.empty(0, dtype=torch.bool, device=self.device)
        self._grow(bucket_width(max(1, max_tokens)) if buckets else max(1, max_tokens))
        self._rows_setup()

    # -- inputs -----------------------------------------------------------------------------

    def build(self, work: Sequence[tuple[SequenceKV, Sequence[int], bool]]) -> None:
        total = sum(len(ids) for _, ids, _ in work)
        if total == 0:
            raise ValueError("a step needs at least one token")
        width = bucket_width(total) if self.buckets else total
        if width > self._cap:
            self._grow(width)
        in_rows = [i for i, (kv, ids, _) in enumerate(work)
                   if len(ids) == 1 and self.rows is not None and kv.row is not None]
        in_rows.sort(key=lambda i: work[i][0].row or 0)
        chosen = set(in_rows)
        order = in_rows + [i for i in range(len(work)) if i not in chosen]
        ids_np, pos_np, logit_np = self._ids_np, self._pos_np, self._rows_np
        self.items.clear()
        starts = [0] * len(work)
        at = 0
        for i in order:
            kv, token_ids, _ = work[i]
            n = len(token_ids)
            ids_np[at: at + n] = token_ids
            pos_np[at: at + n] = range(kv.length, kv.length + n)
            starts[i] = at
            self.items.append(_Item(kv, at, n))
            at += n
        if width > total:  # padding: token 0 at position 0, attends to nothing
            ids_np[total:width] = 0
            pos_np[total:width] = 0
        n_logits = 0
        for i, (_, token_ids, wants_logits) in enumerate(work):
            if wants_logits:
                logit_np[n_logits] = starts[i] + len(token_ids) - 1
                n_logits += 1
        self.n_rows = len(in_rows)
        self.apart = self.items[self.n_rows:]
        self.tokens = total
        self.width = width
        self.n_logits = n_logits
        self.layers_attended = 0
        if self.n_rows:
            self._build_rows()
        if self.device.type != "cpu":
            self._ids_dev[:width].copy_(self._ids_host[:width], non_blocking=True)
            self._pos_dev[:width].copy_(self._pos_host[:width], non_blocking=True)
            self._rows_dev[:n_logits].copy_(self._rows_host[:n_logits], non_blocking=True)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._ids_dev[: self.width].unsqueeze(0)

    @property
    def position_ids(self) -> torch.Tensor:
        return self._pos_dev[: self.width].unsqueeze(0)

    @property
    def logits_rows(self) -> torch.Tensor:
        return self._rows_dev[: self.n_logits]

    def nbytes(self) -> int:
        bufs = [self._ids_host, self._pos_host, self._rows_host, self._mask]
        if self.device.type != "cpu":
            bufs += [self._ids_dev, self._pos_dev, self._rows_dev]
        if self._out is not None:
            bufs.append(self._out)
        if self.rows is not None:
            bufs += [self._row_idx, self._row_ids, self._row_mask, self._row_q]
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
        if self.n_rows:
            self._attend_rows(layer, query, key, value, out, scaling, sliding_window, softcap)
        for it in self.apart:
            a, b = it.start, it.start + it.count
            it.kv.append(layer, key[0, :, a:b], value[0, :, a:b])
            k, v = it.kv.view(layer, it.kv.length + it.count)
            o = attend_one(query[:, :, a:b], k, v, scaling=scaling, sliding_window=sliding_window,
                           softcap=softcap, mask_buf=self._mask_for(it.count, k.shape[2]))
            out[a:b].copy_(o[0].transpose(0, 1))
        if self.width > self.tokens:
            out[self.tokens: self.width].zero_()
        self.layers_attended += 1
        return out[: self.width].unsqueeze(0)

    def end_step(self) -> None:
        for it in self.items:
            it.kv.end_step(it.count)

    # -- the decode rows ---------------------------------------------------------------------

    def _rows_setup(self) -> None:
        rows = self.rows
        if rows is None:
            return
        g, n = rows.geometry, rows.rows
        dev = rows.tensor.device
        self._row_idx = torch.zeros(n * g.num_kv_heads, dtype=torch.long, device=dev)
        self._row_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self._row_mask = torch.ones(n * rows.row_tokens, dtype=torch.bool, device=dev)
        q_heads = g.num_kv_heads  # grows to the model's query heads at the first attend
        self._row_q = torch.zeros((n, q_heads, g.head_dim), dtype=g.dtype, device=dev)
        self._window_masks: dict[int, torch.Tensor] = {}
        self._valid = np.zeros(n, dtype=np.int64)
        self._decoding = np.zeros(n, dtype=bool)

    def _build_rows(self) -> None:
        """Index tensors and the length mask of this step's decode rows."""
        rows = self.rows
        assert rows is not None
        g, cap = rows.geometry, rows.row_tokens
        its = self.items[: self.n_rows]
        row_of = np.fromiter((it.kv.row or 0 for it in its), dtype=np.int64, count=len(its))
        pos = np.fromiter((it.kv.length for it in its), dtype=np.int64, count=len(its))
        if int(pos.max()) >= cap:
            raise RuntimeError(f"a decode row is full ({cap} tokens)")
        span = int(row_of[-1]) + 1
        lmax = int(pos.max()) + 1
        self._span, self._lmax = span, lmax
        self._contiguous = span == self.n_rows
        heads = g.num_kv_heads
        idx = ((row_of[:, None] * heads + np.arange(heads)[None, :]) * cap + pos[:, None])
        self._row_idx[: idx.size].copy_(torch.from_numpy(idx.reshape(-1)))
        self._row_ids[: self.n_rows].copy_(torch.from_numpy(row_of))
        valid, decoding = self._valid, self._decoding
        decoding[:span] = False
        decoding[row_of] = True
        for r in range(span):
            if not decoding[r]:
                owner = rows.owner(r)
                valid[r] = min(lmax, max(1, owner.length if owner is not None else 1))
        valid[row_of] = pos + 1
        self._row_valid = valid[:span].copy()
        self._uniform = self._contiguous and bool((self._row_valid == lmax).all())
        if not self._uniform:
            m = np.arange(lmax)[None, :] < self._row_valid[:, None]
            self._row_mask[: span * lmax].copy_(torch.from_numpy(m.reshape(-1)))
        self._window_masks.clear()

    # NOTE: torch's CPU flash kernel takes a slow path for a mask that broadcasts over heads
    # and queries (`(R, 1, 1, L)`): 16 rows of 1-2k keys, 30 layers, 248 ms in fp32 and 180 ms
    # in bf16 against 101 / 97 ms with no mask; the same mask expanded to `(R, Hkv, G, L)` (a
    # stride-0 view) costs 105 / 87 ms. So `_attend_rows` hands it over expanded.
    def _rows_mask(self, window: int | None) -> torch.Tensor | None:
        """`(R, 1, 1, Lmax)`, True where a row's query may see a key; None: all of them."""
        span, lmax = self._span, self._lmax
        if window is not None and lmax > window:
            m = self._window_masks.get(window)
            if m is None:
                ar = np.arange(lmax)[None, :]
                v = self._row_valid[:, None]
                keep = (ar < v) & (ar >= v - window)
                m = torch.from_numpy(keep).to(self._row_mask.device).view(span, 1, 1, lmax)
                self._window_masks[window] = m
            return m
        if self._uniform:
            return None
        return self._row_mask[: span * lmax].view(span, 1, 1, lmax)

    def _attend_rows(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, out: torch.Tensor, scaling: float,
                     sliding_window: int | None, softcap: float | None) -> None:
        rows = self.rows
        assert rows is not None
        n, span, lmax = self.n_rows, self._span, self._lmax
        hq, d = query.shape[1], query.shape[3]
        hkv = key.shape[1]
        ws_k, ws_v = rows.tensor[layer, 0], rows.tensor[layer, 1]  # (rows, Hkv, cap, D)
        idx = self._row_idx[: n * hkv]
        ws_k.view(-1, d).index_copy_(0, idx, key[0, :, :n].transpose(0, 1).reshape(-1, d))
        ws_v.view(-1, d).index_copy_(0, idx, value[0, :, :n].transpose(0, 1).reshape(-1, d))
        if softcap is not None:  # logit soft-capping (Gemma 2): each row on its own
            for it in self.items[:n]:
                k, v = it.kv.view(layer, it.kv.length + 1)
                o = attend_one(query[:, :, it.start: it.start + 1], k, v, scaling=scaling,
                               sliding_window=sliding_window, softcap=softcap)
                out[it.start].copy_(o[0, :, 0])
            return
        q_new = query[0, :, :n].transpose(0, 1)  # (n, Hq, D)
        if self._contiguous:
            q = q_new.reshape(n, hkv, hq // hkv, d)
        else:
            if self._row_q.shape[1] != hq or self._row_q.dtype != query.dtype:
                self._row_q = torch.zeros((rows.rows, hq, d), dtype=query.dtype,
                                          device=query.device)
            self._row_q.index_copy_(0, self._row_ids[:n], q_new)
            q = self._row_q[:span].view(span, hkv, hq // hkv, d)
        mask = self._rows_mask(sliding_window)
        if mask is not None:  # NOTE: expanded to the query's shape (a view, no copy), see below
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], lmax)
        o = F.scaled_dot_product_attention(q, ws_k[:span, :, :lmax], ws_v[:span, :, :lmax],
                                           attn_mask=mask, scale=scaling)
        o = o.view(span, hq, d)
        if self._contiguous:
            out[:n].copy_(o)
        else:
            torch.index_select(o, 0, self._row_ids[:n], out=out[:n])

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
