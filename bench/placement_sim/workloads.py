"""Synthetic request traces for the placement simulator, generated from a seed (deterministic).

- `multiturn`: a production-style prefix-cache trace of a shared LLM service (the shape of the
  published multi-turn traces: about 12,000 requests in an hour, 24 blocks a request, 63 % of
  block accesses first touches, most blocks used once, at most about 5 % of the distinct blocks
  waiting for a reuse at any moment). Applications, each with its own system prompts, open
  conversations: one-shot API calls (a large document, almost never continued), chat (a few
  turns, the user coming back after minutes, at a pace of their own) and tool-using agents
  (steps seconds apart). Every turn re-reads the conversation so far and appends new blocks.
  `same_pace=False` draws every gap independently (no per-user pace), an ablation.
- `edge_agent`: the daemon's own workload on an edge PC: every asset ticks every 3 s into a
  rolling session (the shared system prompt, a first turn, then one observation + assessment
  per tick) that rolls over at the session token budget; operators ask (forking an asset's
  session, a follow-up or two); weekly reports in fresh sessions; anomaly replays that resume
  an old session (archived sessions start cold).
- `seed`: the project's first trace: sensor sessions every 3 s, Zipf-popular operator chats in
  bursts, sessions idle for an hour then resumed, report scans over cold archives.
- `scan`: archived sessions read once each, in chunks (no reuse at all).
- `shifting`: Zipf-popular chat sessions whose popularity ranking is reshuffled every 10 min.
A request touches a session's whole prefix (its blocks in order), as the engine's requests do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .request_trace import RequestTrace, TraceBuilder

SYSTEM_BLOCKS = 2


def _zipf(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    out: np.ndarray = w / w.sum()
    return out


# ------------------------------------------------------------------------------------------
# production-style multi-turn
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class App:
    """One application of the shared service."""

    name: str
    share: float  # of conversations
    prompts: int  # system prompts (1-4 blocks each, Zipf-popular)
    continue_first: float  # P(a second turn)
    continue_later: float  # P(another turn after the second)
    pace_s: float  # median time between turns (a user's own pace is drawn around it)
    pace_sigma: float  # spread of paces between users (log-normal)
    turn_sigma: float  # spread of one user's gaps around their pace
    first_blocks: float  # median blocks of the first turn (log-normal, sigma 0.8)
    turn_blocks: float  # median blocks a later turn adds (log-normal, sigma 0.8)


APPS = (
    App("chat", 0.42, 6, 0.40, 0.60, 420.0, 0.9, 0.35, 13.5, 4.5),
    App("api", 0.52, 8, 0.02, 0.20, 600.0, 1.0, 0.50, 20.0, 2.7),
    App("agent", 0.06, 4, 0.60, 0.70, 15.0, 0.6, 0.40, 9.0, 3.3),
)


@dataclass(slots=True)
class MultiturnTruth:
    """What generated a multi-turn trace: per block, its application (index into `apps`; -1
    for system prompts, which sessions share) and conversation (-1 likewise); per
    conversation, its user's pace and the times of its turns."""

    apps: tuple[App, ...]
    app: np.ndarray  # int64, by block id
    conversation: np.ndarray  # int64, by block id
    pace: list[float] = field(default_factory=list)
    turns: list[list[float]] = field(default_factory=list)


def multiturn(seed: int = 0, *, duration_s: float = 3600.0, requests: int = 12_000,
              apps: tuple[App, ...] = APPS, same_pace: bool = True,
              max_blocks: int = 160) -> RequestTrace:
    """Production-style multi-turn trace (see module docstring), about `requests` requests."""
    return multiturn_with_truth(seed, duration_s=duration_s, requests=requests, apps=apps,
                                same_pace=same_pace, max_blocks=max_blocks)[0]


