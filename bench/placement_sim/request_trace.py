"""Request traces the simulator replays: one request = the blocks one inference event touched, in
prefix order, at a time, in a session.

Stored as flat numpy arrays (no per-block Python objects): `times[i]`, the block ids
`blocks[offsets[i]:offsets[i+1]]` (dense ids 0..n_blocks-1) and `sessions[i]` of request i.

Files it reads (`read_trace`):
- request traces as JSON lines, as published for prefix-cache workloads (Mooncake's format):
  one request per line, `{"timestamp": MS, "hash_ids": [ID, ...]}`, each id one block of
  `block_tokens` tokens; optional `"session_id"` (or `"session"`, `"chat_id"`). Other fields
  (`input_length`, `output_length`) are ignored. Without session ids a request continues the
  session whose last request it re-reads (see `_SessionGuess`), else it starts a new one.
- the daemon's own block-access trace (`kvctl trace dump`, `.jsonl` with its header, or `.npz`),
  with the daemon's block size where the header gives it.
`write_jsonl` writes the first format (with session ids).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvagentd.kvcache.base import BlockKey
from kvagentd.kvcache.placement.trace_recorder import (AccessEvent, BlockSize,
                                                         load_block_size, load_trace)


@dataclass(slots=True)
class RequestTrace:
    name: str
    times: np.ndarray  # float64 seconds, non-decreasing
    offsets: np.ndarray  # int64, len(times) + 1
    blocks: np.ndarray  # int64 block ids
    sessions: np.ndarray  # int32 index into session_names
    session_names: list[str]
    n_blocks: int
    preload: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # cold at start
    keys: list[BlockKey] | None = None  # the block keys of a daemon trace, by id
    block_size: BlockSize | None = None  # the daemon's block, where its trace gives it

    def __len__(self) -> int:
        return int(self.times.shape[0])

    @property
    def accesses(self) -> int:
        return int(self.blocks.shape[0])

    def request(self, i: int) -> np.ndarray:
        return self.blocks[self.offsets[i]:self.offsets[i + 1]]

    def block_keys(self) -> list[BlockKey]:
        """A 16-byte key per block id (the daemon's keys where the trace came from it)."""
        if self.keys is None:
            self.keys = [i.to_bytes(16, "big") for i in range(self.n_blocks)]
        return self.keys

    def head(self, n: int) -> RequestTrace:
        """The first `n` requests (a smoke run)."""
        n = min(n, len(self))
        m = int(self.offsets[n])
        return RequestTrace(self.name, self.times[:n], self.offsets[:n + 1], self.blocks[:m],
                            self.sessions[:n], self.session_names, self.n_blocks, self.preload,
                            self.keys)

    def summary(self) -> dict[str, object]:
        """Shape figures: requests, accesses, distinct blocks, first-touch share, span."""
        seen = np.zeros(self.n_blocks, dtype=bool)
        seen[self.preload] = True
        distinct = int(np.unique(self.blocks).size) if self.accesses else 0
        first = _first_touches(self.blocks, seen)
        span = float(self.times[-1] - self.times[0]) if len(self) else 0.0
        return {"name": self.name, "requests": len(self), "block_accesses": self.accesses,
                "distinct_blocks": distinct, "first_touch_share":
                (int(first.sum()) / self.accesses) if self.accesses else 0.0,
                "sessions": int(np.unique(self.sessions).size) if len(self) else 0,
                "span_s": span, "preloaded_cold": int(self.preload.size)}


def _first_touches(blocks: np.ndarray, seen_before: np.ndarray) -> np.ndarray:
    """Mask of accesses that are the first use of their block (and not preloaded)."""
    _, first_idx = np.unique(blocks, return_index=True)
    out = np.zeros(blocks.shape[0], dtype=bool)
    out[first_idx] = True
    return out & ~seen_before[blocks]


class TraceBuilder:
    """Collects requests in any order; `finish` sorts them by time (ties: insertion order)."""

    def __init__(self) -> None:
        self.n_blocks = 0
        self._t: list[float] = []
        self._s: list[int] = []
        self._ids: list[np.ndarray] = []
        self._names: dict[str, int] = {}
        self._preload: list[int] = []

    def new_blocks(self, n: int) -> list[int]:
        out = list(range(self.n_blocks, self.n_blocks + n))
        self.n_blocks += n
        return out

    def add(self, t: float, session: str, ids: Sequence[int]) -> None:
        sid = self._names.setdefault(session, len(self._names))
        self._t.append(float(t))
        self._s.append(sid)
        self._ids.append(np.asarray(ids, dtype=np.int64))

    def preload(self, ids: Iterable[int]) -> None:
        """Blocks that exist (in cold) before the trace starts."""
        self._preload.extend(ids)

    def finish(self, name: str) -> RequestTrace:
        order = np.argsort(np.asarray(self._t, dtype=np.float64), kind="stable")
        ids = [self._ids[i] for i in order.tolist()]
        lens = np.fromiter((a.size for a in ids), np.int64, len(ids))
        offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        blocks = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        return RequestTrace(name, np.asarray(self._t, np.float64)[order], offsets, blocks,
                            np.asarray(self._s, np.int32)[order], list(self._names),
                            self.n_blocks, np.asarray(self._preload, np.int64))


# ------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------

def read_trace(path: str | os.PathLike[str], *, name: str | None = None) -> RequestTrace:
    """A request trace from `path`: a daemon trace dump (`.npz`, or JSON lines with the
    kvagentd header) or request JSON lines (see module docstring). Raises ValueError on a
    malformed file, naming the line."""
    p = Path(path)
    label = name or p.stem
    if p.suffix == ".npz":
        return _daemon_trace(p, label)
    with open(p, encoding="utf-8") as f:
        first = f.readline()
    try:
        head = json.loads(first) if first.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}:1: not JSON: {exc}") from exc
    if isinstance(head, dict) and "kvagentd_trace" in head:
        return _daemon_trace(p, label)
    return read_jsonl(p, name=label)


