"""Which sensor source an asset reads: simulated, a replayed recording, or MQTT."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvagentd.agent.replay import ReplaySource
from kvagentd.agent.sensors import MqttSource, SensorSource
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AssetConfig, MqttConfig


def make_source(asset: AssetConfig, *, start_time: float, stale_after_s: float,
                clock: Callable[[], float] = time.time, mqtt: MqttConfig | None = None) -> SensorSource:
    if asset.source == "simulated":
        return SimulatedSource(asset, start_time)
    if asset.source == "replay":
        return ReplaySource(asset)
    return MqttSource(asset, stale_after_s=stale_after_s, clock=clock, mqtt=mqtt)
