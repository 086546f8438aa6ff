"""The persisted summary of the most used sessions: after a restart, warm-up loads them before
the first tick. JSON, written atomically; `load_summary` rejects a malformed file."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..base import BlockKey
from .stats import SessionRecord


@dataclass(frozen=True, slots=True)
class SessionSummary:
    session: str
    score: float  # decayed use (blocks touched), as of the summary
    keys: tuple[BlockKey, ...]  # the blocks of its last request, in prefix order


def save_summary(path: str | os.PathLike[str], sessions: Mapping[str, SessionRecord], *,
                 max_sessions: int, keys_per_session: int = 256) -> None:
    """Write the `max_sessions` highest-scored sessions and their recent keys (atomic)."""
    ranked = sorted(sessions.items(), key=lambda kv: -kv[1].score)[:max_sessions]
    doc = {"version": 2, "sessions": [
        {"session": s, "score": r.score, "keys": [k.hex() for k in r.keys[-keys_per_session:]]}
        for s, r in ranked]}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, p)


def load_summary(path: str | os.PathLike[str]) -> list[SessionSummary]:
    """Read a summary written by `save_summary` (or the version-1 heat summary), highest score
    first. Raises ValueError on a malformed file; a missing file is an empty summary."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        doc = json.loads(p.read_text())
        out = [SessionSummary(str(e["session"]), float(e["score"] if "score" in e else e["heat"]),
                              tuple(bytes.fromhex(k) for k in e["keys"]))
               for e in doc["sessions"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed session summary {p}: {exc}") from exc
    out.sort(key=lambda s: -s.score)
    return out
