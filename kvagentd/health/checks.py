"""The health checks: pure functions of `Facts`, thresholds from `[health]` (`HealthConfig`).

Each check, and what makes it degraded (D) or failing (F):
- daemon: D starting, F stopping. main-loop: F no progress for 3 loop intervals + 5 s.
  scheduler: F stopped.
- service:NAME: F not started, or its own `health()` failing or raising; D a job of it failed
  (until acknowledged).
- ticks:ASSET: F no tick done for `tick_late_intervals` intervals; D paused by an operator.
- skip-rate:ASSET: the share of due ticks skipped or missed in the last `window_s`:
  D at `skip_rate_degraded`, F at `skip_rate_failing` (ok below `min_due_ticks` due ticks).
- tick-p99:ASSET: p99 from due to done over the window, in tick intervals: D above
  `tick_p99_degraded`, F above `tick_p99_failing`.
- sensor:ASSET: F no usable data for the stale limit (`sensor_stale_s`, 0: the agent's own,
  two tick intervals plus a window), so the zone shown is old; D MQTT disconnected while the
  data is still fresh.
- cold-tier: D on the shadow or restoring, F on the shadow because the cold disk is full.
  read-only: D the SSD takes no new records. shadow-fill: D at `shadow_fill_degraded`,
  F at `shadow_fill_failing`.
- checksum-failures, lost-blocks, cold-index, cold-full (cold writes refused because every
  record left was pinned or in use): D when any since start or the last `kvctl health ack`.
- ssd-wear: D at `wear_degraded_percent`, worn, or a stale SMART status file; F SMART says the
  device failed; unknown (no status file): `wear_unknown`.
- memory-errors: D corrected ECC errors since start or the last ack, F an uncorrected one.
  thermal: D CPU throttle events since start or the last ack. pcie: D a GPU or NVMe link
  narrower than it can be. storage:cold: D the cold directory on tmpfs, a network filesystem
  or mounted nobarrier / data=writeback (maintenance/platform.py).
- memory: D below `memory_available_degraded` of RAM. disk:PATH: D below
  `maintenance.free_space_floor_bytes`, F full (less than one cold I/O unit free) or unreadable.

Not a check: the model's commentary (`commentary`), per asset in `Report.commentary`.

A check marked `at_once` carries unambiguous evidence, a fact rather than a figure that may
wander around a threshold: it already spans its own limit (a stalled main loop, stale sensor
data, no tick for `tick_late_intervals`, a full disk, SMART failed), it is a state the daemon
knows (its phase, the config file, a port it could not bind, the cold tier's failover state,
ticks paused by an operator), or it counts faults that stay counted until acknowledged.
`settle.Settled` takes it without waiting `raise_after_s`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from kvagentd.config import Config, HealthConfig
from kvagentd.health.acks import Acknowledgements
from kvagentd.health.facts import Facts, ServiceFacts, TickFacts, WearFacts
from kvagentd.health.report import Check, Commentary, Level, Report, age, pct, size

if TYPE_CHECKING:
    from kvagentd.agent.view import AssetView

log = structlog.get_logger(__name__)

OK, DEGRADED, FAILING = Level.OK, Level.DEGRADED, Level.FAILING
_LEVELS = {"ok": OK, "degraded": DEGRADED, "failing": FAILING}


def assess(cfg: Config, facts: Facts, acks: Acknowledgements) -> Report:
    """Every check, in a fixed order: daemon, services, per asset, cold tier, host,
    platform."""
    checks = [*_daemon(facts), *(_service(s, acks) for s in facts.services)]
    h = cfg.health
    for t in facts.ticks:
        checks += [ticks(t, h), skip_rate(t, h), tick_p99(t, h)]
    checks += [sensor(a, h) for a in facts.assets]
    checks += list(_cold(facts, h, acks))
    if facts.wear is not None:
        checks.append(ssd_wear(facts.wear, h, cfg.maintenance.wear_readonly_percent))
    checks += list(_host(facts, h, acks))
    if facts.platform is not None:
        checks += list(_platform(facts, acks))
    return Report(tuple(checks), acks.at, tuple(commentary(a) for a in facts.assets))


# -- the daemon and its services -----------------------------------------------------------

def _daemon(f: Facts) -> Iterator[Check]:
    d = f.daemon
    # NOTE: the phase is a fact, not a measurement: it is taken at once, both ways
    if d.phase == "running":
        yield Check("daemon", OK, f"running for {age(d.uptime_s)}", at_once=True)
    else:
        yield Check("daemon", DEGRADED if d.phase == "starting" else FAILING, d.phase,
                    at_once=True)
    if d.main_loop_age_s is not None:
        late = d.main_loop_age_s > d.main_loop_limit_s
        yield Check("main-loop", FAILING if late else OK,
                    f"last iteration {age(d.main_loop_age_s)} ago"
                    + (f" (limit {age(d.main_loop_limit_s)})" if late else ""), at_once=late)
    if d.metrics_error is not None:
        yield Check("metrics-listener", DEGRADED, f"{d.metrics_error}; metrics stay on the "
                                                  "control socket (GET /v1/metrics)", at_once=True)
    if d.config_rejected is not None:
        yield Check("config", DEGRADED, f"the file no longer loads ({d.config_rejected}); the "
                                        "daemon runs its previous configuration and would not "
                                        "start again with this file", at_once=True)
    elif d.config_pending:
        yield Check("config", DEGRADED, f"changed in the file, applied at the next restart: "
                                        f"{', '.join(d.config_pending)}", at_once=True)
    else:
        yield Check("config", OK, "running the configuration file as loaded", at_once=True)
    if d.scheduler_running:
        yield Check("scheduler", OK, f"{d.scheduler_jobs} jobs")
    else:
        yield Check("scheduler", FAILING, "not running: no tick, report or maintenance runs",
                    at_once=True)


def _service(s: ServiceFacts, acks: Acknowledgements) -> Check:
    name = f"service:{s.name}"
    if not s.started:
        return Check(name, FAILING, "not started", at_once=True)
    if s.probe_error is not None:
        return Check(name, FAILING, f"health probe raised {s.probe_error}", at_once=True)
    own = s.health or {"status": "ok", "detail": "running"}
    level = _LEVELS.get(str(own.get("status")), FAILING)
    reason = str(own.get("detail") or "running")
    failed = [(j, acks.since(f"job:{j.job_id}", j.errors)) for j in s.failed_jobs]
    failed = [(j, n) for j, n in failed if n]
    if failed and level is OK:
        j, n = max(failed, key=lambda p: -(p[0].last_error_age_s or 0.0))
        more = f" (and {len(failed) - 1} more jobs)" if len(failed) > 1 else ""
        return Check(name, DEGRADED, f"job {j.job_id} failed {n}x, last {age(j.last_error_age_s)} "
                                     f"ago: {j.last_error}{more}", ackable=True, at_once=True)
    # NOTE: a service that says it is failing names a state (its thread stopped), not a figure
    return Check(name, level, reason, ackable=bool(s.failed_jobs), at_once=level is FAILING)


# -- the agent: per asset --------------------------------------------------------------------

def ticks(t: TickFacts, h: HealthConfig) -> Check:
    name, every = f"ticks:{t.asset}", f"every {age(t.interval_s)}"
    if t.paused:
        return Check(name, DEGRADED, f"paused by an operator (kvctl jobs resume "
                                     f"agent.tick.{t.asset})", at_once=True)
    limit = h.tick_late_intervals * t.interval_s
    since = t.last_done_age_s if t.last_done_age_s is not None else t.waiting_s
    if since > limit:
        what = f"no tick done for {age(since)}" if t.last_done_age_s is not None \
            else f"no tick done in {age(since)} since start"
        return Check(name, FAILING, f"{what} ({every}; failing after "
                                    f"{h.tick_late_intervals:g} intervals)", at_once=True)
    if t.last_done_age_s is None:
        return Check(name, OK, f"first tick due ({every})")
    return Check(name, OK, f"last tick {age(t.last_done_age_s)} ago ({every})")


def skip_rate(t: TickFacts, h: HealthConfig) -> Check:
    name, w = f"skip-rate:{t.asset}", t.window
    dropped = w.skipped + w.missed
    base = f"{dropped} of {w.due} due ticks skipped in the last {age(h.window_s)}"
    if w.due < h.min_due_ticks:
        return Check(name, OK, f"{base} (too few to judge)")
    rate = dropped / w.due
    limits = f"degraded at {pct(h.skip_rate_degraded)}, failing at {pct(h.skip_rate_failing)}"
    if rate >= h.skip_rate_failing:
        return Check(name, FAILING, f"{base} ({pct(rate)}; {limits})")
    if rate >= h.skip_rate_degraded and dropped:
        return Check(name, DEGRADED, f"{base} ({pct(rate)}; {limits})")
    return Check(name, OK, base)


def tick_p99(t: TickFacts, h: HealthConfig) -> Check:
    name, d = f"tick-p99:{t.asset}", sorted(t.window.durations)
    if not d:
        return Check(name, OK, f"no tick done in the last {age(h.window_s)}")
    p99 = d[min(len(d) - 1, max(0, math.ceil(0.99 * len(d)) - 1))]
    ratio = p99 / t.interval_s
    # rounded up, so a p99 just above a limit never reads as equal to it ("1.00x ... degraded
    # above 1x")
    shown = math.ceil(ratio * 100 - 1e-9) / 100
    base = f"p99 {age(p99)} from due to done, {shown:.2f}x the {age(t.interval_s)} interval"
    if ratio > h.tick_p99_failing:
        return Check(name, FAILING, f"{base} (failing above {h.tick_p99_failing:g}x)")
    if ratio > h.tick_p99_degraded:
        return Check(name, DEGRADED, f"{base} (degraded above {h.tick_p99_degraded:g}x)")
    return Check(name, OK, f"{base} ({len(d)} ticks)")


def sensor(a: AssetView, h: HealthConfig) -> Check:
    """Whether the asset's source delivers usable windows. An MQTT source is judged by its
    messages and its link; any source by whether its newest window was refused. Ticks that run
    late make the shown zone old too, but that is the ticks' check, not the sensor's."""
    name = f"sensor:{a.name}"
    limit = h.sensor_stale_s or a.stale_after_s
    down = a.connected is False
    link = f"{a.link} disconnected" if down and "(" not in a.link else a.link
    shown = f"; status still shows zone {a.last_zone} from {age(a.data_age_s)} ago" \
        if a.last_zone and a.data_age_s is not None else ""
    if a.connected is not None:  # MQTT
        if a.message_age_s is None:
            if a.running_s > limit:
                return Check(name, FAILING, f"{link}: no message in {age(a.running_s)} since "
                                            f"start{_bad(a.bad_samples)}", at_once=True)
            return Check(name, DEGRADED if down else OK, f"{link}: waiting for the first message")
        if a.message_age_s > limit:
            return Check(name, FAILING, f"{link}: no message for {age(a.message_age_s)} (stale "
                                        f"after {age(limit)}){shown}{_bad(a.bad_samples)}",
                         at_once=True)
    if a.last_refused is not None:
        stale = a.data_age_s is None or a.data_age_s > limit
        return Check(name, FAILING if stale else DEGRADED,
                     f"{link}: the newest window was refused ({a.last_refused})"
                     + (f"; no usable one for {age(a.data_age_s)}" if stale else "")
                     + f"{shown if stale else ''}{_bad(a.bad_samples)}", at_once=stale)
    if down:
        return Check(name, DEGRADED, f"{link}; last message {age(a.message_age_s)} ago")
    if a.message_age_s is not None:
        return Check(name, OK, f"{link}, last message {age(a.message_age_s)} ago")
    if a.data_age_s is None:
        return Check(name, OK, f"{link}: waiting for the first window")
    return Check(name, OK, f"{link}, last window read {age(a.data_age_s)} ago")


# one failed turn is a moment (a timeout under load, a full queue at the beat); three in a row,
# about 9 s at the 3 s cadence, is a condition an operator should see
LLM_FAILING_TURNS = 3


def commentary(a: AssetView) -> Commentary:
    """Whether the asset's ticks get their commentary. Never a health check: the ticks still
    measure and diagnose without it, and a small model's prose is not the box's health."""
    since = f"{a.llm_errors} turns failed" + (
        f" and {a.llm_cut} were cut by the tick's deadline" if a.llm_cut else "") + (
        f"; {a.llm_withheld} commentaries withheld" if a.llm_withheld else "") + " since start"
    counts = {"failed": a.llm_errors, "cut": a.llm_cut, "withheld": a.llm_withheld}
    if a.llm_failing >= LLM_FAILING_TURNS:
        hint = ("; the model's text disagrees with the diagnosis or copies its prompt "
                "(`kvctl events` shows each): a larger model comments better"
                if (a.llm_error or "").startswith("commentary withheld") else "")
        return Commentary(a.name, "missing", f"the last {a.llm_failing} model turns gave no "
                                             f"commentary, the last: {a.llm_error}{hint}; ticks "
                                             f"still measure and diagnose ({since})", **counts)
    if a.llm_failing:
        return Commentary(a.name, "ok", f"the last model turn gave no commentary "
                                        f"({a.llm_error}); {since}", **counts)
    if a.llm_errors or a.llm_cut or a.llm_withheld:
        return Commentary(a.name, "ok", f"commenting; {since}", **counts)
    return Commentary(a.name, "ok", "no model turn without commentary since start", **counts)


def commentaries(views: Callable[[], Sequence[AssetView]]) -> dict[str, Any]:
    """Per asset, its `commentary` as `/v1/status` shows it (`{"error": ...}` when the views
    cannot be read: one broken probe must not hide the rest of the status)."""
    try:
        return {c.asset: c.as_dict() for c in (commentary(v) for v in views())}
    except Exception as exc:  # a broken probe is reported, never a failed status request
        log.error("commentary_status_failed", exc_info=exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def _bad(bad: dict[str, int]) -> str:
    if not bad:
        return ""
    return "; bad windows: " + ", ".join(f"{k} {v}" for k, v in sorted(bad.items()))


# -- the cold tier ---------------------------------------------------------------------------

def _cold(f: Facts, h: HealthConfig, acks: Acknowledgements) -> Iterator[Check]:
    c = f.cold
    if c is not None:
        # NOTE: the failover pair's states are taken at once, both ways: it has its own
        # hysteresis (it fails back only after `failback_good_probes` good probes in a row)
        if c.serving == "ssd":
            yield Check("cold-tier", OK, "serving from the SSD", at_once=True)
        elif c.serving == "shadow" and c.cause == "no_space":
            # NOTE: unambiguous (the SSD answered ENOSPC), and the SSD's part of the job, the
            # archive of long-idle sessions, is not being done: only the RAM shadow takes them
            yield Check("cold-tier", FAILING, f"the cold disk is full ({c.reason}): new cold "
                                              "records go to the shadow in RAM until there is "
                                              "room", at_once=True)
        else:
            what = "restoring to the SSD" if c.serving == "restoring" else "serving from the shadow"
            deferred = f"; restore deferred: {c.restore_deferred}" if c.restore_deferred else ""
            yield Check("cold-tier", DEGRADED, f"{what} ({c.reason}){deferred}", at_once=True)
        if c.read_only:
            why = (f"the SSD directory could not be written: {c.ssd_unwritable}"
                   if c.ssd_unwritable else "wear limit or a read-only file system")
            yield Check("read-only", DEGRADED, f"the SSD takes no new cold records ({why}); "
                                               "blocks that do not fit warm are dropped and "
                                               "recomputed", at_once=True)
        else:
            yield Check("read-only", OK, "the SSD takes new cold records", at_once=True)
        yield shadow_fill(c.shadow_bytes, c.shadow_capacity_bytes, h)
        counters = f.counters()
        n = acks.since("checksum-failures", counters["checksum-failures"])
        yield _counted("checksum-failures", n, acks,
                       "cold records failed their checksum; their blocks were recomputed")
        n = acks.since("cold-full", counters["cold-full"])
        yield _counted("cold-full", n, acks,
                       "blocks the cold tier refused, full of records that must stay (pinned or "
                       "in use); they stay in warm, or are dropped and recomputed when a request "
                       "needs the room: raise kv.cold_capacity_bytes or unpin blocks")
        discarded = [f"{dev}: {w}" for dev, w in c.index_discarded.items() if w]
        if acks.since("cold-index", counters["cold-index"]):
            yield Check("cold-index", DEGRADED, "set aside at start, its records were "
                        "discarded: " + "; ".join(discarded), ackable=True, at_once=True)
        else:
            yield Check("cold-index", OK, "acknowledged: " + "; ".join(discarded) if discarded
                        else "opened cleanly", ackable=bool(discarded))
    if f.lost_blocks is not None:
        n = acks.since("lost-blocks", f.lost_blocks)
        yield _counted("lost-blocks", n, acks,
                       "blocks could not be read back; their tokens are recomputed on next use")


def _counted(name: str, n: int, acks: Acknowledgements, what: str) -> Check:
    since = "since the acknowledgement" if acks.at is not None else "since start"
    if n:
        return Check(name, DEGRADED, f"{n} {since}: {what} (kvctl health ack {name})",
                     ackable=True, at_once=True)
    return Check(name, OK, f"none {since}", ackable=True)


def shadow_fill(used: int, capacity: int, h: HealthConfig) -> Check:
    if capacity <= 0:
        return Check("shadow-fill", OK, f"{size(used)} (no capacity set)")
    fill = used / capacity
    base = f"{pct(fill)} of {size(capacity)}"
    if fill >= h.shadow_fill_failing:
        return Check("shadow-fill", FAILING, f"{base}: new cold writes will be refused "
                                             f"(failing at {pct(h.shadow_fill_failing)})")
    if fill >= h.shadow_fill_degraded:
        return Check("shadow-fill", DEGRADED, f"{base} (degraded at {pct(h.shadow_fill_degraded)})")
    return Check("shadow-fill", OK, base)


def ssd_wear(w: WearFacts, h: HealthConfig, readonly_percent: float) -> Check:
    limits = f"degraded at {h.wear_degraded_percent:g} %, read-only at {readonly_percent:g} %"
    if w.state == "failed":
        return Check("ssd-wear", FAILING, "SMART says the SSD is failing; cold tier on the shadow",
                     at_once=True)
    if w.state in ("unknown", "not checked"):
        why = w.error or "no SMART data yet"
        return Check("ssd-wear", _LEVELS[h.wear_unknown],
                     f"unknown: {why} (kvagentd-health.timer writes it)")
    if w.file_age_s is not None and w.file_age_s > w.stale_after_s:
        return Check("ssd-wear", DEGRADED, f"the SMART status file is {age(w.file_age_s)} old "
                                           "(is kvagentd-health.timer running?)")
    used = "?" if w.percent is None else f"{w.percent:g} %"
    if w.state == "worn" or (w.percent is not None and w.percent >= h.wear_degraded_percent):
        return Check("ssd-wear", DEGRADED, f"{used} used ({limits})")
    return Check("ssd-wear", OK, f"{used} used ({limits})")


# -- the host --------------------------------------------------------------------------------

def _host(f: Facts, h: HealthConfig, acks: Acknowledgements) -> Iterator[Check]:
    low = f.memory_available < f.memory_total * h.memory_available_degraded
    yield Check("memory", DEGRADED if low else OK,
                f"{size(f.memory_available)} available of {size(f.memory_total)}"
                + (f" (degraded below {pct(h.memory_available_degraded)})" if low else ""))
    for d in f.disks:
        name = f"disk:{d.path}"
        if d.free_bytes is None:
            yield Check(name, FAILING, d.error or "unreadable", at_once=True)
        elif d.free_bytes < max(f.disk_full_below, 1):
            yield Check(name, FAILING, f"full: {size(d.free_bytes)} free, nothing more can be "
                                       "written here", at_once=True)
        elif d.free_bytes < f.free_space_floor:
            yield Check(name, DEGRADED, f"{size(d.free_bytes)} free, below the floor of "
                                        f"{size(f.free_space_floor)}")
        else:
            yield Check(name, OK, f"{size(d.free_bytes)} free")
    failed = [(j, acks.since(f"job:{j.job_id}", j.errors)) for j in f.other_failed_jobs]
    failed = [(j, n) for j, n in failed if n]
    if failed:
        j, n = failed[0]
        yield Check("jobs", DEGRADED, f"job {j.job_id} failed {n}x, last "
                                      f"{age(j.last_error_age_s)} ago: {j.last_error}",
                    ackable=True, at_once=True)


def _platform(f: Facts, acks: Acknowledgements) -> Iterator[Check]:
    """The box under the daemon (`maintenance/platform.py`): memory errors, thermal
    throttling, PCIe links, the cold directory's filesystem."""
    p = f.platform
    assert p is not None
    counters = f.counters()
    if p.edac_uncorrected:
        yield Check("memory-errors", FAILING, f"{p.edac_uncorrected} uncorrected ECC errors since "
                    "start: the box may have computed wrong data; replace the DIMM (EDAC)",
                    at_once=True)
    elif p.edac_present:
        n = acks.since("memory-errors", counters["memory-errors"])
        yield _counted("memory-errors", n, acks, "corrected ECC errors (EDAC): a DIMM is "
                       "failing; hot and warm KV carry no checksum")
    n = acks.since("thermal", counters["thermal"])
    yield _counted("thermal", n, acks, "CPU thermal throttle events: every tick runs slower "
                   "(airflow, fan, heat sink)")
    if p.pcie_degraded:
        yield Check("pcie", DEGRADED, "links narrower than they can be (reseat the card or "
                    "the drive): " + "; ".join(p.pcie_degraded), at_once=True)
    if p.storage:
        yield Check("storage:cold", DEGRADED, "; ".join(p.storage), at_once=True)
    elif not p.read_errors:
        yield Check("storage:cold", OK, "; ".join(("a local filesystem with safe mount "
                                                   "options", *p.storage_notes)), at_once=True)
