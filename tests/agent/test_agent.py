from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from kvagentd.agent import jobs, prompts
from kvagentd.agent.agent import Agent
from kvagentd.agent.features import Window
from kvagentd.agent.sensors import SensorSource
from kvagentd.config import AssetConfig, FaultConfig
from kvagentd.engine.executor import Priority
from kvagentd.engine.job import OnCut
from kvagentd.scheduling import jobs as schedjobs

from .conftest import agent_config


def make_agent(tmp_path, executor, scheduler, clock, **kw) -> Agent:
    return Agent(agent_config(**kw), executor, scheduler, tmp_path, clock=clock)


def test_tick_writes_event_and_asks_the_model_at_tick_priority(tmp_path, fake_executor,
                                                               scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, assessment_max_tokens=17)
    row = ag.tick_once("pump-1")
    assert row["kind"] == "tick" and row["zone"] == "A" and not row["anomaly"]
    assert row["features"]["rms_mm_s"] > 0 and row["fault"] == "none"
    assert row["diagnosis"]["fault"] == "none" and "BPFO" in row["diagnosis"]["ratios"]
    assert row["session"] == "pump-1-1"
    assert row["assessment"] == "Condition normal, no action needed."
    assert row["latency_s"] is not None
    (req,) = fake_executor.requests
    assert req.priority == Priority.TICK and req.max_new_tokens == 17
    assert req.system == prompts.SYSTEM_PROMPT and req.session == "pump-1-1"
    assert req.text.startswith("Asset pump-1") and "No fault; RMS " in req.text
    assert req.text.endswith("Action: no action.")
    # steered: it opens with the diagnosis' words and may not raise an alarm
    c = req.constraints
    assert c is not None and c.opening == "No fault:" and "faulty" in c.banned
    assert c.guard is not None and c.guard("No fault: the bearing is damaged") is not None
    clock.advance(3)
    ag.tick_once("pump-1")
    assert fake_executor.requests[1].text.count("\n") == 0  # later turns: one observation line
    assert ag.events.query(asset="pump-1")[0]["t"] == clock.t


def test_rollover_starts_new_session_with_profile_and_summary(tmp_path, fake_executor,
                                                             scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, session_token_budget=400)
    sessions = []
    for _ in range(30):
        sessions.append(ag.tick_once("pump-1")["session"])
        clock.advance(3)
    assert sessions[0] == "pump-1-1" and len(set(sessions)) >= 3
    assert sessions == sorted(sessions, key=lambda s: int(s.rsplit("-", 1)[1]))
    assert max(fake_executor.sessions.values()) <= 400
    firsts = [r for r in fake_executor.requests if r.text.startswith("Asset pump-1")]
    assert len(firsts) == len(set(sessions))
    assert all(r.system == prompts.SYSTEM_PROMPT for r in fake_executor.requests)
    assert "Recent state of pump-1 over" in firsts[1].text
    assert ag.status()["assets"]["pump-1"]["rollovers"] == len(set(sessions)) - 1


def test_a_session_that_outgrows_the_hot_pool_rolls_over_instead_of_failing_every_tick(
        tmp_path, fake_executor, scheduler, clock):
    """The engine refuses a session the hot pool cannot hold (HotPoolFull): with a session
    budget larger than kv.hot_bytes holds, the same session would fail on every tick. The
    agent notes it on the tick and the next tick starts a new session."""
    from kvagentd.engine.executor import HotPoolFull

    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    for _ in range(8):
        assert ag.tick_once("pump-1")["session"] == "pump-1-1"
        clock.advance(3)
    fake_executor.fail_next = HotPoolFull("session 'pump-1-1' needs 75 hot blocks (1215 tokens) "
                                          "but the hot pool has 68")
    row = ag.tick_once("pump-1")
    assert row["session"] == "pump-1-1" and row["assessment"] is None
    assert "needs 75 hot blocks" in row["note"] and "next tick starts a new session" in row["note"]
    held = fake_executor.sessions["pump-1-1"]  # the size the pool still held
    assert f"roll over at {held} tokens" in row["note"]
    clock.advance(3)
    row = ag.tick_once("pump-1")
    assert row["session"] == "pump-1-2" and row["assessment"] is not None
    assert ag.status()["assets"]["pump-1"]["rollovers"] == 1
    sizes = []
    for _ in range(40):  # later sessions roll over before they reach the size that failed
        clock.advance(3)
        row = ag.tick_once("pump-1")
        sizes.append(fake_executor.sessions[row["session"]])
    assert max(sizes) <= held and ag.status()["assets"]["pump-1"]["rollovers"] > 1
    fake_executor.fail_next = RuntimeError("some other failure")  # not a reason to roll over
    clock.advance(3)
    current = ag.tick_once("pump-1")["session"]
    (view,) = ag.asset_views()
    assert view.llm_failing == 1 and "some other failure" in (view.llm_error or "")
    assert view.llm_errors == 2  # what the asset's commentary status reads
    clock.advance(3)
    assert ag.tick_once("pump-1")["session"] == current
    assert ag.asset_views()[0].llm_failing == 0  # answered again


