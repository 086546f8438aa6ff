"""The daemon's block-access trace: a bounded ring of access events, dumped to / loaded from files.

One event = one block touched by one inference event: (tick, wall time, session, block key,
tier at access). Files are JSON lines (`.jsonl`: one header line, then one object per event)
or a compact numpy archive (`.npz`, loaded with `allow_pickle=False`). Nothing is pickled.
The header carries the daemon's block size (`block_tokens`, `block_bytes`) where it is known,
so a replay counts bytes moved as the daemon would.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from ..base import BlockKey, Tier
from .base import CODE_OF, NONE, TIER_OF

TRACE_VERSION = 1
KEY_BYTES = 16
_TIER_CODE = CODE_OF  # tier at access, as placement's column codes
_CODE_TIER: dict[int, Tier | None] = {NONE: None, **TIER_OF}
_TIER_NAME = {None: "", Tier.HOT: "hot", Tier.WARM: "warm", Tier.COLD: "cold"}
_NAME_TIER = {v: k for k, v in _TIER_NAME.items()}


class AccessEvent(NamedTuple):
    tick: int
    time: float
    session: str
    key: BlockKey
    tier: Tier | None  # where the block was when it was asked for; None: unknown / new


class BlockSize(NamedTuple):
    """The size of one block of the traced store: tokens, and KV bytes."""

    tokens: int
    bytes: int


def _meta(size: BlockSize | None) -> dict[str, int]:
    return {} if size is None else {"block_tokens": size.tokens, "block_bytes": size.bytes}


class TraceRecorder:
    """Keeps the last `capacity` access events (0 disables recording) in numpy rings: recording
    one inference event is a few vectorized writes, whatever its number of blocks. Keys are
    16-byte block keys; `block_size`, where known, goes into the files' header. Thread-safe."""

    def __init__(self, capacity: int = 100_000, *, block_size: BlockSize | None = None) -> None:
        self.capacity = capacity
        self.block_size = block_size
        cap = max(capacity, 1)
        self._tick = np.zeros(cap, dtype=np.int64)
        self._time = np.zeros(cap, dtype=np.float64)
        self._sess = np.zeros(cap, dtype=np.int32)
        self._key = np.zeros(cap, dtype=f"V{KEY_BYTES}")
        self._tier = np.zeros(cap, dtype=np.int8)
        self._names: list[str] = []
        self._sid: dict[str, int] = {}
        self._next = 0  # ring position of the next event
        self._n = 0  # events held
        self._lock = threading.Lock()
        self.recorded = 0  # events ever recorded (the ring keeps the last `capacity`)

    def record(self, tick: int, time: float, session: str, keys: Sequence[BlockKey],
               tiers: np.ndarray | None = None) -> None:
        """One inference event: `keys` in order; `tiers[i]` is the tier code (`base.CODE_OF`)
        of `keys[i]` when it was asked for. Raises ValueError for a key that is not 16 bytes."""
        if self.capacity <= 0 or not keys:
            return
        raw = b"".join(keys)
        if len(raw) != KEY_BYTES * len(keys):
            raise ValueError(f"trace keys must be {KEY_BYTES} bytes")
        kv = np.frombuffer(raw, dtype=f"V{KEY_BYTES}")
        tv = np.zeros(len(keys), np.int8) if tiers is None else np.asarray(tiers, np.int8)
        cap = self.capacity
        if kv.size > cap:
            kv, tv = kv[-cap:], tv[-cap:]
        with self._lock:
            sid = self._sid.get(session)
            if sid is None:
                if len(self._names) >= 2 * cap + 1024:
                    self._compact_sessions()
                sid = self._sid[session] = len(self._names)
                self._names.append(session)
            idx = (self._next + np.arange(kv.size)) % cap
            self._tick[idx] = tick
            self._time[idx] = time
            self._sess[idx] = sid
            self._key[idx] = kv
            self._tier[idx] = tv
            self._next = int(idx[-1]) + 1 if idx[-1] + 1 < cap else 0
            self._n = min(cap, self._n + kv.size)
            self.recorded += len(keys)

    def _compact_sessions(self) -> None:
        """Caller holds the lock: keep only the names of sessions the ring still holds."""
        held = np.unique(self._sess[self._order()])
        names = [self._names[i] for i in held.tolist()]
        remap = np.zeros(len(self._names), dtype=np.int32)
        remap[held] = np.arange(held.size, dtype=np.int32)
        self._sess = remap[self._sess]
        self._names = names
        self._sid = {n: i for i, n in enumerate(names)}

    def _order(self) -> np.ndarray:
        """Caller holds the lock: ring positions of the held events, oldest first."""
        cap = self.capacity
        return (self._next - self._n + np.arange(self._n)) % cap

    def events(self) -> list[AccessEvent]:
        with self._lock:
            o = self._order()
            ticks, times = self._tick[o].tolist(), self._time[o].tolist()
            sess, tiers = self._sess[o].tolist(), self._tier[o].tolist()
            keys = [bytes(k) for k in self._key[o]]
            names = self._names
        return [AccessEvent(t, w, names[s], k, _CODE_TIER[c])
                for t, w, s, k, c in zip(ticks, times, sess, keys, tiers)]

    def __len__(self) -> int:
        return self._n

    def stats(self) -> dict[str, object]:
        with self._lock:
            o = self._order()
            tiers = np.bincount(self._tier[o], minlength=4) if o.size else np.zeros(4, np.int64)
            sessions = int(np.unique(self._sess[o]).size)
            blocks = int(np.unique(self._key[o]).size)
            first = int(self._tick[o[0]]) if o.size else None
            last = int(self._tick[o[-1]]) if o.size else None
            span = float(self._time[o[-1]] - self._time[o[0]]) if o.size else 0.0
        by_tier = {"hot": int(tiers[1]), "warm": int(tiers[2]), "cold": int(tiers[3]),
                   "unknown": int(tiers[0])}
        return {"capacity": self.capacity, "events": len(self), "recorded": self.recorded,
                "sessions": sessions, "blocks": blocks, "first_tick": first, "last_tick": last,
                "span_s": span, "by_tier": by_tier, **_meta(self.block_size)}

    def dump(self, path: str | os.PathLike[str]) -> int:
        """Write the ring to `path` (.npz -> numpy archive, else JSON lines); returns events."""
        return write_trace(path, self.events(), self.block_size)


