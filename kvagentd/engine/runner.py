"""The model side of a step: one forward over a `StepBatch`, logits of the rows that need them.

`ModelRunner` switches the model to the engine's attention (`attention.ATTENTION`, which is
plain sdpa for any call without a step), then every `forward` runs the packed tokens of all
sequences of the step at once. Not thread-safe: the engine's one model worker calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvagentd.engine import attention
from kvagentd.engine.batch import StepBatch
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.rows import BatchRows


def needs_buckets(model: Any, device: torch.device) -> bool:
    """Shape buckets (`batch.bucket_width`) where the matmuls keep memory per shape: reduced
    precision on the CPU (oneDNN). fp32 on the CPU stays flat without them, and pays no
    padding."""
    dtype = getattr(model, "dtype", torch.float32)
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


class ModelRunner:
    """Batched forward of `model` (a transformers causal LM in eval mode) on `device`."""

    def __init__(self, model: Any, *, device: torch.device | str, max_step_tokens: int,
                 rows: BatchRows | None = None, buckets: bool | None = None) -> None:
        attention.register()
        model.set_attn_implementation(attention.ATTENTION)
        self.model = model
        self.device = torch.device(device)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        self.num_layers = int(config.num_hidden_layers)
        if buckets is None:
            buckets = needs_buckets(model, self.device)
        self.batch = StepBatch(max_step_tokens, self.device, rows, buckets=buckets)
        # NOTE: a 4-D mask is passed through by transformers' mask builders untouched, so no
        # per-step mask is built; the engine's attention masks each sequence itself.
        self._no_mask = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=self.device)

    @torch.no_grad()
    def forward(self, work: Sequence[tuple[SequenceKV, Sequence[int], bool]]) -> torch.Tensor:
        """Run one step; returns logits `(n, vocab)` for the items with `wants_logits`, in order.
        Each item's KV has advanced by its tokens when this returns."""
        b = self.batch
        b.build(work)
        out = self.model(input_ids=b.input_ids, position_ids=b.position_ids,
                         attention_mask=self._no_mask, use_cache=False,
                         logits_to_keep=b.logits_rows, **{attention.STEP_KWARG: b})
        if b.layers_attended != self.num_layers:
            raise RuntimeError(f"{type(self.model).__name__}: {b.layers_attended} of "
                               f"{self.num_layers} layers used the engine's attention; this "
                               f"model family does not route attention through transformers' "
                               f"attention interface")
        b.end_step()
        logits: torch.Tensor = out.logits[0]
        return logits

    def nbytes(self) -> int:
        """Bytes of the step's reusable buffers."""
        return self.batch.nbytes()