def multiturn_with_truth(seed: int = 0, *, duration_s: float = 3600.0,
                         requests: int = 12_000, apps: tuple[App, ...] = APPS,
                         same_pace: bool = True, max_blocks: int = 160
                         ) -> tuple[RequestTrace, MultiturnTruth]:
    """`multiturn`'s trace and what generated it."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    prompts = {a.name: [b.new_blocks(int(rng.integers(1, 5))) for _ in range(a.prompts)]
               for a in apps}
    shares = np.array([a.share for a in apps])
    shares = shares / shares.sum()
    turns = np.array([1.0 + a.continue_first / (1.0 - a.continue_later) for a in apps])
    rate = requests / duration_s / float(shares @ turns)  # conversations per second
    t, conv = 0.0, 0
    owner: dict[int, tuple[int, int]] = {}  # block id -> (application, conversation)
    paces: list[float] = []
    turns: list[list[float]] = []
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration_s:
            break
        ai = int(rng.choice(len(apps), p=shares))
        a = apps[ai]
        system = prompts[a.name][int(rng.choice(a.prompts, p=_zipf(a.prompts, 1.0)))]
        own = b.new_blocks(max(1, int(rng.lognormal(np.log(a.first_blocks), 0.8))))
        pace = float(rng.lognormal(np.log(a.pace_s), a.pace_sigma))
        owner.update(dict.fromkeys(own, (ai, conv)))
        paces.append(pace)
        turns.append([])
        session = f"{a.name}-{conv}"
        tt, k = t, 1
        while True:
            b.add(tt, session, (system + own)[:max_blocks])
            turns[conv].append(tt)
            if rng.random() >= (a.continue_first if k == 1 else a.continue_later):
                break
            gap = pace if same_pace else float(rng.lognormal(np.log(a.pace_s), a.pace_sigma))
            tt += gap * float(rng.lognormal(0.0, a.turn_sigma))
            if tt >= duration_s:
                break
            new = b.new_blocks(max(1, int(rng.lognormal(np.log(a.turn_blocks), 0.8))))
            owner.update(dict.fromkeys(new, (ai, conv)))
            own = own + new
            k += 1
        conv += 1
    app = np.full(b.n_blocks, -1, np.int64)
    conversation = np.full(b.n_blocks, -1, np.int64)
    if owner:
        ids = np.fromiter(owner, np.int64, len(owner))
        pairs = np.array(list(owner.values()), np.int64)
        app[ids], conversation[ids] = pairs[:, 0], pairs[:, 1]
    return (b.finish("multiturn" if same_pace else "multiturn-iid"),
            MultiturnTruth(apps, app, conversation, paces, turns))


# ------------------------------------------------------------------------------------------
# the daemon's own workload
# ------------------------------------------------------------------------------------------

def edge_agent(seed: int = 0, *, duration_s: float = 3600.0, assets: int = 8,
               tick_s: float = 3.0, system_blocks: int = 11, first_turn_blocks: int = 7,
               tick_blocks: int = 6, session_blocks: int = 96, ask_every_s: float = 90.0,
               report_every_s: float = 900.0, report_blocks: int = 38,
               replay_every_s: float = 600.0, archived_sessions: int = 40) -> RequestTrace:
    """The agent's hour on an edge PC (see module docstring); block counts are for 16-token
    blocks of SmolLM2 prompts (system prompt about 180 tokens, a tick about 100 tokens, the
    session budget 1,536 tokens)."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    system = b.new_blocks(system_blocks)
    # sessions that ended (replay candidates): (end time, name, blocks); archived ones start cold
    ended: list[tuple[float, str, list[int]]] = []
    for i in range(archived_sessions):
        blocks = system + b.new_blocks(session_blocks - system_blocks)
        b.preload(blocks[system_blocks:])
        ended.append((-1.0, f"asset-{i % assets}-archived{i}", blocks))
    history: list[tuple[list[float], list[list[int]]]] = []  # per asset: tick times, prefixes
    for a in range(assets):
        n, t = 0, 0.37 * a
        prefix: list[int] = []
        times: list[float] = []
        prefixes: list[list[int]] = []
        while t < duration_s:
            if not prefix or len(prefix) + tick_blocks > session_blocks:
                if prefix:
                    ended.append((t, f"asset-{a}-{n}", prefix))
                n += 1
                prefix = system + b.new_blocks(first_turn_blocks)
            else:
                prefix = prefix + b.new_blocks(tick_blocks)
            b.add(t, f"asset-{a}-{n}", prefix)
            times.append(t)
            prefixes.append(prefix)
            t += tick_s * float(rng.uniform(0.98, 1.02))
        history.append((times, prefixes))
    # operators ask about an asset: a fork of its session, a follow-up or two minutes later
    t, k = 0.0, 0
    while True:
        t += float(rng.exponential(ask_every_s))
        if t >= duration_s:
            break
        times, prefixes = history[int(rng.integers(assets))]
        j = int(np.searchsorted(times, t, side="right")) - 1
        fork = (prefixes[j] if j >= 0 else system) + b.new_blocks(int(rng.integers(2, 5)))
        tt = t
        for _ in range(1 + int(rng.integers(0, 3))):
            b.add(tt, f"ask-{k}", fork)
            tt += float(rng.uniform(20.0, 120.0))
            fork = fork + b.new_blocks(int(rng.integers(2, 6)))
        k += 1
    # weekly reports: a fresh session (system prompt + the statistics) per asset in turn
    t, k = 300.0, 0
    while t < duration_s:
        b.add(t, f"report-{k % assets}-{k}", system + b.new_blocks(report_blocks))
        t += report_every_s / assets
        k += 1
    # anomaly replays: resume a session that ended before (rolled over or archived), then a
    # follow-up
    t, k = 200.0, 0
    while t < duration_s:
        done = [e for e in ended if e[0] < t]
        _, name, blocks = done[int(rng.integers(len(done)))]
        q = blocks + b.new_blocks(3)
        b.add(t, f"replay-{k}:{name}", q)
        b.add(t + float(rng.uniform(10.0, 40.0)), f"replay-{k}:{name}", q + b.new_blocks(4))
        t += float(rng.exponential(replay_every_s))
        k += 1
    return b.finish("edge-agent")


