"""What the agent tells the health checks and the metrics about each asset: its sensor link,
how fresh its data is, and the last measurement.

`asset_view(...)` is read-only: it takes the asset's state and the event log as they are.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from kvagentd.agent.sensors import MqttSource, SensorSource
from kvagentd.config import AgentConfig, AssetConfig

ZONE_NUMBER = {"A": 1, "B": 2, "C": 3, "D": 4}


class AssetView(NamedTuple):
    name: str
    source: str  # simulated | replay | mqtt
    link: str  # where the data comes from, for messages ("mqtt 127.0.0.1:1883 plant/pump-1")
    connected: bool | None  # MQTT: whether the client is connected; None: no link to hold
    data_age_s: float | None  # since the last usable window (None: none yet)
    running_s: float  # since the agent started (how long "none yet" has lasted)
    stale_after_s: float  # older data is refused by the source
    last_zone: str | None  # of the last usable window
    last_rms_mm_s: float | None
    last_anomaly: bool | None
    bad_samples: dict[str, int]  # per reason, since start
    message_age_s: float | None = None  # MQTT: since the last message arrived (None: none yet)
    last_refused: str | None = None  # the newest window was refused: why ("stale: ...")
    llm_failing: int = 0  # the asset's model turns in a row without commentary
    llm_error: str | None = None  # why the last of them gave none
    llm_errors: int = 0  # model turns failed since start
    llm_cut: int = 0  # model turns the tick's deadline cut since start
    llm_withheld: int = 0  # commentaries the check withheld since start
    last_diagnosis: dict[str, Any] | None = None  # of the last usable window (`Diagnosis.as_dict`)


class _AssetState(Protocol):
    """The members of the agent's per-asset state the view reads."""

    asset: AssetConfig
    source: SensorSource
    last_t: float | None
    bad: Any  # collections.Counter of bad-data reasons
    llm_failing: int
    llm_error: str | None
    llm_errors: int
    llm_cut: int
    withheld: int


def stale_after_s(config: AgentConfig) -> float:
    """How old a window may be before the agent's sources refuse it as stale: two tick
    intervals (at least 2 s) plus the longest window."""
    return max(2.0 * config.tick_interval_s, 2.0) + max(
        (a.window_s for a in config.assets), default=1.0)


def asset_view(st: _AssetState, last_row: dict[str, Any] | None, config: AgentConfig, *,
               now: float, started_at: float | None,
               newest: dict[str, Any] | None = None) -> AssetView:
    """The view of one asset at `now` (the agent's clock); `last_row` is its newest tick row,
    `newest` its newest row of any kind (a refused window is a `bad_data` row)."""
    a = st.asset
    connected: bool | None = None
    message_age: float | None = None
    link: str = a.source
    if isinstance(st.source, MqttSource):
        connected = st.source.connected
        received = st.source.last_received
        message_age = None if received is None else max(0.0, now - received)
        link = f"mqtt {a.mqtt_host}:{a.mqtt_port} {a.mqtt_topic}"
        if not connected:  # say why: refused (bad password), unreachable (TLS), ...
            state = st.source.status()
            link += f" ({state['state']}{': ' + str(state['reason']) if state['reason'] else ''})"
    features = (last_row or {}).get("features") or {}
    rms = features.get("rms_mm_s")
    return AssetView(
        name=a.name, source=a.source, link=link, connected=connected,
        data_age_s=None if st.last_t is None else max(0.0, now - st.last_t),
        running_s=0.0 if started_at is None else max(0.0, now - started_at),
        stale_after_s=stale_after_s(config),
        last_zone=(last_row or {}).get("zone"),
        last_rms_mm_s=float(rms) if isinstance(rms, int | float) else None,
        last_anomaly=bool(last_row["anomaly"]) if last_row else None,
        bad_samples=dict(st.bad),
        message_age_s=message_age,
        last_refused=str(newest.get("note") or "refused")
        if newest and newest.get("kind") == "bad_data" else None,
        llm_failing=st.llm_failing, llm_error=st.llm_error, llm_errors=st.llm_errors,
        llm_cut=st.llm_cut, llm_withheld=st.withheld,
        last_diagnosis=(last_row or {}).get("diagnosis"))
