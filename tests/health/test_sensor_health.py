"""An MQTT outage: the sensor check says disconnected while the last window is fresh, and
failing once it is stale, naming the zone that status still shows (a real mosquitto)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from apscheduler.schedulers.background import BackgroundScheduler

from kvagentd.agent.agent import Agent
from kvagentd.agent.sensors import encode_binary
from kvagentd.config import AssetConfig, HealthConfig
from kvagentd.health import checks
from tests.agent.conftest import ManualClock, agent_config
from tests.agent.mqtt_broker import Broker, free_port, wait_for


def test_mqtt_outage_with_stale_data_is_failing(tmp_path: Path) -> None:
    port = free_port()
    asset = AssetConfig(name="m1", source="mqtt", mqtt_port=port, mqtt_topic="plant/m1",
                        sample_rate_hz=4000.0, window_s=0.5, zone_limits_mm_s=(0.01, 0.02, 0.03))
    broker = Broker(tmp_path / "broker", port=port).start()  # fails when mosquitto is missing
    clock = ManualClock()
    sched = BackgroundScheduler()
    ag = Agent(agent_config(assets=(asset,), tick_interval_s=3.0), None, sched, tmp_path,
               clock=clock)
    ag.start()
    h = HealthConfig()
    try:
        src = ag.assets["m1"].source
        assert wait_for(lambda: ag.asset_views()[0].connected is True)
        v = ag.asset_views()[0]
        assert v.data_age_s is None and checks.sensor(v, h).level.value == "ok"
        clock.advance(30)
        v = ag.asset_views()[0]
        assert checks.sensor(v, h).level.value == "failing"  # nothing in 30 s since start
        x = np.random.default_rng(1).normal(0, 5, 2000)
        broker.publish("plant/m1", encode_binary(x, 4000.0))
        assert wait_for(lambda: src.messages == 1)  # type: ignore[attr-defined]
        assert ag.tick_once("m1")["zone"] in ("C", "D")
        v = ag.asset_views()[0]
        assert v.last_zone in ("C", "D") and v.last_rms_mm_s and v.last_anomaly is True
        assert checks.sensor(v, h).level.value == "ok"

        broker.stop()
        assert wait_for(lambda: ag.asset_views()[0].connected is False)
        down = checks.sensor(ag.asset_views()[0], h)
        assert down.level.value == "degraded" and "disconnected" in down.reason
        clock.advance(60)
        assert ag.tick_once("m1")["kind"] == "bad_data"  # stale
        assert ag.status()["assets"]["m1"]["last_zone"] in ("C", "D")  # what status still shows
        stale = checks.sensor(ag.asset_views()[0], h)
        assert stale.level.value == "failing"
        assert "no message for 60 s" in stale.reason and "still shows zone" in stale.reason
        assert "stale 1" in stale.reason and "disconnected" in stale.reason
    finally:
        ag.stop()
        broker.stop()
