"""Every decoder-only family the engine supports, as a tiny random-weight model built from its
config here (no download): batched logits equal the model's own DynamicCache run (eager
attention), with sliding windows shorter than the sequences where the family has them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvagentd.engine.model import LoadedModel
from kvagentd.engine.runner import ModelRunner

from .test_batch import TOL, Spec, _drive, _ids, _kvs

COMMON: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 512,
                          "initializer_range": 0.2}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "sliding_window": 24, "attn_logit_softcapping": 20.0,
                "final_logit_softcapping": 15.0, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}


def _models(family: str) -> tuple[Any, Any]:
    cfg_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    torch.manual_seed(0)
    ref = getattr(transformers, model_name)(config).to(torch.float32).eval()
    ref.set_attn_implementation("eager")
    return ref, copy.deepcopy(ref)


def _reference(model: Any, s: Spec) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        x = torch.tensor([s.prompt])
        for tok in [None, *s.tokens[:-1]]:
            if tok is not None:
                x = torch.tensor([[tok]])
            out.append(model(input_ids=x, cache=cache).logits[0, -1])
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_family_batched_logits_equal_dynamic_cache(family: str, layout: str) -> None:
    ref, model = _models(family)
    lm = LoadedModel(model, None, "", torch.float32, torch.device("cpu"), family, 0.0)
    runner = ModelRunner(model, device="cpu", max_step_tokens=48)
    specs = [Spec([t % 512 for t in _ids(41, 11)], join=0, chunk=16, new=10),
             Spec([t % 512 for t in _ids(9, 12)], join=0, chunk=16, new=16),
             Spec([t % 512 for t in _ids(20, 13)], join=2, chunk=32, new=6)]
    _drive(runner, specs, _kvs(lm, layout, specs))
    for s in specs:
        want = _reference(ref, s)
        assert len(s.logits) == len(want) == s.new
        for got, w in zip(s.logits, want):
            assert (got - w).abs().max().item() <= TOL, family
