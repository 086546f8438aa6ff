"""One beat of ticks: every asset's turn due at the same instant goes to the engine together.

All tick jobs share one interval trigger start (`aligned_start`), so they fire at the same
instants; each runs its diagnosis in its own thread and then hands its turn to the `Beat`. The
beat submits the turns it holds in one `submit_all` call (they join the same model step, so
their prefills and decodes share every weight read) as soon as every tick in flight has either
handed its turn or finished without one, or `window_s` after the first turn, whichever comes
first. A tick run alone (`tick_once`) is submitted at once.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from kvagentd.engine.executor import GenerationRequest, QueueFull


class BatchSubmitter(Protocol):
    """What the beat needs of the engine's executor."""

    def submit_all(self, requests: Sequence[GenerationRequest]) -> Sequence[object]:
        """Queue every request at once; per request its job, or the `QueueFull` refusing it."""
        ...


@dataclass(slots=True)
class _Turn:
    request: GenerationRequest
    outcome: object = None  # the job, or the QueueFull that refused it


class Beat:
    """Collects the tick turns of one beat (see module docstring). Thread-safe."""

    def __init__(self, executor: BatchSubmitter, window_s: float = 0.5) -> None:
        self.executor = executor
        self.window_s = window_s
        self._cond = threading.Condition()
        self._in_flight = 0  # ticks inside `ticking()` that have not handed a turn yet
        self._pending: list[_Turn] = []
        self._local = threading.local()  # per tick thread: has it handed its turn?
        self.beats = 0  # submissions made, with their sizes
        self.last_size = 0

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Bracket one tick: the beat waits for the turns of ticks in flight."""
        self._local.handed = False
        with self._cond:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                if not self._local.handed:  # finished without a turn (bad data, no LLM)
                    self._in_flight = max(0, self._in_flight - 1)
                self._cond.notify_all()

    def submit(self, req: GenerationRequest) -> object:
        """Hand one tick's turn; returns its job once the beat is submitted. Raises
        `QueueFull` when the engine refused it."""
        turn = _Turn(req)
        with self._cond:
            self._pending.append(turn)
            if getattr(self._local, "handed", True) is False:  # inside `ticking()`
                self._local.handed = True
                self._in_flight = max(0, self._in_flight - 1)
            self._cond.notify_all()
            deadline = time.monotonic() + self.window_s
            while turn.outcome is None:
                if self._in_flight == 0 or time.monotonic() >= deadline:
                    self._flush()
                    break
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        if isinstance(turn.outcome, QueueFull):
            raise turn.outcome
        return turn.outcome

    def _flush(self) -> None:
        """Caller holds the lock: submit every pending turn at once."""
        turns, self._pending = self._pending, []
        if not turns:
            return
        outcomes = self.executor.submit_all([t.request for t in turns])
        for t, out in zip(turns, outcomes):
            t.outcome = out
        self.beats += 1
        self.last_size = len(turns)
        self._cond.notify_all()


def aligned_start(interval_s: float, now: float | None = None) -> dt.datetime:
    """The next instant that is a whole number of `interval_s` since the epoch (UTC): every
    tick job started from it fires at the same instants."""
    t = time.time() if now is None else now
    return dt.datetime.fromtimestamp(math.ceil(t / interval_s) * interval_s, tz=dt.UTC)
