"""Block heat: H = sum over a block's last W access ticks of 1 / (now - t_i), now - t_i >= 1.

Ticks count inference events (one `record` call = one tick), not wall time. Storage is dense
and vectorized: row `i` of a `(capacity, W)` float32 array is the ring buffer of block `i`'s last
W access ticks (empty entries are -inf, so they contribute 1/inf = 0). A dict maps block key ->
row, a free list recycles rows. Recording an access is O(1) per key; `heat()` computes every
block at once. Ticks are stored relative to a base that is moved forward before float32 loses
integer precision (2^24).
"""

from __future__ import annotations

import json
import os
import threading
from itertools import repeat
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable, Sequence

import numpy as np

from ..base import BlockKey

_REBASE_AT = float(1 << 23)  # relative ticks stay < 2^24: exact in float32
_CHUNK_ROWS = 4096  # rows per vectorized slice (keeps the scratch buffer in cache)


class HeatMap:
    """Access-tick ring buffers for every known block. Thread-safe (one lock)."""

    def __init__(self, window: int = 200, *, capacity: int = 1024) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._lock = threading.Lock()
        cap = max(16, capacity)
        self._ticks = np.full((cap, window), -np.inf, dtype=np.float32)
        self._pos = np.zeros(cap, dtype=np.int32)  # next ring slot per row
        self._count = np.zeros(cap, dtype=np.int32)  # accesses ever recorded (saturates at W)
        self._live = np.zeros(cap, dtype=bool)
        self._keys: list[BlockKey | None] = [None] * cap
        self._index: dict[BlockKey, int] = {}
        self._free: list[int] = list(range(cap - 1, -1, -1))
        self._session_rows: dict[str, dict[int, None]] = {}  # session -> rows (ordered, recent last)
        self._row_session: dict[int, str] = {}
        self.last_heat = np.zeros(0, dtype=np.float32)  # result of the latest heat() call
        self._high = 0  # rows [0, _high) have ever been used (the free list hands out low rows first)
        self._tick = 0  # absolute tick of the next event
        self._base = 0  # absolute tick of relative 0

    # ------------------------------------------------------------------ recording
    @property
    def tick(self) -> int:
        """The current tick ("now"): the number of events recorded so far."""
        return self._tick

    def __len__(self) -> int:
        return len(self._index)

    def record(self, keys: Iterable[BlockKey], session: str = "") -> int:
        """Record one inference event touching `keys`; returns the event's tick."""
        with self._lock:
            t = self._tick
            self._tick += 1
            rel = np.float32(t - self._base)
            for key in keys:
                row = self._index.get(key)
                if row is None:
                    row = self._new_row(key)
                p = self._pos[row]
                self._ticks[row, p] = rel
                self._pos[row] = p + 1 if p + 1 < self.window else 0
                if self._count[row] < self.window:
                    self._count[row] += 1
                if session:
                    self._attach(row, session)
            if self._tick - self._base >= _REBASE_AT:
                self._rebase()
            return t

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """Drop blocks (evicted / freed); their rows go back to the free list."""
        with self._lock:
            for key in keys:
                row = self._index.pop(key, None)
                if row is None:
                    continue
                self._ticks[row].fill(-np.inf)
                self._pos[row] = 0
                self._count[row] = 0
                self._live[row] = False
                self._keys[row] = None
                s = self._row_session.pop(row, None)
                if s is not None:
                    rows = self._session_rows.get(s)
                    if rows is not None:
                        rows.pop(row, None)
                        if not rows:
                            del self._session_rows[s]
                self._free.append(row)

    def _new_row(self, key: BlockKey) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        if row >= self._high:
            self._high = row + 1
        self._index[key] = row
        self._keys[row] = key
        self._live[row] = True
        return row

    def _attach(self, row: int, session: str) -> None:
        old = self._row_session.get(row)
        if old is not None and old != session:
            rows = self._session_rows.get(old)
            if rows is not None:
                rows.pop(row, None)
                if not rows:
                    del self._session_rows[old]
        self._row_session[row] = session
        rows = self._session_rows.setdefault(session, {})
        rows.pop(row, None)
        rows[row] = None

    def _grow(self) -> None:
        old = self._ticks.shape[0]
        new = old * 2
        ticks = np.full((new, self.window), -np.inf, dtype=np.float32)
        ticks[:old] = self._ticks
        self._ticks = ticks
        self._pos = np.concatenate([self._pos, np.zeros(new - old, np.int32)])
        self._count = np.concatenate([self._count, np.zeros(new - old, np.int32)])
        self._live = np.concatenate([self._live, np.zeros(new - old, bool)])
        self._keys.extend([None] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))

    def _rebase(self) -> None:
        # NOTE: entries pushed below -2^24 lose precision, but each then contributes < 6e-8.
        # A new array (not in place), so a concurrent heat() sees old ticks with the old base.
        shift = self._tick - self._base - 1024
        self._ticks = self._ticks - np.float32(shift)
        self._base += shift

    # ------------------------------------------------------------------ reading
    @property
    def high_water(self) -> int:
        """Rows in [0, high_water) have been used."""
        return self._high

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    def key_of(self, row: int) -> BlockKey | None:
        return self._keys[row] if 0 <= row < len(self._keys) else None

    def row_of(self, key: BlockKey) -> int | None:
        return self._index.get(key)

    def rows_of(self, keys: Sequence[BlockKey]) -> np.ndarray:
        """Rows of `keys` (int64); unknown keys get -1 (mask them with `>= 0`)."""
        return np.fromiter(map(self._index.get, keys, repeat(-1)), dtype=np.int64,
                           count=len(keys))

    def heat(self, now: int | None = None) -> np.ndarray:
        """Heat of every row (float32, length = row high-water mark; free rows are 0).

        NOTE: the lock is held only to take references: recording an access (the inference
        path) never waits for this computation. A concurrent single-entry write is harmless."""
        with self._lock:
            ticks, n = self._ticks, self._high
            rel_now = np.float32((self._tick if now is None else now) - self._base)
        out = np.zeros(n, dtype=np.float32)
        buf = np.empty((max(1, min(_CHUNK_ROWS, n)), self.window), dtype=np.float32)
        for lo in range(0, n, _CHUNK_ROWS):
            hi = min(n, lo + _CHUNK_ROWS)
            b = buf[: hi - lo]
            np.subtract(rel_now, ticks[lo:hi], out=b)
            np.maximum(b, 1.0, out=b)
            np.reciprocal(b, out=b)
            b.sum(axis=1, out=out[lo:hi])
        self.last_heat = out
        return out

    def heat_of(self, keys: Sequence[BlockKey], now: int | None = None) -> np.ndarray:
        """Heat of `keys` in order; unknown keys have heat 0."""
        return gather(self.heat(now), self.rows_of(keys))

    def session_keys(self, session: str, limit: int | None = None) -> list[BlockKey]:
        """Blocks last touched by `session`, least recent first (the last `limit`)."""
        with self._lock:
            rows = list(self._session_rows.get(session, ()))
            if limit is not None:
                rows = rows[-limit:]
            return [k for k in (self._keys[r] for r in rows) if k is not None]

    def sessions(self) -> list[str]:
        return list(self._session_rows)

    def session_heat(self, now: int | None = None) -> dict[str, float]:
        """Sum of block heat per session (each block counted for its last session)."""
        h = self.heat(now)
        with self._lock:
            return {s: float(h[list(rows)].sum()) for s, rows in self._session_rows.items()}

    def stats(self) -> dict[str, object]:
        h = self.heat()
        live = self._live[: h.shape[0]]
        vals = h[live]
        return {"blocks": int(live.sum()), "tick": self._tick, "window": self.window,
                "sessions": len(self._session_rows),
                "heat_mean": float(vals.mean()) if vals.size else 0.0,
                "heat_max": float(vals.max()) if vals.size else 0.0}

    # ------------------------------------------------------------------ persistence
    def save_summary(self, path: str | os.PathLike[str], *, keys_per_session: int = 256,
                     max_sessions: int | None = None) -> None:
        """Write the hottest sessions' heat and recent block keys as JSON (atomic replace)."""
        heat = self.session_heat()
        ranked = sorted(heat.items(), key=lambda kv: -kv[1])[:max_sessions]
        doc = {"version": 1, "tick": self._tick, "sessions": [
            {"session": s, "heat": h,
             "keys": [k.hex() for k in self.session_keys(s, keys_per_session)]}
            for s, h in ranked]}
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, p)


def gather(heat: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`heat[rows]` with 0 for rows that are -1 (unknown blocks)."""
    out = np.zeros(rows.shape[0], dtype=np.float32)
    ok = (rows >= 0) & (rows < heat.shape[0])
    out[ok] = heat[rows[ok]]
    return out


@dataclass(frozen=True, slots=True)
class SessionHeat:
    session: str
    heat: float
    keys: tuple[BlockKey, ...]


def load_summary(path: str | os.PathLike[str]) -> list[SessionHeat]:
    """Read a summary written by `HeatMap.save_summary`, hottest session first.

    Raises ValueError on a malformed file; a missing file is an empty summary."""
    p = Path(path)
    if not p.exists():
        return []
    try:
        doc = json.loads(p.read_text())
        out = [SessionHeat(str(e["session"]), float(e["heat"]),
                           tuple(bytes.fromhex(k) for k in e["keys"]))
               for e in doc["sessions"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed heat summary {p}: {exc}") from exc
    out.sort(key=lambda s: -s.heat)
    return out
