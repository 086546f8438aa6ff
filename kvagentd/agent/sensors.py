"""Sensor sources: one interface, three implementations chosen per asset (`asset.source`).

`SensorSource.read_window(now) -> Window` returns the window for wall/simulated time `now` or
raises `BadData(reason)`; `validate(window, asset, now)` checks a window against the asset's
expectations. Reasons (the keys of the per-asset bad-sample counters): `nonfinite` (NaN/inf),
`length` (not `window_s * sample_rate_hz` samples), `rate` (sample rate differs by more than
0.5 %), `silent` (a constant signal: a dead sensor or cable), `stale` (no fresh data), `decode`
(an undecodable message), `missing` (no data at all yet), `io` (a replay file cannot be read).

- `simulated` (`kvagentd.agent.simulator`): a physical model of a rotating machine with the
  fault kinds of the diagnosis vocabulary, deterministic for (seed, now).
- `replay` (`kvagentd.agent.replay`): a recorded .npy/.csv/.wav file with its unit and rate,
  window after window, looping; events say when it wraps.
- `mqtt`: a paho-mqtt 2.x subscriber to `asset.mqtt_topic`; the latest message is the window.
  Payload, either
    * JSON: `{"sample_rate": 12000, "kind": "acceleration"|"velocity", "samples": [floats],
      "t0": unix seconds (optional)}`, or
    * binary: a 20-byte little-endian header `struct "<4sdB3xI"` = magic `b"KVS1"`, sample rate
      (float64), kind (uint8: 0 acceleration m/s^2, 1 velocity mm/s), 3 pad bytes, sample count
      (uint32); then `count` float32 little-endian samples.
  The client reconnects by itself with exponential backoff (1 s doubling to 30 s).
"""

from __future__ import annotations

import json
import struct
import threading
import time
from abc import ABC, abstractmethod
from typing import Literal

import numpy as np
import structlog

from kvagentd.agent.features import Window
from kvagentd.config import AssetConfig, MqttConfig

log = structlog.get_logger(__name__)

BINARY_HEADER = struct.Struct("<4sdB3xI")
BINARY_MAGIC = b"KVS1"
KINDS: tuple[Literal["acceleration"], Literal["velocity"]] = ("acceleration", "velocity")
RATE_TOLERANCE = 0.005


class BadData(Exception):
    """A window could not be produced or failed validation; `reason` is a counter key."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class SensorSource(ABC):
    @abstractmethod
    def read_window(self, now: float) -> Window:
        """The window ending at `now`; raises BadData when there is none usable."""

    def start(self) -> None:  # noqa: B027 - an optional hook
        """Open connections (default: nothing)."""

    def stop(self) -> None:  # noqa: B027 - an optional hook
        """Close connections (default: nothing)."""

    def status(self) -> dict[str, object]:
        """The source's connection state for `/v1/status` (default: nothing to say)."""
        return {}