def event_json(e: AccessEvent) -> str:
    return json.dumps({"tick": e.tick, "t": round(e.time, 6), "s": e.session,
                       "k": e.key.hex(), "tier": _TIER_NAME[e.tier]})


def iter_jsonl(events: Iterable[AccessEvent], block_size: BlockSize | None = None
               ) -> Iterator[str]:
    yield json.dumps({"kvagentd_trace": TRACE_VERSION, **_meta(block_size)}) + "\n"
    for e in events:
        yield event_json(e) + "\n"


def write_trace(path: str | os.PathLike[str], events: Sequence[AccessEvent],
                block_size: BlockSize | None = None) -> int:
    """Write `events` to `path` (.npz -> numpy archive, else JSON lines) through `<path>.tmp`.

    For files the caller names itself (benchmarks, the simulator); the daemon writes dumps
    through `kvagentd.control.dumps`, which opens its files safely and calls `write_trace_to`.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "wb") as f:
        write_trace_to(f, events, npz=p.suffix == ".npz", block_size=block_size)
    os.replace(tmp, p)
    return len(events)


def write_trace_to(f: BinaryIO, events: Sequence[AccessEvent], *, npz: bool,
                   block_size: BlockSize | None = None) -> int:
    """Write `events` to the open binary file `f` (numpy archive or JSON lines)."""
    if npz:
        sessions = sorted({e.session for e in events})
        sidx = {s: i for i, s in enumerate(sessions)}
        keylen = max((len(e.key) for e in events), default=16)
        keys = np.zeros((len(events), keylen), dtype=np.uint8)
        for i, e in enumerate(events):
            keys[i, : len(e.key)] = np.frombuffer(e.key, dtype=np.uint8)
        arrays: dict[str, np.ndarray] = {
            "version": np.array(TRACE_VERSION),
            "tick": np.array([e.tick for e in events], dtype=np.int64),
            "time": np.array([e.time for e in events], dtype=np.float64),
            "session": np.array([sidx[e.session] for e in events], dtype=np.int32),
            "sessions": np.array(sessions, dtype=np.str_),
            "keys": keys, "tier": np.array([_TIER_CODE[e.tier] for e in events], dtype=np.int8),
            **{k: np.array(v, dtype=np.int64) for k, v in _meta(block_size).items()}}
        # (numpy's stubs read a ** mapping as possibly filling its allow_pickle flag)
        np.savez_compressed(f, **arrays)  # type: ignore[arg-type]
    else:
        for line in iter_jsonl(events, block_size):
            f.write(line.encode("utf-8"))
    return len(events)


def load_block_size(path: str | os.PathLike[str]) -> BlockSize | None:
    """The block size a trace file's header gives (None: not given, as in files written
    before it was); raises ValueError on a malformed header."""
    p = Path(path)
    try:
        if p.suffix == ".npz":
            with np.load(p, allow_pickle=False) as z:
                head = {k: int(z[k]) for k in ("block_tokens", "block_bytes") if k in z.files}
        else:
            with open(p, encoding="utf-8") as f:
                head = json.loads(f.readline() or "{}")
        if not isinstance(head, dict):
            raise TypeError("the header is not an object")
        if "block_tokens" not in head and "block_bytes" not in head:
            return None
        size = BlockSize(int(head["block_tokens"]), int(head["block_bytes"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed trace header in {p}: {exc}") from exc
    if size.tokens < 1 or size.bytes < 1:
        raise ValueError(f"malformed trace header in {p}: block size {size}")
    return size


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
