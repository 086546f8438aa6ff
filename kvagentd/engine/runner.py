"""The data path of one request, top-down in `Runner.run`:

    match_prefix(all token ids) -> ensure_resident(matched blocks) -> prefill the unmatched
    suffix (the partial tail included; it is never stored) -> greedy decode -> commit the new
    full blocks -> record_access -> save the session.

`run` is a generator that yields after every model step (a prefill chunk or one decode
token), so the executor can pause it and run a more urgent request in between. Its return
value (StopIteration.value) is the `GenerationResult`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import structlog
import torch

from kvagentd.engine.cache import HotPoolCache, Workspaces, new_cache
from kvagentd.engine.sessions import ChatFormat, Session, SessionStore
from kvagentd.kvcache.base import KVStore

log = structlog.get_logger(__name__)

PREFILL_CHUNK = 512


class HotPoolFull(RuntimeError):
    """The hot pool cannot hold this request's new blocks even after demoting idle blocks."""


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
    ttft_s: float = 0.0  # from the start of the run (after queueing) to the first token
    total_s: float = 0.0
    queue_wait_s: float = 0.0
    loaded: dict[str, int] = field(default_factory=dict)  # blocks by tier they came from
    timings: dict[str, float] = field(default_factory=dict)  # where the time went

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class Runner:
    """Runs requests for one model over one store. Not thread-safe: one model worker."""

    def __init__(self, model: Any, tokenizer: Any, store: KVStore, sessions: SessionStore, *,
                 workspaces: Workspaces | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 on_recompute: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.sessions = sessions
        self.chat = ChatFormat(tokenizer)
        self.geometry = store.geometry
        self.device = store.hot_arena().device
        self.workspaces = workspaces or Workspaces(self.geometry, self.device)
        self.prefill_chunk = prefill_chunk
        self.on_recompute = on_recompute

    def prompt_ids(self, session: Session, text: str | None, system: str | None) -> list[int]:
        """The session's ids plus the new turn (templated alone; history is never re-encoded).
        `text=None` continues the session's ids as they are (no new turn)."""
        if text is None:
            if not session.token_ids:
                raise ValueError(f"session {session.id!r} has no tokens to continue")
            return list(session.token_ids)
        if not session.token_ids:
            return self.chat.first_turn(system, text)
        return session.token_ids + self.chat.next_turn(text)

    def run(self, session_id: str, text: str | None, *, system: str | None = None,
            max_new_tokens: int = 64, stop: Callable[[], str | None] = lambda: None,
            on_text: Callable[[str], None] | None = None,
            ) -> Generator[None, None, GenerationResult]:
        t0 = time.perf_counter()
        res = GenerationResult(session=session_id)
        session = self.sessions.get(session_id) or Session(session_id)
        ids = self.prompt_ids(session, text, system)
        cache: HotPoolCache | None = None
        try:
            cache, used_keys = self._restore(session_id, ids, max_new_tokens, res)
            logits = yield from self._prefill(cache, ids[cache.get_seq_length():], res)
            generated = yield from self._decode(cache, logits, max_new_tokens, stop, on_text,
                                                res, t0)
            stored_keys = self._commit(session_id, ids + generated, cache, used_keys)
            self.store.record_access(stored_keys, session_id)
        finally:
            self.store.release(session_id)
            if cache is not None:
                cache.release_workspace()
        session.token_ids = ids + generated + self.chat.close_turn(generated)
        session.block_keys = stored_keys
        session.last_used = time.time()
        session.turns += 1
        self.sessions.save(session)
        res.total_s = time.perf_counter() - t0
        return res

    # -- steps ------------------------------------------------------------------------------

    def _restore(self, session_id: str, ids: list[int], max_new_tokens: int,
                 res: GenerationResult) -> tuple[HotPoolCache, list[bytes]]:
        """Match and load the longest stored prefix; bind private slots for the new blocks."""
        bt = self.geometry.block_tokens
        t = time.perf_counter()
        match = self.store.match_prefix(ids)
        res.timings["match_s"] = time.perf_counter() - t
        t = time.perf_counter()
        residency = self.store.ensure_resident(match.keys, session_id)
        res.timings["resident_s"] = time.perf_counter() - t
        res.loaded = dict(residency.loaded)
        usable = residency.slots[: len(match.keys)]
        if residency.missing_from is not None:
            usable = residency.slots[: residency.missing_from]
            res.recomputed_tokens = (len(match.keys) - len(usable)) * bt
            if self.on_recompute is not None:
                self.on_recompute(res.recomputed_tokens)
            log.warning("blocks_recomputed", session=session_id,
                        first_missing=residency.missing_from, tokens=res.recomputed_tokens)
        t = time.perf_counter()
        cache = new_cache(self.geometry, self.store.hot_arena(), len(ids) + max_new_tokens,
                          self.workspaces)
        cache.load_blocks(usable)
        if cache.get_seq_length() >= len(ids):
            cache.crop(-1)  # every input token is cached: re-run the last one for its logits
        res.timings["gather_s"] = time.perf_counter() - t
        res.reused_tokens = cache.get_seq_length()
        res.prompt_tokens = len(ids)
        n_new = (len(ids) + max_new_tokens) // bt - len(usable)
        slots = self.store.allocate_hot(n_new, session_id) if n_new > 0 else []
        if slots is None:
            cache.release_workspace()
            raise HotPoolFull(f"hot pool cannot provide {n_new} blocks for session "
                              f"{session_id!r} (warm tier full too); retry later or raise "
                              f"kv.hot_bytes")
        cache.bind_new_slots(slots)
        return cache, list(match.keys[: len(usable)])

    def _prefill(self, cache: HotPoolCache, suffix: list[int], res: GenerationResult
                 ) -> Generator[None, None, torch.Tensor]:
        """Run the unmatched suffix in chunks; returns the last position's logits."""
        t = time.perf_counter()
        res.prefill_tokens = len(suffix)
        logits = None
        for i in range(0, len(suffix), self.prefill_chunk):
            logits = self._forward(cache, suffix[i: i + self.prefill_chunk])
            if i + self.prefill_chunk < len(suffix):
                yield
        res.timings["prefill_s"] = time.perf_counter() - t
        assert logits is not None  # the suffix always has at least one token
        return logits

    def _decode(self, cache: HotPoolCache, logits: torch.Tensor, max_new_tokens: int,
                stop: Callable[[], str | None], on_text: Callable[[str], None] | None,
                res: GenerationResult, t0: float) -> Generator[None, None, list[int]]:
        """Greedy decode until a stop token, `max_new_tokens`, or `stop()` says why not."""
        generated: list[int] = []
        shown = ""
        t_dec = time.perf_counter()
        while True:
            tok = int(logits.argmax())
            generated.append(tok)
            if len(generated) == 1:
                res.ttft_s = time.perf_counter() - t0
                res.timings["first_token_s"] = time.perf_counter() - t_dec
            if tok in self.chat.stop_ids:
                res.finish_reason = "stop"
            else:
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if on_text is not None and text.startswith(shown) and len(text) > len(shown):
                    on_text(text[len(shown):])
                    shown = text
                if len(generated) >= max_new_tokens:
                    res.finish_reason = "length"
                elif (why := stop()) is not None:
                    res.finish_reason = why
            if res.finish_reason:
                break
            yield
            logits = self._forward(cache, [tok])
        res.text = self.tokenizer.decode(generated, skip_special_tokens=True)
        res.new_tokens = len(generated)
        res.timings["decode_s"] = time.perf_counter() - t_dec
        return generated

    def _commit(self, session_id: str, ids: list[int], cache: HotPoolCache,
                used_keys: list[bytes]) -> list[bytes]:
        """Publish the blocks this request wrote; returns every stored key of the session."""
        if not cache.written:
            return used_keys
        first = cache.written[0][0]
        assert first == len(used_keys), "written blocks must follow the reused prefix"
        new_keys = self.store.commit(session_id, ids, [s for _, s in cache.written], first)
        return used_keys + list(new_keys)

    @torch.no_grad()
    def _forward(self, cache: HotPoolCache, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]
