"""The model as the agent sees it: one small interface over the engine's executor.

Everything the agent and its report writer ask of the model goes through `ModelClient`:
- `submit_tick(session, text, system)`: THE place where one sensor tick's turn is submitted
  (TICK priority, `agent.assessment_max_tokens`, a deadline at the end of the tick's interval:
  a turn the engine cannot finish within it ends there) and waited for. The turns of one beat go to the
  engine together (`beat.py`), so they share model steps. Expected failures (queue full,
  timeout, a failed generation) come back as a `Completion` with `error` set; nothing raises
  into the tick job.
- `generate(session, text, system, priority)`: a longer text at REPORT (or ASK) priority,
  waited for without a timeout (the executor's deadline ends it); failures raise (the report
  writer records them in the report).

`Executor` and `GenerationJob` are the two members of the engine this module uses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import structlog

from kvagentd.agent.beat import Beat
from kvagentd.config import AgentConfig
from kvagentd.engine.constraints import Constraints
from kvagentd.engine.executor import GenerationRequest, HotPoolFull, Priority, QueueFull
from kvagentd.engine.job import CUT_SHORT, OnCut
from kvagentd.engine.job import GenerationResult

log = structlog.get_logger(__name__)

TICK_MARGIN = 0.1  # share of the tick interval left for the step that crosses the deadline


class GenerationJob(Protocol):
    """A submitted request (engine `Job`)."""

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The finished result; raises TimeoutError after `timeout` s, or the job's error."""
        ...

    def cancel(self) -> None:
        """Stop the job at its next step (no-op once done)."""
        ...


class Executor(Protocol):
    """What the agent needs of the engine's executor."""

    def submit(self, request: GenerationRequest) -> GenerationJob:
        """Queue `request`; raises QueueFull when the bounded queue is full."""
        ...

    def submit_all(self, requests: Sequence[GenerationRequest]
                   ) -> Sequence[GenerationJob | QueueFull]:
        """Queue every request at once (one beat); per request its job or its QueueFull."""
        ...

    def rewind(self, session_id: str, tokens: int) -> bool:
        """Take back the session's ids from `tokens` on (raises SessionBusy while it runs)."""
        ...


@dataclass(frozen=True, slots=True)
class Completion:
    """Outcome of one request: `text` (stripped) and `result`, or `error` (a short note)."""

    text: str | None
    result: GenerationResult | None = None
    error: str | None = None
    outgrown: bool = False  # the session no longer fits the hot pool (HotPoolFull)
    kept: bool = False  # the engine saved the turn in its session (a next turn continues it)

    @property
    def cut(self) -> bool:
        """Ended by its deadline (or a cancel) before the model finished."""
        return self.result is not None and self.result.finish_reason in CUT_SHORT

    @property
    def ok(self) -> bool:
        return self.error is None


class ModelClient:
    """Submits the agent's requests to `executor`; `config` sets token limits and deadlines."""

    def __init__(self, executor: Executor, config: AgentConfig) -> None:
        self.executor = executor
        self.config = config
        self.beat = Beat(executor)

    def reload(self, config: AgentConfig) -> None:
        self.config = config

    def submit_tick(self, session: str, text: str, system: str | None, *,
                    started: float | None = None, first: bool = False,
                    constraints: Constraints | None = None) -> Completion:
        """Submit one tick's turn at TICK priority and wait for it (see module docstring).
        `started` (`time.perf_counter()` when the tick began) puts the deadline at the end of
        the tick's interval, less `TICK_MARGIN` of it for the engine step that crosses it.
        A turn the deadline cuts leaves no fragment of an answer in the session: the model
        copies fragments it sees in its context. The session's `first` turn (the system prompt,
        profile and summary) is kept as a user turn left unanswered, its KV with it: a device
        that cannot answer it within one interval would otherwise redo it, and fail it, every
        tick; a later turn cut off leaves the session as it was."""
        cfg = self.config
        elapsed = 0.0 if started is None else time.perf_counter() - started
        deadline = max(0.05, cfg.tick_interval_s * (1.0 - TICK_MARGIN) - elapsed)
        req = GenerationRequest(session=session, text=text, system=system,
                                max_new_tokens=cfg.assessment_max_tokens, priority=Priority.TICK,
                                deadline_s=deadline, one_sentence=True,
                                on_cut=OnCut.PROMPT if first else OnCut.NOTHING,
                                constraints=constraints)
        try:
            job = cast(GenerationJob, self.beat.submit(req))
        except QueueFull:
            return Completion(None, error="llm: queue full")
        try:
            res = job.result(timeout=max(30.0, 10.0 * cfg.tick_interval_s))
        except TimeoutError:
            job.cancel()
            return Completion(None, error="llm: timeout")
        except Exception as exc:  # noqa: BLE001 - a failed generation must not end the tick job
            log.warning("agent.llm_failed", session=session, error=repr(exc))
            return Completion(None, error=f"llm: {type(exc).__name__}: {exc}",
                              outgrown=isinstance(exc, HotPoolFull))
        # kept: what the engine did, not what was asked (a turn cut before its first token
        # leaves nothing to keep, and the next tick has to start the session again)
        return Completion(res.text.strip(), res, kept=res.saved)

    def withdraw(self, session: str, result: GenerationResult) -> int:
        """Take back the turn `result` answered in `session`: the session returns to what it
        held before the turn, or, for its first turn, keeps that turn's prompt unanswered (the
        system prompt, profile and summary are not prefilled again). Returns the session's
        tokens after it; 0 when nothing could be taken back (the session must roll over)."""
        target = result.turn_start or result.unanswered_tokens
        if not target:
            return 0
        try:
            self.executor.rewind(session, target)
        except Exception as exc:  # noqa: BLE001 - a session that cannot rewind rolls over
            log.warning("agent.rewind_failed", session=session, error=repr(exc))
            return 0
        return target

    def generate(self, session: str, text: str, system: str | None, *,
                 priority: Priority = Priority.REPORT, max_new_tokens: int | None = None,
                 ) -> Completion:
        """A longer generation (reports, replays); waits for it; failures raise."""
        job = self.executor.submit(GenerationRequest(
            session=session, text=text, system=system,
            max_new_tokens=max_new_tokens or self.config.report_max_tokens, priority=priority))
        res = job.result()
        return Completion(res.text.strip(), res, kept=res.saved)
