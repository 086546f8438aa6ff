"""The logits that followed a prompt, kept so a resume needs no forward before its first token.

A request's first answer token is chosen from the logits at the end of its prompt. They are
kept here, content-addressed by the prompt's ids (as block keys are), for the most recent
`capacity` prompts. A later request whose ids are exactly such a prompt, every one of them in
stored blocks (a stored session continued with no new turn, a request retried after a
failure), takes its first token from them: restore its KV, choose, go on, the way a
llama.cpp session file carries its last logits. Without an entry the last id is run again.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch
import xxhash

from kvagentd.engine.sessions import pack_ids


class LogitsMemo:
    """Bounded LRU of `ids -> logits of the next token` (float32, on the logits' device)."""

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._d: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    @staticmethod
    def key(ids: Sequence[int]) -> bytes:
        return xxhash.xxh3_128_digest(pack_ids(ids)) + len(ids).to_bytes(4, "little")

    def put(self, ids: Sequence[int], logits: torch.Tensor) -> None:
        if self.capacity <= 0:
            return
        k = self.key(ids)
        with self._lock:
            self._d[k] = logits.detach().float().clone()
            self._d.move_to_end(k)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def get(self, ids: Sequence[int]) -> torch.Tensor | None:
        k = self.key(ids)
        with self._lock:
            hit = self._d.get(k)
            if hit is not None:
                self._d.move_to_end(k)
                self.hits += 1
        return hit

    def nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._d.values())
