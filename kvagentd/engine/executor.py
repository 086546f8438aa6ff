"""The model worker: continuous batching with priorities over a bounded queue.

One thread runs `step()` over and over; the data path of a step reads top-down:

    reap (cancelled, past deadline) -> prepare prompts -> plan admission (scheduler)
    -> preempt (commit + release) -> admit (match -> ensure_resident -> bind hot slots)
    -> one batched forward over every running sequence (decode tokens + prefill chunks)
    -> greedy token per sequence -> stream text -> finish (commit, record_access, save)

Requests join and leave the batch at step boundaries. Priorities (tick > ask > report, with
aging so nothing starves) decide admission, the token budget and preemption; see
`scheduler.py`. Jobs of one session never overlap. Expected outcomes are values (`job.py`).
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
import torch

from kvagentd.config import ExecutorConfig
from kvagentd.engine.blocks import BlockManager
from kvagentd.engine.constraints import choose
from kvagentd.engine.job import (CUT_SHORT, GenerationRequest, Job, JobState, OnCut,
                                 Priority)
from kvagentd.engine.metrics import EngineMetrics
from kvagentd.engine.runner import ModelRunner
from kvagentd.engine.scheduler import Need, Scheduler, SchedulerConfig
from kvagentd.engine.sequence import Sequence
from kvagentd.engine.sessions import ChatFormat, Session, SessionStore
from kvagentd.engine.threads import own_pool

__all__ = ["Executor", "GenerationRequest", "HotPoolFull", "Job", "JobNotRun", "Priority",
           "QueueFull", "SessionBusy"]

log = structlog.get_logger(__name__)

_IDLE_RETRY_S = 0.05  # wait when nothing could run (room held outside the engine)
_WINDOW = 256  # steps and requests kept for status figures


class SessionBusy(RuntimeError):
    """The session has a queued or running request."""


class QueueFull(RuntimeError):
    """The bounded queue is full: the caller should answer busy and retry later (409)."""


class JobNotRun(RuntimeError):
    """The job ended before it started (deadline passed in the queue, cancelled, stopped)."""


class HotPoolFull(RuntimeError):
    """The hot pool cannot hold this request's blocks, even with nothing else running."""


