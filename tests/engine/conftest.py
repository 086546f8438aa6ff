"""Engine fixtures: the tiny random Llama (fast) and SmolLM2 (marked `model`), loaded once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvagentd.config import ModelConfig
from kvagentd.engine.model import LoadedModel, ModelNotFound, load_model, model_geometry
from kvagentd.engine.tiny import tiny_model_dir
from kvagentd.kvcache.keys import make_namespace

REPO = Path(__file__).resolve().parents[2]
BLOCK_TOKENS = 16

# NOTE: the test machine is shared; one intra-op thread keeps the tiny model's steps from
# stalling on oversubscribed cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Fixed across runs so the one-time GGUF conversion (~30 s) is reused."""
    path = Path(os.environ.get("KVAGENTD_TEST_CACHE", REPO / "var" / "test-cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny(model_cache_dir: Path) -> LoadedModel:
    torch.manual_seed(0)
    return load_model(ModelConfig(source="hf_dir", path=tiny_model_dir(model_cache_dir),
                                  device="cpu", dtype="float32"), model_cache_dir)


@pytest.fixture(scope="session")
def smol(model_cache_dir: Path) -> LoadedModel:
    try:
        return load_model(ModelConfig(source="embedded", device="cpu", dtype="float32"),
                          model_cache_dir)
    except ModelNotFound as exc:
        pytest.skip(str(exc))


def make_store(lm: LoadedModel, root: Path, *, hot_blocks: int = 256, warm_blocks: int = 256,
               codec: str = "raw", cold: bool = True):
    """A real tiered store for `lm` with its cold tier under `root`."""
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.kvcache.store import TieredKVStore

    geometry = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    namespace = make_namespace(lm.fingerprint, lm.dtype, BLOCK_TOKENS)
    def cold_store(listener):
        return ColdStore(root / "cold", geometry, namespace, codec=codec,
                         capacity_bytes=256 << 20, segment_bytes=8 << 20,
                         io_unit_bytes=128 << 10, o_direct=False, listener=listener)

    return TieredKVStore(geometry, namespace, hot_bytes=hot_blocks * geometry.block_bytes,
                         warm_bytes=warm_blocks * geometry.block_bytes,
                         cold=cold_store if cold else None)


def greedy_reference(lm: LoadedModel, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of a full recompute of `ids` with transformers' DynamicCache."""
    from transformers import DynamicCache

    model, out = lm.model, []
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    stop = {lm.tokenizer.eos_token_id}
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=x, cache=cache, logits_to_keep=1).logits[0, -1]
            tok = int(logits.argmax())
            out.append(tok)
            if tok in stop:
                break
            x = torch.tensor([[tok]])
    return out
