"""Metrics read from the services when Prometheus scrapes (`ScrapeCollector`), so no figure is
counted twice: the store's tiers, the cold tier's per-device counters, SSD wear, the agent's
per-asset state and job outcomes, and the health checks.

Names follow the Prometheus conventions: base units in the name (`_bytes`, `_seconds`,
`_meters_per_second`, `_ratio` for 0-1), `_total` for counters, labels for tiers, devices,
assets and checks. Enumerations are one gauge per value (1 for the current one):
`kvagentd_cold_serving{tier="shadow"} 1`, `kvagentd_asset_fault{kind="outer_race"} 1`. Numeric
codes, for alert rules: `kvagentd_asset_zone` A=1 .. D=4, `kvagentd_asset_fault_severity`
none=0 low=1 medium=2 high=3, `kvagentd_health_check_status` ok=0, degraded=1, failing=2 (the
settled levels, after the hysteresis), `kvagentd_commentary_status` ok=0, missing=1 (the
model's commentary, never part of health).

An asset's measured values (RMS, zone, fault, severity, kurtosis, defect lines) describe its
last usable window; once that is older than the agent's stale limit (the sensor stopped, or
sends only refused windows) they are withdrawn, not repeated: a dead sensor must not read as
zone A. Before the first window since start there are none (the event log's last row is the
previous run's). `kvagentd_asset_sensor_stale` says so, and the data age keeps growing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvagentd.agent.diagnosis.bearing import PRIMARY_LINE
from kvagentd.agent.diagnosis.result import FAULTS, SEVERITIES
from kvagentd.agent.view import ZONE_NUMBER

if TYPE_CHECKING:
    from kvagentd.agent.view import AssetView
    from kvagentd.health import Facts, Report
    from kvagentd.scheduling.jobwatch import JobRecord

log = structlog.get_logger(__name__)

SERVING = ("ssd", "shadow", "restoring")
SSD_STATES = ("ok", "worn", "failed", "unknown", "not checked")
_STATUS_CODE = {"ok": 0, "degraded": 1, "failing": 2}
SEVERITY_CODE = {s: i for i, s in enumerate(SEVERITIES)}  # none=0 low=1 medium=2 high=3
DEFECT_LINES = tuple(PRIMARY_LINE.values())  # BPFO, BPFI, 2xBSF, FTF


class Scrape(NamedTuple):
    """What one scrape reads, gathered by the daemon (`Daemon.scrape`)."""

    facts: Facts
    report: Report
    store: dict[str, Any] | None  # TieredKVStore.stats()
    ticks: dict[str, JobRecord | None]  # per asset: its tick job's totals


class ScrapeCollector(Collector):
    """A prometheus_client collector over `source()`; None (not started) yields nothing."""

    def __init__(self, source: Callable[[], Scrape | None]) -> None:
        self.source = source

    def describe(self) -> list[Metric]:
        return []  # NOTE: not probed at registration (the services do not exist yet)

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.source()
        except Exception as exc:  # a scrape must never fail as a whole
            log.error("metrics_scrape_failed", exc_info=exc)
            return
        if s is None:
            return
        yield from _health(s)
        yield from _commentary(s.report)
        if s.store is not None:
            yield from _store(s.store, s.facts.lost_blocks)
        yield from _cold(s.facts)
        yield from _assets(s)


def _g(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _c(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def _health(s: Scrape) -> Iterator[Metric]:
    worst = _g("kvagentd_health_status", "Worst health check: 0 ok, 1 degraded, 2 failing")
    worst.add_metric([], _STATUS_CODE[s.report.level.value])
    yield worst
    each = _g("kvagentd_health_check_status", "Each health check: 0 ok, 1 degraded, 2 failing",
              ["check"])
    for c in s.report.checks:
        each.add_metric([c.name], _STATUS_CODE[c.level.value])
    yield each


def _commentary(r: Report) -> Iterator[Metric]:
    state = _g("kvagentd_commentary_status", "Whether the asset's ticks get the model's "
               "commentary: 0 ok, 1 missing (its last turns gave none; not part of health)",
               ["asset"])
    missing = _c("kvagentd_commentary_missing", "Model turns that gave no commentary, by why: "
                 "failed, cut (the tick's deadline), withheld (the check refused the text)",
                 ["asset", "reason"])
    for c in r.commentary:
        state.add_metric([c.asset], 0 if c.state == "ok" else 1)
        missing.add_metric([c.asset, "failed"], c.failed)
        missing.add_metric([c.asset, "cut"], c.cut)
        missing.add_metric([c.asset, "withheld"], c.withheld)
    yield from (state, missing)


def _store(st: dict[str, Any], lost: int | None) -> Iterator[Metric]:
    tiers = st.get("tiers") or {}
    blocks = _g("kvagentd_kv_blocks", "Blocks held per tier", ["tier"])
    used = _g("kvagentd_kv_bytes", "Bytes of KV held per tier", ["tier"])
    cap = _g("kvagentd_kv_capacity_bytes", "Capacity per tier", ["tier"])
    frag = _g("kvagentd_kv_fragmentation_ratio",
              "1 - largest free run / free slots of a block arena (0: compact)", ["tier"])
    for t in ("hot", "warm"):
        d = tiers.get(t) or {}
        blocks.add_metric([t], d.get("blocks", 0))
        used.add_metric([t], d.get("bytes", 0))
        cap.add_metric([t], d.get("arena_bytes", 0))
        frag.add_metric([t], d.get("fragmentation", 0.0))
    blocks.add_metric(["cold"], (tiers.get("cold") or {}).get("blocks", 0))
    yield from (blocks, used, cap, frag)
    pinned = _g("kvagentd_kv_pinned_blocks", "Blocks pinned by an operator")
    pinned.add_metric([], st.get("pinned", 0))
    yield pinned
    loaded = _c("kvagentd_kv_loaded_blocks", "Blocks made resident for requests, by the tier "
                "they came from", ["tier"])
    for t in ("hot", "warm", "cold"):
        loaded.add_metric([t], st.get(f"loaded_{t}", 0))
    yield loaded
    for key, name, doc in (
            ("lost", "kvagentd_kv_lost_blocks", "Blocks that could not be read back "
                                                "(recomputed on next use)"),
            ("evicted", "kvagentd_kv_evicted_blocks", "Blocks forgotten for space"),
            ("expired", "kvagentd_kv_expired_blocks", "Cold blocks forgotten past their TTL"),
            ("demoted", "kvagentd_kv_demoted_blocks", "Blocks moved down a tier"),
            ("promoted", "kvagentd_kv_promoted_blocks", "Blocks moved up a tier")):
        c = _c(name, doc)
        c.add_metric([], lost if key == "lost" and lost is not None else st.get(key, 0))
        yield c
    yield from _write_behind(st.get("write_behind") or {})
    yield from _write_budget(st.get("write_budget") or {})


def _write_budget(b: dict[str, Any]) -> Iterator[Metric]:
    """The SSD's write budget (`kv.ssd_write_budget_bytes_per_day`): what write-behind and
    demotions wrote and were refused; the alert compares the written rate with the budget."""
    if not b:
        return
    written = _c("kvagentd_ssd_budget_written_bytes",
                 "Bytes the store wrote to the cold tier under the SSD write budget")
    written.add_metric([], b.get("written_bytes") or 0)
    refused = _c("kvagentd_ssd_budget_refused_bytes",
                 "Bytes not written for the SSD write budget (kept in RAM or recomputed later)")
    refused.add_metric([], b.get("refused_bytes") or 0)
    yield from (written, refused)
    if b.get("bytes_per_day"):
        per_day = _g("kvagentd_ssd_budget_bytes_per_day", "The SSD write budget, bytes a day")
        per_day.add_metric([], b["bytes_per_day"])
        yield per_day


def _write_behind(wb: dict[str, Any]) -> Iterator[Metric]:
    """The store's write-behind to the cold tier, while it is enabled. A round that takes
    longer than the interval is the rate budget (`rate_bytes_per_s`) falling behind."""
    if not wb.get("enabled"):
        return
    for key, name, doc in (
            ("rounds", "kvagentd_kv_write_behind_rounds", "Write-behind rounds run"),
            ("errors", "kvagentd_kv_write_behind_errors", "Write-behind rounds that failed"),
            ("written_bytes", "kvagentd_kv_write_behind_written_bytes",
             "Bytes of blocks written behind to the cold tier"),
            ("refused_blocks", "kvagentd_kv_write_behind_refused_blocks",
             "Blocks the cold tier refused to write behind")):
        c = _c(name, doc)
        c.add_metric([], wb.get(key) or 0)
        yield c
    interval = _g("kvagentd_kv_write_behind_interval_seconds",
                  "Configured time between write-behind rounds")
    interval.add_metric([], wb.get("interval_s") or 0.0)
    yield interval
    if wb.get("last_round_s") is not None:
        last = _g("kvagentd_kv_write_behind_round_seconds",
                  "Duration of the last write-behind round (paced to rate_bytes_per_s)")
        last.add_metric([], wb["last_round_s"])
        unsaved = _g("kvagentd_kv_write_behind_unsaved_blocks",
                     "Blocks still without a cold copy when the last round ended")
        unsaved.add_metric([], wb.get("unsaved_blocks") or 0)
        yield from (last, unsaved)


def _cold(f: Facts) -> Iterator[Metric]:
    v = f.cold
    if v is not None:
        used = _g("kvagentd_cold_bytes", "Bytes of cold records per device", ["device"])
        cap = _g("kvagentd_cold_capacity_bytes", "Cold capacity per device", ["device"])
        used.add_metric(["ssd"], v.ssd_bytes)
        used.add_metric(["shadow"], v.shadow_bytes)
        cap.add_metric(["ssd"], v.ssd_capacity_bytes)
        cap.add_metric(["shadow"], v.shadow_capacity_bytes)
        yield from (used, cap)
        families = {
            "read_bytes": _c("kvagentd_cold_read_bytes", "Bytes read from cold records",
                             ["device"]),
            "write_bytes": _c("kvagentd_cold_written_bytes", "Bytes of cold records written",
                              ["device"]),
            "reads": _c("kvagentd_cold_reads", "Cold records read", ["device"]),
            "writes": _c("kvagentd_cold_writes", "Cold records written", ["device"]),
            "corrupt": _c("kvagentd_cold_checksum_failures",
                          "Cold records that failed their checksum (reads and scrubs)",
                          ["device"]),
            "missing": _c("kvagentd_cold_missing_records",
                          "Indexed cold records not found on disk", ["device"]),
            "evicted": _c("kvagentd_cold_evicted_records", "Cold records evicted for capacity",
                          ["device"]),
        }
        errors = _c("kvagentd_cold_io_errors", "Cold I/O errors (EIO, ENOSPC, EROFS)",
                    ["device", "op"])
        discarded = _g("kvagentd_cold_index_discarded",
                       "1 when the device's index was unreadable at start and set aside",
                       ["device"])
        for dev, counters in v.counters.items():
            for key, fam in families.items():
                fam.add_metric([dev], counters.get(key, 0))
            errors.add_metric([dev, "read"], counters.get("io_errors", 0))
            errors.add_metric([dev, "write"], counters.get("write_failures", 0))
            discarded.add_metric([dev], 1 if v.index_discarded.get(dev) else 0)
        yield from families.values()
        yield from (errors, discarded)
        ro = _g("kvagentd_cold_read_only", "1 while the SSD takes no new cold records")
        ro.add_metric([], 1 if v.read_only else 0)
        serving = _g("kvagentd_cold_serving", "Where cold writes go: 1 for the current one",
                     ["tier"])
        for t in SERVING:
            serving.add_metric([t], 1 if v.serving == t else 0)
        since = _g("kvagentd_cold_serving_since_seconds",
                   "Unix time of the last switch between the SSD and the shadow")
        since.add_metric([], v.since)
        fo = _c("kvagentd_cold_failovers", "Switches of cold writes to the shadow")
        fo.add_metric([], v.failovers)
        fb = _c("kvagentd_cold_failbacks", "Restores of the shadow to the SSD")
        fb.add_metric([], v.failbacks)
        yield from (ro, serving, since, fo, fb)
    w = f.wear
    if w is not None:
        state = _g("kvagentd_ssd_health", "SSD health from SMART: 1 for the current state",
                   ["state"])
        for s in SSD_STATES:
            state.add_metric([s], 1 if w.state == s else 0)
        yield state
        if w.percent is not None:
            wear = _g("kvagentd_ssd_wear_ratio", "SSD endurance used (SMART percentage used "
                                                 "/ 100)")
            wear.add_metric([], w.percent / 100.0)
            yield wear


def stale(v: AssetView) -> bool:
    """Whether the asset's last usable window is past the agent's stale limit (or none came
    in that long since start): its measured values are no longer the machine's."""
    if v.data_age_s is None:
        return v.running_s > v.stale_after_s
    return v.data_age_s > v.stale_after_s


