"""The batched step against each sequence alone and against the model's own DynamicCache run:
mixed lengths, prefill chunks beside decodes, a sequence joining mid-batch, one leaving early.
Both KV layouts (contiguous working copy, paged in place) run the same scenarios."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache

from kvagentd.engine.cache import HotPoolCache, new_cache
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.model import LoadedModel, model_geometry
from kvagentd.engine.paged import PagedKV, PagedScratch
from kvagentd.engine.runner import ModelRunner

from .conftest import BLOCK_TOKENS

TOL = 1e-4


@dataclass
class Spec:
    prompt: list[int]
    join: int  # step at which it joins
    chunk: int  # prefill chunk
    new: int  # tokens to generate (it leaves after them)
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist()


def _specs() -> list[Spec]:
    return [Spec(_ids(70, 1), join=0, chunk=32, new=12),   # chunked prefill beside decodes
            Spec(_ids(5, 2), join=0, chunk=64, new=20),    # short: decodes from step 1
            Spec(_ids(33, 3), join=3, chunk=16, new=8),    # joins mid-batch
            Spec(_ids(17, 4), join=1, chunk=64, new=3)]    # leaves early


def _kvs(lm: LoadedModel, layout: str, specs: list[Spec], device: str = "cpu"
         ) -> list[SequenceKV]:
    geo = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    per = [-(-(len(s.prompt) + s.new) // BLOCK_TOKENS) for s in specs]
    arena = torch.zeros((sum(per), *geo.block_shape), dtype=lm.dtype, device=device)
    scratch = PagedScratch(geo, device)
    out: list[SequenceKV] = []
    at = 0
    for s, n in zip(specs, per):
        slots = list(range(at, at + n))
        at += n
        if layout == "contiguous":
            kv = new_cache(geo, arena, len(s.prompt) + s.new)
            kv.bind_new_slots(slots)
            out.append(kv)
        else:
            scratch.reserve(len(s.prompt) + s.new)
            out.append(PagedKV(geo, arena, slots, length=0, first_new=0, scratch=scratch))
    return out


def _drive(runner: ModelRunner, specs: list[Spec], kvs: list[SequenceKV]) -> None:
    """Run the specs as a continuous batch: each step every active sequence feeds its next
    prefill chunk or its last token; greedy tokens and the logits that chose them are kept."""
    step = 0
    while any(len(s.tokens) < s.new for s in specs):
        work, who = [], []
        for s, kv in zip(specs, kvs):
            if s.join > step or len(s.tokens) >= s.new:
                continue
            ids = s.prompt + s.tokens
            n = min(s.chunk, len(ids) - kv.length)
            work.append((kv, ids[kv.length: kv.length + n], kv.length + n == len(ids)))
            who.append(s)
        step += 1
        if not work:
            continue
        logits = runner.forward(work)
        rows = iter(logits)
        for s, (_, _, last) in zip(who, work):
            if last:
                row = next(rows)
                s.logits.append(row.clone())
                s.tokens.append(int(row.argmax()))


def _reference(lm: LoadedModel, s: Spec) -> list[torch.Tensor]:
    """Logits of the model's own DynamicCache run over the same tokens."""
    cache = DynamicCache(config=lm.model.config)
    out = []
    with torch.no_grad():
        x = torch.tensor([s.prompt])
        for tok in [None, *s.tokens[:-1]]:
            if tok is not None:
                x = torch.tensor([[tok]])
            out.append(lm.model(input_ids=x, cache=cache, logits_to_keep=1).logits[0, -1])
    return out


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_batched_equals_alone_and_dynamic_cache(tiny: LoadedModel, layout: str) -> None:
    runner = ModelRunner(tiny.model, device="cpu", max_step_tokens=64)
    batched = _specs()
    _drive(runner, batched, _kvs(tiny, layout, batched))
    for i, s in enumerate(batched):
        alone = [_specs()[i]]
        alone[0].join = 0
        _drive(runner, alone, _kvs(tiny, layout, alone))
        assert s.tokens == alone[0].tokens
        assert len(s.tokens) == s.new
        ref = _reference(tiny, s)
        for got, one, want in zip(s.logits, alone[0].logits, ref):
            assert (got - one).abs().max().item() <= TOL
            assert (got - want).abs().max().item() <= TOL


def test_full_blocks_land_in_their_slots(tiny: LoadedModel) -> None:
    """Both layouts leave the same, DynamicCache-equal K/V in the blocks they complete."""
    specs = {layout: _specs()[:2] for layout in ("contiguous", "paged")}
    runner = ModelRunner(tiny.model, device="cpu", max_step_tokens=64)
    written = {}
    for layout, sp in specs.items():
        kvs = _kvs(tiny, layout, sp)
        _drive(runner, sp, kvs)
        kv = kvs[0]
        written[layout] = kv
        assert [b for b, _ in kv.written] == list(range((70 + 12 - 1) // BLOCK_TOKENS))
    s = specs["paged"][0]
    with torch.no_grad():
        ref = tiny.model(input_ids=torch.tensor([s.prompt + s.tokens]),
                         cache=DynamicCache(config=tiny.model.config)).cache
    for kv in written.values():
        arena = kv.arena
        assert arena is not None
        for b, slot in kv.written:
            sl = slice(b * BLOCK_TOKENS, (b + 1) * BLOCK_TOKENS)
            for layer, dl in enumerate(ref.layers):
                assert (arena[slot, layer, 0] - dl.keys[0, :, sl]).abs().max() <= TOL
                assert (arena[slot, layer, 1] - dl.values[0, :, sl]).abs().max() <= TOL


def test_a_model_that_bypasses_the_attention_interface_is_refused(tiny: LoadedModel) -> None:
    runner = ModelRunner(tiny.model, device="cpu", max_step_tokens=16)
    runner.num_layers += 1  # as if one layer had not used the engine's attention
    sp = _specs()[:1]
    with pytest.raises(RuntimeError, match="attention interface"):
        runner.forward([(_kvs(tiny, "contiguous", sp)[0], sp[0].prompt[:4], True)])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_steady_decode_reuses_every_buffer(tiny: LoadedModel, layout: str) -> None:
    """Once the step buffers have grown to the batch, decode steps allocate none of the
    engine's buffers: ids, positions, logit rows, attention output and each sequence's KV
    storage keep their memory."""
    runner = ModelRunner(tiny.model, device="cpu", max_step_tokens=64)
    specs = _specs()[:3]
    kvs = _kvs(tiny, layout, specs)
    for s, kv in zip(specs, kvs):  # prefill, then one decode step of all three
        runner.forward([(kv, s.prompt, True)])
    runner.forward([(kv, [1], True) for kv in kvs])
    b = runner.batch

    def buffers() -> list[int]:
        ptrs = [b._ids_host.data_ptr(), b._pos_host.data_ptr(), b._rows_host.data_ptr()]
        assert b._out is not None
        ptrs.append(b._out.data_ptr())
        for kv in kvs:
            if isinstance(kv, PagedKV):
                ptrs += [kv.arena.data_ptr(), *(t.data_ptr() for t in kv.scratch.buffers(1))]
            else:
                assert isinstance(kv, HotPoolCache)
                ptrs.append(kv.work.data_ptr())
        return ptrs

    before, nbytes = buffers(), runner.nbytes()
    for step in range(8):
        runner.forward([(kv, [2 + step], True) for kv in kvs])
        assert buffers() == before
    assert runner.nbytes() == nbytes
