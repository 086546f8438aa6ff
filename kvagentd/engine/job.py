"""A submitted request and its handle: priority, deadline, cancellation, streamed text, result.

Deadline and cancellation end a started job with `finish_reason` "deadline" / "cancelled" and
its partial answer; what `result()` raises otherwise is the executor's (`executor.JobNotRun`,
`executor.HotPoolFull`, ...) or the request's own error.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvagentd.engine.constraints import Constraints
from kvagentd.kvcache.transitions import check_transition


class Priority(enum.IntEnum):
    TICK = 0
    ASK = 1
    REPORT = 2


class OnCut(enum.Enum):
    """What a turn that its deadline or a cancel cut off leaves in its session."""

    ANSWER = "answer"  # the turn and the part of the answer generated (a reader saw it)
    PROMPT = "prompt"  # the turn's prompt, left unanswered: not the fragment of an answer
    NOTHING = "nothing"  # the session stays as it was before the request


@dataclass(frozen=True)
class GenerationRequest:
    session: str
    text: str | None  # None: continue the session's ids as they are (no new turn)
    system: str | None = None  # used only when the session does not exist yet
    max_new_tokens: int = 64
    priority: Priority = Priority.ASK
    deadline_s: float | None = None  # seconds from submit; None = the executor default
    one_sentence: bool = False  # end at the first sentence's end (`sequence.sentence_end`)
    on_cut: OnCut = OnCut.ANSWER  # what a turn cut off leaves in the session
    constraints: Constraints | None = None  # opening, banned phrases, spans not to copy


@dataclass(slots=True)
class GenerationResult:
    session: str
    text: str = ""
    new_tokens: int = 0
    prompt_tokens: int = 0  # every token the model attended to before the first answer token
    reused_tokens: int = 0  # taken from stored blocks, not recomputed
    recomputed_tokens: int = 0  # matched in the store but missing/corrupt, so recomputed
    prefill_tokens: int = 0  # tokens run through the model before the first answer token
    finish_reason: str = ""  # stop | length | deadline | cancelled
    saved: bool = False  # the turn was saved in its session (a next turn continues it)
    session_tokens: int = 0  # tokens its session holds after it (when saved)
    ttft_s: float = 0.0  # from admission (after queueing) to the first token
    total_s: float = 0.0  # from admission to the end
    queue_wait_s: float = 0.0  # from submit to the first admission
    turn_start: int = 0  # ids its session held before this turn (0: a new session)
    unanswered_tokens: int = 0  # ids of the session with this turn's prompt left unanswered
    preemptions: int = 0
    loaded: dict[str, int] = field(default_factory=dict)  # blocks by tier they came from
    timings: dict[str, float] = field(default_factory=dict)  # where the time went

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


CUT_SHORT = frozenset({"deadline", "cancelled"})  # finish reasons of a turn cut off


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # preempted: its blocks went back to the store; it resumes from them
    DONE = "done"
    FAILED = "failed"


_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.DONE, JobState.FAILED}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.DONE, JobState.FAILED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
}

_END = object()


class Job:
    """Handle of one submitted request. The public methods are thread-safe."""

    def __init__(self, job_id: int, request: GenerationRequest, deadline: float | None,
                 submitted_step: int) -> None:
        self.id = job_id
        self.request = request
        self.state = JobState.QUEUED
        self.submitted_at = time.monotonic()
        self.deadline = deadline  # time.monotonic() value or None
        self.submitted_step = submitted_step  # executor step counter at submit
        self.started_step: int | None = None  # executor step counter when it first ran
        self.started_at = 0.0
        self.steps = 0  # model steps this job took part in
        self.pauses = 0  # preemptions
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._pieces: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancel = threading.Event()

    # -- public -----------------------------------------------------------------------------

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"job {self.id} not done after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def stream(self) -> Iterator[str]:
        """Text pieces as they are generated; ends when the job ends (raises its error)."""
        while True:
            item = self._pieces.get()
            if item is _END:
                break
            assert isinstance(item, str)
            yield item
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self._cancel.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def priority(self) -> Priority:
        return self.request.priority

    def info(self) -> dict[str, Any]:
        r = self.request
        return {"id": self.id, "session": r.session, "priority": r.priority.name.lower(),
                "state": self.state.value, "steps": self.steps, "pauses": self.pauses,
                "age_s": round(time.monotonic() - self.submitted_at, 3)}

    # -- worker side ------------------------------------------------------------------------

    def move(self, new: JobState) -> None:
        check_transition(_TRANSITIONS, self.state, new, f"job {self.id} state")
        self.state = new

    def stop_reason(self, now: float | None = None) -> str | None:
        if self._cancel.is_set():
            return "cancelled"
        if self.deadline is not None and (now or time.monotonic()) >= self.deadline:
            return "deadline"
        return None

    def emit(self, piece: str) -> None:
        self._pieces.put(piece)

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self.move(JobState.DONE if error is None else JobState.FAILED)
        self._pieces.put(_END)
        self._done.set()
