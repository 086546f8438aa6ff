"""One beat of ticks: the turns of ticks in flight go to the engine in one submission."""

from __future__ import annotations

import datetime as dt
import threading
import time

from kvagentd.agent.agent import Agent
from kvagentd.agent.beat import Beat, aligned_start
from kvagentd.config import AssetConfig
from kvagentd.engine.executor import GenerationRequest, QueueFull

from .conftest import FakeExecutor, agent_config


def _req(i: int) -> GenerationRequest:
    return GenerationRequest(f"s{i}", "x")


def _run_ticks(beat: Beat, n: int, *, silent: int = 0, delay: float = 0.0) -> list[object]:
    """n ticks enter together; `silent` of them end without a turn, after `delay`."""
    out: list[object] = [None] * n
    inside = threading.Barrier(n)

    def tick(i: int) -> None:
        with beat.ticking():
            inside.wait()
            if i < silent:
                time.sleep(delay)
                return
            out[i] = beat.submit(_req(i))

    threads = [threading.Thread(target=tick, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_ticks_in_flight_are_submitted_together() -> None:
    ex = FakeExecutor()
    beat = Beat(ex, window_s=5.0)
    jobs = _run_ticks(beat, 6)
    assert ex.beats == [6] and all(j is not None for j in jobs)
    assert beat.beats == 1 and beat.last_size == 6


def test_a_tick_without_a_turn_does_not_hold_the_beat() -> None:
    ex = FakeExecutor()
    beat = Beat(ex, window_s=5.0)
    t0 = time.monotonic()
    _run_ticks(beat, 4, silent=1, delay=0.2)
    assert ex.beats == [3] and time.monotonic() - t0 < 2.0  # not the 5 s window


def test_a_stuck_tick_holds_the_beat_only_for_its_window() -> None:
    ex = FakeExecutor()
    beat = Beat(ex, window_s=0.3)
    stuck = threading.Event()

    def slow() -> None:
        with beat.ticking():
            stuck.wait(10)

    th = threading.Thread(target=slow)
    th.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    assert beat.submit(_req(0)) is not None  # a lone turn beside the stuck tick
    assert 0.25 <= time.monotonic() - t0 < 2.0 and ex.beats == [1]
    stuck.set()
    th.join()
    t0 = time.monotonic()
    with beat.ticking():
        beat.submit(_req(1))  # nothing else in flight: at once
    assert time.monotonic() - t0 < 0.2 and ex.beats == [1, 1]


def test_a_refused_turn_raises_queue_full() -> None:
    ex = FakeExecutor()
    ex.full = True
    beat = Beat(ex)
    try:
        with beat.ticking():
            beat.submit(_req(0))
    except QueueFull:
        pass
    else:
        raise AssertionError("QueueFull expected")


def test_aligned_start_is_a_whole_number_of_intervals() -> None:
    at = aligned_start(3.0, now=1_800_000_001.2)
    assert at == dt.datetime.fromtimestamp(1_800_000_003.0, tz=dt.UTC)
    assert aligned_start(0.5, now=10.0).timestamp() == 10.0


def test_every_asset_ticks_in_one_beat_with_its_interval_as_deadline(tmp_path, scheduler):
    ex = FakeExecutor()
    names = [f"pump-{i}" for i in range(4)]
    ag = Agent(agent_config(assets=tuple(AssetConfig(name=n, seed=i + 1)
                                         for i, n in enumerate(names)), tick_interval_s=2.0),
               ex, scheduler, tmp_path)
    ag.start()
    try:
        starts = {scheduler.get_job(f"agent.tick.{n}").next_run_time for n in names}
        assert len(starts) == 1  # the same beat for every asset
        threads = [threading.Thread(target=ag._tick_job, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert ex.beats == [4]
        assert {r.session.rsplit("-", 1)[0] for r in ex.requests} == set(names)
        # the turn ends with the tick's interval (less the margin for the last step)
        assert all(0.0 < r.deadline_s <= 2.0 * 0.9 for r in ex.requests)
        assert all(r.one_sentence for r in ex.requests)  # a tick's commentary: one sentence
    finally:
        ag.stop()
