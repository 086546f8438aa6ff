"""One request inside the engine: its token ids, its KV while it runs, its result so far.

A sequence's token ids are the session's ids plus the new turn (the prompt), then the tokens it
generates. Its KV covers `kv.length` of them; the rest (a prompt suffix, a resumed sequence's
tail, or the last generated token) are its pending tokens, fed at the next steps. Preemption
drops the KV but keeps the ids, so a resumed sequence continues exactly where it stopped.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from kvagentd.engine.constraints import Rules
from kvagentd.engine.job import GenerationResult
from kvagentd.engine.kv import SequenceKV
from kvagentd.engine.sessions import ChatFormat, Session

if TYPE_CHECKING:
    from kvagentd.engine.job import Job, Priority


_SENTENCE_END = re.compile(r"(?<![0-9])[.!?](?=\s|$)|[.!?](?=\s)")


def sentence_end(text: str) -> int | None:
    """Where the first sentence of `text` ends (the index after its `.`, `!` or `?`), or None
    while it has not ended. A full stop ends a sentence when whitespace follows it, or, at the
    very end of the text, when it does not follow a digit (so "0.9" is still a number that
    may go on, while "zone A." has ended)."""
    m = _SENTENCE_END.search(text.lstrip())
    return None if m is None else m.end() + len(text) - len(text.lstrip())


class Sequence:
    """The engine's state of one job (owned by the model worker; not thread-safe)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.session_id = job.request.session
        self.session: Session | None = None
        self.tokens: list[int] = []
        self.n_prompt = 0  # ids before the answer (the answer's forced opening follows them)
        self.n_forced = 0  # ids of the opening, fed as the answer's first ids
        self.rules: Rules | None = None
        self.guard_gave_up = False  # its guard refused every candidate once: not asked again
        self.first_logits: Any = None  # logits of its first token, known at admission (memo)
        self.kv: SequenceKV | None = None
        self.used_keys: list[bytes] = []  # stored keys of its leading blocks, held while running
        self.blocks_held = 0  # hot blocks it holds while running (reused + private)
        self.bytes_held = 0  # bytes it holds outside the hot pool while running
        self.result = GenerationResult(session=self.session_id)
        self.first_admitted_at: float | None = None  # perf_counter() when admission began
        self.admitted_at = 0.0  # perf_counter() when its latest admission ended
        self.first_token_at: float | None = None
        self._shown = ""

    # -- set-up -----------------------------------------------------------------------------

    @property
    def prepared(self) -> bool:
        return self.session is not None

    def prepare(self, session: Session, chat: ChatFormat, tokenizer: Any = None) -> None:
        """Build the prompt ids: the session's ids plus the new turn (templated alone; history
        is never re-encoded), then the ids of the answer's opening, if the request has one. A
        request without text continues the session's ids as they are."""
        text, system = self.job.request.text, self.job.request.system
        constraints = self.job.request.constraints
        if text is None:
            if not session.token_ids:
                raise ValueError(f"session {session.id!r} has no tokens to continue")
            ids = list(session.token_ids)
        elif not session.token_ids:
            ids = chat.first_turn(system, text)
        else:
            ids = session.token_ids + chat.next_turn(text)
        self.session = session
        self.result.turn_start = len(session.token_ids)
        self.n_prompt = len(ids)
        if constraints and tokenizer is not None:
            self.rules = Rules(constraints, tokenizer)
            ids = ids + self.rules.opening_ids
            self.n_forced = len(self.rules.opening_ids)
        self.tokens = ids
        self.result.prompt_tokens = len(ids)

    # -- figures the scheduler reads --------------------------------------------------------

    @property
    def order(self) -> int:
        return self.job.id

    @property
    def priority(self) -> Priority:
        return self.job.request.priority

    @property
    def submitted_at(self) -> float:
        return self.job.submitted_at

    @property
    def choosing_first(self) -> bool:
        """Its next token is the answer's first one."""
        return len(self.tokens) == self.n_prompt + self.n_forced

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def remaining_new(self) -> int:
        return max(0, self.job.request.max_new_tokens - (len(self.tokens) - self.n_prompt))

    @property
    def final_tokens(self) -> int:
        """Most positions its KV can reach: every id so far plus the tokens still to come."""
        return len(self.tokens) + self.remaining_new

    @property
    def running(self) -> bool:
        return self.kv is not None

    @property
    def pending(self) -> int:
        """Tokens not yet run through the model (0 when not running)."""
        return 0 if self.kv is None else len(self.tokens) - self.kv.length

    def chunk(self, n: int) -> list[int]:
        return self.tokens[self.kv_or_fail().length: self.kv_or_fail().length + n]

    def kv_or_fail(self) -> SequenceKV:
        if self.kv is None:
            raise RuntimeError(f"sequence of session {self.session_id!r} is not running")
        return self.kv

    # -- generation -------------------------------------------------------------------------

    def banned_next(self) -> set[int]:
        """Ids the request's constraints forbid as its next token (none: empty)."""
        if not self.rules:
            return set()
        return self.rules.banned_next(self.tokens[self.n_prompt:])

    def text_with(self, token: int, tokenizer: Any) -> str:
        """The answer's text if `token` came next."""
        return str(tokenizer.decode(self.tokens[self.n_prompt:] + [token],
                                    skip_special_tokens=True))

    def accept(self, token: int, chat: ChatFormat, tokenizer: Any) -> str | None:
        """Take the next greedy token; returns why the sequence ends now, or None."""
        first = self.choosing_first
        self.tokens.append(token)
        if first:
            now = self.first_token_at = time.perf_counter()
            self.result.ttft_s = now - (self.first_admitted_at or now)
            self.result.timings["prefill_s"] = now - self.admitted_at
        if token in chat.stop_ids:
            return "stop"
        text, ended = self._cut(str(tokenizer.decode(self.generated, skip_special_tokens=True)))
        if text.startswith(self._shown) and len(text) > len(self._shown):
            self.job.emit(text[len(self._shown):])
            self._shown = text
        if ended:
            return "stop"
        if self.remaining_new == 0:
            return "length"
        return None

    def final_text(self, tokenizer: Any) -> str:
        """The generated text; for a one-sentence request, up to the end of that sentence (the
        token that showed the end may carry the next word's start: its ids stay in the
        session, so the session's ids and KV agree, but it is not shown)."""
        return self._cut(str(tokenizer.decode(self.generated, skip_special_tokens=True)))[0]

    def _cut(self, text: str) -> tuple[str, bool]:
        """`text` as shown, and whether it has ended: a one-sentence request's text ends with
        its first sentence."""
        end = sentence_end(text) if self.job.request.one_sentence else None
        return (text, False) if end is None else (text[:end], True)
