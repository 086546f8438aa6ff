"""MQTT source against a real mosquitto broker on a free loopback port."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kvagentd.agent.agent import Agent
from kvagentd.agent.sensors import MqttSource, encode_binary
from kvagentd.config import AssetConfig

from .conftest import agent_config

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if Path(p).is_file()), None)

pytestmark = pytest.mark.skipif(
    MOSQUITTO is None,
    reason="mosquitto binary not found (make test installs it with apt-get when it can)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_broker(tmp_path: Path, port: int) -> subprocess.Popen:
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"mosquitto exited: {proc.stderr.read().decode()}")
            time.sleep(0.05)
    proc.kill()
    pytest.fail("mosquitto did not listen")


def stop_broker(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def publish(port: int, topic: str, payload: bytes) -> None:
    import paho.mqtt.client as mqtt

    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.publish(topic, payload, qos=1).wait_for_publish(5)
    c.disconnect()
    c.loop_stop()


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_mqtt_ticks_bad_payloads_and_reconnect(tmp_path, fake_executor, scheduler):
    port = free_port()
    asset = AssetConfig(name="m1", source="mqtt", mqtt_port=port, mqtt_topic="plant/m1",
                        sample_rate_hz=4000.0, window_s=0.5)
    proc = start_broker(tmp_path, port)
    ag = Agent(agent_config(assets=(asset,)), fake_executor, scheduler, tmp_path)
    src = ag.assets["m1"].source
    assert isinstance(src, MqttSource)
    ag.start()
    try:
        assert ag.tick_once("m1")["note"].startswith("missing")  # nothing received yet
        assert wait_for(lambda: src.connected)
        n = 2000
        x = np.random.default_rng(1).normal(0, 1, n)
        publish(port, "plant/m1", encode_binary(x, 4000.0))
        assert wait_for(lambda: src.messages == 1)
        row = ag.tick_once("m1")
        assert row["kind"] == "tick" and row["features"]["kurtosis"] == pytest.approx(3, abs=0.4)
        publish(port, "plant/m1", json.dumps({"sample_rate": 4000, "kind": "acceleration",
                                              "samples": x[:100].tolist()}).encode())
        assert wait_for(lambda: src.messages == 2)
        assert ag.tick_once("m1")["note"].startswith("length")
        publish(port, "plant/m1", b"\x00garbage")
        assert wait_for(lambda: src.decode_errors == 1)
        assert ag.tick_once("m1")["note"].startswith("decode")
        # The broker goes away and comes back on the same port: the client reconnects.
        stop_broker(proc)
        assert wait_for(lambda: not src.connected)
        proc = start_broker(tmp_path, port)
        assert wait_for(lambda: src.connected and src.connects >= 2, timeout=40)
        publish(port, "plant/m1", json.dumps({"sample_rate": 4000,
                                              "samples": x.tolist()}).encode())
        assert wait_for(lambda: src.messages == 3)
        assert ag.tick_once("m1")["kind"] == "tick"
        bad = ag.status()["assets"]["m1"]["bad_samples"]
        assert bad == {"missing": 1, "length": 1, "decode": 1}
    finally:
        ag.stop()
        stop_broker(proc)


def test_mqtt_stale_data(tmp_path):
    t = [1000.0]
    src = MqttSource(AssetConfig(source="mqtt", mqtt_topic="x"), stale_after_s=5.0,
                     clock=lambda: t[0])

    class Msg:
        payload = json.dumps({"sample_rate": 12000, "samples": [0.0, 1.0]}).encode()

    src._on_message(None, None, Msg())
    assert src.read_window(1002.0).samples.size == 2
    from kvagentd.agent.sensors import BadData

    with pytest.raises(BadData) as e:
        src.read_window(1010.0)
    assert e.value.reason == "stale"
