"""One model worker with a bounded priority queue.

Priorities: sensor tick > operator question > report job. Every request runs as a generator
that yields after each model step (a prefill chunk or one decode token); between steps the
worker picks the most urgent runnable job, so a tick that arrives while a long report decodes
starts after at most one more decode step (the report is paused, keeps its hot blocks and its
working copy, and resumes after the tick). Jobs of one session never interleave.

Expected outcomes are values: a full queue raises `QueueFull` at submit (409 / exit 75);
deadline and cancellation end a running job with `finish_reason` "deadline" / "cancelled" and
its partial answer. A job that never started because its deadline passed or the executor
stopped raises `JobNotRun` from `result()`.
"""

from __future__ import annotations

import enum
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Protocol

import structlog

from kvagentd.config import ExecutorConfig
from kvagentd.engine.runner import GenerationResult

log = structlog.get_logger(__name__)


class Priority(enum.IntEnum):
    TICK = 0
    ASK = 1
    REPORT = 2


@dataclass(frozen=True)
class GenerationRequest:
    session: str
    text: str
    system: str | None = None  # used only when the session does not exist yet
    max_new_tokens: int = 64
    priority: Priority = Priority.ASK
    deadline_s: float | None = None  # seconds from submit; None = the executor default


class QueueFull(RuntimeError):
    """The bounded queue is full: the caller should answer busy and retry later."""


class JobNotRun(RuntimeError):
    """The job ended before it started (deadline passed in the queue, executor stopped)."""


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"


_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.PAUSED, JobState.DONE, JobState.FAILED}),
    JobState.PAUSED: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
}

_END = object()


class RunFn(Protocol):
    def __call__(self, session_id: str, text: str, *, system: str | None, max_new_tokens: int,
                 stop: Callable[[], str | None], on_text: Callable[[str], None],
                 ) -> Generator[None, None, GenerationResult]: ...


class Job:
    """Handle of one submitted request."""

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
        self.steps = 0  # model steps this job ran
        self.pauses = 0
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._pieces: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._gen: Generator[None, None, GenerationResult] | None = None

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
            yield item  # type: ignore[misc]
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self._cancel.set()

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def info(self) -> dict[str, Any]:
        r = self.request
        return {"id": self.id, "session": r.session, "priority": r.priority.name.lower(),
                "state": self.state.value, "steps": self.steps, "pauses": self.pauses,
                "age_s": round(time.monotonic() - self.submitted_at, 3)}

    # -- worker side ------------------------------------------------------------------------

    def _move(self, new: JobState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"job {self.id}: illegal transition {self.state} -> {new}")
        self.state = new

    def _stop_reason(self) -> str | None:
        if self._cancel.is_set():
            return "cancelled"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        return None

    def _finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self._move(JobState.DONE if error is None else JobState.FAILED)
        self._pieces.put(_END)
        self._done.set()


