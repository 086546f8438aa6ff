"""One MQTT broker connection of a sensor source: credentials, TLS, client id, QoS, clean
session, and the connection's state for status, health and metrics.

Settings come from `[agent.mqtt]` (`MqttConfig`) and the asset (`mqtt_host`, `mqtt_port`,
`mqtt_topic`). The password is read when the connection starts, from `password_file` or from
the systemd credential `password_credential` (`$CREDENTIALS_DIRECTORY/<name>`), never from the
configuration or the command line, and it is never logged.

The client id is `<client_id_prefix>-<box>-<asset>`: `box` is `box_id`, or this host's name,
so two boxes with the same asset names do not take each other's session on the broker.

State (`BrokerState`): `connecting` until the first answer, `connected`, `refused` (the broker
said no: bad user name or password, not authorized), `unreachable` (no TCP or TLS connection:
down, wrong address, certificate not trusted), `disconnected` (lost after being connected;
reconnecting), `stopped`, `misconfigured` (the password cannot be read). paho reconnects by
itself with backoff (1 s doubling to 30 s) in every state but `stopped` and `misconfigured`.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import structlog

from kvagentd.config import AssetConfig, ConfigError, MqttConfig
from kvagentd.config.secrets import read_secret

log = structlog.get_logger(__name__)


class BrokerState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    DISCONNECTED = "disconnected"
    STOPPED = "stopped"
    MISCONFIGURED = "misconfigured"


def connect_failure(exc: BaseException | None, broker: str) -> str:
    """Why a connection to `broker` failed, in an operator's words: refused, DNS, TLS (the
    certificate, or TLS on a plain port), unreachable, timed out."""
    if exc is None:
        return "no connection (the cause was not reported)"
    if isinstance(exc, ConnectionRefusedError):
        return f"refused: nothing accepts connections on {broker} (the broker down, or another port)"
    if isinstance(exc, socket.gaierror):
        return f"DNS: the broker's host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate is not trusted ({exc.verify_message or exc})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc} (a plain MQTT port, or a TLS setting the broker refuses)"
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"timed out connecting to {broker} (a firewall, or the host is down)"
    if isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"unreachable: no route to {broker} ({exc.strerror})"
    return f"no connection: {type(exc).__name__}: {exc}"


class BrokerConfigError(ValueError):
    """The connection cannot be set up from the configuration (an unreadable password...)."""


def read_password(cfg: MqttConfig, environ: Mapping[str, str]) -> str | None:
    """The broker password from its file or systemd credential; None when none is configured."""
    try:
        return read_secret("agent.mqtt", cfg.password_file, cfg.password_credential, environ)
    except ConfigError as exc:
        raise BrokerConfigError(str(exc)) from None


def client_id(cfg: MqttConfig, asset: str, hostname: str | None = None) -> str:
    box = cfg.box_id or "".join(c if c.isalnum() or c in "_.-" else "_"
                                for c in (hostname or socket.gethostname()))[:64]
    return f"{cfg.client_id_prefix}-{box}-{asset}"


class BrokerConnection:
    """A paho-mqtt 2.x client subscribed to one asset's topic; `on_message(payload)` gets
    every message. `start()` never blocks on the broker; `stop()` disconnects."""

    def __init__(self, asset: AssetConfig, cfg: MqttConfig,
                 on_message: Callable[[bytes], None], *,
                 environ: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] = time.time) -> None:
        self.asset, self.cfg = asset, cfg
        self.on_message = on_message
        self.environ, self.clock = environ, clock
        self.client_id = client_id(cfg, asset.name)
        self._lock = threading.Lock()
        self._state = BrokerState.STOPPED
        self._since = clock()
        self._reason = ""
        self._client: Any = None
        self.connects = 0
        self.failures = 0  # refused or unreachable attempts
        self.disconnects = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background; a missing password is `misconfigured` (logged), not a crash."""
        import paho.mqtt.client as mqtt

        try:
            password = read_password(self.cfg, self.environ)
        except BrokerConfigError as exc:
            self._set(BrokerState.MISCONFIGURED, str(exc))
            log.error("mqtt.misconfigured", asset=self.asset.name, error=str(exc))
            return
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             clean_session=self.cfg.clean_session,
                             protocol=mqtt.MQTTv311)
        if self.cfg.username:
            client.username_pw_set(self.cfg.username, password)
        if self.cfg.tls:
            client.tls_set(ca_certs=str(self.cfg.ca_file) if self.cfg.ca_file else None,
                           certfile=str(self.cfg.cert_file) if self.cfg.cert_file else None,
                           keyfile=str(self.cfg.key_file) if self.cfg.key_file else None,
                           cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_message = lambda _c, _u, msg: self.on_message(bytes(msg.payload))
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._set(BrokerState.CONNECTING, "")
        client.connect_async(self.asset.mqtt_host, self.asset.mqtt_port,
                             keepalive=self.cfg.keepalive_s)
        client.loop_start()
        self._client = client
        log.info("mqtt.connecting", asset=self.asset.name, broker=self.broker,
                 client_id=self.client_id, tls=self.cfg.tls, user=self.cfg.username or None)

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()
        if self._state is not BrokerState.MISCONFIGURED:
            self._set(BrokerState.STOPPED, "")

    # -- paho callbacks (its network thread) -----------------------------------------------

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        if reason_code.is_failure:
            self.failures += 1
            self._set(BrokerState.REFUSED, str(reason_code))
            log.warning("mqtt.refused", asset=self.asset.name, broker=self.broker,
                        reason=str(reason_code))
            return
        self.connects += 1
        self._set(BrokerState.CONNECTED, "")
        client.subscribe(self.asset.mqtt_topic, qos=self.cfg.qos)
        log.info("mqtt.connected", asset=self.asset.name, broker=self.broker,
                 topic=self.asset.mqtt_topic, qos=self.cfg.qos,
                 session_present=bool(getattr(flags, "session_present", False)))

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self.failures += 1
        # NOTE: paho calls this inside its `except OSError:` around the connect, without the
        # exception: the one being handled is the cause
        why = connect_failure(sys.exc_info()[1], self.broker)
        # A connection lost earlier stays `disconnected` (since then) while retries fail.
        lost = self.state is BrokerState.DISCONNECTED
        self._set(BrokerState.DISCONNECTED if lost else BrokerState.UNREACHABLE, why)
        log.warning("mqtt.unreachable", asset=self.asset.name, broker=self.broker,
                    tls=self.cfg.tls, reason=why)

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        if self._client is None:
            return  # our own stop()
        state = self.state
        if state is BrokerState.CONNECTED:
            self.disconnects += 1
            self._set(BrokerState.DISCONNECTED, str(reason_code))
            log.warning("mqtt.disconnected", asset=self.asset.name, reason=str(reason_code))
        elif state is BrokerState.CONNECTING:
            # Closed before any CONNACK: not an MQTT broker, or TLS expected on this port.
            self.failures += 1
            self._set(BrokerState.UNREACHABLE,
                      f"closed before the broker answered ({reason_code}); TLS on this port?")
            log.warning("mqtt.unreachable", asset=self.asset.name, broker=self.broker,
                        reason=str(reason_code), tls=self.cfg.tls)

    # -- state -----------------------------------------------------------------------------

    def _set(self, state: BrokerState, reason: str) -> None:
        with self._lock:
            if state is not self._state:
                self._since = self.clock()
            self._state, self._reason = state, reason

    @property
    def state(self) -> BrokerState:
        with self._lock:
            return self._state

    @property
    def connected(self) -> bool:
        return self.state is BrokerState.CONNECTED

    @property
    def broker(self) -> str:
        return f"{self.asset.mqtt_host}:{self.asset.mqtt_port}"

    def status(self) -> dict[str, Any]:
        with self._lock:
            state, since, reason = self._state, self._since, self._reason
        return {"broker": self.broker, "topic": self.asset.mqtt_topic, "state": state.value,
                "since_s": round(self.clock() - since, 3), "reason": reason,
                "client_id": self.client_id, "tls": self.cfg.tls,
                "user": self.cfg.username or None, "qos": self.cfg.qos,
                "clean_session": self.cfg.clean_session, "connects": self.connects,
                "failures": self.failures, "disconnects": self.disconnects}


def metric_families(connections: Mapping[str, BrokerConnection]) -> Iterator[Any]:
    """Prometheus families of the connections (for a collector on the daemon's registry)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily("kvagentd_mqtt_connected",
                           "1 while the asset's MQTT source is connected to its broker",
                           labels=["asset", "broker"])
    state = GaugeMetricFamily("kvagentd_mqtt_state", "the MQTT connection's state (1 = current)",
                              labels=["asset", "state"])
    connects = CounterMetricFamily("kvagentd_mqtt_connects", "successful MQTT connections",
                                   labels=["asset"])
    failures = CounterMetricFamily("kvagentd_mqtt_connect_failures",
                                   "MQTT connection attempts refused or failed", labels=["asset"])
    for name, c in connections.items():
        current = c.state
        up.add_metric([name, c.broker], 1.0 if current is BrokerState.CONNECTED else 0.0)
        for s in BrokerState:
            state.add_metric([name, s.value], 1.0 if s is current else 0.0)
        connects.add_metric([name], float(c.connects))
        failures.add_metric([name], float(c.failures))
    yield from (up, state, connects, failures)


class MqttCollector:
    """Prometheus collector of MQTT connections (`kvagentd_mqtt_*`), read at each scrape."""

    def __init__(self, connections: Callable[[], Mapping[str, BrokerConnection]]) -> None:
        self.connections = connections

    def collect(self) -> Iterator[Any]:
        yield from metric_families(self.connections())