def test_a_first_turn_does_not_count_as_the_growth_of_the_next(tmp_path, fake_executor,
                                                               scheduler, clock):
    """The first turn carries the system prompt, the profile and the summary; the next turn
    adds one observation. A budget that holds the first turn and a few observations must not
    roll the session over after its first turn."""
    probe = make_agent(tmp_path / "probe", fake_executor, scheduler, clock)
    probe.tick_once("pump-1")
    first = fake_executor.sessions["pump-1-1"]
    fake_executor.sessions.clear()
    default = 2 * probe.config.assessment_max_tokens + 64
    assert first > default  # else this test would not tell the two estimates apart
    ag = make_agent(tmp_path / "agent", fake_executor, scheduler, clock,
                    session_token_budget=first + default + 8)
    sessions = []
    for _ in range(3):
        sessions.append(ag.tick_once("pump-1")["session"])
        clock.advance(3)
    assert sessions[:2] == ["pump-1-1", "pump-1-1"], sessions


def test_summary_is_deterministic(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    for _ in range(5):
        ag.tick_once("pump-1")
        clock.advance(3)
    rows = ag.events.recent("pump-1", 20)
    assert prompts.summary("pump-1", rows) == prompts.summary("pump-1", [dict(r) for r in rows])
    assert "over 5 measurements" in prompts.summary("pump-1", rows)


def test_session_numbering_continues_after_restart(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    ag.tick_once("pump-1")
    ag.events.close()
    ag2 = make_agent(tmp_path, fake_executor, scheduler, clock)
    assert ag2.tick_once("pump-1")["session"] == "pump-1-2"


def test_features_only_modes(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock,
                    assets=(AssetConfig(name="fan", llm=False),))
    row = ag.tick_once("fan")
    assert row["assessment"] is None and row["session"] is None and row["zone"] == "A"
    assert fake_executor.requests == []
    ag2 = make_agent(tmp_path / "b", None, scheduler, clock)
    row2 = ag2.tick_once("pump-1")
    assert row2["assessment"] is None and row2["features"] is not None
    assert ag2.status()["assets"]["pump-1"]["llm"] is False


class ScriptedSource(SensorSource):
    def __init__(self, asset: AssetConfig, windows: list) -> None:
        self.asset, self.windows = asset, list(windows)

    def read_window(self, now: float) -> Window:
        w = self.windows.pop(0)
        if isinstance(w, Exception):
            raise w
        return w


def test_bad_samples_are_counted_and_never_crash_a_tick(tmp_path, fake_executor, scheduler,
                                                        clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    a = ag.assets["pump-1"].asset
    n = int(a.sample_rate_hz * a.window_s)
    good = np.random.default_rng(0).normal(0, 1, n)
    nan = good.copy()
    nan[10] = np.nan
    ag.assets["pump-1"].source = ScriptedSource(a, [
        Window(nan, a.sample_rate_hz, "acceleration", 0.0),
        Window(good[: n // 2], a.sample_rate_hz, "acceleration", 0.0),
        Window(good, a.sample_rate_hz / 2, "acceleration", 0.0),
        Window(np.zeros(n), a.sample_rate_hz, "acceleration", 0.0),
        Window(good, a.sample_rate_hz, "acceleration", 0.0),
    ])
    rows = [ag.tick_once("pump-1") for _ in range(5)]
    assert [r["kind"] for r in rows] == ["bad_data"] * 4 + ["tick"]
    assert [r["note"].split(":")[0] for r in rows[:4]] == ["nonfinite", "length", "rate", "silent"]
    st = ag.status()["assets"]["pump-1"]
    assert st["bad_samples"] == {"nonfinite": 1, "length": 1, "rate": 1, "silent": 1}
    assert st["bad_samples_total"] == 4 and st["ticks"] == 5
    assert len(fake_executor.requests) == 1


def test_llm_failures_are_recorded_not_raised(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.fail_next = RuntimeError("engine broke")
    r1 = ag.tick_once("pump-1")
    fake_executor.full = True
    r2 = ag.tick_once("pump-1")
    fake_executor.full = False
    r3 = ag.tick_once("pump-1")
    assert r1["assessment"] is None and "engine broke" in r1["note"]
    assert r2["note"] == "llm: queue full"
    assert r3["assessment"]
    assert ag.status()["assets"]["pump-1"]["llm_errors"] == 2


def test_scheduler_skips_are_counted_not_piled_up(tmp_path, fake_executor, scheduler):
    release = threading.Event()
    calls = []

    class SlowJob:
        def result(self, timeout=None):
            calls.append(1)
            release.wait(10)
            return fake_executor.submit(req_holder[0]).result()

        def cancel(self):
            pass

    req_holder = []

    class SlowExecutor:
        def submit(self, req):
            req_holder[:] = [req]
            return SlowJob()

        def submit_all(self, reqs):
            return [self.submit(r) for r in reqs]

    ag = Agent(agent_config(tick_interval_s=0.1), SlowExecutor(), scheduler, tmp_path)
    ag.start()
    scheduler.resume()
    deadline = time.monotonic() + 10
    while ag.status()["assets"]["pump-1"]["skipped_ticks"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    st = ag.status()["assets"]["pump-1"]
    ag.stop()
    assert st["skipped_ticks"] >= 3
    assert len(calls) <= 2  # one running tick, never a pile of them


def test_jobs_list_run_pause_resume(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    ag.start()
    ids = [j["id"] for j in schedjobs.list_jobs(scheduler)]
    assert ids == ["agent.prune", "agent.tick.pump-1", "agent.weekly.pump-1"]
    tick = schedjobs.job_info(scheduler.get_job("agent.tick.pump-1"))
    assert tick["max_instances"] == 1 and tick["coalesce"] is True
    assert schedjobs.pause_job(scheduler, "agent.tick.pump-1")["paused"] is True
    assert schedjobs.resume_job(scheduler, "agent.tick.pump-1")["paused"] is False
    assert schedjobs.run_job(scheduler, "agent.weekly.pump-1")["next_run"] is not None
    with pytest.raises(schedjobs.UnknownJob):
        schedjobs.pause_job(scheduler, "nope")
    from kvagentd.config import Config

    # SIGHUP hands services the whole configuration; the agent applies its section
    ag.reload(Config(agent=dataclasses.replace(ag.config, tick_interval_s=5.0)))
    assert "0:00:05" in schedjobs.job_info(scheduler.get_job("agent.tick.pump-1"))["trigger"]
    ag.stop()
    assert schedjobs.list_jobs(scheduler) == []


def test_weekly_trigger_text():
    assert "mon" in str(jobs.weekly_trigger("mon 06:00"))
    with pytest.raises(ValueError):
        jobs.weekly_trigger("every monday")


def test_status_reports_per_asset_figures(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, assets=(
        AssetConfig(name="p1"), AssetConfig(name="p2", fault=FaultConfig(kind="imbalance",
                                                                         onset_s=0.0,
                                                                         severity=3.0))))
    for _ in range(3):
        ag.tick_once("p1")
        ag.tick_once("p2")
        clock.advance(3)
    s = ag.status()["assets"]
    assert s["p1"]["last_zone"] == "A" and s["p2"]["last_zone"] == "D"
    assert s["p1"]["last_assessment_age_s"] == 3.0
    assert s["p1"]["tick_latency_p50_s"] <= s["p1"]["tick_latency_p99_s"]
    assert s["p1"]["skipped_ticks"] == 0 and s["p1"]["ticks"] == 3
    assert len(ag.events.query(anomalies=True)) == 3


def test_skipped_ticks_in_status_are_the_daemons_one_count(tmp_path, fake_executor, scheduler,
                                                             clock):
    """Status shows what the daemon's job watch counted (the same count as health and the
    metrics): a run coalesced after a 20 s stall counts once for every interval it covered."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from apscheduler.events import EVENT_JOB_EXECUTED, EVENT_JOB_MISSED

    from kvagentd.scheduling.jobwatch import JobWatch

    watch = JobWatch(clock=lambda: 1000.0, period_of=lambda _job: 3.0)
    ag = Agent(agent_config(), fake_executor, scheduler, tmp_path, clock=clock,
               job_record=watch.record)
    assert ag.status()["assets"]["pump-1"]["skipped_ticks"] == 0

    def event(code: int, due: float) -> SimpleNamespace:
        t = datetime.fromtimestamp(due, UTC)
        return SimpleNamespace(code=code, job_id="agent.tick.pump-1", scheduled_run_time=t,
                               scheduled_run_times=[t])

    watch.on_event(event(EVENT_JOB_EXECUTED, 900.0))
    watch.on_event(event(EVENT_JOB_MISSED, 903.0))
    watch.on_event(event(EVENT_JOB_EXECUTED, 924.0))  # 906 ... 921 never ran: 6 more
    st = ag.status()["assets"]["pump-1"]
    assert (st["skipped_ticks"], st["missed_ticks"]) == (0, 7)


def test_commentary_cut_at_the_deadline_is_not_shown(tmp_path, fake_executor, scheduler,
                                                      clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.answer, fake_executor.finish_reason = "No fault: RMS", "deadline"
    row = ag.tick_once("pump-1")
    assert row["assessment"] is None and not row["withheld"]
    assert row["note"] == "commentary cut at the tick's deadline after 3 tokens (not shown)"
    assert row["fault"] == "none" and row["zone"] == "A"  # the measurement is there all the same
    clock.advance(3)
    fake_executor.answer, fake_executor.finish_reason = "No fault: no action.", "stop"
    assert ag.tick_once("pump-1")["assessment"] == "No fault: no action."


def test_a_first_turn_cut_before_its_first_token_keeps_its_prompt(tmp_path, fake_executor,
                                                                  scheduler, clock):
    """A first turn the deadline cuts before the model wrote anything still holds the system
    prompt, profile and summary, and their KV: the engine keeps it as a user turn left
    unanswered, and the next tick continues that session instead of computing all of it again
    (a slow device that cannot answer the first turn within one interval would otherwise fail
    it every tick). The agent goes by what the engine saved."""
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.answer, fake_executor.finish_reason = "", "deadline"
    ag.tick_once("pump-1")
    first = fake_executor.requests[-1]
    assert first.on_cut is OnCut.PROMPT
    kept = fake_executor.sessions[first.session]
    assert ag.assets["pump-1"].session_tokens == kept > 0
    clock.advance(3)
    fake_executor.answer, fake_executor.finish_reason = "Condition normal, no action.", "stop"
    ag.tick_once("pump-1")
    again = fake_executor.requests[-1]
    assert again.session == first.session and again.on_cut is OnCut.NOTHING  # a continuation
    assert not again.text.startswith(first.text.split("\n")[0])  # no profile again
    assert ag.assets["pump-1"].session_tokens == fake_executor.sessions[first.session] > kept


def test_a_cut_commentary_is_not_kept_in_the_session(tmp_path, fake_executor, scheduler, clock):
    """A fragment kept as the assistant's turn is copied by the model in the next turns (the
    field saw 'The recent' answered tick after tick): the tick asks the engine not to keep a
    later turn its deadline cut, and the session's size stays what it was. A first turn is
    kept without its fragment (a slow device would otherwise redo it, and fail it, every
    tick)."""
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.answer, fake_executor.finish_reason = "Pump-1 runs in zone", "deadline"
    ag.tick_once("pump-1")  # a first turn is kept, cut or not: it starts the session
    first = fake_executor.requests[-1]
    assert first.on_cut is OnCut.PROMPT and first.session in fake_executor.sessions
    session = first.session
    size = fake_executor.sessions[session]
    tokens = ag.assets["pump-1"].session_tokens
    assert tokens == size > 0
    clock.advance(3)
    fake_executor.answer, fake_executor.finish_reason = "The recent", "deadline"
    ag.tick_once("pump-1")
    cut = fake_executor.requests[-1]
    assert cut.session == session and cut.on_cut is OnCut.NOTHING
    assert fake_executor.sessions[session] == size and ag.assets["pump-1"].session_tokens == size
    st = ag.assets["pump-1"]
    assert st.llm_failing == 2 and "deadline" in (st.llm_error or "")  # no commentary: failed
    for _ in range(2):
        clock.advance(3)
        ag.tick_once("pump-1")
    from kvagentd.health import checks
    note = checks.commentary(ag.asset_views()[0])
    assert note.state == "missing" and "tick's deadline" in note.reason
    clock.advance(3)
    fake_executor.answer, fake_executor.finish_reason = "No fault: no action.", "stop"
    ag.tick_once("pump-1")
    assert st.llm_failing == 0
    assert fake_executor.requests[-1].session == session  # the same session goes on
    assert ag.assets["pump-1"].session_tokens == fake_executor.sessions[session] > size


def test_a_fragment_the_model_ended_itself_is_withheld(tmp_path, fake_executor, scheduler,
                                                        clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.answer, fake_executor.finish_reason = "The recent", "stop"
    row = ag.tick_once("pump-1")
    assert row["withheld"] and "a fragment ('The recent')" in row["note"]
    clock.advance(3)  # the same words cut by the token limit are judged as any text
    fake_executor.answer, fake_executor.finish_reason = "Zone A", "length"
    assert ag.tick_once("pump-1")["assessment"] == "Zone A"


def test_commentary_that_copies_the_prompt_is_withheld_and_the_session_goes_on(
        tmp_path, fake_executor, scheduler, clock):
    """A small model's copy of its first turn's summary says nothing about the tick: withheld,
    with the words it copied; the session goes on (a new one would hold the same summary to
    copy). Restating this tick's own observation is a commentary."""
    from kvagentd.health import checks
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    fake_executor.answer = "Recent state of pump-1: no measurements yet."
    row = ag.tick_once("pump-1")
    assert row["assessment"] is None and row["withheld"]
    assert "copies what it was given ('recent state of pump 1 no measurements yet')" in row["note"]
    for _ in range(2):  # withheld turn after turn: the commentary status says the ticks get none
        clock.advance(3)
        assert ag.tick_once("pump-1")["withheld"]
    note = checks.commentary(ag.asset_views()[0])
    assert note.state == "missing" and "copies what it was given" in note.reason
    assert "3 commentaries withheld" in note.reason and "a larger model" in note.reason
    clock.advance(3)
    fake_executor.answer = "The pump-1 runs in zone A with no fault pattern."
    row2 = ag.tick_once("pump-1")
    assert row2["session"] == row["session"]
    assert row2["assessment"] == fake_executor.answer and not row2["withheld"]
    assert checks.commentary(ag.asset_views()[0]).state == "ok"
    st = ag.status()["assets"]["pump-1"]
    assert st["commentaries"] == 4 and st["commentaries_withheld"] == 3


def test_commentary_that_contradicts_the_diagnosis_is_withheld(tmp_path, fake_executor,
                                                             scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, assets=(
        AssetConfig(fault=FaultConfig(kind="outer_race", onset_s=0.0)),))
    row = ag.tick_once("pump-1")  # the fake model says "Condition normal"
    assert row["fault"] == "outer_race" and row["anomaly"]
    assert row["assessment"] is None and row["withheld"]
    assert row["note"].startswith("commentary withheld: says 'normal'")
    clock.advance(3)
    fake_executor.answer = "Outer-race defect: BPFO line 99.5x the floor; replace the bearing."
    row2 = ag.tick_once("pump-1")
    assert row2["withheld"] and "99.5" in row2["note"]  # a number the evidence does not hold
    # the contradicting text left the context: the session was rewound to before it, and
    # the first turn's prompt stays (unanswered), so it is not prefilled again
    assert row2["session"] == row["session"]
    first_prompt = fake_executor.sessions[row["session"]]
    assert fake_executor.rewinds[0] == (row["session"], first_prompt)
    assert fake_executor.rewinds[1][1] == first_prompt
    assert fake_executor.requests[-1].constraints is not None
    clock.advance(3)
    fake_executor.answer = "Outer-race defect: plan a bearing replacement."
    row3 = ag.tick_once("pump-1")
    assert row3["assessment"] == fake_executor.answer and not row3["withheld"]
    st = ag.status()["assets"]["pump-1"]
    assert st["commentaries"] == 3 and st["commentaries_withheld"] == 2
    assert st["last_fault"] == "outer_race"


def test_model_text_never_reaches_a_prompt(tmp_path, fake_executor, scheduler, clock):
    fake_executor.answer = "Zebra-unicorn pump status report."
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, session_token_budget=400)
    for _ in range(30):
        ag.tick_once("pump-1")
        clock.advance(3)
    assert len({r.session for r in fake_executor.requests}) >= 2
    assert not any("Zebra" in r.text for r in fake_executor.requests)


def test_a_window_contradicting_the_stated_speed_is_bad_data(tmp_path, fake_executor,
                                                            scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    a = ag.assets["pump-1"].asset
    from kvagentd.agent.simulator import SimulatedSource

    truth = SimulatedSource(dataclasses.replace(a, rpm=a.rpm / 2.6), 0.0)
    ag.assets["pump-1"].source = ScriptedSource(a, [truth.read_window(10.0)])
    row = ag.tick_once("pump-1")
    assert row["kind"] == "bad_data" and row["note"].startswith("speed: ")
    assert ag.status()["assets"]["pump-1"]["bad_samples"] == {"speed": 1}
    assert fake_executor.requests == []


def test_replay_wrap_is_in_the_events(tmp_path, scheduler, clock):
    x = np.random.default_rng(0).normal(0.0, 1.0, 30000)
    np.save(tmp_path / "r.npy", x)
    (tmp_path / "r.npy.json").write_text('{"sample_rate_hz": 12000, "unit": "m/s^2"}')
    ag = make_agent(tmp_path / "a", None, scheduler, clock, assets=(
        AssetConfig(source="replay", replay_path=tmp_path / "r.npy"),))
    rows = [ag.tick_once("pump-1") for _ in range(3)]
    assert [r["features"]["replay_offset"] for r in rows] == [0, 12000, 0]
    assert "wrapped" not in rows[1]["note"] and "pass 2" in rows[2]["note"]
    assert "wrapped around" in rows[2]["note"]


def test_ask_about_an_asset_carries_its_diagnosis(tmp_path, fake_executor, scheduler, clock):
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, assets=(
        AssetConfig(fault=FaultConfig(kind="outer_race", onset_s=0.0)),))
    ag.tick_once("pump-1")
    fake_executor.answer = "The outer race is damaged; plan a bearing replacement."
    out = ag.ask("pump-1", "What is wrong with the pump?")
    req = fake_executor.requests[-1]
    assert req.priority == Priority.ASK and req.session == "pump-1:ask:daemon"
    assert "Diagnosis (measured): outer-race defect" in req.text
    assert req.text.endswith("Question: What is wrong with the pump?")
    assert out["commentary"] == fake_executor.answer and not out["withheld"]
    assert out["diagnosis"]["fault"] == "outer_race"
    fake_executor.answer = "The pump is healthy."
    bad = ag.ask("pump-1", "And now?")
    assert bad["commentary"] is None and bad["withheld"] and "healthy" in bad["reason"]
    assert "Asset pump-1" not in fake_executor.requests[-1].text  # profile only on the first


def test_a_number_from_earlier_in_the_session_is_in_the_evidence(tmp_path, fake_executor,
                                                                  scheduler, clock):
    """The model is given its session's turns, not only this tick's line: a number from the
    first turn's profile or summary is not an invented one (withholding it rolled the session
    over, and a small model that echoes its context restarted the long first turn every other
    tick). A number in none of the turns is still withheld, and a new session starts with
    nothing but its own first turn as evidence."""
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    rpm = ag.assets["pump-1"].asset.rpm
    first = ag.tick_once("pump-1")
    assert f"{rpm:g} rpm" in fake_executor.requests[-1].text  # the profile, in the first turn
    clock.advance(3)
    fake_executor.answer = f"Shaft at {rpm:g} rpm, condition normal."
    row = ag.tick_once("pump-1")
    assert f"{rpm:g}" not in fake_executor.requests[-1].text  # not in this tick's line
    assert row["assessment"] == fake_executor.answer and not row["withheld"]
    assert row["session"] == first["session"]
    clock.advance(3)
    fake_executor.answer = "Shaft at 4242 rpm, condition normal."
    row = ag.tick_once("pump-1")
    assert row["withheld"] and "4242" in row["note"]
    withheld_turn = fake_executor.requests[-1].text
    clock.advance(3)  # the withheld turn leaves the context: the session is rewound before it
    fake_executor.answer = "Condition normal, no action needed."
    row = ag.tick_once("pump-1")
    assert row["session"] == first["session"]
    text = ag.assets["pump-1"].session_text
    assert withheld_turn not in text and text.endswith(fake_executor.requests[-1].text)


def test_a_failed_turn_adds_nothing_to_what_the_model_was_given(tmp_path, fake_executor,
                                                                scheduler, clock):
    """A request that failed (timeout, full queue, an engine error) never reached the model's
    context: its text is not evidence for later commentary."""
    ag = make_agent(tmp_path, fake_executor, scheduler, clock)
    ag.tick_once("pump-1")
    given = ag.assets["pump-1"].session_text
    assert given == fake_executor.requests[-1].text
    clock.advance(3)
    fake_executor.fail_next = RuntimeError("engine down")
    row = ag.tick_once("pump-1")
    assert row["assessment"] is None and "engine down" in row["note"]
    assert ag.assets["pump-1"].session_text == given


def test_comment_on_change_asks_when_the_diagnosis_moves_and_at_least_every_gap(
        tmp_path, fake_executor, scheduler, clock):
    """`agent.comment_every = "change"`: a steady healthy asset is commented on its first
    tick and then every `comment_max_gap` ticks; every tick still measures and records; a
    tick whose commentary is not shown makes the next one ask again."""
    ag = make_agent(tmp_path, fake_executor, scheduler, clock, comment_every="change",
                    comment_max_gap=4)
    fake_executor.answer = "No fault: no action."
    rows = []
    for _ in range(9):
        rows.append(ag.tick_once("pump-1"))
        clock.advance(3)
    asked = [i for i, r in enumerate(rows) if r["session"]]
    assert asked == [0, 4, 8]
    assert all(r["kind"] == "tick" and r["features"] for r in rows)
    assert ag.status()["assets"]["pump-1"]["ticks_without_commentary"] == 6
    fake_executor.answer = "The bearing is damaged."  # withheld: the next tick asks again
    rows = []
    for i in range(9, 16):
        if i == 14:
            fake_executor.answer = "No fault: no action."
        rows.append(ag.tick_once("pump-1"))
        clock.advance(3)
    assert [bool(r["session"]) for r in rows] == [False, False, False, True, True, True, False]
    assert [r["withheld"] for r in rows[3:6]] == [True, True, False]
