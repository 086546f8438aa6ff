"""The agent service: per-asset tick jobs, measured diagnoses, rolling sessions, reports.

One tick (`tick_once(asset)`), top-down:
    read window -> validate -> diagnose (features, spectra, speed check, fault, baseline,
    trends) -> event row -> raw window kept when due -> observation turn (time + diagnosis)
    appended to the asset's session -> `ModelClient.submit_tick` -> the model's commentary
    checked against the diagnosis (`grounding.check`) -> shown or withheld on the row.
A window that cannot be read, fails validation, or whose spectrum contradicts the stated shaft
speed becomes a `bad_data` row and a per-asset counter; nothing in a tick raises to the
scheduler. A withheld commentary also rolls the session over, so the contradicting text is
not in the context of later turns.

Sessions are named `<asset>-<n>`. A session grows by one turn per tick; when the next turn would
pass `agent.session_token_budget` it rolls over: `<asset>-<n+1>` starts with the shared system
prompt (`prompts.SYSTEM_PROMPT`), the asset profile and a deterministic summary of the recent
measurements and diagnoses. Old sessions are never dropped by the agent (anomaly replay resumes
them; placement ages them into the cold tier). After a restart numbering continues past the
highest session recorded in the event log.

`ask(asset, question)` answers an operator's question about an asset with its latest diagnosis
as context; the answer is checked like a tick's commentary.

The LLM step is skipped for assets with `llm = false`, for every asset when there is no
executor (`model.source = "none"`), and while `llm_gate(asset)` names another box that writes
the asset's sessions now (the asset was handed over through the remote store): ticks then only
diagnose. A session handed over from another box continues here after `resume_session`.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import structlog
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobExecutionEvent

from kvagentd.agent import grounding, jobs, prompts
from kvagentd.agent.beat import aligned_start
from kvagentd.agent.diagnosis.diagnoser import Diagnoser, SpeedRefused
from kvagentd.agent.events import EventLog
from kvagentd.agent.model_client import Completion, Executor, ModelClient
from kvagentd.agent.reports import ReportWriter
from kvagentd.agent.sensors import BadData, validate
from kvagentd.agent.sources import make_source
from kvagentd.agent.state import AssetState
from kvagentd.agent.view import AssetView, asset_view
from kvagentd.agent.windows import WindowStore
from kvagentd.config import AgentConfig, Config
from kvagentd.engine.executor import Priority

log = structlog.get_logger(__name__)

# what the event log raises when its disk is full or failing: a tick still completes
UNRECORDABLE = (sqlite3.Error, OSError)
UNRECORDED_LOG_EVERY = 100  # one warning for the first tick not recorded, then every 100th
UNRECORDED_RECENT_S = 600.0  # health shows unrecorded ticks this long after the last one

SUMMARY_ROWS = 20  # event rows summarized into a new session
TREND_SEED_S = 25 * 3600.0  # per-minute summaries loaded into the trends at start
_SESSION_RE = re.compile(r"^(?P<asset>.+)-(?P<n>\d+)$")


class Agent:
    """Service (start/stop/status/reload). `clock` gives the time ticks are stamped with and the
    sensors are read at (a simulated clock for soak runs); `store_stats` returns the KV store's
    `stats()` (replay reports record the tier loads they caused)."""

    def __init__(self, config: AgentConfig, executor: Executor | None, scheduler: Any,
                 state_dir: Path, clock: Callable[[], float] = time.time,
                 store_stats: Callable[[], dict[str, Any]] | None = None,
                 llm_gate: Callable[[str], str | None] | None = None,
                 job_record: Callable[[str], Any] | None = None) -> None:
        """`job_record(job_id)`: the daemon's count of a job's skipped and missed runs
        (`JobWatch.record`); without it (an agent on its own) the agent counts the scheduler's
        events itself."""
        self.config = config
        self.llm_gate = llm_gate
        self.job_record = job_record
        self.model = ModelClient(executor, config) if executor is not None else None
        self.scheduler = scheduler
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.events = EventLog(self.state_dir / "events.sqlite")
        self.windows = WindowStore(self.state_dir / "windows",
                                   max_bytes=config.windows_store_bytes,
                                   anomaly_interval_s=config.anomaly_window_interval_s,
                                   normal_interval_s=config.normal_window_interval_s)
        self.reports = ReportWriter(
            self.state_dir / "reports", events=self.events,
            assets={a.name: a for a in config.assets},
            generate=self.model.generate if self.model is not None else None, clock=clock,
            store_stats=store_stats, retire_session=self.retire_session,
            period_s=config.report_period_s, windows=self.windows)
        self.started_at: float | None = None
        self._running = False
        self._asked: set[str] = set()
        start = clock()
        stale = max(2.0 * config.tick_interval_s, 2.0) + max(
            (a.window_s for a in config.assets), default=1.0)
        self.assets: dict[str, AssetState] = {}
        for a in config.assets:
            src = make_source(a, start_time=start, stale_after_s=stale, clock=clock,
                              mqtt=config.mqtt)
            diag = Diagnoser(a, self.state_dir / "baselines" / f"{a.name}.json")
            diag.seed(self.events.minutes(a.name, start - TREND_SEED_S, start + 1.0))
            self.assets[a.name] = AssetState(a, src, diag, self._next_session_index(a.name))

    # -------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.started_at = self.clock()
        for st in self.assets.values():
            try:
                st.source.start()
            except (OSError, ValueError, BadData) as exc:
                # A source that cannot open yet reports bad data on each tick.
                log.warning("agent.source_start_failed", asset=st.asset.name, error=str(exc))
        self.scheduler.add_listener(self._on_scheduler_event,
                                    EVENT_JOB_MAX_INSTANCES | EVENT_JOB_MISSED)
        if self.config.enabled:
            self._schedule(self.config)
        self._running = True
        log.info("agent.started", assets=list(self.assets), llm=self.model is not None)

    def stop(self) -> None:
        """Remove the jobs, wait for a tick in flight and for running reports, close."""
        self._running = False
        self.scheduler.remove_listener(self._on_scheduler_event)
        for jid in (*(j for name in self.assets for j in (jobs.tick_job_id(name),
                                                          jobs.weekly_job_id(name))),
                    jobs.PRUNE_JOB_ID):
            if self.scheduler.get_job(jid) is not None:
                self.scheduler.remove_job(jid)
        self.reports.wait(timeout=30.0)
        for st in self.assets.values():
            with st.lock:  # a tick in flight finishes first; later ones see `closed`
                st.closed = True
        for st in self.assets.values():
            st.source.stop()
            st.diagnoser.close()
        self.events.close()
        log.info("agent.stopped")

    def health(self) -> dict[str, Any] | None:
        """The service itself: running (its tick jobs scheduled) or not. How each asset is
        doing is `asset_views()` (the daemon's health checks judge it)."""
        if not self._running:
            return {"status": "failing", "detail": "the agent is not running"}
        now = self.clock()
        lost = [st for st in self.assets.values() if st.unrecorded
                and st.unrecorded_t is not None and now - st.unrecorded_t < UNRECORDED_RECENT_S]
        if lost:
            worst = max(lost, key=lambda st: st.unrecorded)
            return {"status": "degraded", "detail": (
                f"{sum(st.unrecorded for st in lost)} ticks of "
                f"{', '.join(st.asset.name for st in lost)} measured but not recorded in "
                f"the event log ({worst.unrecorded_error}; {self.events.path}): status shows "
                f"them, events and reports do not")}
        return {"status": "ok", "detail": "assets: " + ", ".join(self.assets)}

    def asset_views(self) -> list[AssetView]:
        """Per asset: sensor link, data freshness and the last measurement (read-only)."""
        now = self.clock()
        views = []
        for name, st in self.assets.items():
            last = self.events.recent(name, 1)
            newest = self.events.query(asset=name, limit=1)
            views.append(asset_view(st, last[-1] if last else None, self.config, now=now,
                                    started_at=self.started_at,
                                    newest=newest[0] if newest else None))
        return views

    def reload(self, full: Config) -> None:
        """Apply a new tick interval / report cron from the `agent` section; asset changes
        need a restart."""
        config = full.agent
        old = self.config
        self.config = config
        if self.model is not None:
            self.model.reload(config)
        if self._running and config.enabled:
            self._schedule(config)
        if [a.name for a in config.assets] != [a.name for a in old.assets]:
            log.warning("agent.assets_changed", effect="restart required")

    def _schedule(self, config: AgentConfig) -> None:
        trigger = jobs.weekly_trigger(config.weekly_report_cron)
        beat_start = aligned_start(config.tick_interval_s)
        for name in self.assets:
            self.scheduler.add_job(
                self._tick_job, "interval", seconds=config.tick_interval_s, args=(name,),
                start_date=beat_start,  # every asset's tick fires in the same beat
                id=jobs.tick_job_id(name), name=f"tick {name}", max_instances=1, coalesce=True,
                misfire_grace_time=max(1, int(config.tick_interval_s)), replace_existing=True)
            self.scheduler.add_job(
                self.reports.run_weekly, trigger, args=(name,), id=jobs.weekly_job_id(name),
                name=f"weekly report {name}", max_instances=1, coalesce=True,
                misfire_grace_time=3600, replace_existing=True)
        self.scheduler.add_job(self.prune, "interval", seconds=jobs.PRUNE_INTERVAL_S,
                               id=jobs.PRUNE_JOB_ID, name="event log retention",
                               max_instances=1, coalesce=True, replace_existing=True)

    def prune(self) -> dict[str, int]:
        """Apply the event log's retention (`agent.events_*retention_s`)."""
        done = self.events.prune(self.clock(), self.config.events_raw_retention_s,
                                 self.config.events_retention_s)
        log.info("agent.events_pruned", **done)
        return done

    def _on_scheduler_event(self, event: JobExecutionEvent) -> None:
        if not event.job_id.startswith(jobs.TICK_PREFIX):
            return
        st = self.assets.get(event.job_id[len(jobs.TICK_PREFIX):])
        if st is None:
            return
        # NOTE: counted here for status; the daemon logs one (rate-limited) warning per skip.
        if event.code == EVENT_JOB_MAX_INSTANCES:
            st.skipped += 1
            log.debug("agent.tick_skipped", asset=st.asset.name, skipped=st.skipped)
        else:
            st.missed += 1
            log.debug("agent.tick_missed", asset=st.asset.name, missed=st.missed)

    def _not_recorded(self, st: AssetState, now: float, exc: BaseException,
                      row: dict[str, Any]) -> dict[str, Any]:
        """The event log could not take this tick (a full or failing state disk): the tick
        still counts and its measurement stays in status; health says so (`health`)."""
        st.unrecorded += 1  # since the last tick that was recorded
        st.unrecorded_error, st.unrecorded_t = f"{type(exc).__name__}: {exc}", now
        if st.unrecorded % UNRECORDED_LOG_EVERY == 1:
            log.warning("agent.tick_not_recorded", asset=st.asset.name, error=st.unrecorded_error,
                        not_recorded=st.unrecorded, path=str(self.events.path))
        return {**row, "t": now, "asset": st.asset.name,
                "note": f"not recorded in the event log: {st.unrecorded_error}"}

    def _record(self, st: AssetState, **row: Any) -> int:
        """Append a row of `st`'s asset to the event log (raises UNRECORDABLE); the first row
        recorded after some were not ends that spell."""
        eid = self.events.append(asset=st.asset.name, **row)
        if st.unrecorded:
            log.warning("agent.ticks_recorded_again", asset=st.asset.name,
                        not_recorded=st.unrecorded)
            st.unrecorded = 0
        return eid

    def _tick_job(self, asset: str) -> None:
        st = self.assets[asset]
        with st.lock, self._in_beat():
            if not st.closed:
                self._tick(st)

    def _in_beat(self) -> AbstractContextManager[None]:
        """A tick's turn goes to the model with the others of its beat (`beat.py`)."""
        return self.model.beat.ticking() if self.model is not None else nullcontext()

    # -------------------------------------------------------------------------------- the tick

    def tick_once(self, asset: str) -> dict[str, Any]:
        """Run one tick for `asset` now; returns its event row."""
        st = self.assets[asset]
        with st.lock, self._in_beat():
            if st.closed:
                raise RuntimeError("the agent is stopped")
            return self._tick(st)

    def _bad(self, st: AssetState, now: float, t0: float, reason: str, detail: str
             ) -> dict[str, Any]:
        st.bad[reason] += 1
        st.track_sensor(reason)
        log.info("agent.bad_data", asset=st.asset.name, reason=reason, detail=detail)
        try:
            eid = self._record(st, t=now, kind="bad_data", note=f"{reason}: {detail}")
            self.events.complete(eid, assessment=None, latency_s=time.perf_counter() - t0)
            return self.events.get(eid) or {}
        except UNRECORDABLE as exc:
            return self._not_recorded(st, now, exc, {"kind": "bad_data"})

    def _tick(self, st: AssetState) -> dict[str, Any]:
        a = st.asset
        t0 = time.perf_counter()
        now = self.clock()
        st.ticks += 1
        try:
            window = st.source.read_window(now)
            validate(window, a)
            diagnosis = st.diagnoser.diagnose(window, now)
        except BadData as exc:
            return self._bad(st, now, t0, exc.reason, exc.detail)
        except SpeedRefused as exc:
            return self._bad(st, now, t0, "speed", str(exc))
        d = diagnosis.as_dict()
        st.track_sensor(None)
        st.track_diagnosis(d)
        assert st.diagnoser.last is not None
        features: dict[str, Any] = st.diagnoser.last.features.as_dict()
        note = ""
        if window.offset is not None:
            features.update(replay_offset=window.offset, replay_pass=window.passes + 1)
            note = f"replay offset {window.offset}" + (
                f", pass {window.passes + 1}: the recording has wrapped around"
                if window.passes else "")
        st.last_zone, st.last_t, st.last_diagnosis = diagnosis.zone, now, d
        held_by = self.llm_gate(a.name) if self.llm_gate is not None else None
        if held_by is not None:
            note = f"{note}; " if note else ""
            note += f"llm: the asset's sessions are written by box {held_by}"
        use_llm = (a.llm and self.model is not None and held_by is None
                   and st.wants_comment(self.config.comment_every, self.config.comment_max_gap,
                                        d))
        measured = {"kind": "tick", "zone": diagnosis.zone, "anomaly": diagnosis.anomaly,
                    "features": features, "diagnosis": d}
        try:
            obs = prompts.observation(now, d)
            turn = self._next_turn(st, now, obs) if use_llm else None
            eid = self._record(st, t=now, features=features, zone=diagnosis.zone,
                               anomaly=diagnosis.anomaly, session=turn[0] if turn else None,
                               note=note, diagnosis=d)
        except UNRECORDABLE as exc:  # no model turn either: its session could not be noted
            return self._not_recorded(st, now, exc, measured)
        self.windows.offer(a.name, eid, now, window, diagnosis.anomaly)
        commentary, withheld = None, False
        if turn is not None:
            commentary, withheld, why = self._comment(st, d, *turn, started=t0, obs=obs)
            if why:
                note = f"{note}; {why}" if note else why
            if commentary is None:
                st.commented_on = None  # nothing shown: the next tick asks again
        latency = time.perf_counter() - t0
        st.latencies.append(latency)
        try:
            self.events.complete(eid, assessment=commentary, latency_s=latency,
                                 note=note or None, withheld=withheld)
            return self.events.get(eid) or {}
        except UNRECORDABLE as exc:
            return self._not_recorded(st, now, exc,
                                      {**measured, "id": eid, "assessment": commentary})

    def _comment(self, st: AssetState, d: dict[str, Any], session: str, text: str,
                 system: str | None, *, started: float, obs: str
                 ) -> tuple[str | None, bool, str | None]:
        """The model's commentary on this tick (`text` the turn, `obs` its observation):
        (text shown, withheld?, note)."""
        assert self.model is not None
        given = f"{st.session_text}\n{text}" if st.session_text else text
        before_text = st.session_text
        rules = grounding.constraints(d, given.replace(obs, " "), obs)
        done = self.model.submit_tick(session, text, system, started=started,
                                      first=st.session_tokens == 0, constraints=rules)
        st.account(done, self.clock(), given)
        if done.outgrown:
            # the session holds more than the hot pool can: it would fail every tick from now
            # on, so the next tick starts a new one, and later sessions of the asset roll over
            # before they reach this size (agent.session_token_budget is more than kv.hot_bytes
            # holds for this model)
            st.force_rollover = True
            if st.session_tokens and (st.fits_tokens is None
                                      or st.session_tokens < st.fits_tokens):
                st.fits_tokens = st.session_tokens
            log.warning("agent.session_outgrew_hot_pool", asset=st.asset.name, session=session,
                        session_tokens=st.session_tokens,
                        budget=self.config.session_token_budget,
                        hint="lower agent.session_token_budget or raise kv.hot_bytes")
            return None, False, (f"{done.error}; the next tick starts a new session, and "
                                 f"sessions roll over at {st.fits_tokens} tokens from now on")
        if done.error is not None:
            return None, False, done.error
        if done.result is not None and done.result.finish_reason == "deadline":
            # a sentence cut off by the tick's deadline is a fragment, not a commentary
            return None, False, (f"commentary cut at the tick's deadline after "
                                 f"{done.result.new_tokens} tokens (not shown)")
        st.commentaries += 1
        verdict = grounding.check(done.text, d, given, ended=_ended(done))
        copy = (grounding.copied(done.text or "", given.replace(obs, " "), obs)
                if verdict.ok else None)
        if not verdict.ok or copy is not None:
            why = ("commentary withheld: " + (verdict.reason if not verdict.ok else
                                              f"copies what it was given ({copy!r})"))
            st.checked(why)
            # NOTE: the withheld text must not stay in the context of later turns (the model
            # copies what it sees): the session is rewound to before it, not rolled over.
            if done.result is not None and done.kept:
                self._withdraw(st, session, done.result, before_text, given)
            log.debug("agent.commentary_withheld", asset=st.asset.name, reason=why,
                      text=done.text)
            return None, True, why
        st.checked(None)
        st.last_assessment, st.last_assessment_t = done.text, self.clock()
        return done.text, False, None

    def _withdraw(self, st: AssetState, session: str, result: Any, before_text: str,
                  given: str) -> None:
        """Take the turn back from `session` (`ModelClient.withdraw`); a session that cannot
        be rewound rolls over before the next tick."""
        assert self.model is not None
        tokens = self.model.withdraw(session, result)
        if not tokens:
            st.force_rollover = True
            return
        st.rewinds += 1
        st.session_tokens = tokens
        # a later turn is taken back whole; a first turn keeps its prompt, unanswered
        st.session_text = before_text if result.turn_start else given

    def _next_turn(self, st: AssetState, now: float, obs: str) -> tuple[str, str, str | None]:
        """(session, user text, system prompt or None): rolls over when the budget is reached."""
        estimate = st.turn_tokens or (2 * self.config.assessment_max_tokens + 64)
        budget = self.config.session_token_budget
        if st.fits_tokens is not None:  # the hot pool held no more than this
            budget = min(budget, st.fits_tokens)
        if st.session_tokens and (st.force_rollover or
                                  st.session_tokens + estimate > budget):
            st.session_index += 1
            st.session_tokens = st.turn_tokens = 0
            st.session_text = ""
            st.force_rollover = False
            st.rollovers += 1
            log.debug("agent.rollover", asset=st.asset.name, session=st.session)
        if st.session_tokens == 0:
            self.events.set_meta(f"session:{st.asset.name}", str(st.session_index))
            recent = prompts.summary(st.asset.name, self.events.recent(st.asset.name, SUMMARY_ROWS))
            return st.session, prompts.first_turn(st.asset, recent, obs, now), prompts.SYSTEM_PROMPT
        return st.session, obs, prompts.SYSTEM_PROMPT

    # -------------------------------------------------------------------------------- questions

    def ask(self, asset: str, question: str, *, session: str | None = None,
            max_tokens: int | None = None) -> dict[str, Any]:
        """Answer an operator's question about `asset` with its latest diagnosis as context.

        Raises KeyError (unknown asset) and LookupError (no model); the generation's own
        failures (queue full ...) propagate. The answer is checked like a tick's commentary.
        """
        st = self.assets[asset]
        if self.model is None:
            raise LookupError("no model is loaded: questions need the LLM")
        sid = session or f"{asset}:ask:daemon"
        d, t = st.last_diagnosis, st.last_t or self.clock()
        context = prompts.ask_context(asset, t, d)
        if sid not in self._asked:
            context = f"{prompts.asset_profile(st.asset)}\n{context}"
        text = f"{context}\nQuestion: {question.strip()}"
        done = self.model.generate(sid, text, prompts.SYSTEM_PROMPT, priority=Priority.ASK,
                                   max_new_tokens=max_tokens)
        self._asked.add(sid)
        verdict = grounding.check(done.text, d or {"fault": "none", "zone": "A"}, text,
                                  ended=_ended(done))
        res = done.result
        return {"asset": asset, "session": sid, "diagnosis": d,
                "commentary": done.text if verdict.ok else None,
                "withheld": not verdict.ok, "reason": verdict.reason or None,
                "result": res.as_dict() if res is not None else None}

    def retire_session(self, session: str) -> None:
        """Make the asset owning `session` roll over before its next turn (replay resumes it)."""
        for st in self.assets.values():
            if st.session == session:
                with st.lock:  # waits for a tick in flight on this session
                    st.force_rollover = True

    def resume_session(self, asset: str, session: str, tokens: int) -> None:
        """Continue `session` (`<asset>-<n>`, handed over from another box, `tokens` long) with
        the next tick of `asset`, instead of the session this box would write next."""
        st = self.assets[asset]
        m = _SESSION_RE.match(session)
        if m is None or m.group("asset") != asset:
            raise ValueError(f"session {session!r} is not a session of asset {asset!r}")
        with st.lock:
            st.session_index = int(m.group("n"))
            st.session_tokens, st.turn_tokens = int(tokens), 0
            st.force_rollover = False
        log.info("agent.session_resumed", asset=asset, session=session, tokens=tokens)

    def _next_session_index(self, asset: str) -> int:
        best = int(self.events.get_meta(f"session:{asset}") or 0)
        for s in self.events.sessions(asset):
            m = _SESSION_RE.match(s)
            if m and m.group("asset") == asset:
                best = max(best, int(m.group("n")))
        return best + 1

    # -------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {"enabled": self.config.enabled, "running": self._running,
                "tick_interval_s": self.config.tick_interval_s,
                "assets": {name: {**st.status(now, st.asset.llm and self.model is not None),
                                  **self._dropped(name),
                                  "llm_held_by": self.llm_gate(name) if self.llm_gate else None}
                           for name, st in self.assets.items()},
                "reports_running": self.reports.running(),
                "events_db": str(self.events.path), "event_rows": self.events.count(),
                "windows_stored": len(self.windows), "windows_bytes": self.windows.bytes,
                "sources": {name: st.source.status() for name, st in self.assets.items()}}

    def _dropped(self, name: str) -> dict[str, int]:
        """Due ticks that did not run, as the daemon's job watch counts them (a run the
        scheduler coalesced after a stall counts once for every interval it covered)."""
        if self.job_record is None:
            return {}
        rec = self.job_record(jobs.TICK_PREFIX + name)
        if rec is None:
            return {"skipped_ticks": 0, "missed_ticks": 0}
        return {"skipped_ticks": rec.skipped, "missed_ticks": rec.missed}


def _ended(done: Completion) -> bool:
    """Whether the model ended its text itself (an end of turn or of its sentence), not a
    token limit."""
    return done.result is not None and done.result.finish_reason == "stop"
