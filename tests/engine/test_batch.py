"""The batched step against each sequence alone and against the model's own DynamicCache run:
mixed lengths, prefill chunks beside decodes, a sequence joining mid-batch, one leaving early.
Every KV layout runs the same scenarios: a private working copy per sequence, rows of the
batch workspace (decode rows attend in one call; rows still prefilling sit between them; a
row that leaves is filled by the top one), and paged in place."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from kvagentd.engine.cache import HotPoolCache, new_cache
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.model import LoadedModel, model_geometry
from kvagentd.engine.paged import PagedKV, PagedScratch
from kvagentd.engine.rows import BatchRows
from kvagentd.engine.batch import bucket_width
from kvagentd.engine.runner import ModelRunner, needs_buckets

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


LAYOUTS = ["contiguous", "rows", "paged"]


def _rows(lm: LoadedModel, n: int = 6, tokens: int = 128) -> BatchRows:
    return BatchRows(model_geometry(lm.model, BLOCK_TOKENS, lm.dtype), n, tokens, "cpu")


def _runner(lm: LoadedModel, layout: str, max_step_tokens: int = 64,
            rows: BatchRows | None = None, buckets: bool = False) -> ModelRunner:
    if layout == "rows" and rows is None:
        rows = _rows(lm)
    return ModelRunner(lm.model, device="cpu", max_step_tokens=max_step_tokens,
                       rows=rows if layout == "rows" else None, buckets=buckets)


def _kvs(lm: LoadedModel, layout: str, specs: list[Spec], device: str = "cpu",
         rows: BatchRows | None = None) -> list[SequenceKV]:
    geo = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    per = [-(-(len(s.prompt) + s.new) // BLOCK_TOKENS) for s in specs]
    arena = torch.zeros((sum(per), *geo.block_shape), dtype=lm.dtype, device=device)
    scratch = PagedScratch(geo, device)
    out: list[SequenceKV] = []
    at = 0
    for s, n in zip(specs, per):
        slots = list(range(at, at + n))
        at += n
        if layout == "rows":
            assert rows is not None

            def bind(row: int, work: torch.Tensor) -> HotPoolCache:
                return HotPoolCache(geo, arena, work, rows=rows, row=row)

            kv = rows.acquire(bind)
            assert isinstance(kv, HotPoolCache)
            kv.bind_new_slots(slots)
            out.append(kv)
        elif layout == "contiguous":
            kv = new_cache(geo, arena, len(s.prompt) + s.new)
            kv.bind_new_slots(slots)
            out.append(kv)
        else:
            scratch.reserve(len(s.prompt) + s.new)
            out.append(PagedKV(geo, arena, slots, length=0, first_new=0, scratch=scratch))
    return out


def _drive(runner: ModelRunner, specs: list[Spec], kvs: list[SequenceKV]) -> None:
    """Run the specs as a continuous batch: each step every active sequence feeds its next
    prefill chunk or its last token; greedy tokens and the logits that chose them are kept.
    A sequence that is done gives its row back (the top row moves into it)."""
    step = 0
    released: set[int] = set()
    while any(len(s.tokens) < s.new for s in specs):
        for i, (s, kv) in enumerate(zip(specs, kvs)):
            if len(s.tokens) >= s.new and i not in released and isinstance(kv, HotPoolCache):
                released.add(i)
                kv.release_workspace()
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_equals_alone_and_dynamic_cache(tiny: LoadedModel, layout: str) -> None:
    rows = _rows(tiny)
    runner = _runner(tiny, layout, rows=rows)
    batched = _specs()
    _drive(runner, batched, _kvs(tiny, layout, batched, rows=rows))
    for i, s in enumerate(batched):
        alone = [_specs()[i]]
        alone[0].join = 0
        _drive(runner, alone, _kvs(tiny, layout, alone, rows=rows))
        assert s.tokens == alone[0].tokens
        assert len(s.tokens) == s.new
        ref = _reference(tiny, s)
        for got, one, want in zip(s.logits, alone[0].logits, ref):
            assert (got - one).abs().max().item() <= TOL
            assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shape_buckets_pad_the_step_and_change_no_result(tiny: LoadedModel, layout: str) -> None:
    """Padded to a bucket width, a step's tokens and logits are those of the unpadded step."""
    rows = _rows(tiny)
    runner = _runner(tiny, layout, rows=rows, buckets=True)
    padded = _specs()
    widths: list[int] = []
    forward = runner.forward

    def spy(work):  # type: ignore[no-untyped-def]
        out = forward(work)
        widths.append(runner.batch.width - runner.batch.tokens)
        return out

    runner.forward = spy  # type: ignore[method-assign]
    _drive(runner, padded, _kvs(tiny, layout, padded, rows=rows))
    assert any(w > 0 for w in widths)  # some step was padded
    for s in padded:
        ref = _reference(tiny, s)
        assert len(s.tokens) == s.new
        for got, want in zip(s.logits, ref):
            assert (got - want).abs().max().item() <= TOL


