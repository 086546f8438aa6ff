"""The CUDA path (run where a GPU is present): the paged layout reads and writes the hot pool
in place on the device; batched logits equal the model's own DynamicCache run on the device,
and the engine over a CUDA hot pool answers as each request alone would."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvagentd.config import ExecutorConfig
from kvagentd.engine.executor import GenerationRequest
from kvagentd.engine.model import LoadedModel, model_geometry
from kvagentd.engine.runner import ModelRunner
from kvagentd.engine.service import Engine, kv_layout
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

from .conftest import BLOCK_TOKENS
from .test_batch import Spec, _drive, _ids, _kvs

pytestmark = pytest.mark.cuda  # deselected where there is no CUDA device (tests/conftest.py)
CUDA = "cuda"


def _on_cuda(lm: LoadedModel, dtype: torch.dtype) -> LoadedModel:
    model = copy.deepcopy(lm.model).to(device=CUDA, dtype=dtype)
    return LoadedModel(model, lm.tokenizer, lm.fingerprint, dtype, torch.device(CUDA),
                       lm.source, 0.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_paged_batch_on_cuda_equals_dynamic_cache(tiny: LoadedModel, dtype: torch.dtype,
                                                  tol: float) -> None:
    lm = _on_cuda(tiny, dtype)
    assert kv_layout("auto", torch.device(CUDA)) == "paged"
    runner = ModelRunner(lm.model, device=CUDA, max_step_tokens=64)
    specs = [Spec(_ids(70, 1), 0, 32, 12), Spec(_ids(5, 2), 0, 64, 20), Spec(_ids(33, 3), 3, 16, 8)]
    kvs = _kvs(lm, "paged", specs, device=CUDA)
    _drive(runner, specs, kvs)
    for s in specs:
        cache = DynamicCache(config=lm.model.config)
        with torch.no_grad():
            x = torch.tensor([s.prompt], device=CUDA)
            for i, tok in enumerate([None, *s.tokens[:-1]]):
                if tok is not None:
                    x = torch.tensor([[tok]], device=CUDA)
                want = lm.model(input_ids=x, cache=cache, logits_to_keep=1).logits[0, -1]
                assert (s.logits[i].float() - want.float()).abs().max().item() <= tol


def test_engine_over_a_cuda_hot_pool(tiny: LoadedModel, tmp_path: Path) -> None:
    lm = _on_cuda(tiny, torch.float32)
    geo = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    ns = make_namespace(lm.fingerprint, lm.dtype, BLOCK_TOKENS)
    store = TieredKVStore(geo, ns, hot_bytes=256 * geo.block_bytes,
                          warm_bytes=256 * geo.block_bytes, device=CUDA)
    eng = Engine(lm, store, state_dir=tmp_path / "state", executor_config=ExecutorConfig())
    eng.start()
    try:
        assert eng.blocks.layout == "paged"
        alone = [eng.ask(f"a{i}", f"question {i} about the pump", max_new_tokens=12,
                         system="sys") for i in range(3)]
        jobs = [eng.submit(GenerationRequest(f"b{i}", f"question {i} about the pump", "sys", 12))
                for i in range(3)]
        assert [j.result(120).text for j in jobs] == [a.text for a in alone]
        assert eng.status()["executor"]["memory"]["working_copy_bytes"] == 0  # no second copy
        store.check_integrity()
    finally:
        eng.stop()
        store.close()
