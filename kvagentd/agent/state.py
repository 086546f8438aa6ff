"""The agent's per-asset state: its source, diagnoser, session bookkeeping and counters."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from kvagentd.agent.diagnosis.diagnoser import Diagnoser
from kvagentd.agent.model_client import Completion
from kvagentd.agent.sensors import SensorSource
from kvagentd.config import AssetConfig

log = structlog.get_logger(__name__)
# ticks in a row that must diagnose a new fault or severity before the log tells it (9 s at
# the default 3 s: a diagnosis wavering at a fault's onset is not logged back and forth)
FAULT_CONFIRM_TICKS = 3
# bad-data reasons that mean no data comes (sensors.py), not one malformed window
SENSOR_DOWN = frozenset({"stale", "missing", "io", "silent"})

LATENCY_WINDOW = 1000  # tick latencies kept per asset for p50/p99


@dataclass(slots=True)
class AssetState:
    asset: AssetConfig
    source: SensorSource
    diagnoser: Diagnoser
    session_index: int
    session_tokens: int = 0  # tokens of the current session (as the engine saved it)
    turn_tokens: int = 0  # growth of the session by the last tick
    # the user turns the engine kept in the current session: what the model was given, so the
    # evidence a number in its commentary must come from
    session_text: str = ""
    force_rollover: bool = False
    fits_tokens: int | None = None  # the largest session the hot pool held (after a HotPoolFull)
    closed: bool = False
    ticks: int = 0
    skipped: int = 0
    missed: int = 0
    rollovers: int = 0
    rewinds: int = 0  # turns taken back from the session (a withheld commentary)
    commented_on: tuple[str, str, str] | None = None  # (fault, severity, zone) last commented
    since_comment: int = 0  # ticks since the last one that asked for a commentary
    uncommented: int = 0  # ticks that asked for none (agent.comment_every = "change")
    llm_errors: int = 0
    llm_cut: int = 0  # model turns the tick's deadline cut (no commentary)
    llm_failing: int = 0  # model turns without commentary in a row (0 after one that answered)
    llm_error: str | None = None  # why the last of them gave none
    commentaries: int = 0  # model answers checked against the diagnosis
    withheld: int = 0  # ... of which the check withheld (not shown)
    unrecorded: int = 0  # ticks not written to the event log since one was (disk full, I/O)
    unrecorded_error: str | None = None  # why the last one was not
    unrecorded_t: float | None = None  # when (the agent's clock)
    bad: collections.Counter[str] = field(default_factory=collections.Counter)
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_WINDOW))
    last_zone: str | None = None
    last_t: float | None = None
    last_diagnosis: dict[str, Any] | None = None
    last_assessment: str | None = None
    last_assessment_t: float | None = None
    last_result: dict[str, Any] | None = None
    loaded: collections.Counter[str] = field(default_factory=collections.Counter)  # by tier
    reused_tokens: int = 0
    prompt_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    logged_fault: tuple[str, str] = ("none", "none")  # (fault, severity) the log last told
    fault_candidate: tuple[str, str] | None = None  # a new (fault, severity) being confirmed
    fault_seen: int = 0  # ticks in a row the candidate was diagnosed
    sensor_down: str | None = None  # why the sensor gives no usable data (logged once)

    @property
    def session(self) -> str:
        return f"{self.asset.name}-{self.session_index}"

    def track_diagnosis(self, d: dict[str, Any]) -> None:
        """Log the asset's fault appearing, changing (kind or severity) and clearing, once
        each: a change counts after FAULT_CONFIRM_TICKS ticks in a row diagnose it, so a
        diagnosis wavering at a fault's onset is not logged back and forth."""
        now = (str(d.get("fault") or "none"), str(d.get("severity") or "none"))
        if now == self.logged_fault:
            self.fault_candidate, self.fault_seen = None, 0
            return
        if now != self.fault_candidate:
            self.fault_candidate, self.fault_seen = now, 0
        self.fault_seen += 1
        if self.fault_seen < FAULT_CONFIRM_TICKS:
            return
        old, self.logged_fault = self.logged_fault, now
        self.fault_candidate, self.fault_seen = None, 0
        fields = dict(asset=self.asset.name, fault=now[0], severity=now[1],
                      summary=d.get("summary"), zone=d.get("zone"))
        if now[0] == "none":
            log.info("agent.fault_cleared", was=old[0], **fields)
        elif old[0] == "none":
            log.warning("agent.fault_appeared", **fields)
        else:
            log.warning("agent.fault_changed", was=old[0], was_severity=old[1], **fields)

    def track_sensor(self, bad: str | None) -> None:
        """Log the sensor going silent (`bad`: a reason of SENSOR_DOWN) and coming back (a
        usable window), once each; a malformed window (decode, length ...) is neither."""
        if bad is not None and bad not in SENSOR_DOWN:
            return
        if bad is not None and self.sensor_down is None:
            log.warning("agent.sensor_down", asset=self.asset.name, reason=bad)
        elif bad is None and self.sensor_down is not None:
            log.info("agent.sensor_back", asset=self.asset.name, was=self.sensor_down)
        self.sensor_down = bad

    def wants_comment(self, every: str, max_gap: int, d: dict[str, Any]) -> bool:
        """Does this tick (diagnosis `d`) ask for a commentary (`agent.comment_every`)?"""
        key = (str(d.get("fault")), str(d.get("severity")), str(d.get("zone")))
        if every == "tick" or key != self.commented_on or self.since_comment + 1 >= max_gap:
            self.commented_on, self.since_comment = key, 0
            return True
        self.since_comment += 1
        self.uncommented += 1
        return False

    def checked(self, withheld: str | None) -> None:
        """A finished turn's commentary after the check: shown (`withheld` None) ends a run of
        turns without commentary; withheld (why, the event's note) extends it, as a failed or
        cut turn does (the commentary status reads "missing" after a few in a row)."""
        if withheld is None:
            self.llm_failing = 0
            return
        self.withheld += 1
        self.llm_failing += 1
        self.llm_error = withheld

    def account(self, done: Completion, now: float, given: str = "") -> None:
        """Record a tick's completion (session size and text, reuse, errors); `given`: the
        session's user turns with this one, what the session holds if the engine kept it."""
        res = done.result
        if res is None:
            self.llm_errors += 1
            self.llm_failing += 1
            self.llm_error = done.error
            return
        if done.cut:
            # no commentary: counts for the commentary status (every turn cut means the device cannot
            # finish a sentence within the interval)
            self.llm_cut += 1
            self.llm_failing += 1
            self.llm_error = (f"commentary cut at the tick's deadline after {res.new_tokens} "
                              f"tokens (the model does not finish a sentence within the "
                              f"interval: fewer assets with llm, a longer tick interval or a "
                              f"faster device)")
        # a turn that finished ends a run of turns without commentary only when its text is
        # shown (`checked`)
        # a turn the engine did not keep (a later one cut off by its deadline, a first one cut
        # before its first token) leaves the session what it was
        if done.kept:
            self.session_text = given
            total = int(res.session_tokens) or (int(res.prompt_tokens)
                                                + int(res.new_tokens))
            # a later turn's growth estimates the next one; a first turn's (system prompt,
            # profile and summary) does not, so after one the default estimate stands
            self.turn_tokens = max(0, total - self.session_tokens) if self.session_tokens else 0
            self.session_tokens = total
        self.last_result = {"prompt_tokens": res.prompt_tokens,
                            "reused_tokens": res.reused_tokens,
                            "recomputed_tokens": res.recomputed_tokens,
                            "new_tokens": res.new_tokens, "ttft_s": res.ttft_s,
                            "total_s": res.total_s, "queue_wait_s": res.queue_wait_s,
                            "loaded": dict(res.loaded)}
        self.loaded.update(res.loaded)
        self.reused_tokens += int(res.reused_tokens)
        self.prompt_tokens += int(res.prompt_tokens)

    def status(self, now: float, llm: bool) -> dict[str, Any]:
        lat = np.asarray(self.latencies, dtype=float)
        d = self.last_diagnosis or {}
        return {
            "source": self.asset.source, "llm": llm, "session": self.session,
            "session_tokens": self.session_tokens, "rollovers": self.rollovers,
            "rewinds": self.rewinds, "ticks_without_commentary": self.uncommented,
            "ticks": self.ticks, "last_zone": self.last_zone,
            "last_fault": d.get("fault"), "last_severity": d.get("severity"),
            "last_diagnosis": d.get("summary"),
            "baseline": self.diagnoser.status(),
            "last_tick_age_s": None if self.last_t is None else round(now - self.last_t, 3),
            "last_assessment": self.last_assessment,
            "last_assessment_age_s": None if self.last_assessment_t is None
            else round(now - self.last_assessment_t, 3),
            "commentaries": self.commentaries, "commentaries_withheld": self.withheld,
            "tick_latency_p50_s": round(float(np.percentile(lat, 50)), 4) if lat.size else None,
            "tick_latency_p99_s": round(float(np.percentile(lat, 99)), 4) if lat.size else None,
            "skipped_ticks": self.skipped, "missed_ticks": self.missed,
            "llm_errors": self.llm_errors, "llm_cut": self.llm_cut, "bad_samples": dict(self.bad),
            "bad_samples_total": sum(self.bad.values()),
            "blocks_loaded_by_tier": dict(self.loaded),
            "prompt_tokens_reused": round(self.reused_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens else None,
        }
