"""Decoding constraints: the compiled rules on SmolLM2's tokenizer, and the engine applying
them per row inside batched steps (the tiny model shares that tokenizer)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvagentd.config import ExecutorConfig
from kvagentd.engine.constraints import Constraints, Rules
from kvagentd.engine.executor import GenerationRequest, Priority
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine

from .conftest import greedy_reference, make_store

SYSTEM = "You watch pumps."
QUESTION = "How is pump 4 doing today?"
N = 16


@pytest.fixture()
def engine(tiny: LoadedModel, tmp_path: Path) -> Iterator[Engine]:
    store = make_store(tiny, tmp_path, hot_blocks=1024, warm_blocks=256)
    eng = Engine(tiny, store, state_dir=tmp_path / "state", executor_config=ExecutorConfig())
    eng.start()
    eng.chat.stop_ids = frozenset()  # the random model's end token would end runs early
    yield eng
    eng.stop()
    store.close()


def _enc(lm: LoadedModel, text: str) -> list[int]:
    return list(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_rules_mask_every_spelling_of_a_banned_phrase(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    rules = Rules(Constraints(banned=("fault", "outer race")), tok)
    for spelling in ("fault", " fault", "Fault", " Fault", "FAULT", " outer race"):
        ids = _enc(tiny, spelling)
        assert ids[-1] in rules.banned_next(ids[:-1]), spelling
    race = _enc(tiny, " outer race")
    assert len(race) > 1 and race[0] not in rules.banned_next([])
    assert race[-1] in rules.banned_next(race[:-1])  # the last id after the others
    assert race[-1] not in rules.banned_next(_enc(tiny, " inner"))


def test_rules_forbid_copying_but_allow_what_is_current(tiny: LoadedModel) -> None:
    old = "Recent state of pump 1 over 20 measurements: RMS 0.91 mm/s in zone A."
    now = "RMS 0.91 mm/s in zone A"
    rules = Rules(Constraints(no_copy=old, allow=now, no_copy_tokens=4), tiny.tokenizer)
    ids = _enc(tiny, old)
    seen = [i for i in range(3, len(ids)) if ids[i] in rules.banned_next(ids[i - 3:i])]
    assert seen, "no n-gram of the old text was forbidden"
    cur = _enc(tiny, " " + now)
    assert not any(cur[i] in rules.banned_next(cur[i - 3:i]) for i in range(3, len(cur)))


def test_a_reading_spelled_digit_by_digit_is_not_a_copy(tiny: LoadedModel) -> None:
    """A session's summary holds "...57Z: RMS 0.91-1.01 mm/s (last 0.96)"; the answer "No
    fault: RMS 0.96" shares the five tokens ": RMS 0.9" with it, one word among them: it may
    go on. Five tokens of words copied from the summary may not."""
    old = ("Recent state of pump-1 over 18 measurements from 2026-12-07T22:36:06Z to "
           "2026-12-07T22:36:57Z: RMS 0.91-1.01 mm/s (last 0.96); zones A 18.")
    now = "22:37:00. No fault; RMS 0.96 mm/s, zone A. Action: no action."
    rules = Rules(Constraints(no_copy=old, allow=now), tiny.tokenizer)
    answer = _enc(tiny, "No fault: RMS 0.96 mm/s in zone A; no action.")
    assert not any(answer[i] in rules.banned_next(answer[:i]) for i in range(1, len(answer)))
    copy = _enc(tiny, " state of pump-1 over")  # five tokens, three of them words
    assert copy[4] in rules.banned_next(copy[:4])


def test_the_engine_never_emits_a_banned_token_and_equals_greedy_until_it_would(
        engine: Engine, tiny: LoadedModel) -> None:
    free = engine.ask("free", QUESTION, max_new_tokens=N, system=SYSTEM)
    ids = engine.table.get("free").token_ids
    gen = ids[free.prompt_tokens: free.prompt_tokens + free.new_tokens]
    word = tiny.tokenizer.decode([gen[2]]).strip()
    assert word
    banned = Rules(Constraints(banned=(word,)), tiny.tokenizer).banned_next([])
    jobs = [engine.submit(GenerationRequest(
        f"c{i}", QUESTION, SYSTEM, N, Priority.TICK,
        constraints=Constraints(banned=(word,)) if i % 2 == 0 else None)) for i in range(4)]
    for i, j in enumerate(jobs):
        r = j.result(60)
        got = engine.table.get(f"c{i}").token_ids[r.prompt_tokens: r.prompt_tokens + N]
        if i % 2:
            assert got == gen  # an unconstrained row beside constrained ones is unchanged
            continue
        assert not banned & set(got)
        k = next(k for k, t in enumerate(gen) if t in banned)
        assert got[:k] == gen[:k] and got[k] != gen[k]


def test_an_opening_starts_the_answer_and_the_model_completes_it(
        engine: Engine, tiny: LoadedModel) -> None:
    c = Constraints(opening="No fault:")
    r = engine.submit(GenerationRequest("o", QUESTION, SYSTEM, N, Priority.TICK,
                                        constraints=c)).result(60)
    assert r.text.startswith("No fault:")
    ids = engine.table.get("o").token_ids
    opening = _enc(tiny, "No fault:")
    start = r.prompt_tokens - len(opening)
    assert ids[start: r.prompt_tokens] == opening
    expected = greedy_reference(tiny, ids[: r.prompt_tokens], N - len(opening))
    assert ids[r.prompt_tokens: r.prompt_tokens + len(expected)] == expected
    assert r.new_tokens == N  # the opening counts toward max_new_tokens