def _daemon_trace(path: Path, name: str) -> RequestTrace:
    tr = from_events(load_trace(path), name)
    tr.block_size = load_block_size(path)
    return tr


def read_jsonl(path: str | os.PathLike[str], *, name: str | None = None) -> RequestTrace:
    """Request JSON lines (`timestamp` in ms, `hash_ids`, optional session id)."""
    p = Path(path)
    b = TraceBuilder()
    dense: dict[int, int] = {}
    sessions = _SessionGuess()
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                t = float(d["timestamp"]) / 1000.0
                raw = [int(x) for x in d["hash_ids"]]
                sess = d.get("session_id", d.get("session", d.get("chat_id")))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{p}:{lineno}: not a request line "
                                 f"(timestamp ms and hash_ids): {exc}") from exc
            if not raw:
                continue
            ids, deepest = [], -1
            for j, h in enumerate(raw):
                i = dense.get(h)
                if i is None:
                    i = dense[h] = len(dense)
                else:
                    deepest = j
                ids.append(i)
            b.add(t, sessions.of(ids, deepest) if sess is None else str(sess), ids)
    b.n_blocks = len(dense)
    return b.finish(name or p.stem)


class _SessionGuess:
    """Sessions for a trace without them: a request continues the session that last used its
    deepest already-seen block when it re-reads that session's whole last request (but its
    last, partial block) and no other session has used that block (a shared prompt)."""

    def __init__(self) -> None:
        self.n = 0
        self.first: dict[int, str] = {}  # block -> the session that first used it
        self.shared: set[int] = set()  # blocks two sessions or more have used
        self.last_user: dict[int, str] = {}
        self.last_len: dict[str, int] = {}

    def of(self, ids: list[int], deepest: int) -> str:
        s = None
        if deepest >= 0 and ids[deepest] not in self.shared:
            x = self.last_user[ids[deepest]]
            if deepest >= self.last_len[x] - 2:
                s = x
        if s is None:
            self.n += 1
            s = f"s{self.n}"
        for i in ids:
            f = self.first.setdefault(i, s)
            if f != s:
                self.shared.add(i)
            self.last_user[i] = s
        self.last_len[s] = len(ids)
        return s


def write_jsonl(trace: RequestTrace, path: str | os.PathLike[str], *,
                block_tokens: int = 16) -> None:
    """Write `trace` as request JSON lines (timestamps in ms, session ids, input lengths)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for i in range(len(trace)):
            ids = trace.request(i).tolist()
            f.write(json.dumps({"timestamp": round(float(trace.times[i]) * 1000.0, 3),
                                "session_id": trace.session_names[int(trace.sessions[i])],
                                "input_length": len(ids) * block_tokens, "hash_ids": ids})
                    + "\n")


def from_events(events: Iterable[AccessEvent], name: str) -> RequestTrace:
    """Group a daemon trace's events (consecutive events of one tick and session) into
    requests; blocks keep their keys. Blocks first seen in cold were there before the trace
    started: they are preloaded."""
    b = TraceBuilder()
    ids_of: dict[BlockKey, int] = {}
    keys: list[BlockKey] = []
    cur: list[int] = []
    head: AccessEvent | None = None
    for e in events:
        if head is not None and (e.tick != head.tick or e.session != head.session):
            b.add(head.time, head.session, cur)
            cur = []
        if not cur:
            head = e
        i = ids_of.get(e.key)
        if i is None:
            i = ids_of[e.key] = len(keys)
            keys.append(e.key)
            if e.tier is not None:
                b.preload([i])
        cur.append(i)
    if head is not None and cur:
        b.add(head.time, head.session, cur)
    b.n_blocks = len(keys)
    tr = b.finish(name)
    tr.keys = keys
    return tr
