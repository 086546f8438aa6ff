"""MQTT sources against a real mosquitto: ticks, bad payloads and reconnects; password
authentication and TLS (wrong password refused, right password over TLS accepted, an untrusted
CA unreachable, client certificates); client ids per box; connection state in status, health
and metrics; the password never in the configuration."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvagentd.agent.agent import Agent
from kvagentd.agent.broker import BrokerState, MqttCollector, client_id, read_password
from kvagentd.agent.sensors import BadData, MqttSource, encode_binary
from kvagentd.agent.view import asset_view
from kvagentd.config import (AgentConfig, AssetConfig, ConfigError, HealthConfig, MqttConfig,
                             load_config)
from kvagentd.health.checks import sensor

from .conftest import agent_config
from .mqtt_broker import Broker, Pki, make_pki, wait_for

USER, PASSWORD = "box7", "s3cret-vibration"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secure(tmp_path: Path, pki: Pki):  # type: ignore[no-untyped-def]
    broker = Broker(tmp_path / "broker", users={USER: PASSWORD}, pki=pki).start()
    yield broker
    broker.stop()


def password_file(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "mqtt-password"
    p.write_text(text + "\n")
    p.chmod(0o600)
    return p


def source(port: int, mqtt: MqttConfig, name: str = "m1") -> MqttSource:
    return MqttSource(AssetConfig(name=name, source="mqtt", mqtt_port=port, mqtt_topic="plant/m1",
                                  sample_rate_hz=4000.0, window_s=0.5),
                      stale_after_s=30.0, mqtt=mqtt)


def test_mqtt_ticks_bad_payloads_and_reconnect(tmp_path, fake_executor, scheduler):
    broker = Broker(tmp_path / "broker").start()
    asset = AssetConfig(name="m1", source="mqtt", mqtt_port=broker.port, mqtt_topic="plant/m1",
                        sample_rate_hz=4000.0, window_s=0.5)
    ag = Agent(agent_config(assets=(asset,)), fake_executor, scheduler, tmp_path)
    src = ag.assets["m1"].source
    assert isinstance(src, MqttSource)
    ag.start()
    try:
        assert ag.tick_once("m1")["note"].startswith("missing")  # nothing received yet
        assert wait_for(lambda: src.connected)
        n = 2000
        x = np.random.default_rng(1).normal(0, 1, n)
        broker.publish("plant/m1", encode_binary(x, 4000.0))
        assert wait_for(lambda: src.messages == 1)
        row = ag.tick_once("m1")
        assert row["kind"] == "tick" and row["features"]["kurtosis"] == pytest.approx(3, abs=0.4)
        broker.publish("plant/m1", json.dumps({"sample_rate": 4000, "kind": "acceleration",
                                               "samples": x[:100].tolist()}).encode())
        assert wait_for(lambda: src.messages == 2)
        assert ag.tick_once("m1")["note"].startswith("length")
        broker.publish("plant/m1", b"\x00garbage")
        assert wait_for(lambda: src.decode_errors == 1)
        assert ag.tick_once("m1")["note"].startswith("decode")
        # The broker goes away and comes back on the same port: the client reconnects.
        broker.stop()
        assert wait_for(lambda: not src.connected)
        assert ag.status()["sources"]["m1"]["state"] == "disconnected"
        check = sensor(ag.asset_views()[0], HealthConfig())
        assert check.level.value != "ok" and "(disconnected" in check.reason
        broker = Broker(tmp_path / "broker", port=broker.port).start()
        assert wait_for(lambda: src.connected and src.connects >= 2, timeout=40)
        broker.publish("plant/m1", json.dumps({"sample_rate": 4000,
                                               "samples": x.tolist()}).encode())
        assert wait_for(lambda: src.messages == 3)
        assert ag.tick_once("m1")["kind"] == "tick"
        bad = ag.status()["assets"]["m1"]["bad_samples"]
        assert bad == {"missing": 1, "length": 1, "decode": 1}
        assert sensor(ag.asset_views()[0], HealthConfig()).level.value == "ok"
    finally:
        ag.stop()
        broker.stop()


def test_wrong_password_is_refused(tmp_path: Path, secure: Broker, pki: Pki) -> None:
    src = source(secure.port, MqttConfig(username=USER, tls=True, ca_file=pki.ca,
                                         password_file=password_file(tmp_path, "guess")))
    src.start()
    try:
        assert wait_for(lambda: src.broker.state is BrokerState.REFUSED)
        st = src.status()
        assert st["state"] == "refused" and st["failures"] >= 1 and st["connects"] == 0
        assert "password" in st["reason"].lower() or "authori" in st["reason"].lower()
        # `kvctl health` says why the sensor has no data
        view = asset_view(SimpleNamespace(asset=src.asset, source=src, last_t=None, bad={},
                                          llm_failing=0, llm_error=None, llm_errors=0,
                                          llm_cut=0, withheld=0),
                          None, AgentConfig(), now=0.0, started_at=0.0)
        check = sensor(view, HealthConfig())
        assert check.level.value == "degraded" and f"(refused: {st['reason']})" in check.reason
        secure.publish("plant/m1", encode_binary(np.ones(2000), 4000.0), user=USER,
                       password=PASSWORD)
        with pytest.raises(BadData):
            src.read_window(0.0)
        assert src.messages == 0
    finally:
        src.stop()


def test_right_password_and_tls_are_accepted(tmp_path: Path, secure: Broker, pki: Pki,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "mqtt-password").write_text(PASSWORD)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))  # as systemd's LoadCredential=
    cfg = MqttConfig(username=USER, password_credential="mqtt-password", tls=True,
                     ca_file=pki.ca, box_id="line2-box7", qos=1)
    src = source(secure.port, cfg)
    src.start()
    try:
        assert wait_for(lambda: src.connected)
        x = np.random.default_rng(2).normal(0, 1, 2000)
        secure.publish("plant/m1", encode_binary(x, 4000.0), user=USER, password=PASSWORD)
        assert wait_for(lambda: src.messages == 1)
        assert src.read_window(src.clock()).samples.size == 2000
        st = src.status()
        assert st["state"] == "connected" and st["tls"] is True and st["user"] == USER
        assert st["client_id"] == "kvagentd-line2-box7-m1" and st["qos"] == 1
        assert PASSWORD not in json.dumps(st)
        families = {f.name: f for f in MqttCollector(lambda: {"m1": src.broker}).collect()}
        (up,) = families["kvagentd_mqtt_connected"].samples
        assert up.labels == {"asset": "m1", "broker": f"127.0.0.1:{secure.port}"}
        assert up.value == 1.0
        states = {s.labels["state"]: s.value for s in families["kvagentd_mqtt_state"].samples}
        assert states["connected"] == 1.0 and sum(states.values()) == 1.0
    finally:
        src.stop()
    assert src.status()["state"] == "stopped"


def test_a_broker_certificate_from_an_untrusted_ca_is_unreachable(
        tmp_path: Path, secure: Broker, pki: Pki) -> None:
    src = source(secure.port, MqttConfig(username=USER, tls=True, ca_file=pki.other_ca,
                                         password_file=password_file(tmp_path, PASSWORD)))
    src.start()
    try:
        assert wait_for(lambda: src.broker.state is BrokerState.UNREACHABLE)
        reason = src.status()["reason"]
        assert src.broker.connects == 0 and "certificate is not trusted" in reason, reason
    finally:
        src.stop()


def test_the_cause_of_a_failed_connection_is_named(tmp_path: Path) -> None:
    """Nothing listening, a host name that does not resolve: each says so."""
    import socket as sk

    free = sk.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    src = source(port, MqttConfig())
    src.start()
    try:
        assert wait_for(lambda: src.broker.state is BrokerState.UNREACHABLE)
        assert "refused: nothing accepts connections" in src.status()["reason"]
    finally:
        src.stop()
    from kvagentd.agent.broker import connect_failure

    why = connect_failure(sk.gaierror(-2, "Name or service not known"), "mqtt.invalid:1883")
    assert why.startswith("DNS:") and "Name or service not known" in why
    assert connect_failure(TimeoutError(), "b:1883").startswith("timed out")
    assert connect_failure(None, "b:1883").startswith("no connection")


def test_plain_connections_to_a_tls_listener_fail(tmp_path: Path, secure: Broker) -> None:
    src = source(secure.port, MqttConfig(username=USER,
                                         password_file=password_file(tmp_path, PASSWORD)))
    src.start()
    try:
        assert wait_for(lambda: src.broker.state is BrokerState.UNREACHABLE)
        assert src.broker.failures >= 1 and not src.connected and "TLS" in src.status()["reason"]
    finally:
        src.stop()


def test_client_certificates(tmp_path: Path, pki: Pki) -> None:
    broker = Broker(tmp_path / "mtls", users={USER: PASSWORD}, pki=pki,
                    require_certificate=True).start()
    pw = password_file(tmp_path, PASSWORD)
    with_cert = source(broker.port, MqttConfig(username=USER, password_file=pw, tls=True,
                                               ca_file=pki.ca, cert_file=pki.client_cert,
                                               key_file=pki.client_key), name="a")
    without = source(broker.port, MqttConfig(username=USER, password_file=pw, tls=True,
                                             ca_file=pki.ca), name="b")
    with_cert.start()
    without.start()
    try:
        assert wait_for(lambda: with_cert.connected)
        assert wait_for(lambda: without.broker.failures >= 1)
        assert not without.connected
    finally:
        with_cert.stop()
        without.stop()
        broker.stop()


def test_two_boxes_with_the_same_asset_names_keep_their_connections(tmp_path: Path) -> None:
    """Finding 7: a fixed client id `kvagentd-<asset>` made two boxes kick each other off."""
    broker = Broker(tmp_path / "broker").start()
    a = source(broker.port, MqttConfig(box_id="box-a"))
    b = source(broker.port, MqttConfig(box_id="box-b"))
    a.start()
    b.start()
    try:
        assert wait_for(lambda: a.connected and b.connected)
        assert not wait_for(lambda: a.broker.disconnects + b.broker.disconnects > 0, timeout=3)
        assert a.connects == b.connects == 1
    finally:
        a.stop()
        b.stop()
        broker.stop()


def test_a_missing_password_is_a_state_not_a_crash(tmp_path: Path) -> None:
    src = source(1, MqttConfig(username=USER, password_file=tmp_path / "nope"))
    src.start()
    st = src.status()
    assert st["state"] == "misconfigured" and "nope" in st["reason"]
    src.stop()
    assert src.status()["state"] == "misconfigured"


def test_password_sources_and_client_ids(tmp_path: Path) -> None:
    assert read_password(MqttConfig(), {}) is None
    assert read_password(MqttConfig(username="u", password_file=password_file(tmp_path, "p w")),
                         {}) == "p w"
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "broker").write_text("from-systemd\n")
    cfg = MqttConfig(username="u", password_credential="broker")
    assert read_password(cfg, {"CREDENTIALS_DIRECTORY": str(creds)}) == "from-systemd"
    with pytest.raises(ValueError, match="CREDENTIALS_DIRECTORY"):
        read_password(cfg, {})
    (creds / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_password(MqttConfig(username="u", password_credential="empty"),
                      {"CREDENTIALS_DIRECTORY": str(creds)})
    assert client_id(MqttConfig(), "pump-1", hostname="edge box.local") == \
        "kvagentd-edge_box.local-pump-1"
    assert client_id(MqttConfig(box_id="b7", client_id_prefix="plant"), "p") == "plant-b7-p"


@pytest.mark.parametrize("toml, field", [
    ('[agent.mqtt]\npassword = "x"\n', "agent.mqtt.password"),  # never in the configuration
    ('[agent.mqtt]\npassword_file = "/etc/kvagentd/mqtt-password"\n', "agent.mqtt.username"),
    ('[agent.mqtt]\ntls = true\ncert_file = "/c.pem"\n', "agent.mqtt.key_file"),
    ('[agent.mqtt]\nca_file = "/ca.pem"\n', "agent.mqtt.ca_file"),
    ('[agent.mqtt]\nusername = "u"\npassword_file = "/p"\npassword_credential = "p"\n',
     "agent.mqtt.password_credential"),
    ('[agent.mqtt]\nqos = 3\n', "agent.mqtt.qos"),
    ('[agent.mqtt]\nbox_id = "a b"\n', "agent.mqtt.box_id"),
])
def test_bad_mqtt_configuration(tmp_path: Path, toml: str, field: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(p, env={})
    assert e.value.path == field


def test_stale_data(tmp_path: Path) -> None:
    t = [1000.0]
    src = MqttSource(AssetConfig(source="mqtt", mqtt_topic="x"), stale_after_s=5.0,
                     clock=lambda: t[0])
    src._on_payload(json.dumps({"sample_rate": 12000, "samples": [0.0, 1.0]}).encode())
    assert src.read_window(1002.0).samples.size == 2
    with pytest.raises(BadData) as e:
        src.read_window(1010.0)
    assert e.value.reason == "stale"


def test_the_daemon_exports_connection_state(tmp_path: Path) -> None:
    """Through the composition root, as the daemon builds it: metrics, status, health."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvagentd.services import BuildContext, build_services

    broker = Broker(tmp_path / "broker").start()
    p = tmp_path / "c.toml"
    p.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n[model]\nsource = "none"\n'
                 '[agent.mqtt]\nbox_id = "b1"\n'
                 f'[[agent.assets]]\nname = "fan-3"\nsource = "mqtt"\nmqtt_port = {broker.port}\n'
                 'mqtt_topic = "plant/fan-3"\n')
    from apscheduler.schedulers.background import BackgroundScheduler

    sched = BackgroundScheduler(timezone="UTC")
    sched.start(paused=True)
    registry = CollectorRegistry()
    services = build_services(load_config(p, env={}), BuildContext(sched, registry))
    agent = services.agent
    assert agent is not None
    agent.start()
    try:
        src = agent.assets["fan-3"].source
        assert isinstance(src, MqttSource)
        assert wait_for(lambda: src.connected)
        text = generate_latest(registry).decode()
        assert f'kvagentd_mqtt_connected{{asset="fan-3",broker="127.0.0.1:{broker.port}"}} 1.0' \
            in text
        assert 'kvagentd_mqtt_connects_total{asset="fan-3"} 1.0' in text
        assert agent.status()["sources"]["fan-3"]["client_id"].startswith("kvagentd-b1-fan-3")
        assert agent.asset_views()[0].connected is True
        broker.stop()
        assert wait_for(lambda: not src.connected)
        check = sensor(agent.asset_views()[0], HealthConfig())
        assert check.level.value == "degraded" and "(disconnected" in check.reason
        assert 'kvagentd_mqtt_connected{asset="fan-3"' in generate_latest(registry).decode()
    finally:
        agent.stop()
        sched.shutdown(wait=False)
        broker.stop()
