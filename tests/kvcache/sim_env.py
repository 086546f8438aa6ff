"""A placement service over the simulator's store, for placement tests."""

from __future__ import annotations

import numpy as np

from bench.placement_sim.replay import SimClock
from bench.placement_sim.store import SimStore
from kvagentd.config import PlacementConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.base import Capacities

H, W, C = Tier.HOT, Tier.WARM, Tier.COLD


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class Env:
    """A simulated store of `n` blocks (keys `key(i)`) with a placement service over it."""

    def __init__(self, caps: Capacities, n: int, policy: str = "reuse", *,
                 sessions: tuple[str, ...] = ("s", "t", "u"), summary_path=None,
                 **cfg: object) -> None:
        self.clock = SimClock(0.0)
        self.feed = AccessFeed(clock=self.clock)
        self.keys = [key(i) for i in range(n)]
        self.store = SimStore(caps, n, self.keys, block_bytes=100, clock=self.clock,
                              access_listener=self.feed.record, session_names=list(sessions))
        self.svc = PlacementService(self.store, self.feed,
                                    PlacementConfig(policy=policy, trace_capacity=1000,
                                                    **cfg),  # type: ignore[arg-type]
                                    clock=self.clock, summary_path=summary_path, seed=1)

    def use(self, t: float, ids: list[int], session: int = 0) -> None:
        self.clock.t = t
        self.store.access(np.array(ids, dtype=np.int64), session)

    def tiers(self, ids: list[int]) -> list[Tier | None]:
        return [{1: H, 2: W, 3: C}.get(int(self.store.tier[i])) for i in ids]