def test_bucket_widths_are_few_and_pad_little() -> None:
    widths = {bucket_width(n) for n in range(1, 2049)}
    assert len(widths) <= 72
    for n in range(1, 2049):
        w = bucket_width(n)
        assert n <= w <= n * 1.125
        assert bucket_width(w) == w
    assert [bucket_width(n) for n in range(1, 17)] == list(range(1, 17))


def test_reduced_precision_on_the_cpu_takes_buckets(tiny: LoadedModel) -> None:
    cpu = torch.device("cpu")
    assert not needs_buckets(tiny.model, cpu)  # fp32: flat without them
    bf16 = SimpleNamespace(dtype=torch.bfloat16)
    assert needs_buckets(bf16, cpu)
    assert not needs_buckets(bf16, torch.device("cuda"))


def test_full_blocks_land_in_their_slots(tiny: LoadedModel) -> None:
    """Every layout leaves the same, DynamicCache-equal K/V in the blocks it completes."""
    specs = {layout: _specs()[:2] for layout in LAYOUTS}
    written = {}
    for layout, sp in specs.items():
        rows = _rows(tiny)
        runner = _runner(tiny, layout, rows=rows)
        kvs = _kvs(tiny, layout, sp, rows=rows)
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_steady_decode_reuses_every_buffer(tiny: LoadedModel, layout: str) -> None:
    """Once the step buffers have grown to the batch, decode steps allocate none of the
    engine's buffers: ids, positions, logit rows, attention output, the decode rows' index
    tensors and mask, and each sequence's KV storage keep their memory."""
    rows = _rows(tiny)
    runner = _runner(tiny, layout, rows=rows)
    specs = _specs()[:3]
    kvs = _kvs(tiny, layout, specs, rows=rows)
    for s, kv in zip(specs, kvs):  # prefill, then one decode step of all three
        runner.forward([(kv, s.prompt, True)])
    runner.forward([(kv, [1], True) for kv in kvs])
    b = runner.batch

    def buffers() -> list[int]:
        ptrs = [b._ids_host.data_ptr(), b._pos_host.data_ptr(), b._rows_host.data_ptr()]
        assert b._out is not None
        ptrs.append(b._out.data_ptr())
        if b.rows is not None:
            ptrs += [b.rows.tensor.data_ptr(), b._row_idx.data_ptr(), b._row_ids.data_ptr(),
                     b._row_mask.data_ptr()]
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


def test_decode_rows_attend_in_one_call_per_layer(tiny: LoadedModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Four decode rows of different lengths and a prefill chunk beside them: the rows take
    one attention call per layer together, the chunk one of its own."""
    from kvagentd.engine import attention, batch

    rows = _rows(tiny)
    runner = _runner(tiny, "rows", rows=rows)
    specs = _specs()
    kvs = _kvs(tiny, "rows", specs, rows=rows)
    for s, kv in zip(specs[:4], kvs):
        runner.forward([(kv, s.prompt, True)])
    calls: list[tuple[int, ...]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        calls.append(tuple(q.shape))
        return real(q, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(batch.F, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", counting)
    runner.forward([(kv, [7], True) for kv in kvs[:3]])
    layers = runner.num_layers
    assert len(calls) == layers and all(c[0] == 3 for c in calls)
    calls.clear()
    extra = _kvs(tiny, "rows", [Spec(_ids(9, 9), 0, 9, 1)], rows=rows)[0]
    runner.forward([(kvs[0], [8], True), (extra, _ids(9, 9), True), (kvs[1], [8], True)])
    assert len(calls) == 2 * layers

