"""The daemon's block-access trace: a bounded ring of access events, dumped to / loaded from files.

One event = one block touched by one inference event: (tick, wall time, session, block key,
tier at access). Files are JSON lines (`.jsonl`: one header line, then one object per event)
or a compact numpy archive (`.npz`, loaded with `allow_pickle=False`). Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from ..base import BlockKey, Tier

TRACE_VERSION = 1
_TIER_CODE = {None: 0, Tier.HOT: 1, Tier.WARM: 2, Tier.COLD: 3}
_CODE_TIER = {v: k for k, v in _TIER_CODE.items()}
_TIER_NAME = {None: "", Tier.HOT: "hot", Tier.WARM: "warm", Tier.COLD: "cold"}
_NAME_TIER = {v: k for k, v in _TIER_NAME.items()}


class AccessEvent(NamedTuple):
    tick: int
    time: float
    session: str
    key: BlockKey
    tier: Tier | None  # where the block was when it was asked for; None: unknown / new


class TraceRecorder:
    """Keeps the last `capacity` access events (0 disables recording). Thread-safe."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._ring: deque[AccessEvent] = deque(maxlen=max(capacity, 1))
        self._lock = threading.Lock()
        self.recorded = 0  # events ever recorded (the ring keeps the last `capacity`)

    def record(self, tick: int, time: float, session: str, keys: Sequence[BlockKey],
               tiers: Sequence[Tier | None] | None = None) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            for i, k in enumerate(keys):
                self._ring.append(AccessEvent(tick, time, session, k,
                                              tiers[i] if tiers is not None else None))
            self.recorded += len(keys)

    def events(self) -> list[AccessEvent]:
        with self._lock:
            return list(self._ring)

    def __len__(self) -> int:
        return len(self._ring)

    def stats(self) -> dict[str, object]:
        ev = self.events()
        by_tier = {"hot": 0, "warm": 0, "cold": 0, "unknown": 0}
        for e in ev:
            by_tier[_TIER_NAME[e.tier] or "unknown"] += 1
        return {"capacity": self.capacity, "events": len(ev), "recorded": self.recorded,
                "sessions": len({e.session for e in ev}), "blocks": len({e.key for e in ev}),
                "first_tick": ev[0].tick if ev else None, "last_tick": ev[-1].tick if ev else None,
                "span_s": (ev[-1].time - ev[0].time) if ev else 0.0, "by_tier": by_tier}

    def dump(self, path: str | os.PathLike[str]) -> int:
        """Write the ring to `path` (.npz -> numpy archive, else JSON lines); returns events."""
        return write_trace(path, self.events())


def event_json(e: AccessEvent) -> str:
    return json.dumps({"tick": e.tick, "t": round(e.time, 6), "s": e.session,
                       "k": e.key.hex(), "tier": _TIER_NAME[e.tier]})


def iter_jsonl(events: Iterable[AccessEvent]) -> Iterator[str]:
    yield json.dumps({"kvagentd_trace": TRACE_VERSION}) + "\n"
    for e in events:
        yield event_json(e) + "\n"


def write_trace(path: str | os.PathLike[str], events: Sequence[AccessEvent]) -> int:
    """Write `events` to `path` (.npz -> numpy archive, else JSON lines) through `<path>.tmp`.

    For files the caller names itself (benchmarks, the simulator); the daemon writes dumps
    through `kvagentd.control.dumps`, which opens its files safely and calls `write_trace_to`.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        write_trace_to(f, events, npz=p.suffix == ".npz")
    os.replace(tmp, p)
    return len(events)


def write_trace_to(f: BinaryIO, events: Sequence[AccessEvent], *, npz: bool) -> int:
    """Write `events` to the open binary file `f` (numpy archive or JSON lines)."""
    if npz:
        sessions = sorted({e.session for e in events})
        sidx = {s: i for i, s in enumerate(sessions)}
        keylen = max((len(e.key) for e in events), default=16)
        keys = np.zeros((len(events), keylen), dtype=np.uint8)
        for i, e in enumerate(events):
            keys[i, : len(e.key)] = np.frombuffer(e.key, dtype=np.uint8)
        np.savez_compressed(
            f, version=np.array(TRACE_VERSION),
            tick=np.array([e.tick for e in events], dtype=np.int64),
            time=np.array([e.time for e in events], dtype=np.float64),
            session=np.array([sidx[e.session] for e in events], dtype=np.int32),
            sessions=np.array(sessions, dtype=np.str_),
            keys=keys, tier=np.array([_TIER_CODE[e.tier] for e in events], dtype=np.int8))
    else:
        for line in iter_jsonl(events):
            f.write(line.encode("utf-8"))
    return len(events)


def load_trace(path: str | os.PathLike[str]) -> list[AccessEvent]:
    """Read a trace written by `write_trace`; raises ValueError on a malformed file."""
    p = Path(path)
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                if int(z["version"]) != TRACE_VERSION:
                    raise ValueError(f"trace version {int(z['version'])}")
                sessions = [str(s) for s in z["sessions"]]
                keys = z["keys"]
                return [AccessEvent(int(t), float(w), sessions[int(s)], bytes(keys[i]),
                                    _CODE_TIER[int(c)])
                        for i, (t, w, s, c) in enumerate(zip(z["tick"], z["time"], z["session"],
                                                              z["tier"]))]
        out = []
        with open(p, encoding="utf-8") as f:
            head = json.loads(f.readline() or "{}")
            if head.get("kvagentd_trace") != TRACE_VERSION:
                raise ValueError("not a kvagentd trace (bad header)")
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    out.append(AccessEvent(int(d["tick"]), float(d["t"]), str(d["s"]),
                                           bytes.fromhex(d["k"]), _NAME_TIER[d["tier"]]))
        return out
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed trace {p}: {exc}") from exc
