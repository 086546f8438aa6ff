"""Requests a simulator replays: one inference event = the blocks it touched, in prefix order."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvagentd.kvcache.base import BlockKey
from kvagentd.kvcache.placement.trace_recorder import AccessEvent


@dataclass(frozen=True, slots=True)
class Request:
    """One inference event: the blocks it touched, in order."""

    tick: int
    time: float
    session: str
    keys: tuple[BlockKey, ...]


def to_requests(events: Iterable[AccessEvent]) -> list[Request]:
    """Group consecutive events of one tick and session (a dumped daemon trace) into requests."""
    out: list[Request] = []
    cur: list[BlockKey] = []
    head: AccessEvent | None = None
    for e in events:
        if head is not None and (e.tick != head.tick or e.session != head.session):
            out.append(Request(head.tick, head.time, head.session, tuple(cur)))
            cur = []
        if not cur:
            head = e
        cur.append(e.key)
    if head is not None and cur:
        out.append(Request(head.tick, head.time, head.session, tuple(cur)))
    return out
