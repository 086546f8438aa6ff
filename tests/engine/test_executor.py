"""The model worker: priorities, step-level preemption, bounded queue, deadlines, cancel."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Generator

import pytest

from kvagentd.config import ExecutorConfig
from kvagentd.engine.executor import (Executor, GenerationRequest, JobNotRun, Priority,
                                      QueueFull)
from kvagentd.engine.model import LoadedModel
from kvagentd.engine.runner import GenerationResult
from kvagentd.engine.service import Engine, SessionBusy

from .conftest import make_store


def held(run: Callable, session: str, at_step: int, reached: threading.Event,
         release: threading.Event) -> Callable:
    """Wrap a run function: `session`'s job blocks inside step `at_step` until `release`."""

    def wrapped(sid: str, *args, **kwargs) -> Generator[None, None, GenerationResult]:
        gen = run(sid, *args, **kwargs)
        step = 0
        while True:
            if sid == session and step == at_step:
                reached.set()
                release.wait(30)
            try:
                next(gen)
            except StopIteration as done:
                return done.value
            step += 1
            yield

    return wrapped


class FakeModel:
    """A run function whose steps are recorded in one global order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.delay = 0.0

    def run(self, session: str, text: str, *, system: str | None, max_new_tokens: int,
            stop: Callable[[], str | None], on_text: Callable[[str], None],
            ) -> Generator[None, None, GenerationResult]:
        res = GenerationResult(session=session)
        if text == "boom":
            raise ValueError("model exploded")
        for i in range(max_new_tokens):
            self.gate.wait()
            time.sleep(self.delay)
            self.log.append((session, i))
            on_text(f"{i} ")
            res.new_tokens = i + 1
            if (why := stop()) is not None:
                res.finish_reason = why
                return res
            if i + 1 < max_new_tokens:
                yield
        res.finish_reason = "length"
        return res


def _executor(fake: FakeModel, **kw) -> Executor:
    ex = Executor(fake.run, ExecutorConfig(**kw))
    ex.start()
    return ex


def test_tick_preempts_report_within_one_step() -> None:
    fake = FakeModel()
    reached, release = threading.Event(), threading.Event()
    ex = Executor(held(fake.run, "report", 5, reached, release), ExecutorConfig())
    ex.start()
    try:
        report = ex.submit(GenerationRequest("report", "r", max_new_tokens=200,
                                             priority=Priority.REPORT))
        assert reached.wait(10)
        tick = ex.submit(GenerationRequest("tick", "t", max_new_tokens=3,
                                           priority=Priority.TICK))
        release.set()
        assert tick.result(10).new_tokens == 3
        assert report.result(10).new_tokens == 200
        assert tick.started_step is not None
        assert tick.started_step - tick.submitted_step <= 1
        order = [s for s, _ in fake.log]
        first_tick = order.index("tick")
        assert order[first_tick: first_tick + 3] == ["tick"] * 3  # ran to completion at once
        assert first_tick - tick.submitted_step <= 1
        assert report.pauses == 1 and order[-1] == "report"
    finally:
        ex.stop()


def test_priority_order_and_fifo_within_a_class() -> None:
    fake = FakeModel()
    fake.gate.clear()
    ex = _executor(fake)
    try:
        jobs = [ex.submit(GenerationRequest("blocker", "b", max_new_tokens=1,
                                            priority=Priority.REPORT))]
        time.sleep(0.05)  # the worker is now inside the blocker's first step
        for sid, prio in [("rep", Priority.REPORT), ("ask1", Priority.ASK),
                          ("tick", Priority.TICK), ("ask2", Priority.ASK)]:
            jobs.append(ex.submit(GenerationRequest(sid, "x", max_new_tokens=1, priority=prio)))
        fake.gate.set()
        for j in jobs:
            j.result(10)
        assert [s for s, _ in fake.log] == ["blocker", "tick", "ask1", "ask2", "rep"]
    finally:
        ex.stop()


def test_same_session_never_interleaves() -> None:
    fake = FakeModel()
    ex = _executor(fake)
    try:
        a = ex.submit(GenerationRequest("s", "a", max_new_tokens=5, priority=Priority.REPORT))
        b = ex.submit(GenerationRequest("s", "b", max_new_tokens=5, priority=Priority.TICK))
        a.result(10), b.result(10)
        assert fake.log == [("s", i) for i in range(5)] * 2
    finally:
        ex.stop()


def test_queue_full_raises() -> None:
    fake = FakeModel()
    fake.gate.clear()
    ex = _executor(fake, queue_size=2)
    try:
        running = ex.submit(GenerationRequest("r", "x", max_new_tokens=1))
        time.sleep(0.05)
        ex.submit(GenerationRequest("a", "x", max_new_tokens=1))
        ex.submit(GenerationRequest("b", "x", max_new_tokens=1))
        with pytest.raises(QueueFull):
            ex.submit(GenerationRequest("c", "x", max_new_tokens=1))
        assert ex.status()["rejected"] == 1
        fake.gate.set()
        running.result(10)
    finally:
        ex.stop()


def test_cancel_deadline_and_failure() -> None:
    fake = FakeModel()
    fake.delay = 0.002
    ex = _executor(fake, ask_max_tokens=100_000)
    try:
        long = ex.submit(GenerationRequest("long", "x", max_new_tokens=10_000))
        next(long.stream())
        long.cancel()
        assert long.result(10).finish_reason == "cancelled"
        late = ex.submit(GenerationRequest("late", "x", max_new_tokens=10_000, deadline_s=0.2))
        r = late.result(30)
        assert r.finish_reason == "deadline" and 0 < r.new_tokens < 10_000
        bad = ex.submit(GenerationRequest("bad", "boom"))
        with pytest.raises(ValueError, match="exploded"):
            bad.result(10)
        assert ex.submit(GenerationRequest("ok", "x", max_new_tokens=2)).result(10).new_tokens == 2
        expired = GenerationRequest("exp", "x", deadline_s=0.0)
        fake.gate.clear()
        blocker = ex.submit(GenerationRequest("blk", "x", max_new_tokens=1))
        time.sleep(0.05)
        job = ex.submit(expired)
        fake.gate.set()
        blocker.result(10)
        with pytest.raises(JobNotRun):
            job.result(10)
    finally:
        ex.stop()


def test_ask_tokens_are_bounded() -> None:
    fake = FakeModel()
    ex = _executor(fake, ask_max_tokens=7)
    try:
        assert ex.submit(GenerationRequest("a", "x", max_new_tokens=100)).result(10).new_tokens == 7
        rep = GenerationRequest("r", "x", max_new_tokens=20, priority=Priority.REPORT)
        assert ex.submit(rep).result(10).new_tokens == 20
    finally:
        ex.stop()


def test_tick_during_real_report(tiny: LoadedModel, tmp_path: Path) -> None:
    """On the tiny model: a tick submitted while a 200-token report decodes starts within one
    decode step, and both answers equal what each would produce alone."""
    store = make_store(tiny, tmp_path)
    eng = Engine(tiny, store, state_dir=tmp_path / "state",
                 executor_config=ExecutorConfig(report_deadline_s=600.0))
    reached, release = threading.Event(), threading.Event()
    eng.executor._run = held(eng.runner.run, "weekly", 20, reached, release)
    eng.start()
    try:
        report = eng.submit(GenerationRequest("weekly", "Write the weekly report.", "sys-r",
                                              max_new_tokens=200, priority=Priority.REPORT))
        assert reached.wait(60)  # the report is in its 20th decode step
        tick = eng.submit(GenerationRequest("pump-1", "rms 2.1 mm/s", "sys-t",
                                            max_new_tokens=8, priority=Priority.TICK))
        release.set()
        t = tick.result(120)
        r = report.result(300)
        assert tick.started_step - tick.submitted_step <= 1
        assert report.pauses == 1 and t.new_tokens > 0
        assert r.new_tokens > 21  # the report went on after the tick
        alone = eng.ask("weekly-2", "Write the weekly report.", max_new_tokens=200,
                        priority=Priority.REPORT, system="sys-r")
        assert alone.text == r.text
        with pytest.raises(SessionBusy):
            job = eng.submit(GenerationRequest("pump-1", "again", max_new_tokens=50))
            eng.sessions.drop("pump-1")
        job.result(60)
    finally:
        eng.stop()
        store.close()
