"""Which sequences run in the next step: a pure plan from the current state.

Rank. A sequence's rank is its class (tick 0 < ask 1 < report 2) lowered by one for every
`aging_s` seconds since it was submitted, never below 0; ties go to the earlier submission.
Ranks order everything: admission, the token budget and the choice of preemption victims.
Aging is the no-starvation rule: under a saturated tick load an ask or report waits at most
`class * aging_s` before it ranks with the ticks, and as it was submitted before them it is
admitted ahead of every tick submitted after it; once it ranks 0 nothing preempts it.

Admission. Waiting sequences, best rank first, at most one per session (a session's jobs never
overlap), join while the batch has a free place (`max_batch`), the hot pool room for all the
blocks they will need (reused + computed) and the memory budget room for their working copy.
When the best waiting sequence does not fit, running sequences of a strictly worse rank are
preempted, worst first, if that makes it fit; otherwise admission stops there, so nothing of
a worse rank overtakes it. A sequence that could never fit, even alone, is reported as such.

Token budget. Every running sequence with a pending token and a decode to do gets its token
first (best rank first), then prefill chunks (at most `prefill_chunk` each) fill the rest of
`step_tokens` in rank order, so prefills never starve decodes. A step with no decode to do
runs prefills at full width, up to `prefill_tokens` in all, as a one-shot prefill would:
chunking only splits a prompt while decodes wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvagentd.engine.job import Priority


class Schedulable(Protocol):
    """What the scheduler reads of a sequence (implemented by `sequence.Sequence` + its job)."""

    @property
    def session_id(self) -> str: ...

    @property
    def order(self) -> int:
        """Submission order (the job id)."""

    @property
    def priority(self) -> Priority: ...

    @property
    def submitted_at(self) -> float:
        """`time.monotonic()` at submit."""

    @property
    def running(self) -> bool: ...

    @property
    def pending(self) -> int:
        """Tokens to run before its next token (running sequences)."""

    @property
    def blocks_held(self) -> int: ...

    @property
    def bytes_held(self) -> int: ...


S = TypeVar("S", bound=Schedulable)


@dataclass(frozen=True, slots=True)
class Resources:
    """Room as the engine accounts it: hot blocks and bytes held by running sequences."""

    capacity_blocks: int
    free_blocks: int
    capacity_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class Need:
    blocks: int
    bytes: int


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch: int = 16
    step_tokens: int = 256
    prefill_chunk: int = 256
    aging_s: float = 10.0
    prefill_tokens: int = 4096


@dataclass(slots=True)
class StepPlan(Generic[S]):
    preempt: list[S] = field(default_factory=list)
    admit: list[S] = field(default_factory=list)
    never_fit: list[S] = field(default_factory=list)


class Scheduler:
    """Plans admission, preemption and the token budget of each step (see module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_batch < 1 or config.step_tokens < config.max_batch:
            raise ValueError("need max_batch >= 1 and step_tokens >= max_batch")
        self.config = config

    def rank(self, s: Schedulable, now: float) -> tuple[int, int]:
        aged = int((now - s.submitted_at) / self.config.aging_s) if self.config.aging_s > 0 else 0
        return max(0, int(s.priority) - max(0, aged)), s.order

    def admission(self, waiting: Sequence[S], running: Sequence[S], needs: dict[int, Need],
                  res: Resources, now: float) -> StepPlan[S]:
        """Preemptions and admissions for this step. `needs[id(s)]` is what each waiting
        sequence would hold once admitted; waiting sequences without an entry are skipped
        (not prepared yet)."""
        plan: StepPlan[S] = StepPlan()
        busy = {s.session_id for s in running}
        free_blocks, free_bytes = res.free_blocks, res.free_bytes
        places = self.config.max_batch - len(running)
        victims = sorted(running, key=lambda s: self.rank(s, now), reverse=True)
        candidates: list[S] = []
        seen: set[str] = set()
        for s in sorted(waiting, key=lambda s: s.order):  # only the first job of a session
            if s.session_id in seen or s.session_id in busy:
                seen.add(s.session_id)
                continue
            seen.add(s.session_id)
            if id(s) in needs:
                candidates.append(s)
        for c in sorted(candidates, key=lambda s: self.rank(s, now)):
            need = needs[id(c)]
            if need.blocks > res.capacity_blocks or need.bytes > res.capacity_bytes:
                plan.never_fit.append(c)
                continue
            rank = self.rank(c, now)[0]
            short = self._short(need, free_blocks, free_bytes, places)
            if short:
                worse = [v for v in victims if self.rank(v, now)[0] > rank]
                gain_b = free_blocks + sum(v.blocks_held for v in worse)
                gain_m = free_bytes + sum(v.bytes_held for v in worse)
                if self._short(need, gain_b, gain_m, places + len(worse)):
                    break  # even preempting every worse-ranked sequence would not make room
                while self._short(need, free_blocks, free_bytes, places):
                    v = worse.pop(0)
                    victims.remove(v)
                    plan.preempt.append(v)
                    free_blocks += v.blocks_held
                    free_bytes += v.bytes_held
                    places += 1
            plan.admit.append(c)
            free_blocks -= need.blocks
            free_bytes -= need.bytes
            places -= 1
        return plan

    def budget(self, running: Sequence[S], now: float) -> list[tuple[S, int]]:
        """Tokens each running sequence runs this step: decodes first, then prefill chunks."""
        cfg = self.config
        ranked = sorted((s for s in running if s.pending > 0), key=lambda s: self.rank(s, now))
        decoding = any(s.pending == 1 for s in ranked)
        left = cfg.step_tokens if decoding else max(cfg.step_tokens, cfg.prefill_tokens)
        chunk = cfg.prefill_chunk if decoding else left
        out: dict[int, tuple[S, int]] = {}
        for s in ranked:
            if s.pending == 1 and left > 0:
                out[id(s)] = (s, 1)
                left -= 1
        for s in ranked:
            if s.pending > 1 and left > 0:
                n = min(s.pending, chunk, left)
                out[id(s)] = (s, n)
                left -= n
        return [out[id(s)] for s in ranked if id(s) in out]

    @staticmethod
    def _short(need: Need, free_blocks: int, free_bytes: int, places: int) -> bool:
        return need.blocks > free_blocks or need.bytes > free_bytes or places < 1