# ------------------------------------------------------------------------------------------
# the first traces
# ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class _Sess:
    name: str
    blocks: list[int]
    window: int  # blocks of its own kept in the prompt (rolling)
    grow_every: int  # a new block every N requests
    count: int = 0


def _touch(s: _Sess, system: list[int], b: TraceBuilder) -> list[int]:
    s.count += 1
    if s.grow_every and s.count % s.grow_every == 0:
        s.blocks.append(b.new_blocks(1)[0])
        if len(s.blocks) > s.window:
            del s.blocks[0]
    return system + s.blocks


def seed_workload(seed: int = 0, *, duration_s: float = 7200.0, assets: int = 8,
                  chat_sessions: int = 160, archived_sessions: int = 40,
                  idle_sessions: int = 12, zipf_a: float = 1.1, burst_every_s: float = 12.0,
                  report_every_s: float = 900.0) -> RequestTrace:
    """The seed workload (see module docstring). About 200 sessions in total."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    system = b.new_blocks(SYSTEM_BLOCKS)
    for a in range(assets):  # sensor sessions: one per asset, a tick every 3 s
        s = _Sess(f"asset-{a}", b.new_blocks(16), window=24, grow_every=4)
        t = 0.3 * a
        while t < duration_s:
            b.add(t, s.name, _touch(s, system, b))
            t += 3.0
    chats = [_Sess(f"chat-{i}", b.new_blocks(int(rng.integers(6, 24))), window=40, grow_every=3)
             for i in range(chat_sessions)]
    w = _zipf(chat_sessions, zipf_a)
    t = 0.0
    while True:  # operator chats, Zipf popularity, bursts of 10 requests within seconds
        t += float(rng.exponential(burst_every_s))
        if t >= duration_s:
            break
        s = chats[int(rng.choice(chat_sessions, p=w))]
        bt = t
        for _ in range(10):
            b.add(bt, s.name, _touch(s, system, b))
            bt += float(rng.uniform(0.3, 1.5))
    for i in range(idle_sessions):  # idle for up to an hour, then resumed with a short burst
        s = _Sess(f"idle-{i}", b.new_blocks(int(rng.integers(8, 20))), window=40, grow_every=2)
        t0 = float(rng.uniform(0, 600))
        for j in range(4):
            b.add(t0 + j * 2.0, s.name, _touch(s, system, b))
        t1 = t0 + float(rng.uniform(1800, 3300))
        if t1 < duration_s:
            for j in range(4):
                b.add(t1 + j * 2.0, s.name, _touch(s, system, b))
    archive = [(f"archive-{i}", b.new_blocks(int(rng.integers(16, 40))))
               for i in range(archived_sessions)]
    for _, bl in archive:
        b.preload(bl)
    t = 120.0
    while t < duration_s:  # report jobs scan a week of archived sessions chunk by chunk
        rt = t
        for name, bl in archive:
            for lo in range(0, len(bl), 8):
                b.add(rt, f"report:{name}", bl[lo: lo + 8])
                rt += 0.05
        t += report_every_s
    return b.finish("seed")


def pure_scan(seed: int = 0, *, sessions: int = 300, chunk: int = 8,
              gap_s: float = 0.05) -> RequestTrace:
    """Archived sessions (cold at start) each read once, sequentially, `chunk` blocks at a time."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    t = 0.0
    for i in range(sessions):
        bl = b.new_blocks(int(rng.integers(16, 48)))
        b.preload(bl)
        for lo in range(0, len(bl), chunk):
            b.add(t, f"archive-{i}", bl[lo: lo + chunk])
            t += gap_s
    return b.finish("scan")


def shifting_popularity(seed: int = 0, *, duration_s: float = 3600.0, sessions: int = 200,
                        zipf_a: float = 1.0, shift_every_s: float = 600.0,
                        rate_per_s: float = 2.0) -> RequestTrace:
    """Zipf-popular chat sessions; every `shift_every_s` the popularity ranking is reshuffled."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    system = b.new_blocks(SYSTEM_BLOCKS)
    ss = [_Sess(f"chat-{i}", b.new_blocks(int(rng.integers(6, 24))), window=32, grow_every=4)
          for i in range(sessions)]
    w = _zipf(sessions, zipf_a)
    rank = rng.permutation(sessions)
    t, next_shift = 0.0, shift_every_s
    while True:
        t += float(rng.exponential(1.0 / rate_per_s))
        if t >= duration_s:
            break
        if t >= next_shift:
            rank = rng.permutation(sessions)
            next_shift += shift_every_s
        s = ss[int(rank[int(rng.choice(sessions, p=w))])]
        b.add(t, s.name, _touch(s, system, b))
    return b.finish("shifting")


STANDARD: dict[str, Callable[..., RequestTrace]] = {
    "multiturn": multiturn, "edge-agent": edge_agent, "seed": seed_workload, "scan": pure_scan,
    "shifting": shifting_popularity}
