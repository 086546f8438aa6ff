"""Trace-driven simulation: replays requests against the daemon's own placement service.

`simulate()` drives the real `PlacementService` (its AccessStats, policy, heat map, Prefetcher
and apply step, fed through an `AccessFeed` as in the daemon) over a `SimStore`, with a
simulated clock: rounds every `placement.interval_s` of trace time ingest the accesses since the
previous round as one batch; a request that read from cold has its neighbour prefetches issued
at once (prefetching policies). Idle stretches with nothing to do are skipped
(a round with no new access and an empty plan changes nothing until the next request, a
prefetch due time or a background move landing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from kvagentd.config import PlacementConfig
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.base import Capacities, PlacementStore
from kvagentd.kvcache.placement.policy import PlacementPolicy

from .request_trace import RequestTrace
from .store import Latencies, SimCounters, SimStore


class SimClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(slots=True)
class SimResult:
    policy: str
    trace: str
    capacity: Capacities
    requests: int
    accesses: int
    reaccesses: int  # accesses of blocks used before in the trace
    counters: SimCounters
    rounds: int
    decision_s: float  # planning time over all rounds
    decided_accesses: int  # distinct blocks used between rounds, summed over rounds
    wall_s: float
    moves: dict[str, int] = field(default_factory=dict)
    prefetched: dict[str, int] = field(default_factory=dict)  # what became of raised blocks

    @property
    def hot_hit_rate(self) -> float:
        """Hot hits over all block accesses."""
        return self.counters.hot_hits / self.accesses if self.accesses else 0.0

    @property
    def hot_hit_rate_reaccess(self) -> float:
        """Hot hits over re-accesses (the accesses any demand policy could hit)."""
        return self.counters.hot_hits / self.reaccesses if self.reaccesses else 0.0

    @property
    def hot_warm_hit_rate_reaccess(self) -> float:
        c = self.counters
        return (c.hot_hits + c.warm_hits) / self.reaccesses if self.reaccesses else 0.0

    @property
    def decision_us_per_accessed_block(self) -> float:
        return 1e6 * self.decision_s / self.decided_accesses if self.decided_accesses else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        c = self.counters
        return {"policy": self.policy, "trace": self.trace,
                "capacity_blocks": {"hot": self.capacity.hot, "warm": self.capacity.warm},
                "requests": self.requests, "block_accesses": self.accesses,
                "reaccesses": self.reaccesses,
                "hot_hit_rate_all": self.hot_hit_rate,
                "hot_hit_rate_reaccess": self.hot_hit_rate_reaccess,
                "hot_warm_hit_rate_reaccess": self.hot_warm_hit_rate_reaccess,
                "hot_hits": c.hot_hits, "warm_hits": c.warm_hits, "cold_stalls": c.cold_hits,
                "first_touches": c.first_touches, "recomputed": c.recomputed,
                "stall_s": c.stall_s, "copy_s": c.copy_s,
                "bytes_migrated": c.bytes_migrated, "bytes_foreground": c.bytes_foreground,
                "bytes_background": c.bytes_background, "cold_write_bytes": c.cold_write_bytes,
                "foreground_demotions": c.foreground_demotions,
                "background_promotions": c.background_promotions, "evicted": c.evicted,
                "misses_by_class": dict(sorted(c.misses_by_class.items())),
                "rounds": self.rounds,
                "decision_us_per_accessed_block": self.decision_us_per_accessed_block,
                "sim_wall_s": self.wall_s, "sim_accesses_per_s": self.accesses_per_s,
                "moves": self.moves, "prefetched_blocks": self.prefetched}


def _placement_store(store: SimStore) -> PlacementStore:
    return store  # mypy checks that SimStore implements the protocol


def simulate(trace: RequestTrace, policy: str, caps: Capacities, *,
             latencies: Latencies | None = None, block_bytes: int = 368_640,
             config: PlacementConfig | None = None, check: bool = False,
             seed: int = 0, instance: PlacementPolicy | None = None) -> SimResult:
    """Replay `trace` against `policy` with hot / warm capacities `caps` (blocks);
    `instance`: a policy object of that name to use instead of the configured one (a
    benchmark's variant of it)."""
    cfg = replace(config or PlacementConfig(trace_capacity=0), policy=policy)
    n = len(trace)
    t0 = float(trace.times[0]) if n else 0.0
    clock = SimClock(t0)
    feed = AccessFeed(capacity=1 << 20, clock=clock)
    store = SimStore(caps, trace.n_blocks, trace.block_keys(), block_bytes=block_bytes,
                     latencies=latencies or Latencies(), clock=clock,
                     access_listener=feed.record, session_names=trace.session_names, seed=seed)
    store.preload_cold(trace.preload, t0)
    svc = PlacementService(_placement_store(store), feed, cfg, clock=clock, seed=seed)
    if instance is not None:
        assert instance.name == policy, "a variant of the configured policy"
        svc.policy = instance
    interval = cfg.interval_s
    next_round = t0 + interval
    moves: dict[str, int] = {}
    active = False  # any request since the last round
    idle_plan_empty = False
    times, offsets, blocks, sessions = trace.times, trace.offsets, trace.blocks, trace.sessions
    prefetching = svc.policy.uses_prefetch
    wall0 = time.perf_counter()

    def do_round(t: float) -> None:
        nonlocal idle_plan_empty, active
        clock.t = t
        store.complete_pending(t)
        plan = svc.run_round()
        for k, v in plan.counts().items():
            moves[k] = moves.get(k, 0) + v
        idle_plan_empty = not active and len(plan) == 0
        active = False
        if check:
            store.check()

    for i in range(n):
        t = float(times[i])
        while next_round <= t:
            if idle_plan_empty and not active:
                # nothing changes until a request, a prefetch due time or a move landing
                wake = [t]
                if svc.policy.uses_prefetch:
                    due = svc.prefetcher.next_due(next_round)
                    if due is not None:
                        wake.append(due)
                pend = store.next_pending()
                if pend is not None:
                    wake.append(pend)
                target = min(wake)
                if target > next_round:
                    next_round += int((target - next_round) // interval) * interval
                    if next_round > t:
                        break
            do_round(next_round)
            next_round += interval
        clock.t = t
        cold = store.access(blocks[offsets[i]:offsets[i + 1]], int(sessions[i]))
        if cold and prefetching:  # a cold read queues neighbour prefetches: issue them now
            svc.flush_prefetch()
        active = True
        if check:
            store.check()
    wall = time.perf_counter() - wall0
    distinct = int(len(set(blocks.tolist()))) if n else 0
    return SimResult(policy, trace.name, caps, n, trace.accesses, trace.accesses - distinct,
                     store.c, svc.rounds, svc.decision_s, svc.decided_accesses, wall, moves,
                     svc.stats.prefetch_outcomes())
