"""The scheduler's plans, without a model: ranks, admission, preemption, token budget, aging."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from kvagentd.engine.job import Priority
from kvagentd.engine.scheduler import Need, Resources, Scheduler, SchedulerConfig

_order = itertools.count(1)


@dataclass(eq=False)
class Seq:
    session_id: str
    priority: Priority
    submitted_at: float = 0.0
    running: bool = False
    pending: int = 0
    blocks_held: int = 0
    bytes_held: int = 0
    order: int = 0

    def __post_init__(self) -> None:
        self.order = next(_order)


def _res(free_blocks: int = 100, cap: int = 100, free_bytes: int = 1000) -> Resources:
    return Resources(cap, free_blocks, 1000, free_bytes)


def _needs(seqs: list[Seq], blocks: int = 10, nbytes: int = 0) -> dict[int, Need]:
    return {id(s): Need(blocks, nbytes) for s in seqs}


def test_admission_follows_priority_then_submission() -> None:
    sch = Scheduler(SchedulerConfig(max_batch=3, aging_s=0))
    w = [Seq("r", Priority.REPORT), Seq("a1", Priority.ASK), Seq("t", Priority.TICK),
         Seq("a2", Priority.ASK)]
    plan = sch.admission(w, [], _needs(w), _res(), now=0.0)
    assert [s.session_id for s in plan.admit] == ["t", "a1", "a2"]
    assert plan.preempt == [] and plan.never_fit == []


def test_one_job_per_session_and_busy_sessions_wait() -> None:
    sch = Scheduler(SchedulerConfig(aging_s=0))
    run = Seq("s", Priority.REPORT, running=True, pending=1)
    w = [Seq("s", Priority.TICK), Seq("x", Priority.ASK), Seq("x", Priority.TICK)]
    plan = sch.admission(w, [run], _needs(w), _res(), now=0.0)
    assert [(s.session_id, s.priority) for s in plan.admit] == [("x", Priority.ASK)]


def test_preempts_worse_ranked_only_when_that_makes_room() -> None:
    sch = Scheduler(SchedulerConfig(aging_s=0))
    rep = Seq("rep", Priority.REPORT, running=True, pending=1, blocks_held=30)
    ask = Seq("ask", Priority.ASK, running=True, pending=1, blocks_held=30)
    tick = Seq("tick", Priority.TICK)
    plan = sch.admission([tick], [rep, ask], _needs([tick], blocks=20),
                         _res(free_blocks=5), now=0.0)
    assert plan.preempt == [rep] and plan.admit == [tick]  # the worst rank goes first, alone
    plan = sch.admission([tick], [rep, ask], _needs([tick], blocks=50),
                         _res(free_blocks=5), now=0.0)
    assert plan.preempt == [rep, ask] and plan.admit == [tick]
    plan = sch.admission([tick], [rep, ask], _needs([tick], blocks=80),
                         _res(free_blocks=5), now=0.0)
    assert plan.preempt == [] and plan.admit == []  # not enough even with both: keep them
    other = Seq("t2", Priority.TICK, running=True, pending=1, blocks_held=90)
    plan = sch.admission([tick], [other], _needs([tick], blocks=20), _res(free_blocks=5), 0.0)
    assert plan.preempt == [] and plan.admit == []  # equal rank is never preempted


def test_head_of_line_blocks_worse_ranks_and_never_fit_is_reported() -> None:
    sch = Scheduler(SchedulerConfig(aging_s=0))
    huge, tick, ask = Seq("h", Priority.TICK), Seq("t", Priority.TICK), Seq("a", Priority.ASK)
    needs = {id(huge): Need(500, 0), id(tick): Need(50, 0), id(ask): Need(1, 0)}
    plan = sch.admission([huge, tick, ask], [], needs, _res(free_blocks=20), now=0.0)
    assert plan.never_fit == [huge]
    assert plan.admit == []  # the tick waits for room; the ask does not overtake it
    needs[id(tick)] = Need(10, 0)
    plan = sch.admission([huge, tick, ask], [], needs, _res(free_blocks=20), now=0.0)
    assert plan.admit == [tick, ask]


def test_memory_budget_and_batch_places_limit_admission() -> None:
    sch = Scheduler(SchedulerConfig(max_batch=2, aging_s=0))
    w = [Seq(f"t{i}", Priority.TICK) for i in range(4)]
    plan = sch.admission(w, [], _needs(w, blocks=1, nbytes=400), _res(free_bytes=1000), 0.0)
    assert plan.admit == w[:2]
    plan = sch.admission(w, [], _needs(w, blocks=1, nbytes=600), _res(free_bytes=1000), 0.0)
    assert plan.admit == w[:1]


def test_aging_lifts_waiting_asks_and_reports_ahead_of_new_ticks() -> None:
    sch = Scheduler(SchedulerConfig(max_batch=1, aging_s=10.0))
    report = Seq("rep", Priority.REPORT, submitted_at=0.0)
    ask = Seq("ask", Priority.ASK, submitted_at=5.0)
    ticks = [Seq(f"t{i}", Priority.TICK, submitted_at=t) for i, t in enumerate((9, 14, 19.5))]
    w = [report, ask, *ticks]
    assert sch.admission(w, [], _needs(w), _res(), now=9.5).admit == [ticks[0]]
    assert sch.admission(w, [], _needs(w), _res(), now=15.5).admit == [ask]
    assert sch.admission(w, [], _needs(w), _res(), now=20.0).admit == [report]
    assert sch.rank(report, 20.0)[0] == 0 and sch.rank(ask, 20.0)[0] == 0


def test_no_starvation_under_a_saturated_tick_load() -> None:
    """Simulated: a tick arrives every second and each sequence runs 3 s in a batch of 2, so
    ticks alone would keep the batch full forever. The ask and the report still run."""
    sch = Scheduler(SchedulerConfig(max_batch=2, aging_s=4.0))
    waiting = [Seq("ask", Priority.ASK, submitted_at=0.0), Seq("rep", Priority.REPORT,
                                                               submitted_at=0.0)]
    running: dict[int, tuple[Seq, float]] = {}
    started: dict[str, float] = {}
    for now in range(60):
        waiting.append(Seq(f"tick{now}", Priority.TICK, submitted_at=float(now)))
        for k, (_, end) in list(running.items()):
            if end <= now:
                del running[k]
        plan = sch.admission(waiting, [s for s, _ in running.values()], _needs(waiting),
                             _res(), float(now))
        for s in plan.admit:
            waiting.remove(s)
            s.running = True
            running[id(s)] = (s, now + 3)
            started[s.session_id] = now
    assert started["ask"] <= 1 * 4.0 + 3  # within one aging period (+ one run to free a place)
    assert started["rep"] <= 2 * 4.0 + 3
    assert len(waiting) > 20  # the ticks did saturate the box
    strict = Scheduler(SchedulerConfig(max_batch=2, aging_s=0))
    w = [Seq("ask", Priority.ASK), Seq("t", Priority.TICK, submitted_at=50.0)]
    assert strict.admission(w, [], _needs(w), _res(), 1e6).admit[0].session_id == "t"


def test_budget_decodes_first_then_prefill_chunks_by_rank() -> None:
    sch = Scheduler(SchedulerConfig(step_tokens=40, prefill_chunk=16, aging_s=0))
    dec_r = Seq("dr", Priority.REPORT, running=True, pending=1)
    pre_t = Seq("pt", Priority.TICK, running=True, pending=100)
    pre_r = Seq("pr", Priority.REPORT, running=True, pending=30)
    dec_t = Seq("dt", Priority.TICK, running=True, pending=1)
    idle = Seq("idle", Priority.TICK, running=True, pending=0)
    plan = sch.budget([dec_r, pre_t, pre_r, dec_t, idle], now=0.0)
    got = {s.session_id: n for s, n in plan}
    assert got == {"dt": 1, "dr": 1, "pt": 16, "pr": 16}
    assert [s.session_id for s, _ in plan] == ["pt", "dt", "dr", "pr"]  # rank order
    tight = Scheduler(SchedulerConfig(max_batch=2, step_tokens=2, aging_s=0))
    got = {s.session_id: n for s, n in tight.budget([dec_r, pre_t, dec_t], 0.0)}
    assert got == {"dt": 1, "dr": 1}  # prefill waits; decodes go first


def test_prefill_runs_at_full_width_when_no_decode_waits() -> None:
    """With nothing to decode, prefills are not chunked: up to `prefill_tokens` in one step,
    as a one-shot prefill; as soon as a decode waits, chunks go back to `prefill_chunk`."""
    sch = Scheduler(SchedulerConfig(step_tokens=64, prefill_chunk=16, prefill_tokens=2048,
                                    aging_s=0))
    a = Seq("a", Priority.TICK, running=True, pending=2000)
    b = Seq("b", Priority.ASK, running=True, pending=180)
    got = {s.session_id: n for s, n in sch.budget([a, b], 0.0)}
    assert got == {"a": 2000, "b": 48}  # 2,048 tokens in all
    alone = {s.session_id: n for s, n in sch.budget([b], 0.0)}
    assert alone == {"b": 180}
    d = Seq("d", Priority.TICK, running=True, pending=1)
    got = {s.session_id: n for s, n in sch.budget([a, b, d], 0.0)}
    assert got == {"d": 1, "a": 16, "b": 16}


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(max_batch=8, step_tokens=4))
