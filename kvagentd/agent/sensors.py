"""Sensor sources: one interface, three implementations chosen per asset (`asset.source`).

`SensorSource.read_window(now) -> Window` returns the window for wall/simulated time `now` or
raises `BadData(reason)`; `validate(window, asset, now)` checks a window against the asset's
expectations. Reasons (the keys of the per-asset bad-sample counters): `nonfinite` (NaN/inf),
`length` (not `window_s * sample_rate_hz` samples), `rate` (sample rate differs by more than
0.5 %), `silent` (a constant signal: a dead sensor or cable), `stale` (no fresh data), `decode`
(an undecodable message), `missing` (no data at all yet), `io` (a replay file cannot be read).

- `simulated`: a physical model of a rotating machine, deterministic for (seed, now). Shaft rate
  fr = rpm / 60: 1x (imbalance) and 2x (misalignment) velocity harmonics; a bearing defect is a
  train of impacts at BPFO (outer race) or BPFI (inner race, amplitude-modulated at 1x) with 1 %
  timing jitter, each ringing a structural resonance (decaying sinusoid, 3.5 kHz, 5 % damping);
  broadband noise. Faults (`asset.fault`) start at `onset_s` after the source's start time and
  grow by `growth_per_hour` (x severity) per hour. Time comes from the `now` passed in, so a
  simulated clock works.
- `replay`: a `.npy` (1-D float array) or `.csv` (first column, `#` comments and a non-numeric
  header line skipped) of samples at `asset.sample_rate_hz`, served window after window, looping.
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
import math
import struct
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import structlog

from kvagentd.agent.features import Window, bearing_frequencies
from kvagentd.config import AssetConfig

log = structlog.get_logger(__name__)

BINARY_HEADER = struct.Struct("<4sdB3xI")
BINARY_MAGIC = b"KVS1"
KINDS = ("acceleration", "velocity")
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

    def start(self) -> None:
        """Open connections (default: nothing)."""

    def stop(self) -> None:
        """Close connections (default: nothing)."""


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
# simulated
# ------------------------------------------------------------------------------------------

RESONANCE_HZ = 3500.0
RESONANCE_DAMPING = 0.05
BASE_1X_MM_S = 0.9  # RMS velocity of the healthy 1x component
BASE_2X_MM_S = 0.25
NOISE_M_S2 = 0.4  # RMS of the broadband acceleration noise
IMPACT_M_S2 = 3.0  # impact ringing amplitude at fault level 1
IMBALANCE_MM_S = 1.2  # added 1x RMS velocity per fault level
MISALIGN_MM_S = 1.0  # added 2x RMS velocity per fault level


class SimulatedSource(SensorSource):
    """Deterministic machine model (see module docstring); `start_time` anchors fault onset."""

    def __init__(self, asset: AssetConfig, start_time: float) -> None:
        self.asset = asset
        self.start_time = start_time

    def fault_level(self, now: float) -> float:
        f = self.asset.fault
        age = now - self.start_time - f.onset_s
        if f.kind == "none" or age < 0:
            return 0.0
        return f.severity * (1.0 + f.growth_per_hour * age / 3600.0)

    def read_window(self, now: float) -> Window:
        a = self.asset
        fs = a.sample_rate_hz
        n = expected_length(a)
        t0 = now - a.window_s
        t = t0 + np.arange(n) / fs
        # Seeded by (seed, window start in ms): the same time gives the same window.
        rng = np.random.default_rng([a.seed, int(round(t0 * 1000)) & 0xFFFFFFFFFFFF])
        fr = a.rpm / 60.0
        level = self.fault_level(now)
        kind = a.fault.kind
        v1 = BASE_1X_MM_S + (IMBALANCE_MM_S * level if kind == "imbalance" else 0.0)
        v2 = BASE_2X_MM_S + (MISALIGN_MM_S * level if kind == "misalignment" else 0.0)
        v3 = 0.4 * MISALIGN_MM_S * level if kind == "misalignment" else 0.0
        phase = rng.uniform(0, 0.2)  # small phase wander; harmonics stay coherent with time
        vel = np.zeros(n)
        for h, v_rms in ((1, v1), (2, v2), (3, v3)):
            if v_rms > 0:
                vel += math.sqrt(2) * v_rms * np.sin(2 * np.pi * h * fr * t + h * phase)
        if a.signal == "acceleration":
            # d/dt of the velocity harmonics, mm/s -> m/s^2.
            acc = np.zeros(n)
            for h, v_rms in ((1, v1), (2, v2), (3, v3)):
                if v_rms > 0:
                    w = 2 * np.pi * h * fr
                    acc += math.sqrt(2) * v_rms / 1000.0 * w * np.cos(w * t + h * phase)
            acc += rng.normal(0.0, NOISE_M_S2, n)
            if kind in ("outer_race", "inner_race") and level > 0:
                acc += self._impacts(t, t0, fs, level, rng)
            x = acc
        else:
            x = vel + rng.normal(0.0, NOISE_M_S2 * 0.05, n)
        return Window(samples=x.astype(np.float64), sample_rate=fs, kind=a.signal, t0=t0)

    def _impacts(self, t: np.ndarray, t0: float, fs: float, level: float,
                 rng: np.random.Generator) -> np.ndarray:
        a = self.asset
        freqs = bearing_frequencies(a.bearing, a.rpm)
        f_def = freqs.bpfo if a.fault.kind == "outer_race" else freqs.bpfi
        period = 1.0 / f_def
        ring_s = 5.0 / (RESONANCE_DAMPING * 2 * np.pi * RESONANCE_HZ)  # until e^-5
        k0 = math.floor((t0 - ring_s) / period)
        k1 = math.ceil((t0 + t.size / fs) / period)
        times = np.arange(k0, k1 + 1) * period
        times = times + rng.normal(0.0, 0.01 * period, times.size)
        amps = np.full(times.size, IMPACT_M_S2 * level)
        if a.fault.kind == "inner_race":
            # The defect rotates with the shaft: load-zone modulation at 1x.
            amps *= 0.6 + 0.4 * np.cos(2 * np.pi * (a.rpm / 60.0) * times)
        out = np.zeros(t.size)
        ring_n = int(ring_s * fs) + 1
        tau = np.arange(ring_n) / fs
        decay = 2 * np.pi * RESONANCE_HZ * RESONANCE_DAMPING
        for ti, ai in zip(times, amps):
            i0 = int(math.ceil((ti - t0) * fs))
            start = max(i0, 0)
            stop = min(i0 + ring_n, t.size)
            if stop <= start:
                continue
            dt = tau[start - i0:stop - i0] + (i0 / fs - (ti - t0))
            out[start:stop] += ai * np.exp(-decay * dt) * np.sin(2 * np.pi * RESONANCE_HZ * dt)
        return out


# ------------------------------------------------------------------------------------------
# replay
# ------------------------------------------------------------------------------------------

def load_samples(path: Path) -> np.ndarray:
    """Samples of a .npy or .csv file as float64 (see module docstring)."""
    if path.suffix == ".npy":
        data = np.load(path, allow_pickle=False)
        return np.asarray(data, dtype=np.float64).reshape(-1)
    values: list[float] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            first = line.split(",")[0].strip()
            try:
                values.append(float(first))
            except ValueError:
                if values:
                    raise
                continue  # a header line
    return np.asarray(values, dtype=np.float64)


class ReplaySource(SensorSource):
    """Consecutive windows of a recorded file, looping at its end."""

    def __init__(self, asset: AssetConfig) -> None:
        self.asset = asset
        self._data: np.ndarray | None = None
        self._pos = 0

    def start(self) -> None:
        if self.asset.replay_path is None:
            raise BadData("io", "no replay_path")
        self._data = load_samples(Path(self.asset.replay_path))

    def read_window(self, now: float) -> Window:
        if self._data is None:
            try:
                self.start()
            except (OSError, ValueError) as exc:
                raise BadData("io", str(exc)) from exc
        data = self._data
        assert data is not None
        n = expected_length(self.asset)
        if data.size < n:
            raise BadData("length", f"file holds {data.size} samples, a window needs {n}")
        if self._pos + n > data.size:
            self._pos = 0
        x = data[self._pos:self._pos + n]
        self._pos += n
        return Window(x, self.asset.sample_rate_hz, self.asset.signal, now - self.asset.window_s)


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

    `clock` stamps arrivals (the same clock as `read_window`'s `now`). Undecodable messages are
    counted in `decode_errors` and reported by the next read.
    """

    def __init__(self, asset: AssetConfig, *, stale_after_s: float, clock=time.time) -> None:
        self.asset = asset
        self.stale_after_s = stale_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._latest: tuple[float, Window] | None = None
        self._pending_error: BadData | None = None
        self.messages = 0
        self.decode_errors = 0
        self.connects = 0
        self._client = None

    def start(self) -> None:
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                             client_id=f"kvagentd-{self.asset.name}", clean_session=True)
        client.on_connect = self._on_connect
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        # connect_async + loop_start: an absent broker is retried in the background.
        client.connect_async(self.asset.mqtt_host, self.asset.mqtt_port, keepalive=30)
        client.loop_start()
        self._client = client

    def stop(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
            self._client = None

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.is_connected()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("mqtt.connect_failed", asset=self.asset.name, reason=str(reason_code))
            return
        self.connects += 1
        client.subscribe(self.asset.mqtt_topic, qos=0)
        log.info("mqtt.connected", asset=self.asset.name, topic=self.asset.mqtt_topic)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        log.warning("mqtt.disconnected", asset=self.asset.name, reason=str(reason_code))

    def _on_message(self, client, userdata, msg) -> None:
        now = self.clock()
        try:
            window = decode_payload(msg.payload, now)
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


def make_source(asset: AssetConfig, *, start_time: float, stale_after_s: float,
                clock=time.time) -> SensorSource:
    if asset.source == "simulated":
        return SimulatedSource(asset, start_time)
    if asset.source == "replay":
        return ReplaySource(asset)
    return MqttSource(asset, stale_after_s=stale_after_s, clock=clock)
