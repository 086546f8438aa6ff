"""Continuous batching through the engine on the tiny model: concurrent sessions give the same
greedy tokens as alone and as a DynamicCache run, with sequences joining mid-batch, leaving on
a stop token, cancelled, recomputing a corrupt cold block; preemption and resume when the hot
pool is too small; an ask gets through a saturated tick load."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvagentd.config import ExecutorConfig
from kvagentd.engine.executor import GenerationRequest, HotPoolFull, Job, Priority
from kvagentd.engine.model import LoadedModel
from kvagentd.engine import sequence
from kvagentd.engine.job import GenerationResult
from kvagentd.engine.service import Engine
from kvagentd.kvcache.base import Tier

from .conftest import greedy_reference, make_store
from .test_executor import Gate

SYSTEM = "You watch the vibration of the pumps and answer briefly."
QUESTIONS = ["How is pump 1 running today?", "Bearing temperature of motor 2, please.",
             "status", ("Report the vibration trend of the gearbox over the last hour, with "
                        "the peak values and what they could mean for the drive end bearing.")]
N = 16


def _start(tiny: LoadedModel, path: Path, layout: str = "contiguous", hot: int = 1024,
           warm: int = 256, **cfg: object) -> tuple[Engine, object]:
    store = make_store(tiny, path, hot_blocks=hot, warm_blocks=warm)
    cfg = {"step_tokens": 24, "prefill_chunk": 16, "ask_max_tokens": 4096, **cfg}
    eng = Engine(tiny, store, state_dir=path / "state",
                 executor_config=ExecutorConfig(kv_layout=layout, **cfg))  # type: ignore[arg-type]
    eng.start()
    return eng, store


@pytest.fixture(params=["contiguous", "paged"])
def engine(request: pytest.FixtureRequest, tiny: LoadedModel, tmp_path: Path
           ) -> Iterator[Engine]:
    eng, store = _start(tiny, tmp_path, request.param)
    yield eng
    eng.stop()
    store.close()  # type: ignore[attr-defined]


def _tail(eng: Engine, session: str, res: GenerationResult) -> list[int]:
    ids = eng.table.get(session).token_ids
    return ids[res.prompt_tokens: res.prompt_tokens + res.new_tokens]


def _alone(eng: Engine, prefix: str, turns: int = 1) -> list[GenerationResult]:
    out = []
    for i, q in enumerate(QUESTIONS):
        for t in range(turns):
            r = eng.ask(f"{prefix}{i}", q if t == 0 else f"and then? ({t})", max_new_tokens=N,
                        system=SYSTEM)
        out.append(r)
    return out


def _together(eng: Engine, prefix: str, text: list[str] | None = None,
              stagger: bool = True) -> list[Job]:
    """Submit one request per question; the last two join after the first step ran."""
    gate = Gate(eng)
    gate.close()
    jobs = [eng.submit(GenerationRequest(f"{prefix}{i}", (text or QUESTIONS)[i], SYSTEM, N))
            for i in range(2)]
    assert gate.inside.wait(30)
    jobs += [eng.submit(GenerationRequest(f"{prefix}{i}", (text or QUESTIONS)[i], SYSTEM, N))
             for i in range(2, len(QUESTIONS))]
    gate.open.set()
    eng.executor.on_step = None
    return jobs


def test_concurrent_sessions_equal_alone_and_dynamic_cache(engine: Engine,
                                                           tiny: LoadedModel) -> None:
    alone = _alone(engine, "a")
    jobs = _together(engine, "b")
    res = [j.result(120) for j in jobs]
    st = engine.executor.status()
    assert st["batch"]["size_max"] >= 3 and st["steps"] > 0
    for i, (r, a) in enumerate(zip(res, alone)):
        assert _tail(engine, f"b{i}", r) == _tail(engine, f"a{i}", a)
        prompt = engine.table.get(f"b{i}").token_ids[: r.prompt_tokens]
        assert _tail(engine, f"b{i}", r) == greedy_reference(tiny, prompt, N)[: r.new_tokens]
    # second turns, all together: each resumes its stored prefix inside the batch
    second = [engine.ask(f"a{i}", "and the next hour?", max_new_tokens=N)
              for i in range(len(QUESTIONS))]
    jobs = [engine.submit(GenerationRequest(f"b{i}", "and the next hour?", None, N))
            for i in range(len(QUESTIONS))]
    for i, (j, a) in enumerate(zip(jobs, second)):
        r = j.result(120)
        assert r.reused_tokens > 0 and _tail(engine, f"b{i}", r) == _tail(engine, f"a{i}", a)
    engine.store.check_integrity()


def test_one_leaves_on_a_stop_token_the_others_go_on(engine: Engine) -> None:
    alone = [(_tail(engine, f"a{i}", r)) for i, r in enumerate(_alone(engine, "a"))]
    pick = None
    for x, toks in enumerate(alone):
        others = {t for y, o in enumerate(alone) if y != x for t in o}
        for k in range(1, len(toks) - 1):
            if toks[k] not in others and toks[k] not in toks[:k]:
                pick = (x, k, toks[k])
                break
        if pick:
            break
    assert pick is not None, "no token unique to one sequence (tiny model changed?)"
    x, k, stop = pick
    engine.chat.stop_ids = engine.chat.stop_ids | {stop}
    res = [j.result(120) for j in _together(engine, "b")]
    for i, r in enumerate(res):
        if i == x:
            assert r.finish_reason == "stop" and _tail(engine, f"b{i}", r) == alone[i][: k + 1]
        else:
            assert _tail(engine, f"b{i}", r) == alone[i]


def test_one_cancelled_the_others_unchanged(engine: Engine) -> None:
    alone = [(_tail(engine, f"a{i}", r)) for i, r in enumerate(_alone(engine, "a"))]
    jobs = _together(engine, "b")
    pieces = jobs[1].stream()
    next(pieces), next(pieces)
    jobs[1].cancel()
    res = [j.result(120) for j in jobs]
    assert res[1].finish_reason == "cancelled"
    assert _tail(engine, "b1", res[1]) == alone[1][: res[1].new_tokens]
    for i in (0, 2, 3):
        assert _tail(engine, f"b{i}", res[i]) == alone[i]


def test_corrupt_cold_block_is_recomputed_inside_the_batch(tiny: LoadedModel,
                                                           tmp_path: Path) -> None:
    eng, store = _start(tiny, tmp_path)
    try:
        _alone(eng, "b")
        keys = eng.table.get("b3").block_keys
        assert len(keys) >= 4 and store.demote(keys, Tier.COLD) == len(keys)  # type: ignore
        db = sqlite3.connect(tmp_path / "cold" / "index.sqlite3")
        seg, off, length = db.execute("SELECT segment, offset, length FROM blocks WHERE key = ?",
                                      (keys[2],)).fetchone()
        db.close()
        with open(tmp_path / "cold" / f"seg-{seg:08d}.kvs", "r+b") as f:
            f.seek(off + length - 100)
            byte = f.read(1)
            f.seek(off + length - 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        prompts = [eng.table.get(f"b{i}").token_ids + eng.chat.next_turn("next?")
                   for i in range(len(QUESTIONS))]
        jobs = [eng.submit(GenerationRequest(f"b{i}", "next?", None, N))
                for i in range(len(QUESTIONS))]
        res = [j.result(120) for j in jobs]
        assert res[3].recomputed_tokens == (len(keys) - 2) * 16 and res[3].reused_tokens == 32
        assert sum(res[3].loaded.values()) == 2  # the shared first block may be hot by then
        assert all(r.recomputed_tokens == 0 for r in res[:3])
        for i, r in enumerate(res):
            assert _tail(eng, f"b{i}", r) == greedy_reference(tiny, prompts[i], N)[: r.new_tokens]
        store.check_integrity()  # type: ignore[attr-defined]
    finally:
        eng.stop()
        store.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_preempted_report_resumes_from_the_store(tiny: LoadedModel, tmp_path: Path,
                                                 layout: str) -> None:
    """The hot pool holds the report or the ticks, not both: the ticks preempt the report,
    whose blocks go back to the store (and down the tiers); it resumes and ends as alone."""
    eng, store = _start(tiny, tmp_path, layout, hot=20, warm=6, step_tokens=64,
                        prefill_chunk=64, aging_s=3600.0)
    try:
        alone = eng.ask("rep-alone", "Write the weekly report.", max_new_tokens=200,
                        priority=Priority.REPORT, system=SYSTEM)
        gate = Gate(eng)
        gate.close()
        report = eng.submit(GenerationRequest("rep", "Write the weekly report.", SYSTEM, 200,
                                              Priority.REPORT))
        for _ in range(40):  # let the report decode a while
            assert gate.inside.wait(30)
            gate.inside.clear()
            gate.open.set()
            gate.open.clear()
        ticks = [eng.submit(GenerationRequest(f"pump-{i}", f"rms {i}.1 mm/s", SYSTEM, 24,
                                              Priority.TICK)) for i in range(4)]
        eng.executor.on_step = None
        gate.open.set()
        for t in ticks:
            assert t.result(120).new_tokens > 0
        r = report.result(120)
        assert report.pauses >= 1 and r.preemptions == report.pauses
        assert r.text == alone.text and r.new_tokens == alone.new_tokens
        assert r.loaded.get("warm", 0) + r.loaded.get("cold", 0) > 0  # resumed from lower tiers
        assert eng.executor.status()["preemptions"] >= 1
        store.check_integrity()  # type: ignore[attr-defined]
    finally:
        eng.stop()
        store.close()  # type: ignore[attr-defined]


def test_an_ask_gets_through_a_saturated_tick_load(tiny: LoadedModel, tmp_path: Path) -> None:
    eng, store = _start(tiny, tmp_path, max_batch=2, aging_s=0.5, queue_size=64)
    stop = threading.Event()
    ticks: list[Job] = []

    def flood() -> None:
        i = 0
        while not stop.is_set():
            if eng.executor.status()["queued"]["tick"] < 4:
                ticks.append(eng.submit(GenerationRequest(f"t{i % 16}", f"rms {i}", SYSTEM, 12,
                                                          Priority.TICK)))
                i += 1
            else:
                time.sleep(0.002)

    th = threading.Thread(target=flood)
    th.start()
    try:
        while len(ticks) < 8:
            time.sleep(0.01)
        ask = eng.submit(GenerationRequest("op", "What is going on?", SYSTEM, 8, Priority.ASK))
        r = ask.result(120)
        assert r.new_tokens > 0
        assert not stop.is_set() and eng.executor.status()["queued"]["tick"] >= 1  # still loaded
        waits = eng.executor.status()["queue_wait_s"]
        assert waits["ask"]["n"] == 1 and waits["tick"]["n"] >= 2
    finally:
        stop.set()
        th.join()
        for t in ticks:
            t.result(120)
        eng.stop()
        store.close()  # type: ignore[attr-defined]


def test_batch_memory_budget_bounds_the_batch(tiny: LoadedModel, tmp_path: Path) -> None:
    """Working copies are counted against executor.batch_memory_bytes: with room for one,
    sequences run one after another; one that cannot fit even alone fails clearly."""
    probe, store0 = _start(tiny, tmp_path / "probe", row_tokens=0)
    one = probe.blocks.workspaces.bytes_for(256)  # a working copy for <= 256 tokens
    probe.stop()
    store0.close()  # type: ignore[attr-defined]
    eng, store = _start(tiny, tmp_path / "run", batch_memory_bytes=one + one // 2, row_tokens=0)
    sizes: list[int] = []
    eng.executor.on_step = lambda size, tokens, s: sizes.append(size)
    try:
        jobs = [eng.submit(GenerationRequest(f"m{i}", QUESTIONS[i], SYSTEM, N))
                for i in range(3)]
        assert all(j.result(120).new_tokens > 0 for j in jobs)
        assert max(sizes) == 1  # never two working copies at once
        mem = eng.executor.status()["memory"]
        assert mem["budget_bytes"] == one + one // 2 and mem["working_copy_bytes"] == 0
        big = eng.submit(GenerationRequest("big", "x", SYSTEM, 400))  # > 256 tokens
        with pytest.raises(HotPoolFull, match="batch_memory_bytes"):
            big.result(60)
    finally:
        eng.stop()
        store.close()  # type: ignore[attr-defined]


def test_a_one_sentence_request_ends_with_its_sentence(engine: Engine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    alone = _alone(engine, "a")[0]
    full = _tail(engine, "a0", alone)
    assert len(alone.text) >= 3
    # a sentence "ends" once the text has 3 characters: the request stops at that token, shows
    # the text up to there, and keeps the ids it generated (its KV and ids agree)
    monkeypatch.setattr(sequence, "sentence_end", lambda t: 3 if len(t) >= 3 else None)
    others = [engine.submit(GenerationRequest(f"c{i}", QUESTIONS[i], SYSTEM, N))
              for i in (1, 2)]
    r = engine.submit(GenerationRequest("b0", QUESTIONS[0], SYSTEM, N, Priority.TICK,
                                        one_sentence=True)).result(120)
    cut = next(k for k in range(1, len(full) + 1)
               if len(engine.loaded.tokenizer.decode(full[:k], skip_special_tokens=True)) >= 3)
    assert r.finish_reason == "stop" and r.text == alone.text[:3]
    assert _tail(engine, "b0", r) == full[:cut] and r.new_tokens == cut
    for j in others:
        assert j.result(120).finish_reason in ("stop", "length")
    engine.store.check_integrity()


@pytest.mark.parametrize("text,end", [
    ("No fault: RMS 0.9 mm/s in zone A; no action.", 44),
    ("  Outer race defect. Plan", 20),
    ("BPFO 8.1x the floor! next", 20),
    ("Why? Because", 4),
    ("RMS 0.9", None),
    ("RMS 0.9.", None),  # a digit before a final full stop: the number may go on
    ("zone A", None),
    ("", None),
])
def test_sentence_end(text: str, end: int | None) -> None:
    assert sequence.sentence_end(text) == end
