"""The engine's attention, plugged into transformers' attention-interface registry.

`ATTENTION` ("kvagentd") is registered with `AttentionInterface` and, for its masks, with
`AttentionMaskInterface` as transformers' own sdpa mask. A model whose `attn_implementation`
is "kvagentd" behaves exactly like "sdpa" (`DynamicCache`, `generate`, padding masks) unless its
forward receives `kv_step=<StepBatch>`: then each layer hands the new K/V of the packed tokens
to the step, which appends them to each sequence's own KV and attends each sequence's queries
to its own keys only (see `batch.py`). The weight matmuls of the whole step stay batched.

This is how vLLM's transformers backend plugs in: the model code is untouched, so every
decoder-only family that routes attention through the interface works (Llama, Qwen2, Qwen3,
Mistral, Gemma, Gemma2, Phi-3 are tested).
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

ATTENTION = "kvagentd"
STEP_KWARG = "kv_step"


class StepAttention(Protocol):
    """What a layer's attention needs of the batched step (implemented by `StepBatch`)."""

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               *, scaling: float, sliding_window: int | None, softcap: float | None
               ) -> torch.Tensor:
        """Attention output `(1, tokens, heads, head_dim)` for the packed `query`
        `(1, heads, tokens, head_dim)`; `key`/`value` are the new tokens' K/V."""


def register() -> None:
    """Register the attention and its mask function (idempotent)."""
    AttentionInterface.register(ATTENTION, kvagentd_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


def kvagentd_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
                       ) -> tuple[torch.Tensor, None]:
    step: StepAttention | None = kwargs.pop(STEP_KWARG, None)
    if step is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask,
                                        dropout=dropout, scaling=scaling, **kwargs)
        return out, None
    layer = int(cast(Any, module).layer_idx)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = step.attend(layer, query, key, value, scaling=scale,
                      sliding_window=kwargs.get("sliding_window"), softcap=kwargs.get("softcap"))
    return out, None


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float,
               sliding_window: int | None = None, softcap: float | None = None,
               mask_buf: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence: `q` `(1, Hq, t, D)` are its last `t` positions,
    `k`/`v` `(1, Hkv, n, D)` its whole KV (`n >= t`). Returns `(1, Hq, t, D)`.

    Key `j` is visible to query position `p` iff `j <= p` and, with a sliding window `W`,
    `j > p - W` (transformers' sliding-window mask)."""
    t, n_keys = q.shape[2], k.shape[2]
    hq, hkv = q.shape[1], k.shape[1]
    if t == 1 and sliding_window is not None and n_keys > sliding_window:
        k, v = k[:, :, n_keys - sliding_window:], v[:, :, n_keys - sliding_window:]
        n_keys = sliding_window
    if softcap is not None:
        return _eager(q, k, v, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
    if t == 1:  # decode: fold each KV head's query group into rows, no mask, no repeat_kv
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, hq // hkv, q.shape[3]), k, v,
                                             scale=scaling)
        return out.view(1, hq, 1, q.shape[3])
    windowed = sliding_window is not None and n_keys > sliding_window
    if n_keys == t and not windowed:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                              enable_gqa=hq != hkv)
    if (t >= SPLIT_MIN_QUERIES and not windowed and q.device.type == "cpu"
            and _FLASH_CPU is not None):
        return _past_then_causal(q, k, v, scaling)
    mask = causal_mask(t, n_keys, sliding_window, mask_buf, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                          enable_gqa=hq != hkv)


# NOTE: a long chunk after a stored prefix (a new session's first turn behind its shared
# system prompt) with an explicit (t, n) mask costs the flash kernel the whole rectangle; the
# past keys (no mask) and the chunk's own keys (is_causal) as two calls merged by their
# log-sum-exp cost the triangle. Measured on CPU (fp32, 9/3 heads of 64): 2,000 queries after
# 32 past keys 35 ms against 52; 256 after 1,500 6.0 against 6.4; 90 after 1,000 1.9 against
# 1.6: so from 512 queries on. The CPU flash kernel is the one that returns the log-sum-exp.
SPLIT_MIN_QUERIES = 512
try:
    _FLASH_CPU: Any = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
except (AttributeError, RuntimeError):  # a torch without it: the masked call serves
    _FLASH_CPU = None


def _past_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                      ) -> torch.Tensor:
    """Causal attention of `t` queries over `n > t` keys (the last `t` are their own) as two
    flash calls, merged by log-sum-exp in float32."""
    assert _FLASH_CPU is not None
    t, n = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    past = n - t
    o1, l1 = _FLASH_CPU(q, k[:, :, :past], v[:, :, :past], scale=scaling)
    o2, l2 = _FLASH_CPU(q, k[:, :, past:], v[:, :, past:], is_causal=True, scale=scaling)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_().unsqueeze(-1), (l2 - m).exp_().unsqueeze(-1)
    out: torch.Tensor = (o1.float() * w1).add_(o2.float() * w2).div_(w1 + w2)
    return out.to(q.dtype)


def causal_mask(t: int, n_keys: int, sliding_window: int | None,
                buf: torch.Tensor | None = None, *, device: torch.device | str = "cpu"
                ) -> torch.Tensor:
    """Boolean `(t, n_keys)` mask, True where query `i` (position `n_keys - t + i`) may see key
    `j`. Written into `buf` (flat, bool) when it is large enough."""
    past = n_keys - t
    if buf is not None and buf.numel() >= t * n_keys:
        mask = buf[: t * n_keys].view(t, n_keys)
    else:
        mask = torch.empty((t, n_keys), dtype=torch.bool, device=device)
    mask.fill_(True)
    mask.tril_(past)
    if sliding_window is not None:
        mask.triu_(past - sliding_window + 1)
    return mask


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float,
           sliding_window: int | None, softcap: float) -> torch.Tensor:
    """Attention with logit soft-capping (Gemma 2), as transformers' eager path computes it."""
    t, n_keys = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    mask = causal_mask(t, n_keys, sliding_window, device=q.device)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