def _assets(s: Scrape) -> Iterator[Metric]:
    views = s.facts.assets
    rms = _g("kvagentd_asset_rms_velocity_meters_per_second",
             "Broadband RMS vibration velocity (10-1000 Hz) of the last window (x1000: mm/s)",
             ["asset"])
    zone = _g("kvagentd_asset_zone", "ISO 10816 zone of the last window: A=1 B=2 C=3 D=4",
              ["asset"])
    anomaly = _g("kvagentd_asset_anomaly", "1 when the last window was flagged", ["asset"])
    age = _g("kvagentd_asset_sensor_data_age_seconds",
             "Seconds since the last usable window (MQTT link: kvagentd_mqtt_*)", ["asset"])
    is_stale = _g("kvagentd_asset_sensor_stale",
                  "1 while the last usable window is older than the stale limit (the asset's "
                  "measured values are withdrawn)", ["asset"])
    bad = _c("kvagentd_asset_bad_windows", "Windows refused, by reason", ["asset", "reason"])
    fault = _g("kvagentd_asset_fault", "Diagnosed fault of the last window: 1 for the current "
                                       "kind (none when no fault)", ["asset", "kind"])
    severity = _g("kvagentd_asset_fault_severity",
                  "Severity of the diagnosed fault: none=0 low=1 medium=2 (zone C) high=3 "
                  "(zone D)", ["asset"])
    confidence = _g("kvagentd_asset_fault_confidence_ratio",
                    "How much of the fault's signature is present, 0-1 (a grade of the "
                    "evidence, not a probability)", ["asset"])
    kurtosis = _g("kvagentd_asset_kurtosis", "Kurtosis of the last window (3 for Gaussian "
                                             "noise; impacts raise it)", ["asset"])
    line = _g("kvagentd_asset_defect_line_strength",
              "Envelope-spectrum line of a bearing defect over the noise floor (BPFO outer "
              "race, BPFI inner race, 2xBSF ball, FTF cage)", ["asset", "line"])
    threshold = _g("kvagentd_asset_defect_line_threshold",
                   "Strength at which the defect line counts as significant", ["asset", "line"])
    for v in views:
        if v.data_age_s is not None:
            age.add_metric([v.name], v.data_age_s)
        for reason, n in v.bad_samples.items():
            bad.add_metric([v.name, reason], n)
        if stale(v):
            is_stale.add_metric([v.name], 1)
            continue
        is_stale.add_metric([v.name], 0)
        if v.data_age_s is None:
            continue  # no window since start: the last row is the previous run's
        if v.last_rms_mm_s is not None:
            rms.add_metric([v.name], v.last_rms_mm_s / 1000.0)
        if v.last_zone in ZONE_NUMBER:
            zone.add_metric([v.name], ZONE_NUMBER[v.last_zone])
        if v.last_anomaly is not None:
            anomaly.add_metric([v.name], 1 if v.last_anomaly else 0)
        d = v.last_diagnosis
        if not d:
            continue
        if d.get("fault") in FAULTS:
            for kind in FAULTS:
                fault.add_metric([v.name, kind], 1 if d["fault"] == kind else 0)
        if d.get("severity") in SEVERITY_CODE:
            severity.add_metric([v.name], SEVERITY_CODE[d["severity"]])
        for fam, key in ((confidence, "confidence"), (kurtosis, "kurtosis")):
            if isinstance(d.get(key), int | float):
                fam.add_metric([v.name], float(d[key]))
        for fam, key in ((line, "ratios"), (threshold, "thresholds")):
            for name, value in (d.get(key) or {}).items():
                if name in DEFECT_LINES and isinstance(value, int | float):
                    fam.add_metric([v.name, name], float(value))
    yield from (rms, zone, anomaly, age, is_stale, bad, fault, severity, confidence, kurtosis,
                line, threshold)
    ticks = _c("kvagentd_agent_ticks", "Sensor ticks done per asset", ["asset"])
    skipped = _c("kvagentd_agent_ticks_skipped",
                 "Due ticks not run: the previous one still ran (overlap) or too late (missed)",
                 ["asset", "reason"])
    for asset, rec in s.ticks.items():
        ticks.add_metric([asset], rec.runs if rec else 0)
        skipped.add_metric([asset, "overlap"], rec.skipped if rec else 0)
        skipped.add_metric([asset, "missed"], rec.missed if rec else 0)
    yield from (ticks, skipped)