class Executor:
    """The model worker. `run` is `Runner.run`; metrics is an `EngineMetrics` or None."""

    def __init__(self, run: RunFn, config: ExecutorConfig, *, metrics: Any = None) -> None:
        self._run = run
        self.config = config
        self.metrics = metrics
        self._cond = threading.Condition()
        self._queued: list[Job] = []
        self._active: list[Job] = []  # started, not finished (one running, others paused)
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.step_count = 0  # model steps run by the worker, all jobs
        self.completed = 0
        self.failed = 0
        self.rejected = 0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="kvagentd-model", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting; queued jobs fail with JobNotRun; running jobs end as cancelled."""
        with self._cond:
            self._stopping = True
            for job in self._active:
                job.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- API --------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> Job:
        with self._cond:
            if self._stopping:
                raise QueueFull("executor is stopping")
            if len(self._queued) >= self.config.queue_size:
                self.rejected += 1
                if self.metrics is not None:
                    self.metrics.rejected.inc()
                raise QueueFull(f"{len(self._queued)} requests queued (executor.queue_size = "
                                f"{self.config.queue_size}); try again later")
            job = Job(next(self._ids), self._bounded(req), self._deadline(req), self.step_count)
            self._queued.append(job)
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queued))
        return job

    def session_busy(self, session: str) -> bool:
        with self._cond:
            return any(j.request.session == session for j in self._queued + self._active)

    def status(self) -> dict[str, Any]:
        with self._cond:
            queued = {p.name.lower(): 0 for p in Priority}
            for j in self._queued:
                queued[j.request.priority.name.lower()] += 1
            return {"running": self._thread is not None and self._thread.is_alive(),
                    "queued": queued, "queue_size": self.config.queue_size,
                    "active": [j.info() for j in self._active], "steps": self.step_count,
                    "completed": self.completed, "failed": self.failed,
                    "rejected": self.rejected}

    # -- worker -----------------------------------------------------------------------------

    def _bounded(self, req: GenerationRequest) -> GenerationRequest:
        limit = self.config.ask_max_tokens if req.priority == Priority.ASK else None
        n = max(1, req.max_new_tokens if limit is None else min(req.max_new_tokens, limit))
        if n == req.max_new_tokens:
            return req
        return GenerationRequest(req.session, req.text, req.system, n, req.priority,
                                 req.deadline_s)

    def _deadline(self, req: GenerationRequest) -> float | None:
        seconds = req.deadline_s
        if seconds is None:
            seconds = (self.config.report_deadline_s if req.priority == Priority.REPORT
                       else self.config.ask_deadline_s)
        return time.monotonic() + seconds

    def _pick(self) -> Job | None:
        """Most urgent runnable job: active ones, or queued ones whose session is idle."""
        busy = {j.request.session for j in self._active}
        cands = self._active + [j for j in self._queued if j.request.session not in busy]
        if not cands:
            return None
        return min(cands, key=lambda j: (j.request.priority, j.id))

    def _worker(self) -> None:
        current: Job | None = None
        while True:
            with self._cond:
                while True:
                    if self._stopping and not self._active:
                        for job in self._queued:
                            job._finish(None, JobNotRun(f"job {job.id}: executor stopped"))
                        self._queued.clear()
                        return
                    job = self._pick()
                    if job is not None:
                        break
                    self._cond.wait()
                if job.state is JobState.QUEUED:
                    self._queued.remove(job)
            if current is not None and current is not job and current.state is JobState.RUNNING:
                current._move(JobState.PAUSED)
                current.pauses += 1
            current = job
            if job.state is JobState.QUEUED and not self._begin(job):
                continue
            if job.state is JobState.PAUSED:
                job._move(JobState.RUNNING)
            self._step(job)

    def _begin(self, job: Job) -> bool:
        """Start `job`'s generator; False if it ended before starting."""
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queued))
        why = "stopping" if self._stopping else job._stop_reason()
        if why is not None:
            self._fail(job, JobNotRun(f"job {job.id} ({job.request.session}): {why} before "
                                      f"it started"))
            return False
        r = job.request
        job._move(JobState.RUNNING)
        job.started_step = self.step_count
        job.started_at = time.monotonic()
        job._gen = self._run(r.session, r.text, system=r.system, max_new_tokens=r.max_new_tokens,
                             stop=job._stop_reason, on_text=job._pieces.put)
        with self._cond:
            self._active.append(job)
        return True

    def _step(self, job: Job) -> None:
        assert job._gen is not None
        try:
            next(job._gen)
        except StopIteration as done:
            result: GenerationResult = done.value
            result.queue_wait_s = job.started_at - job.submitted_at
            self._end(job)
            self._succeed(job, result)
        except Exception as exc:  # the worker survives any failure of one request
            log.error("generation_failed", job=job.id, session=job.request.session,
                      error=f"{type(exc).__name__}: {exc}")
            self._end(job)
            self._fail(job, exc)
        else:
            job.steps += 1
            self.step_count += 1
            return
        job.steps += 1
        self.step_count += 1

    def _end(self, job: Job) -> None:
        with self._cond:
            if job in self._active:
                self._active.remove(job)

    def _succeed(self, job: Job, result: GenerationResult) -> None:
        self.completed += 1
        if self.metrics is not None:
            self.metrics.observe(job.request.priority.name.lower(), result)
        job._finish(result, None)

    def _fail(self, job: Job, exc: BaseException) -> None:
        self.failed += 1
        if self.metrics is not None:
            self.metrics.requests.labels(job.request.priority.name.lower(), "failed").inc()
        job._finish(None, exc)
