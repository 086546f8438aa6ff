"""The model worker on the tiny model: joining at step boundaries, priority order, sessions
never overlapping, bounded queue, deadlines, cancellation, failures."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvagentd.config import ExecutorConfig
from kvagentd.engine.executor import GenerationRequest, JobNotRun, Priority, QueueFull
from kvagentd.engine.job import OnCut
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.service import Engine, SessionBusy

from .conftest import make_store


class Gate:
    """Holds the worker inside its next step (after the forward) until opened."""

    def __init__(self, eng: Engine) -> None:
        self.inside, self.open = threading.Event(), threading.Event()
        self.open.set()
        eng.executor.on_step = self._on_step

    def close(self) -> None:
        self.inside.clear()
        self.open.clear()

    def _on_step(self, size: int, tokens: int, seconds: float) -> None:
        self.inside.set()
        assert self.open.wait(60)


def _engine(tiny: LoadedModel, path: Path, **cfg: object) -> Iterator[Engine]:
    store = make_store(tiny, path, hot_blocks=1024, warm_blocks=256)
    eng = Engine(tiny, store, state_dir=path / "state", executor_config=ExecutorConfig(**cfg))
    eng.start()
    try:
        yield eng
    finally:
        eng.stop()
        store.close()


@pytest.fixture()
def engine(tiny: LoadedModel, tmp_path: Path) -> Iterator[Engine]:
    yield from _engine(tiny, tmp_path, ask_max_tokens=4096)


def test_tick_joins_a_running_report_at_the_next_step(engine: Engine) -> None:
    gate = Gate(engine)
    alone = engine.ask("weekly-alone", "Write the weekly report.", max_new_tokens=60,
                       priority=Priority.REPORT, system="sys-r")
    tick_alone = engine.ask("pump-alone", "rms 2.1 mm/s", max_new_tokens=8,
                            priority=Priority.TICK, system="sys-t")
    gate.close()
    report = engine.submit(GenerationRequest("weekly", "Write the weekly report.", "sys-r",
                                             max_new_tokens=60, priority=Priority.REPORT))
    assert gate.inside.wait(30)  # the worker is inside a report step
    tick = engine.submit(GenerationRequest("pump-1", "rms 2.1 mm/s", "sys-t",
                                           max_new_tokens=8, priority=Priority.TICK))
    gate.open.set()
    t, r = tick.result(60), report.result(60)
    assert tick.started_step is not None and tick.started_step - tick.submitted_step <= 1
    assert report.pauses == 0  # batched together: nothing was preempted
    assert t.text == tick_alone.text and r.text == alone.text
    assert engine.executor.status()["batch"]["size_max"] == 2


def test_priority_order_and_fifo_within_a_class(tiny: LoadedModel, tmp_path: Path) -> None:
    for eng in _engine(tiny, tmp_path, max_batch=1, aging_s=0.0):
        gate = Gate(eng)
        gate.close()
        jobs = {"blocker": eng.submit(GenerationRequest("blocker", "b", max_new_tokens=2,
                                                        priority=Priority.REPORT))}
        assert gate.inside.wait(30)
        for sid, prio in [("rep", Priority.REPORT), ("ask1", Priority.ASK),
                          ("tick", Priority.TICK), ("ask2", Priority.ASK)]:
            jobs[sid] = eng.submit(GenerationRequest(sid, "x", max_new_tokens=2, priority=prio))
        gate.open.set()
        for j in jobs.values():
            j.result(60)
        order = sorted(jobs, key=lambda k: jobs[k].started_step or 0)
        assert order == ["blocker", "tick", "ask1", "ask2", "rep"]


def test_same_session_never_overlaps(engine: Engine) -> None:
    a = engine.submit(GenerationRequest("s", "first", max_new_tokens=6, system="sys"))
    b = engine.submit(GenerationRequest("s", "second", max_new_tokens=6,
                                        priority=Priority.TICK))
    ra, rb = a.result(60), b.result(60)
    assert b.started_step is not None and a.started_step is not None
    assert b.started_step >= a.started_step + ra.new_tokens  # after a's last step
    assert rb.prompt_tokens > ra.prompt_tokens + ra.new_tokens  # its prompt holds a's answer
    assert engine.table.get("s").turns == 2


def test_queue_full_raises(tiny: LoadedModel, tmp_path: Path) -> None:
    for eng in _engine(tiny, tmp_path, queue_size=2):
        gate = Gate(eng)
        gate.close()
        running = eng.submit(GenerationRequest("r", "x", max_new_tokens=2))
        assert gate.inside.wait(30)
        eng.submit(GenerationRequest("a", "x", max_new_tokens=1))
        eng.submit(GenerationRequest("b", "x", max_new_tokens=1))
        with pytest.raises(QueueFull):
            eng.submit(GenerationRequest("c", "x", max_new_tokens=1))
        assert eng.executor.status()["rejected"] == 1
        assert eng.executor.status()["queued"]["ask"] == 2
        gate.open.set()
        running.result(30)


def test_a_cut_turn_can_keep_its_prompt_without_the_fragment(engine: Engine) -> None:
    """`OnCut.PROMPT`: the session keeps the turn as a user turn left unanswered (no assistant
    header, no fragment), with the prompt's blocks; the next turn follows it as another user
    turn and reuses those blocks."""
    chat = engine.executor.chat
    job = engine.submit(GenerationRequest("p", "x " * 60, max_new_tokens=2000, system="s",
                                          on_cut=OnCut.PROMPT))
    next(job.stream())
    job.cancel()
    r = job.result(60)
    assert r.finish_reason == "cancelled" and r.new_tokens > 0 and r.saved
    prompt = chat.first_turn("s", "x " * 60)
    held = engine.table.get("p")
    assert held.token_ids == chat.unanswered(prompt) == prompt[:len(held.token_ids)]
    assert len(held.token_ids) < len(prompt) and r.session_tokens == len(held.token_ids)
    bt = engine.executor.blocks.geometry.block_tokens
    assert len(held.block_keys) == len(held.token_ids) // bt > 0
    nxt = engine.submit(GenerationRequest("p", "y", max_new_tokens=2)).result(60)
    assert nxt.prompt_tokens == len(held.token_ids) + len(chat.next_turn("y"))
    assert nxt.reused_tokens == len(held.block_keys) * bt


def test_cancel_deadline_and_failure(engine: Engine) -> None:
    long = engine.submit(GenerationRequest("long", "x", max_new_tokens=2000, system="s"))
    next(long.stream())
    long.cancel()
    r = long.result(60)
    assert r.finish_reason == "cancelled" and r.new_tokens < 2000
    assert engine.table.get("long").turns == 1 and r.saved  # the partial answer is kept
    before = list(engine.table.get("long").token_ids)
    cut = engine.submit(GenerationRequest("long", "y", max_new_tokens=2000,
                                          on_cut=OnCut.NOTHING))
    next(cut.stream())
    cut.cancel()
    assert cut.result(60).finish_reason == "cancelled" and not cut.result(60).saved
    # ... unless the request says otherwise: then the session stays as it was
    assert engine.table.get("long").turns == 1 and engine.table.get("long").token_ids == before
    fresh = engine.submit(GenerationRequest("fresh", "x", max_new_tokens=2000, system="s",
                                            on_cut=OnCut.NOTHING))
    next(fresh.stream())
    fresh.cancel()
    assert fresh.result(60).finish_reason == "cancelled" and engine.table.get("fresh") is None
    assert not fresh.result(60).saved
    late = engine.submit(GenerationRequest("late", "x", max_new_tokens=2000, deadline_s=0.3,
                                           system="s"))
    r = late.result(60)
    assert r.finish_reason in ("deadline", "stop") and 0 < r.new_tokens < 2000
    bad = engine.submit(GenerationRequest("nobody", None))  # nothing to continue
    with pytest.raises(ValueError, match="no tokens"):
        bad.result(30)
    assert engine.ask("ok", "x", max_new_tokens=2, system="s").new_tokens >= 1
    gate = Gate(engine)
    gate.close()
    blocker = engine.submit(GenerationRequest("blk", "x", max_new_tokens=2))
    assert gate.inside.wait(30)
    expired = engine.submit(GenerationRequest("exp", "x", deadline_s=0.0))
    cancelled = engine.submit(GenerationRequest("cnl", "x"))
    cancelled.cancel()
    gate.open.set()
    blocker.result(30)
    for job in (expired, cancelled):
        with pytest.raises(JobNotRun):
            job.result(30)
    assert engine.table.get("exp") is None and engine.table.get("cnl") is None
    engine.store.check_integrity()


def test_ask_tokens_are_bounded(tiny: LoadedModel, tmp_path: Path) -> None:
    for eng in _engine(tiny, tmp_path, ask_max_tokens=7):
        eos = eng.chat.stop_ids
        r = eng.ask("a", "x", max_new_tokens=100, system="s")
        assert r.new_tokens == 7 or (r.new_tokens < 7 and r.finish_reason == "stop")
        rep = eng.ask("r", "x", max_new_tokens=20, priority=Priority.REPORT, system="s")
        assert rep.new_tokens == 20 or eng.table.get("r").token_ids[-1] in eos or \
            rep.finish_reason == "stop"


def test_busy_session_cannot_be_dropped(engine: Engine) -> None:
    gate = Gate(engine)
    gate.close()
    job = engine.submit(GenerationRequest("pump-1", "again", max_new_tokens=3, system="s"))
    assert gate.inside.wait(30)
    with pytest.raises(SessionBusy):
        engine.sessions.drop("pump-1")
    gate.open.set()
    job.result(30)
    assert engine.sessions.drop("pump-1") is True


def test_stop_ends_started_jobs_and_fails_queued_ones(tiny: LoadedModel, tmp_path: Path) -> None:
    for eng in _engine(tiny, tmp_path, max_batch=1, ask_max_tokens=4096):
        gate = Gate(eng)
        gate.close()
        started = eng.submit(GenerationRequest("a", "x", max_new_tokens=500, system="s"))
        assert gate.inside.wait(30)
        queued = eng.submit(GenerationRequest("b", "x", max_new_tokens=5, system="s"))
        threading.Timer(0.2, gate.open.set).start()
        eng.executor.stop(30)
        assert started.result(5).finish_reason == "cancelled"
        with pytest.raises(JobNotRun):
            queued.result(5)
        with pytest.raises(QueueFull, match="stopping"):
            eng.submit(GenerationRequest("c", "x"))


def test_submit_all_joins_one_step_and_refuses_past_the_queue(tiny: LoadedModel,
                                                              tmp_path: Path) -> None:
    sizes: list[int] = []
    for eng in _engine(tiny, tmp_path, queue_size=3):
        eng.executor.on_step = lambda size, tokens, s: sizes.append(size)
        out = eng.executor.submit_all([GenerationRequest(f"t{i}", "rms 1.2", "s", 4,
                                                         Priority.TICK) for i in range(4)])
        assert [type(o).__name__ for o in out] == ["Job", "Job", "Job", "QueueFull"]
        for job in out[:3]:
            assert not isinstance(job, QueueFull)
            job.result(60)
        assert sizes[0] == 3  # the three joined the first step together
        assert eng.executor.status()["rejected"] == 1


def test_a_turn_taken_back_leaves_the_session_as_before_it(engine: Engine, tiny: LoadedModel
                                                           ) -> None:
    """`rewind` cuts a session to the ids it held before a turn (a commentary the agent will
    not show); the next turn continues from there exactly as if the taken-back turn had never
    run, and the blocks past the cut lose the session's reference."""
    from .conftest import greedy_reference

    first = engine.ask("r", "How is pump 3?", max_new_tokens=8, system="sys")
    before = list(engine.table.get("r").token_ids)
    second = engine.ask("r", "And the bearing, in detail please?", max_new_tokens=40)
    assert second.turn_start == len(before) and second.unanswered_tokens > len(before)
    assert engine.executor.rewind("r", second.turn_start)
    s = engine.table.get("r")
    assert s.token_ids == before and len(s.block_keys) == len(before) // 16
    assert not engine.executor.rewind("r", len(before))  # nothing past it any more
    assert first.turn_start == 0
    ids = before + engine.chat.next_turn("Any change?")
    again = engine.ask("r", "Any change?", max_new_tokens=8)
    got = engine.table.get("r").token_ids[len(ids): len(ids) + again.new_tokens]
    assert got == greedy_reference(tiny, ids, 8)[: again.new_tokens]
    engine.store.check_integrity()


