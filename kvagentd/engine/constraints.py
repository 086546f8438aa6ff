"""Decoding constraints of one request: an opening the answer starts with, phrases it may not
produce, and spans of a text it may not copy.

`Constraints` is what a caller asks for (plain text, tokenizer-free); `Rules` is its compiled
form over one tokenizer, applied to one sequence's greedy choice at every step:

- **opening**: its ids are fed after the prompt as the first ids of the answer (the model
  completes them); they count as generated text.
- **banned**: each phrase in the spellings a tokenizer produces in running text (as written,
  capitalized, upper case; with and without a leading space) becomes token sequences; once
  the answer ends with all but the last id of one, that last id is masked. A one-token
  phrase is masked at every step.
- **no_copy**: no `no_copy_tokens`-gram of that text that holds at least `COPY_WORDS` word
  tokens may be completed (except n-grams that also occur in `allow`, e.g. the current
  observation the answer should restate). Digits are a token each, so `: RMS 0.9` is five
  tokens but one word: a reading, not a copy of the summary it also appears in.
- **no_repeat**: no n-gram of the answer's own ids may be completed twice (a small model's
  "no repair, no repair, no repair").
- **guard**: a check of the answer's text: the greedy candidate whose text it rejects is
  masked and the next best taken (at most `GUARD_TRIES` times). It catches what token masks
  cannot: the same words reached through another tokenization ("2xBSF" as "x", "BS", "F").

The greedy choice stays deterministic: the masked logits' argmax. Cost: a few dictionary
look-ups per constrained sequence and step, and a decode and the guard's check of the answer
when it has one, outside the model's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

GUARD_TRIES = 8  # candidates a guard may reject in one step before the best one is taken
COPY_WORDS = 3  # word tokens (two letters or more) a span must hold to count as a copy


@dataclass(frozen=True, slots=True)
class Constraints:
    opening: str = ""
    banned: tuple[str, ...] = ()
    no_copy: str = ""
    allow: str = ""  # n-grams also found here stay allowed (what the answer should restate)
    no_copy_tokens: int = 5
    no_repeat: int = 0  # n of the answer's own n-grams that may not repeat (0: off)
    guard: Callable[[str], str | None] | None = None  # why an answer text is refused, or None

    def __bool__(self) -> bool:
        return bool(self.opening or self.banned or self.no_copy or self.no_repeat
                    or self.guard)


def _spellings(phrase: str) -> set[str]:
    forms = {phrase, phrase.lower(), phrase[:1].upper() + phrase[1:], phrase.upper()}
    return {f for p in forms for f in (p, " " + p)}


class Rules:
    """`Constraints` compiled for `tokenizer` (see module docstring)."""

    def __init__(self, c: Constraints, tokenizer: Any) -> None:
        self.opening_ids = _encode(tokenizer, c.opening) if c.opening else []
        self.guard = c.guard
        self._repeat = c.no_repeat
        # prefix (tuple of ids) -> ids that may not follow it
        self._next: dict[tuple[int, ...], set[int]] = {}
        for ids in _banned_sequences(tokenizer, tuple(sorted(set(c.banned)))):
            self._next.setdefault(ids[:-1], set()).add(ids[-1])
        self._lengths = sorted({len(k) for k in self._next})
        self._n = max(2, c.no_copy_tokens)
        self._grams: dict[tuple[int, ...], set[int]] = {}
        if c.no_copy:
            allowed = {g for text in ((c.allow, " " + c.allow) if c.allow else ())
                       for g in _ngrams(_encode(tokenizer, text), self._n)}
            words = _word_ids(tokenizer)
            for g in _ngrams(_encode(tokenizer, c.no_copy), self._n):
                if g not in allowed and sum(t in words for t in g) >= COPY_WORDS:
                    self._grams.setdefault(g[:-1], set()).add(g[-1])

    def __bool__(self) -> bool:
        return bool(self._next or self._grams or self._repeat or self.guard)

    def banned_next(self, answer: Sequence[int]) -> set[int]:
        """Ids the next token may not be, after the answer's ids so far."""
        out: set[int] = set()
        n = len(answer)
        r = self._repeat
        if r and n >= r:
            tail = tuple(answer[n - r + 1:])
            out.update(answer[i + r - 1] for i in range(n - r + 1)
                       if tuple(answer[i: i + r - 1]) == tail)
        for k in self._lengths:
            if k <= n:
                hit = self._next.get(tuple(answer[n - k:]) if k else ())
                if hit:
                    out |= hit
        if self._grams and n >= self._n - 1:
            hit = self._grams.get(tuple(answer[n - self._n + 1:]))
            if hit:
                out |= hit
        return out


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_WORD_IDS: dict[int, frozenset[int]] = {}


def _word_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose token holds a word (two letters or more), once per tokenizer."""
    key = id(tokenizer)
    got = _WORD_IDS.get(key)
    if got is None:
        vocab = tokenizer.get_vocab()
        got = frozenset(i for tok, i in vocab.items()
                        if sum(ch.isalpha() for ch in tok.lstrip("Ġ▁ ")) >= 2)
        _WORD_IDS[key] = got
        _TOKENIZERS.setdefault(key, tokenizer)  # keeps the id from being reused
    return got


def _ngrams(ids: Sequence[int], n: int) -> Iterable[tuple[int, ...]]:
    return (tuple(ids[i: i + n]) for i in range(len(ids) - n + 1))


@functools.lru_cache(maxsize=64)
def _banned_cached(tokenizer_id: int, phrases: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    tokenizer = _TOKENIZERS[tokenizer_id]
    seqs = {tuple(_encode(tokenizer, s)) for p in phrases for s in _spellings(p)}
    return tuple(s for s in seqs if s)


_TOKENIZERS: dict[int, Any] = {}


def _banned_sequences(tokenizer: Any, phrases: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Token sequences of every spelling of `phrases` (cached per tokenizer and phrase set:
    the agent asks for the same few sets tick after tick)."""
    _TOKENIZERS.setdefault(id(tokenizer), tokenizer)
    return _banned_cached(id(tokenizer), phrases)


class Constrained(Protocol):
    """A sequence as `choose` reads it (implemented by `sequence.Sequence`)."""

    rules: Rules | None
    guard_gave_up: bool

    def banned_next(self) -> set[int]: ...

    def text_with(self, token: int, tokenizer: Any) -> str: ...


def choose(logits: Any, rows: Sequence[Constrained], tokenizer: Any) -> list[int]:
    """The greedy token of each row of `logits` under its sequence's constraints: the ids they
    forbid masked (one indexed write for all rows), then a row whose guard refuses its
    candidate's text takes the next best, at most `GUARD_TRIES` times (after that its guard is
    not asked again: the caller's own check referees)."""
    r_idx: list[int] = []
    t_idx: list[int] = []
    for i, s in enumerate(rows):
        banned = s.banned_next()
        if banned:
            r_idx += [i] * len(banned)
            t_idx += banned
    if r_idx:
        logits[r_idx, t_idx] = float("-inf")
    tokens: list[int] = logits.argmax(-1).tolist()
    for i, s in enumerate(rows):
        if s.rules is None or s.rules.guard is None or s.guard_gave_up:
            continue
        for _ in range(GUARD_TRIES):
            if s.rules.guard(s.text_with(tokens[i], tokenizer)) is None:
                break
            logits[i, tokens[i]] = float("-inf")
            tokens[i] = int(logits[i].argmax())
        else:
            s.guard_gave_up = True
    return tokens
