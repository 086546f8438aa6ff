"""Standard access traces for the placement simulator, generated from a seed (deterministic).

- `seed_workload`: the agent's day in miniature: ~200 concurrent sessions. Sensor sessions
  (one per asset) every 3 s; operator chat sessions chosen by Zipf popularity, visited in
  bursts of 10 requests within seconds; report jobs that scan a week of archived sessions
  (cold at start) chunk by chunk; sessions idle for hours, then resumed. All sessions share
  the system-prompt blocks.
- `pure_scan`: archived sessions read once each, sequentially, in chunks (no reuse at all).
- `shifting_popularity`: Zipf-popular chat sessions whose popularity ranking rotates.
A request touches a session's prefix (the shared system blocks and its own blocks, as a
request of the engine does) or, for report scans, a chunk of an archived session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvagentd.kvcache.base import BlockKey

from .request_trace import Request

SYSTEM_BLOCKS = 2


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    preload: list[tuple[BlockKey, str]] = field(default_factory=list)  # cold at start
    duration_s: float = 0.0

    @property
    def block_accesses(self) -> int:
        return sum(len(r.keys) for r in self.requests)


class _Keys:
    def __init__(self) -> None:
        self.n = 0

    def new(self) -> BlockKey:
        self.n += 1
        return self.n.to_bytes(16, "big")


@dataclass(slots=True)
class _Sess:
    name: str
    blocks: list[BlockKey]
    window: int  # blocks of its own kept in the prompt (rolling)
    grow_every: int  # a new block every N requests
    count: int = 0


def _touch(s: _Sess, system: list[BlockKey], keys: _Keys) -> tuple[BlockKey, ...]:
    s.count += 1
    if s.grow_every and s.count % s.grow_every == 0:
        s.blocks.append(keys.new())
        if len(s.blocks) > s.window:
            del s.blocks[0]
    return tuple(system) + tuple(s.blocks)


def _zipf_weights(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return w / w.sum()


def seed_workload(seed: int = 0, *, duration_s: float = 7200.0, assets: int = 8,
                  chat_sessions: int = 160, archived_sessions: int = 40,
                  idle_sessions: int = 12, zipf_a: float = 1.1, burst_every_s: float = 12.0,
                  report_every_s: float = 900.0) -> Workload:
    """The seed workload (see module docstring). About 200 sessions in total."""
    rng = np.random.default_rng(seed)
    keys = _Keys()
    system = [keys.new() for _ in range(SYSTEM_BLOCKS)]
    events: list[tuple[float, int, str, tuple[BlockKey, ...]]] = []
    seq = 0

    def emit(t: float, session: str, ks: tuple[BlockKey, ...]) -> None:
        nonlocal seq
        events.append((t, seq, session, ks))
        seq += 1

    # sensor sessions: one per asset, a tick every 3 s
    for a in range(assets):
        s = _Sess(f"asset-{a}", [keys.new() for _ in range(16)], window=24, grow_every=4)
        t = 0.3 * a
        while t < duration_s:
            emit(t, s.name, _touch(s, system, keys))
            t += 3.0
    # operator chat sessions, Zipf popularity, bursts of 10 requests within seconds
    chats = [_Sess(f"chat-{i}", [keys.new() for _ in range(int(rng.integers(6, 24)))],
                   window=40, grow_every=3) for i in range(chat_sessions)]
    w = _zipf_weights(chat_sessions, zipf_a)
    t = 0.0
    while True:
        t += float(rng.exponential(burst_every_s))
        if t >= duration_s:
            break
        s = chats[int(rng.choice(chat_sessions, p=w))]
        bt = t
        for _ in range(10):
            emit(bt, s.name, _touch(s, system, keys))
            bt += float(rng.uniform(0.3, 1.5))
    # sessions idle for hours, then resumed with a short burst
    for i in range(idle_sessions):
        s = _Sess(f"idle-{i}", [keys.new() for _ in range(int(rng.integers(8, 20)))],
                  window=40, grow_every=2)
        t0 = float(rng.uniform(0, 600))
        for j in range(4):
            emit(t0 + j * 2.0, s.name, _touch(s, system, keys))
        t1 = t0 + float(rng.uniform(1800, 3300))  # resumed after up to ~an hour of silence
        if t1 < duration_s:
            for j in range(4):
                emit(t1 + j * 2.0, s.name, _touch(s, system, keys))
    # a week of archived sessions (cold at start), scanned by report jobs chunk by chunk
    archive = [(f"archive-{i}", [keys.new() for _ in range(int(rng.integers(16, 40)))])
               for i in range(archived_sessions)]
    preload = [(k, name) for name, bl in archive for k in bl]
    t = 120.0
    while t < duration_s:
        rt = t
        for name, bl in archive:
            for lo in range(0, len(bl), 8):
                emit(rt, f"report:{name}", tuple(bl[lo: lo + 8]))
                rt += 0.05
        t += report_every_s
    return _finish("seed", events, preload, duration_s)


def pure_scan(seed: int = 0, *, sessions: int = 300, chunk: int = 8,
              gap_s: float = 0.05) -> Workload:
    """Archived sessions (cold at start) each read once, sequentially, `chunk` blocks at a time."""
    rng = np.random.default_rng(seed)
    keys = _Keys()
    archive = [(f"archive-{i}", [keys.new() for _ in range(int(rng.integers(16, 48)))])
               for i in range(sessions)]
    events: list[tuple[float, int, str, tuple[BlockKey, ...]]] = []
    t = 0.0
    for name, bl in archive:
        for lo in range(0, len(bl), chunk):
            events.append((t, len(events), name, tuple(bl[lo: lo + chunk])))
            t += gap_s
    preload = [(k, name) for name, bl in archive for k in bl]
    return _finish("scan", events, preload, t)


def shifting_popularity(seed: int = 0, *, duration_s: float = 3600.0, sessions: int = 200,
                        zipf_a: float = 1.0, shift_every_s: float = 600.0,
                        rate_per_s: float = 2.0) -> Workload:
    """Zipf-popular chat sessions; every `shift_every_s` the popularity ranking is reshuffled."""
    rng = np.random.default_rng(seed)
    keys = _Keys()
    system = [keys.new() for _ in range(SYSTEM_BLOCKS)]
    ss = [_Sess(f"chat-{i}", [keys.new() for _ in range(int(rng.integers(6, 24)))],
                window=32, grow_every=4) for i in range(sessions)]
    w = _zipf_weights(sessions, zipf_a)
    rank = rng.permutation(sessions)
    events: list[tuple[float, int, str, tuple[BlockKey, ...]]] = []
    t, next_shift = 0.0, shift_every_s
    while True:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t >= duration_s:
            break
        if t >= next_shift:
            rank = rng.permutation(sessions)
            next_shift += shift_every_s
        s = ss[int(rank[int(rng.choice(sessions, p=w))])]
        events.append((t, len(events), s.name, _touch(s, system, keys)))
    return _finish("shifting", events, [], duration_s)


def _finish(name: str, events: list[tuple[float, int, str, tuple[BlockKey, ...]]],
            preload: list[tuple[BlockKey, str]], duration: float) -> Workload:
    events.sort(key=lambda e: (e[0], e[1]))
    reqs = [Request(i, t, s, ks) for i, (t, _, s, ks) in enumerate(events)]
    return Workload(name, reqs, preload, duration)


STANDARD = {"seed": seed_workload, "scan": pure_scan, "shifting": shifting_popularity}
