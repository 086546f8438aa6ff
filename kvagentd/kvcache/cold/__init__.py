"""The cold tier: checksummed records in append-only segment files with a SQLite index
(`ColdStore`), the /dev/shm shadow failover pair (`FailoverColdStore`), fault injection and
the builder. See `kvagentd.kvcache.base.ColdTier` for the contract."""

from kvagentd.kvcache.cold.build import ColdTierSpec, build_cold_tier
from kvagentd.kvcache.cold.causes import Cause
from kvagentd.kvcache.cold.failover import (ColdView, FailoverColdStore, FailoverError,
                                            RestoreDeferred, ServingTier)
from kvagentd.kvcache.cold.faults import FaultPlan, FaultyFileIO
from kvagentd.kvcache.cold.store import ColdStore

__all__ = ["Cause", "ColdStore", "ColdTierSpec", "ColdView", "FailoverColdStore", "FailoverError",
           "FaultPlan", "FaultyFileIO", "RestoreDeferred", "ServingTier", "build_cold_tier"]