def validate(window: Window, asset: AssetConfig) -> None:
    """Raise BadData unless `window` matches the asset's rate and length and holds a signal."""
    x = np.asarray(window.samples)
    if x.ndim != 1 or x.size == 0:
        raise BadData("length", f"shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise BadData("nonfinite", f"{int(np.count_nonzero(~np.isfinite(x)))} samples")
    if abs(window.sample_rate - asset.sample_rate_hz) > RATE_TOLERANCE * asset.sample_rate_hz:
        raise BadData("rate", f"{window.sample_rate} Hz, expected {asset.sample_rate_hz}")
    expected = expected_length(asset)
    if abs(x.size - expected) > max(1, expected // 1000):
        raise BadData("length", f"{x.size} samples, expected {expected}")
    if float(np.ptp(x)) <= 1e-9 * max(1.0, float(np.max(np.abs(x)))):
        raise BadData("silent", "constant signal")
    if window.kind not in KINDS:
        raise BadData("decode", f"kind {window.kind!r}")


def expected_length(asset: AssetConfig) -> int:
    return int(round(asset.window_s * asset.sample_rate_hz))


# ------------------------------------------------------------------------------------------
# mqtt
# ------------------------------------------------------------------------------------------

def decode_payload(payload: bytes, received: float) -> Window:
    """A Window from an MQTT payload (JSON or KVS1 binary); raises BadData("decode")."""
    if payload[:4] == BINARY_MAGIC:
        if len(payload) < BINARY_HEADER.size:
            raise BadData("decode", "short header")
        _, rate, kind, count = BINARY_HEADER.unpack_from(payload)
        body = payload[BINARY_HEADER.size:]
        if kind > 1 or len(body) != 4 * count:
            raise BadData("decode", f"kind {kind}, {len(body)} bytes for {count} samples")
        x = np.frombuffer(body, dtype="<f4").astype(np.float64)
        return Window(x, float(rate), KINDS[kind], received - count / rate if rate > 0 else received)
    try:
        doc = json.loads(payload)
        rate = float(doc["sample_rate"])
        kind = doc.get("kind", "acceleration")
        x = np.asarray(doc["samples"], dtype=np.float64).reshape(-1)
        t0 = float(doc["t0"]) if "t0" in doc else received - x.size / rate
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        raise BadData("decode", str(exc)) from exc
    if kind not in KINDS:
        raise BadData("decode", f"kind {kind!r}")
    return Window(x, rate, kind, t0)


def encode_binary(samples: np.ndarray, sample_rate: float, kind: str = "acceleration") -> bytes:
    """The KVS1 binary payload for `samples` (publishers and tests)."""
    x = np.asarray(samples, dtype="<f4")
    return BINARY_HEADER.pack(BINARY_MAGIC, float(sample_rate), KINDS.index(kind), x.size) + x.tobytes()


class MqttSource(SensorSource):
    """Latest window received on `asset.mqtt_topic`; older than `stale_after_s` is `stale`.

    The broker connection (credentials, TLS, client id, QoS, clean session, its state) is a
    `kvagentd.agent.broker.BrokerConnection` configured by `[agent.mqtt]`. `clock` stamps
    arrivals (the same clock as `read_window`'s `now`). Undecodable messages are counted in
    `decode_errors` and reported by the next read.
    """

    def __init__(self, asset: AssetConfig, *, stale_after_s: float, clock=time.time,
                 mqtt: MqttConfig | None = None) -> None:
        from kvagentd.agent.broker import BrokerConnection

        self.asset = asset
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._latest: tuple[float, Window] | None = None
        self._pending_error: BadData | None = None
        self.messages = 0
        self.decode_errors = 0
        self.broker = BrokerConnection(asset, mqtt or MqttConfig(), self._on_payload)

    def start(self) -> None:
        self.broker.start()

    def stop(self) -> None:
        self.broker.stop()

    @property
    def connected(self) -> bool:
        return self.broker.connected

    @property
    def connects(self) -> int:
        return self.broker.connects

    @property
    def last_received(self) -> float | None:
        """When (the source's clock) the newest decodable message arrived; None: none yet."""
        with self._lock:
            return self._latest[0] if self._latest is not None else None

    def status(self) -> dict[str, object]:
        with self._lock:
            counts = {"messages": self.messages, "decode_errors": self.decode_errors}
        return {**self.broker.status(), **counts}

    def _on_payload(self, payload: bytes) -> None:
        now = self.clock()
        try:
            window = decode_payload(payload, now)
        except BadData as exc:
            with self._lock:
                self.decode_errors += 1
                self._pending_error = exc
            return
        with self._lock:
            self.messages += 1
            self._latest = (now, window)

    def read_window(self, now: float) -> Window:
        with self._lock:
            err, self._pending_error = self._pending_error, None
            latest = self._latest
        if err is not None:
            raise err
        if latest is None:
            raise BadData("missing", "no message received yet")
        received, window = latest
        if now - received > self.stale_after_s:
            raise BadData("stale", f"last message {now - received:.1f} s ago")
        return window