class Executor:
    """The model worker over `runner` (the model) and `blocks` (the store)."""

    def __init__(self, runner: ModelRunner, blocks: BlockManager, sessions: SessionStore,
                 chat: ChatFormat, tokenizer: Any, config: ExecutorConfig, *,
                 metrics: EngineMetrics | None = None, threads: int = 1) -> None:
        self.runner = runner
        self.blocks = blocks
        self.sessions = sessions
        self.chat = chat
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.scheduler = Scheduler(SchedulerConfig(config.max_batch, config.step_tokens,
                                                   config.prefill_chunk, config.aging_s,
                                                   config.prefill_tokens))
        self.threads = threads
        self._cond = threading.Condition()
        self._queued: list[Job] = []  # submitted, not yet seen by the worker
        self._waiting: list[Sequence] = []  # not running: new, or preempted
        self._running: list[Sequence] = []
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._room_epoch = 0  # bumped whenever running sequences give room back
        self._tried: dict[int, int] = {}  # id(seq) -> epoch of its failed admission
        self._steps: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=_WINDOW)
        self._waits: dict[str, collections.deque[float]] = {
            p.name.lower(): collections.deque(maxlen=_WINDOW) for p in Priority}
        self.on_step: Callable[[int, int, float], None] | None = None  # (size, tokens, s)
        self.step_count = 0
        self.constraint_s = 0.0  # worker time spent compiling and applying constraints
        self.constrained_steps = 0
        self.completed = 0
        self.failed = 0
        self.rejected = 0
        self.preempted = 0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._worker, name="kvagentd-model", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting; jobs not started fail with JobNotRun; started ones end cancelled."""
        with self._cond:
            self._stopping = True
            for s in self._running + self._waiting:
                s.job.cancel()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running(self) -> bool:
        """True while the worker thread is alive (it can take requests)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- API --------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> Job:
        """Queue `req`; raises `QueueFull` when the bounded queue is full or stopping."""
        out = self.submit_all([req])[0]
        if isinstance(out, QueueFull):
            raise out
        return out

    def submit_all(self, reqs: Iterable[GenerationRequest]) -> list[Job | QueueFull]:
        """Queue every request at once, so that they join the same model step (a beat of
        ticks). Each entry is its `Job`, or the `QueueFull` that refused it."""
        out: list[Job | QueueFull] = []
        with self._cond:
            queued = self._queued_count()
            for req in reqs:
                if self._stopping:
                    out.append(QueueFull("executor is stopping"))
                    continue
                if queued >= self.config.queue_size:
                    self.rejected += 1
                    if self.metrics is not None:
                        self.metrics.rejected.inc()
                    out.append(QueueFull(f"{queued} requests queued (executor.queue_size = "
                                         f"{self.config.queue_size}); try again later"))
                    continue
                job = Job(next(self._ids), self._bounded(req), self._deadline(req),
                          self.step_count)
                self._queued.append(job)
                queued += 1
                out.append(job)
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.queue_depth.set(queued)
        return out

    def rewind(self, session_id: str, tokens: int) -> bool:
        """Take back a session's ids from `tokens` on (a turn its caller withdraws, such as a
        commentary the agent will not show); the blocks past that point lose this session's
        reference and age out. Raises `SessionBusy` while a request of the session runs;
        False when the session is unknown or not longer than `tokens`."""
        if self.session_busy(session_id):
            raise SessionBusy(f"session {session_id!r} has a request in progress")
        session = self.sessions.get(session_id)
        if session is None or tokens >= len(session.token_ids) or tokens < 0:
            return False
        keep = tokens // self.blocks.geometry.block_tokens
        dropped = session.block_keys[keep:]
        session.token_ids = session.token_ids[:tokens]
        session.block_keys = session.block_keys[:keep]
        session.turns = max(0, session.turns - 1)
        self.sessions.save(session)
        if dropped:
            self.blocks.store.drop_session(session_id, dropped)
        log.debug("session_rewound", session=session_id, tokens=tokens)
        return True

    def session_busy(self, session: str) -> bool:
        with self._cond:
            return any(j.request.session == session for j in self._queued) or any(
                s.session_id == session for s in self._waiting + self._running)

    def status(self) -> dict[str, Any]:
        with self._cond:
            queued = {p.name.lower(): 0 for p in Priority}
            for j in self._queued + [s.job for s in self._waiting if s.first_admitted_at is None]:
                queued[j.request.priority.name.lower()] += 1
            active = [s.job.info() for s in self._running + self._waiting
                      if s.first_admitted_at is not None]
            steps = list(self._steps)
            waits = {k: list(v) for k, v in self._waits.items()}
        return {"running": self._thread is not None and self._thread.is_alive(),
                "queued": queued, "queue_size": self.config.queue_size, "active": active,
                "steps": self.step_count, "completed": self.completed, "failed": self.failed,
                "rejected": self.rejected, "preemptions": self.preempted,
                "constraints": {"steps": self.constrained_steps,
                                "seconds": round(self.constraint_s, 4)},
                "batch": _batch_figures(steps, self.config),
                "queue_wait_s": {k: _quantiles(v) for k, v in waits.items()},
                "memory": self.blocks.status()}

    # -- worker -----------------------------------------------------------------------------

    def _worker(self) -> None:
        own_pool(self.threads)  # the one thread that computes with several cores
        while True:
            with self._cond:
                while not (self._queued or self._waiting or self._running or self._stopping):
                    self._cond.wait()
                self._waiting.extend(Sequence(j) for j in self._queued)
                self._queued.clear()
                stopping = self._stopping
            if stopping:  # started sequences end cancelled (and are saved), the rest not run
                self._reap(time.monotonic())
                return
            try:
                ran = self.step()
            except Exception:
                log.exception("engine_step_failed")
                ran = True
            if not ran:
                with self._cond:
                    if not self._queued and not self._stopping:
                        self._cond.wait(_IDLE_RETRY_S)

    def step(self) -> bool:
        """One scheduling round and one batched forward; False when nothing could run."""
        now = time.monotonic()
        self._reap(now)
        self._prepare()
        needs = {id(s): self.blocks.need(s) for s in self._waiting
                 if s.prepared and self._tried.get(id(s)) != self._room_epoch}
        plan = self.scheduler.admission(self._waiting, self._running, needs,
                                        self.blocks.resources(), now)
        for s in plan.never_fit:
            self._fail(s, self._too_big(s, needs[id(s)]))
        for s in plan.preempt:
            self._preempt(s)
        for s in plan.admit:
            self._admit(s)
        work = self.scheduler.budget(self._running, now)
        if not work:
            return False
        t0 = time.perf_counter()
        items = [(s, s.chunk(n), s.pending == n) for s, n in work]
        items, logits = self._forward(items)
        if not items:
            return True
        rows = [s for s, _, last in items if last]
        logits, rows = self._finite(logits, rows)
        t1 = time.perf_counter()
        if self.blocks.memo is not None:
            for i, s in enumerate(rows):
                if s.choosing_first:  # before constraints mask them
                    self.blocks.memo.put(s.tokens, logits[i])
        tokens = choose(logits, rows, self.tokenizer) if rows else []
        if any(s.rules is not None for s in rows):
            self.constraint_s += time.perf_counter() - t1
            self.constrained_steps += 1
        dt = time.perf_counter() - t0
        self._record_step(len(items), sum(len(ids) for _, ids, _ in items), dt)
        chosen = dict(zip(map(id, rows), tokens))
        for s, _, last in items:
            s.job.steps += 1
            if last and id(s) in chosen:
                why = s.accept(int(chosen[id(s)]), self.chat, self.tokenizer)
                if why is not None:
                    self._end(s, why)
        return True

    def _forward(self, items: list[tuple[Sequence, list[int], bool]]
                 ) -> tuple[list[tuple[Sequence, list[int], bool]], Any]:
        """One forward over every item; when it raises, each item again alone, so that only
        the sequences whose own forward fails lose their job (a KV advances only when its
        step completes: a failed step leaves every sequence as it was)."""
        try:
            return items, self.runner.forward([(s.kv_or_fail(), ids, last)
                                               for s, ids, last in items])
        except Exception as exc:  # noqa: BLE001 - found below, per sequence
            log.warning("batch_forward_failed", size=len(items),
                        error=f"{type(exc).__name__}: {exc}", retry="each sequence alone")
            if len(items) == 1:
                self._fail(items[0][0], exc)
                return [], None
        kept, rows = [], []
        for item in items:
            s, ids, last = item
            try:
                out = self.runner.forward([(s.kv_or_fail(), ids, last)])
            except Exception as exc:  # noqa: BLE001 - this sequence's job fails, not the batch
                self._fail(s, exc)
                continue
            kept.append(item)
            if last:
                rows.append(out)
        return kept, (torch.cat(rows) if rows else None)

    def _finite(self, logits: Any, rows: list[Sequence]) -> tuple[Any, list[Sequence]]:
        """Rows whose logits are not all finite fail their own job (the model produced NaN
        or inf for that sequence); the others go on."""
        if not rows:
            return logits, rows
        ok = logits.isfinite().all(-1)
        if bool(ok.all()):
            return logits, rows
        keep = []
        for i, s in enumerate(rows):
            if bool(ok[i]):
                keep.append(i)
            else:
                self._fail(s, FloatingPointError(
                    f"session {s.session_id!r}: the model's logits are not finite (NaN or "
                    f"inf) at position {len(s.tokens) - 1}; this request ends, its KV is not "
                    f"stored"))
        return logits[keep], [rows[i] for i in keep]

    # -- transitions ------------------------------------------------------------------------

    def _reap(self, now: float) -> None:
        for s in self._running + self._waiting:
            why = "cancelled" if self._stopping else s.job.stop_reason(now)
            if why is None:
                continue
            if s.first_admitted_at is None:
                self._fail(s, JobNotRun(f"job {s.job.id} ({s.session_id}): {why} before it "
                                        f"started"))
            else:
                self._end(s, why)

    def _prepare(self) -> None:
        busy = {s.session_id for s in self._running}
        for s in sorted(self._waiting, key=lambda s: s.order):
            if s.session_id in busy:
                continue
            busy.add(s.session_id)
            if not s.prepared:
                try:
                    session = self.sessions.get(s.session_id) or Session(s.session_id)
                    self.sessions.check_writable(session)  # handed over: SessionFenced
                    t0 = time.perf_counter()
                    s.prepare(session, self.chat, self.tokenizer)
                    if s.rules is not None:
                        self.constraint_s += time.perf_counter() - t0
                except Exception as exc:  # noqa: BLE001 - bad input fails its job only
                    self._fail(s, exc)

    def _admit(self, s: Sequence) -> None:
        t0 = time.perf_counter()
        try:
            ok = self.blocks.admit(s)
        except Exception as exc:  # noqa: BLE001 - fails this job; the batch goes on
            self._fail(s, exc)
            return
        if not ok:
            if not self._running:
                self._fail(s, HotPoolFull(
                    f"hot pool cannot provide {self.blocks.need(s).blocks} blocks for session "
                    f"{s.session_id!r} even after dropping idle blocks: the rest is pinned or "
                    f"this request's own (kv.hot_bytes holds "
                    f"{self.blocks.resources().capacity_blocks} blocks); unpin blocks or raise "
                    f"kv.hot_bytes"))
            else:
                self._tried[id(s)] = self._room_epoch
            return
        self._tried.pop(id(s), None)
        job, now = s.job, time.perf_counter()
        s.admitted_at = now
        if s.first_admitted_at is None:
            s.first_admitted_at = t0
            job.started_step, job.started_at = self.step_count, time.monotonic()
            s.result.queue_wait_s = job.started_at - job.submitted_at
            self._waits[job.priority.name.lower()].append(s.result.queue_wait_s)
        job.move(JobState.RUNNING)
        with self._cond:
            self._waiting.remove(s)
            self._running.append(s)
        if s.first_logits is not None:  # resumed with its next token's logits: no forward
            logits, s.first_logits = s.first_logits.clone().unsqueeze(0), None
            why = s.accept(choose(logits, [s], self.tokenizer)[0], self.chat, self.tokenizer)
            if why is not None:
                self._end(s, why)

    def _preempt(self, s: Sequence) -> None:
        try:
            self.blocks.commit(s)
        finally:
            self.blocks.release(s)
        self._room_epoch += 1
        s.job.move(JobState.PAUSED)
        s.job.pauses += 1
        s.result.preemptions += 1
        self.preempted += 1
        if self.metrics is not None:
            self.metrics.preemptions.labels(s.priority.name.lower()).inc()
        log.debug("sequence_preempted", session=s.session_id, tokens=len(s.tokens))
        with self._cond:
            self._running.remove(s)
            self._waiting.append(s)

    def _end(self, s: Sequence, why: str) -> None:
        """Finish a started sequence: commit its blocks, save the session, hand the result."""
        res = s.result
        res.finish_reason = why
        try:
            if s.running:
                keys = self.blocks.commit(s)
                self.blocks.store.record_access(keys, s.session_id)
            else:  # preempted: its blocks were committed then
                keys = self.blocks.store.match_prefix(s.tokens).keys
            generated = s.generated
            on_cut = s.job.request.on_cut if why in CUT_SHORT else OnCut.ANSWER
            if s.session is not None and on_cut is OnCut.PROMPT:
                # the prompt's blocks stay the session's; the fragment's are not referenced
                ids = self.chat.unanswered(s.tokens[:s.n_prompt])
                shared = min(len(ids), s.n_prompt) // self.blocks.geometry.block_tokens
                self._save(s, ids, keys[:shared])
            elif s.session is not None and on_cut is OnCut.ANSWER and generated:
                self._save(s, s.tokens + self.chat.close_turn(generated), keys)
        except Exception as exc:  # noqa: BLE001 - fails this job; the batch goes on
            self._fail(s, exc)
            return
        self._release(s)
        if s.n_prompt:
            kept = self.chat.unanswered(s.tokens[:s.n_prompt])
            res.unanswered_tokens = len(kept) if kept == s.tokens[:len(kept)] else 0
        res.text = s.final_text(self.tokenizer)
        res.new_tokens = len(generated)
        end = time.perf_counter()
        res.total_s = end - (s.first_admitted_at or end)
        if s.first_token_at is not None:
            res.timings["decode_s"] = end - s.first_token_at
        self.completed += 1
        if self.metrics is not None:
            self.metrics.observe(s.priority.name.lower(), res)
        s.job.finish(res, None)

    def _save(self, s: Sequence, ids: list[int], keys: list[bytes]) -> None:
        """`s`'s session now holds `ids`, whose leading full blocks are `keys`."""
        session = s.session
        assert session is not None
        session.token_ids = ids
        session.block_keys = keys
        session.last_used = time.time()
        session.turns += 1
        self.sessions.save(session)
        s.result.saved = True
        s.result.session_tokens = len(ids)

    def _fail(self, s: Sequence, exc: BaseException) -> None:
        if not isinstance(exc, JobNotRun):
            log.error("generation_failed", job=s.job.id, session=s.session_id,
                      error=f"{type(exc).__name__}: {exc}")
        self._release(s)
        self.failed += 1
        if self.metrics is not None:
            self.metrics.requests.labels(s.priority.name.lower(), "failed").inc()
        s.job.finish(None, exc)

    def _release(self, s: Sequence) -> None:
        if s.running:
            self.blocks.release(s)
            self._room_epoch += 1
        self._tried.pop(id(s), None)
        with self._cond:
            if s in self._running:
                self._running.remove(s)
            if s in self._waiting:
                self._waiting.remove(s)

    # -- helpers ----------------------------------------------------------------------------

    def _queued_count(self) -> int:
        return len(self._queued) + sum(1 for s in self._waiting if s.first_admitted_at is None)

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

    def _too_big(self, s: Sequence, need: Need) -> Exception:
        res = self.blocks.resources()
        if need.blocks > res.capacity_blocks:
            return HotPoolFull(f"session {s.session_id!r} needs {need.blocks} hot blocks "
                               f"({s.final_tokens} tokens) but the hot pool has "
                               f"{res.capacity_blocks}; raise kv.hot_bytes or lower max tokens")
        return HotPoolFull(f"session {s.session_id!r} needs {need.bytes} bytes of working copy "
                           f"but executor.batch_memory_bytes is {res.capacity_bytes}")

    def _record_step(self, size: int, tokens: int, seconds: float) -> None:
        self.step_count += 1
        with self._cond:
            self._steps.append((size, tokens, seconds))
        if self.metrics is not None:
            self.metrics.batch_size.observe(size)
            self.metrics.step_seconds.observe(seconds)
            self.metrics.step_tokens.inc(tokens)
            room = self.blocks.resources()
            self.metrics.batch_memory.set(room.capacity_bytes - room.free_bytes)
            self.metrics.queue_depth.set(self._queued_count())
        if self.on_step is not None:
            self.on_step(size, tokens, seconds)


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    qs = statistics.quantiles(values, n=20) if len(values) > 1 else [values[0]] * 19
    return {"n": len(values), "p50": round(statistics.median(values), 4),
            "p95": round(qs[18], 4), "max": round(max(values), 4)}


def _batch_figures(steps: list[tuple[int, int, float]], config: ExecutorConfig
                   ) -> dict[str, Any]:
    out: dict[str, Any] = {"max_batch": config.max_batch, "step_tokens": config.step_tokens}
    if steps:
        sizes = [s for s, _, _ in steps]
        out.update(size_last=sizes[-1], size_mean=round(statistics.fmean(sizes), 2),
                   size_max=max(sizes),
                   tokens_mean=round(statistics.fmean(t for _, t, _ in steps), 1),
                   step_s=_quantiles([d for _, _, d in steps]))
    return out
