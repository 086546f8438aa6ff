"""Placement: where each block lives (hot, warm, cold), decided from its accesses.

`service.PlacementService` runs rounds (gather -> policy -> plan -> apply) over a
`base.PlacementStore`, fed by an `feed.AccessFeed` that the store reports accesses to;
`stats.AccessStats` is what it remembers of each block, `policy` the policies.
"""

from __future__ import annotations

from .base import PlacementStore, TierPool
from .feed import Access, AccessFeed
from .service import PlacementService

__all__ = ["Access", "AccessFeed", "PlacementService", "PlacementStore", "TierPool"]
