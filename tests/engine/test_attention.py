"""The engine's attention kernels against plain masked SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvagentd.engine import attention
from kvagentd.engine.attention import attend_one, causal_mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_long_chunk_after_a_past_equals_the_masked_attention(dtype: torch.dtype,
                                                               tol: float) -> None:
    """A chunk of >= SPLIT_MIN_QUERIES queries behind stored keys is computed as two flash
    calls merged by log-sum-exp; it equals the (t, n) causal mask's attention."""
    g = torch.Generator().manual_seed(0)
    t, past = attention.SPLIT_MIN_QUERIES + 37, 50
    q = torch.randn(1, 6, t, 32, generator=g).to(dtype)
    k = torch.randn(1, 2, past + t, 32, generator=g).to(dtype)
    v = torch.randn(1, 2, past + t, 32, generator=g).to(dtype)
    got = attend_one(q, k, v, scaling=0.2)
    mask = causal_mask(t, past + t, None)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                          scale=0.2, enable_gqa=True)
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= tol
