"""HotPoolCache against transformers' DynamicCache: same logits, blocks written to the pool."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvagentd.engine.cache import HotPoolExhausted, Workspaces, new_cache
from kvagentd.engine.model import LoadedModel, model_geometry

from .conftest import BLOCK_TOKENS

TOL = 1e-5


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (1, n), generator=g)


def _check_equal_logits(lm: LoadedModel, n_prompt: int, n_reuse_blocks: int) -> None:
    model = lm.model
    geo = model_geometry(model, BLOCK_TOKENS, torch.float32)
    arena = torch.zeros((n_prompt // BLOCK_TOKENS + 8, *geo.block_shape))
    ids = _ids(n_prompt)
    with torch.no_grad():
        # prefill
        ref = model(input_ids=ids, cache=DynamicCache(config=model.config))
        cache = new_cache(geo, arena, n_prompt + 8)
        cache.bind_new_slots(list(range(arena.shape[0])))
        out = model(input_ids=ids, cache=cache)
        assert (ref.logits - out.logits).abs().max().item() <= TOL
        # every full block landed in its slot, equal to DynamicCache's K/V
        assert [b for b, _ in cache.written] == list(range(n_prompt // BLOCK_TOKENS))
        for b, slot in cache.written:
            for layer, dl in enumerate(ref.cache.layers):
                sl = slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
                assert torch.equal(arena[slot, layer, 0], dl.keys[0, :, sl])
                assert torch.equal(arena[slot, layer, 1], dl.values[0, :, sl])
        # decode
        dyn, nxt = ref.cache, ids[:, -1:]
        for _ in range(4):
            r = model(input_ids=nxt, cache=dyn)
            o = model(input_ids=nxt, cache=cache)
            assert (r.logits - o.logits).abs().max().item() <= TOL
            nxt = r.logits[:, -1:].argmax(-1)
        # resume: reused blocks from the pool + the suffix, vs DynamicCache holding the same KV
        reuse = n_reuse_blocks * BLOCK_TOKENS
        kv = [(layer.keys[:, :, :reuse].clone(), layer.values[:, :, :reuse].clone())
              for layer in model(input_ids=ids, cache=DynamicCache(config=model.config)).cache.layers]
        r = model(input_ids=ids[:, reuse:], cache=DynamicCache(kv))
        resumed = new_cache(geo, arena, n_prompt)
        resumed.load_blocks([slot for _, slot in cache.written[:n_reuse_blocks]])
        assert resumed.get_seq_length() == reuse
        o = model(input_ids=ids[:, reuse:], cache=resumed)
        assert (r.logits - o.logits).abs().max().item() <= TOL


def test_logits_equal_dynamic_cache_tiny(tiny: LoadedModel) -> None:
    _check_equal_logits(tiny, 100, 5)


@pytest.mark.model
def test_logits_equal_dynamic_cache_smollm2(smol: LoadedModel) -> None:
    _check_equal_logits(smol, 80, 4)


def test_generate_with_hot_pool_cache(tiny: LoadedModel) -> None:
    model = tiny.model
    geo = model_geometry(model, BLOCK_TOKENS, torch.float32)
    ids = _ids(40, seed=3)
    ref = model.generate(ids, max_new_tokens=12, do_sample=False,
                         cache=DynamicCache(config=model.config))
    cache = new_cache(geo, None, 64)
    out = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    assert out[0].tolist() == ref[0].tolist()
    assert cache.get_seq_length() == 40 + 11


def test_crop_then_rerun_last_token(tiny: LoadedModel) -> None:
    model = tiny.model
    geo = model_geometry(model, BLOCK_TOKENS, torch.float32)
    arena = torch.zeros((8, *geo.block_shape))
    ids = _ids(32, seed=5)
    with torch.no_grad():
        first = new_cache(geo, arena, 32)
        first.bind_new_slots([0, 1])
        dyn = model(input_ids=ids, cache=DynamicCache(config=model.config)).cache
        model(input_ids=ids, cache=first)
        dyn.crop(-1)
        ref = model(input_ids=ids[:, -1:], cache=dyn).logits[0, -1]
        again = new_cache(geo, arena, 32)
        again.load_blocks([0, 1])
        again.crop(-1)
        assert again.get_seq_length() == 31
        again.bind_new_slots([])
        out = model(input_ids=ids[:, -1:], cache=again).logits[0, -1]
    assert (ref - out).abs().max().item() <= TOL
    assert again.written == []  # the re-run block was already stored


def test_too_few_private_slots_raises(tiny: LoadedModel) -> None:
    geo = model_geometry(tiny.model, BLOCK_TOKENS, torch.float32)
    arena = torch.zeros((4, *geo.block_shape))
    cache = new_cache(geo, arena, 48)
    cache.bind_new_slots([0])
    with torch.no_grad(), pytest.raises(HotPoolExhausted):
        tiny.model(input_ids=_ids(40), cache=cache)


def test_workspaces_are_reused_within_their_budget(tiny: LoadedModel) -> None:
    geo = model_geometry(tiny.model, BLOCK_TOKENS, torch.float32)
    per_256 = Workspaces(geo, "cpu").bytes_for(256)
    ws = Workspaces(geo, "cpu", budget_bytes=3 * per_256)
    a = ws.acquire(100)
    assert a is not None and a.shape[4] >= 100
    ws.release(a)
    b = ws.acquire(50)
    assert b is a and ws.in_use_bytes() == per_256  # reused, not reallocated
    c = ws.acquire(500)  # 2 x 256 tokens: the budget is now used up
    assert c is not None and c.shape[4] >= 500 and ws.in_use_bytes() == 3 * per_256
    assert not ws.can_acquire(1) and ws.acquire(1) is None
    ws.release(b)
    ws.release(c)
    assert ws.nbytes() == 3 * per_256 and ws.in_use_bytes() == 0
    d = ws.acquire(700)  # 3 x 256: the idle buffers are dropped to make room
    assert d is not None and d.shape[4] >= 700 and ws.nbytes() == 0
    assert ws.in_use_bytes() == 3 * per_256
    cache = new_cache(geo, None, 16)
    with torch.no_grad():
        tiny.model(input_ids=_ids(70), cache=cache)  # grows past its first capacity
    assert cache.get_seq_length() == 70


def test_a_warmed_workspace_is_ready_idle_and_counted(tiny: LoadedModel) -> None:
    """`warm` keeps one idle buffer with its pages taken; the first request that fits uses it,
    and it counts against the budget like any idle buffer (never past it)."""
    geo = model_geometry(tiny.model, BLOCK_TOKENS, torch.float32)
    per_256 = Workspaces(geo, "cpu").bytes_for(256)
    ws = Workspaces(geo, "cpu", budget_bytes=2 * per_256)
    assert ws.warm(300) == 2 * per_256 and ws.nbytes() == 2 * per_256
    assert ws.warm(1) == 0  # the budget is full of the warm buffer
    first = ws.acquire(290)
    assert first is not None and ws.nbytes() == 0 and ws.in_use_bytes() == 2 * per_256
    assert torch.count_nonzero(first) == 0
    ws.release(first)
    assert ws.acquire(100) is first  # still the one buffer
    assert Workspaces(geo, "cpu", budget_bytes=per_256).warm(300) == 0  # too large: none
    assert ws.warm(0) == 0