def test_a_sequence_whose_step_fails_or_gives_nan_fails_alone(engine: Engine, tiny: LoadedModel,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """A forward that raises is run again per sequence: only the one whose own forward raises
    fails; a row of non-finite logits fails its own job; the batch goes on, and the others
    decode exactly what they decode alone."""
    alone = {f"q{i}": engine.ask(f"a{i}", f"question {i} about the fan", max_new_tokens=8,
                                 system="sys").text for i in range(3)}
    runner = engine.runner
    real = runner.forward
    bad_kv: dict[str, object] = {}

    def forward(work):  # the session "q1" raises whenever it is in a step
        if any(kv is bad_kv.get("raise") for kv, _, _ in work):
            raise RuntimeError("simulated kernel failure")
        out = real(work)
        nan_kv = bad_kv.get("nan")
        rows = [kv for kv, _, last in work if last]
        for i, kv in enumerate(rows):
            if kv is nan_kv:
                out[i] = float("nan")
        return out

    monkeypatch.setattr(runner, "forward", forward)
    real_admit = engine.blocks.admit

    def admit(seq):
        ok = real_admit(seq)
        if ok and seq.session_id == "q1":
            bad_kv["raise"] = seq.kv
        if ok and seq.session_id == "q2":
            bad_kv["nan"] = seq.kv
        return ok

    monkeypatch.setattr(engine.blocks, "admit", admit)
    jobs = {f"q{i}": engine.submit(GenerationRequest(f"q{i}", f"question {i} about the fan",
                                                     "sys", 8)) for i in range(3)}
    assert jobs["q0"].result(60).text == alone["q0"]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        jobs["q1"].result(60)
    with pytest.raises(FloatingPointError, match="not finite"):
        jobs["q2"].result(60)
    assert engine.executor.running
    assert engine.table.get("q1") is None and engine.table.get("q2") is None
    engine.store.check_integrity()
