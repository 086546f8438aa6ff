"""The agent service: per-asset tick jobs, rolling sessions, reports.

One tick (`tick_once(asset)`), top-down:
    read window -> validate -> features -> event row -> observation turn appended to the asset's
    session -> executor (TICK priority, bounded tokens) -> assessment stored on the row.
A window that cannot be read or fails validation becomes a `bad_data` row and a per-asset
counter; nothing in a tick raises to the scheduler.

Sessions are named `<asset>-<n>`. A session grows by one turn per tick; when the next turn would
pass `agent.session_token_budget` it rolls over: `<asset>-<n+1>` starts with the shared system
prompt (`prompts.SYSTEM_PROMPT`), the asset profile and a deterministic summary of the recent
event rows. Old sessions are never dropped by the agent (anomaly replay resumes them; placement
ages them into the cold tier). After a restart numbering continues past the highest session in
the event log.

The LLM step is skipped for assets with `llm = false` and for every asset when there is no
executor (`model.source = "none"`): ticks then only log features.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import structlog
from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobExecutionEvent

from kvagentd.agent import jobs, prompts
from kvagentd.agent.events import EventLog
from kvagentd.agent.features import extract
from kvagentd.agent.model_client import Completion, Executor, ModelClient
from kvagentd.agent.reports import ReportWriter
from kvagentd.agent.sensors import BadData, SensorSource, make_source, validate
from kvagentd.config import AgentConfig, AssetConfig, Config

log = structlog.get_logger(__name__)

LATENCY_WINDOW = 1000  # tick latencies kept per asset for p50/p99
SUMMARY_ROWS = 20  # event rows summarized into a new session
_SESSION_RE = re.compile(r"^(?P<asset>.+)-(?P<n>\d+)$")


@dataclass(slots=True)
class AssetState:
    asset: AssetConfig
    source: SensorSource
    session_index: int
    session_tokens: int = 0  # tokens of the current session (prompt + answer of the last turn)
    turn_tokens: int = 0  # growth of the session by the last tick
    force_rollover: bool = False
    closed: bool = False
    ticks: int = 0
    skipped: int = 0
    missed: int = 0
    rollovers: int = 0
    llm_errors: int = 0
    bad: collections.Counter = field(default_factory=collections.Counter)
    latencies: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))
    last_zone: str | None = None
    last_t: float | None = None
    last_assessment: str | None = None
    last_assessment_t: float | None = None
    last_result: dict[str, Any] | None = None
    loaded: collections.Counter = field(default_factory=collections.Counter)  # blocks by tier
    reused_tokens: int = 0
    prompt_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def session(self) -> str:
        return f"{self.asset.name}-{self.session_index}"


class Agent:
    """Service (start/stop/status/reload). `clock` gives the time ticks are stamped with and the
    sensors are read at (a simulated clock for soak runs); `store_stats` returns the KV store's
    `stats()` (replay reports record the tier loads they caused)."""

    def __init__(self, config: AgentConfig, executor: Executor | None, scheduler: Any,
                 state_dir: Path, clock: Callable[[], float] = time.time,
                 store_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.config = config
        self.model = ModelClient(executor, config) if executor is not None else None
        self.scheduler = scheduler
        self.state_dir = Path(state_dir)
        self.clock = clock
        self.events = EventLog(self.state_dir / "events.sqlite")
        self.reports = ReportWriter(
            self.state_dir / "reports", events=self.events,
            assets={a.name: a for a in config.assets},
            generate=self.model.generate if self.model is not None else None, clock=clock,
            store_stats=store_stats, retire_session=self.retire_session,
            period_s=config.report_period_s)
        self.started_at: float | None = None
        self._running = False
        start = clock()
        stale = max(2.0 * config.tick_interval_s, 2.0) + max((a.window_s for a in config.assets), default=1.0)
        self.assets: dict[str, AssetState] = {}
        for a in config.assets:
            src = make_source(a, start_time=start, stale_after_s=stale, clock=clock)
            self.assets[a.name] = AssetState(a, src, self._next_session_index(a.name))

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
        for name in self.assets:
            for jid in (jobs.tick_job_id(name), jobs.weekly_job_id(name)):
                if self.scheduler.get_job(jid) is not None:
                    self.scheduler.remove_job(jid)
        self.reports.wait(timeout=30.0)
        for st in self.assets.values():
            with st.lock:  # a tick in flight finishes first; later ones see `closed`
                st.closed = True
        for st in self.assets.values():
            st.source.stop()
        self.events.close()
        log.info("agent.stopped")

    def health(self) -> dict[str, Any] | None:
        return None

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
        for name in self.assets:
            self.scheduler.add_job(
                self._tick_job, "interval", seconds=config.tick_interval_s, args=(name,),
                id=jobs.tick_job_id(name), name=f"tick {name}", max_instances=1, coalesce=True,
                misfire_grace_time=max(1, int(config.tick_interval_s)), replace_existing=True)
            self.scheduler.add_job(
                self.reports.run_weekly, trigger, args=(name,), id=jobs.weekly_job_id(name),
                name=f"weekly report {name}", max_instances=1, coalesce=True,
                misfire_grace_time=3600, replace_existing=True)

    def _on_scheduler_event(self, event: JobExecutionEvent) -> None:
        if not event.job_id.startswith(jobs.TICK_PREFIX):
            return
        st = self.assets.get(event.job_id[len(jobs.TICK_PREFIX):])
        if st is None:
            return
        if event.code == EVENT_JOB_MAX_INSTANCES:
            st.skipped += 1
            log.warning("agent.tick_skipped", asset=st.asset.name, skipped=st.skipped)
        else:
            st.missed += 1
            log.warning("agent.tick_missed", asset=st.asset.name, missed=st.missed)

    def _tick_job(self, asset: str) -> None:
        st = self.assets[asset]
        with st.lock:
            if not st.closed:
                self._tick(st)

    # -------------------------------------------------------------------------------- the tick

    def tick_once(self, asset: str) -> dict[str, Any]:
        """Run one tick for `asset` now; returns its event row."""
        st = self.assets[asset]
        with st.lock:
            if st.closed:
                raise RuntimeError("the agent is stopped")
            return self._tick(st)

    def _tick(self, st: AssetState) -> dict[str, Any]:
        a = st.asset
        t0 = time.perf_counter()
        now = self.clock()
        st.ticks += 1
        try:
            window = st.source.read_window(now)
            validate(window, a)
        except BadData as exc:
            st.bad[exc.reason] += 1
            eid = self.events.append(t=now, asset=a.name, kind="bad_data",
                                     note=f"{exc.reason}: {exc.detail}")
            self.events.complete(eid, assessment=None, latency_s=time.perf_counter() - t0)
            log.info("agent.bad_data", asset=a.name, reason=exc.reason, detail=exc.detail)
            return self.events.get(eid) or {}
        feats = extract(window, a)
        st.last_zone, st.last_t = feats.zone, now
        use_llm = a.llm and self.model is not None
        turn = self._next_turn(st, now, prompts.observation(now, feats)) if use_llm else None
        eid = self.events.append(t=now, asset=a.name, features=feats.as_dict(), zone=feats.zone,
                                 anomaly=feats.anomaly, session=turn[0] if turn else None)
        assessment, note = None, None
        if turn is not None:
            assessment, note = self._assess(st, *turn)
        latency = time.perf_counter() - t0
        st.latencies.append(latency)
        self.events.complete(eid, assessment=assessment, latency_s=latency, note=note)
        return self.events.get(eid) or {}

    def _next_turn(self, st: AssetState, now: float, obs: str) -> tuple[str, str, str | None]:
        """(session, user text, system prompt or None): rolls over when the budget is reached."""
        estimate = st.turn_tokens or (2 * self.config.assessment_max_tokens + 64)
        if st.session_tokens and (st.force_rollover or
                                  st.session_tokens + estimate > self.config.session_token_budget):
            st.session_index += 1
            st.session_tokens = st.turn_tokens = 0
            st.force_rollover = False
            st.rollovers += 1
            log.info("agent.rollover", asset=st.asset.name, session=st.session)
        if st.session_tokens == 0:
            recent = prompts.summary(st.asset.name, self.events.recent(st.asset.name, SUMMARY_ROWS))
            return st.session, prompts.first_turn(st.asset, recent, obs, now), prompts.SYSTEM_PROMPT
        return st.session, obs, prompts.SYSTEM_PROMPT

    def _assess(self, st: AssetState, session: str, text: str,
                system: str | None) -> tuple[str | None, str | None]:
        """Submit the turn (`ModelClient.submit_tick`); returns (assessment, error note)."""
        assert self.model is not None
        done = self.model.submit_tick(session, text, system)
        self._account(st, done)
        return done.text, done.error

    def _account(self, st: AssetState, done: Completion) -> None:
        """Record a tick's completion on the asset's state (session size, reuse, errors)."""
        res = done.result
        if res is None:
            st.llm_errors += 1
            return
        total = int(res.prompt_tokens) + int(res.new_tokens)
        st.turn_tokens = max(0, total - st.session_tokens)
        st.session_tokens = total
        st.last_assessment = done.text
        st.last_assessment_t = self.clock()
        st.last_result = {"prompt_tokens": res.prompt_tokens, "reused_tokens": res.reused_tokens,
                          "recomputed_tokens": res.recomputed_tokens,
                          "new_tokens": res.new_tokens, "ttft_s": res.ttft_s,
                          "total_s": res.total_s, "queue_wait_s": res.queue_wait_s,
                          "loaded": dict(res.loaded)}
        st.loaded.update(res.loaded)
        st.reused_tokens += int(res.reused_tokens)
        st.prompt_tokens += int(res.prompt_tokens)

    def retire_session(self, session: str) -> None:
        """Make the asset owning `session` roll over before its next turn (replay resumes it)."""
        for st in self.assets.values():
            if st.session == session:
                with st.lock:  # waits for a tick in flight on this session
                    st.force_rollover = True

    def _next_session_index(self, asset: str) -> int:
        best = 0
        for s in self.events.sessions(asset):
            m = _SESSION_RE.match(s)
            if m and m.group("asset") == asset:
                best = max(best, int(m.group("n")))
        return best + 1

    # -------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        now = self.clock()
        out: dict[str, Any] = {}
        for name, st in self.assets.items():
            lat = np.asarray(st.latencies, dtype=float)
            out[name] = {
                "source": st.asset.source, "llm": st.asset.llm and self.model is not None,
                "session": st.session, "session_tokens": st.session_tokens,
                "rollovers": st.rollovers, "ticks": st.ticks, "last_zone": st.last_zone,
                "last_tick_age_s": None if st.last_t is None else round(now - st.last_t, 3),
                "last_assessment": st.last_assessment,
                "last_assessment_age_s": None if st.last_assessment_t is None
                else round(now - st.last_assessment_t, 3),
                "tick_latency_p50_s": round(float(np.percentile(lat, 50)), 4) if lat.size else None,
                "tick_latency_p99_s": round(float(np.percentile(lat, 99)), 4) if lat.size else None,
                "skipped_ticks": st.skipped, "missed_ticks": st.missed,
                "llm_errors": st.llm_errors, "bad_samples": dict(st.bad),
                "bad_samples_total": sum(st.bad.values()),
                "blocks_loaded_by_tier": dict(st.loaded),
                "prompt_tokens_reused": round(st.reused_tokens / st.prompt_tokens, 4)
                if st.prompt_tokens else None,
            }
        return {"enabled": self.config.enabled, "running": self._running,
                "tick_interval_s": self.config.tick_interval_s, "assets": out,
                "reports_running": self.reports.running(),
                "events_db": str(self.events.path)}
