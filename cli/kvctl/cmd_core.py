"""kvctl status | health | config show."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl import render
from kvctl.common import (EX_FAILURE, HEALTH_EXIT, ExitCode, JsonOpt, SocketOpt, TimeoutOpt, call,
                          opts, usage_error)

# Keys of /v1/status that the daemon itself fills; every other dict-valued key is a service.
_CORE_KEYS = {"version", "pid", "phase", "ready", "started_at", "uptime_s", "config_path",
              "metrics_listener", "commentary",
              "host", "gpu", "gpu_reason", "control", "scheduler", "services"}


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    health_app = typer.Typer(help="Named health checks; exits 0 ok, 1 degraded, 2 failing.",
                             invoke_without_command=True)
    health_app.callback()(health)
    health_app.command("ack")(health_ack)
    app.add_typer(health_app, name="health")
    config_app = typer.Typer(help="Inspect the daemon's configuration.", no_args_is_help=True)
    config_app.command("show")(config_show)
    app.add_typer(config_app, name="config")


def status(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
           timeout: TimeoutOpt = None) -> None:
    """Version, uptime, readiness, host memory/disk, GPU and every service's state."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/status"), render_status)


def health(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
           timeout: TimeoutOpt = None) -> None:
    """Every health check with its status and reason, and each asset's commentary (not part
    of health); exits 0 ok, 1 degraded, 2 failing (as a Nagios check)."""
    if ctx.invoked_subcommand is not None:
        return
    o = opts(ctx, socket, json_out, timeout)
    report = call(o, "GET", "/v1/health", ok=(503,))
    render.emit(o, report, render_health)
    code = HEALTH_EXIT.get(str(report.get("status")), EX_FAILURE)
    if code:
        raise ExitCode(code)


def health_ack(ctx: typer.Context,
               checks: Annotated[list[str] | None, typer.Argument(
                   metavar="[CHECK]...",
                   help="checks whose counters to acknowledge, e.g. lost-blocks "
                        "[default: every check that counts faults]")] = None,
               socket: SocketOpt = None, json_out: JsonOpt = False,
               timeout: TimeoutOpt = None) -> None:
    """Acknowledge counted faults (checksum failures, lost blocks, a discarded cold index,
    failed jobs): those checks count from now on. Faults still present stay reported."""
    o = opts(ctx, socket, json_out, timeout)
    reply = call(o, "POST", "/v1/health/ack", body={"checks": list(checks or [])})
    render.emit(o, reply, render_ack)


def config_show(ctx: typer.Context,
                section: Annotated[str | None, typer.Argument(
                    help="only this section, e.g. kv or control")] = None,
                socket: SocketOpt = None, json_out: JsonOpt = False,
                timeout: TimeoutOpt = None) -> None:
    """The configuration the daemon runs with (after environment overrides)."""
    o = opts(ctx, socket, json_out, timeout)
    reply = call(o, "GET", "/v1/config")
    cfg = reply["config"]
    if section is not None:
        if section not in cfg:
            usage_error(o, f"no config section {section!r}; sections: {', '.join(cfg)}")
        reply = {**reply, "config": {section: cfg[section]}}
    render.emit(o, reply, render_config)


# -- human renderers ----------------------------------------------------------------------

def render_status(s: dict[str, Any]) -> str:
    lines = [f"kvagentd {s.get('version', '?')}  {s.get('phase', '?')}"
             f"{', ready' if s.get('ready') else ', not ready'}  up "
             f"{render.duration(s.get('uptime_s'))}  pid {s.get('pid', '?')}"]
    host = s.get("host") or {}
    mem = host.get("memory") or {}
    if mem:
        lines.append(f"memory   {render.size(mem.get('available_bytes'))} available of "
                     f"{render.size(mem.get('total_bytes'))} "
                     f"({render.percent(mem.get('used_percent'))} used)"
                     + (f"  load {host['load_1m']:.2f}" if host.get("load_1m") is not None else ""))
    proc = host.get("process") or {}
    if proc:
        lines.append(f"process  rss {render.size(proc.get('rss_bytes'))}  "
                     f"threads {proc.get('threads', '-')}  fds {proc.get('open_fds', '-')}")
    for d in host.get("disks") or []:
        lines.append(f"disk     {d.get('path')}  {render.size(d.get('free_bytes'))} free of "
                     f"{render.size(d.get('total_bytes'))} ({render.percent(d.get('used_percent'))}"
                     " used)")
    gpus = s.get("gpu")
    if gpus is None:
        lines.append(f"gpu      none ({s.get('gpu_reason', 'unknown')})")
    else:
        for g in gpus:
            pcie = g.get("pcie") or {}
            link = (f"PCIe gen{pcie.get('gen', '?')} x{pcie.get('width', '?')}" if pcie else "")
            lines.append(f"gpu{g.get('index', '')}     {g.get('name', '?')}  mem "
                         f"{render.size(g.get('memory_used_bytes'))} / "
                         f"{render.size(g.get('memory_total_bytes'))}  util "
                         f"{render.percent(g.get('utilization_gpu_percent'))}  {link}".rstrip())
    ctl = s.get("control") or {}
    if ctl:
        lines.append(f"control  {ctl.get('socket')}  connections {ctl.get('connections', 0)}"
                     f"  in flight {ctl.get('in_flight', 0)}")
    if s.get("metrics_listener"):
        lines.append(f"metrics  {s['metrics_listener']}")
    sched = s.get("scheduler") or {}
    if sched:
        lines.append(f"jobs     {len(sched.get('jobs') or [])} scheduled"
                     f"{'' if sched.get('running') else ' (scheduler stopped)'}")
    for name, value in s.items():
        if name in _CORE_KEYS or not isinstance(value, dict):
            continue
        summary = _summary(name, value)
        if summary is not None:
            lines.extend(summary)
        else:
            lines.append(f"{name}:")
            lines.append(render.kv(value, 1))
    lines.extend(_commentary_lines(s.get("commentary")))
    if any(name in _SUMMARIES for name in s):
        lines.append("(kvctl status --json shows every counter)")
    return "\n".join(lines)


def _commentary_lines(notes: Any) -> list[str]:
    """Per asset: whether its ticks get the model's commentary (not part of health)."""
    if not isinstance(notes, dict):
        return []
    out = []
    for asset, c in notes.items():
        if not isinstance(c, dict):  # {"error": "..."}: the daemon could not tell
            out.append(f"comment  {asset}: {c}")
            continue
        out.append(f"comment  {asset}: {c.get('state', '?')}  withheld {c.get('withheld', 0)}"
                   f"  failed {c.get('failed', 0)}  cut {c.get('cut', 0)}"
                   + (f"  ({c.get('reason')})" if c.get("state") != "ok" else ""))
    return out


def _summary(name: str, value: dict[str, Any]) -> list[str] | None:
    """A few lines for a service whose status has the expected shape, else None (the caller
    prints every field): a newer or older daemon must never break `kvctl status`."""
    summarize = _SUMMARIES.get(name)
    if summarize is None or "error" in value:
        return None
    try:
        return summarize(value)
    except (AttributeError, TypeError, ValueError):
        return None


def _store_summary(v: dict[str, Any]) -> list[str]:
    tiers = v.get("tiers") or {}
    out = []
    for t in ("hot", "warm"):
        d = tiers.get(t) or {}
        out.append(f"{t:<8} {d.get('blocks', 0)} / {d.get('capacity', '?')} blocks  "
                   f"{render.size(d.get('bytes'))}  fragmentation "
                   f"{render.percent(100 * (d.get('fragmentation') or 0))}  {d.get('device', '')}")
    c = tiers.get("cold") or {}
    fo = c.get("failover") or {}
    out.append(f"cold     {c.get('blocks', 0)} blocks  {render.size(c.get('bytes_used'))} of "
               f"{render.size(c.get('capacity_bytes'))}  codec {c.get('codec', '?')}"
               f"  evicted {c.get('evicted', 0)}"
               f"{'  READ-ONLY' if c.get('read_only') else ''}"
               + (f"  serving {fo.get('serving')}" if fo else ""))
    wb = v.get("write_budget") or {}
    if wb:
        limit = wb.get("bytes_per_day")
        out.append(f"ssd      written {render.size(wb.get('written_bytes'))} "
                   f"({render.size(wb.get('written_per_day_bytes'))}/day since start)  budget "
                   + (f"{render.size(limit)}/day, {render.size(wb.get('available_bytes'))} "
                      f"left now" if limit else "none")
                   + f"  refused {render.size(wb.get('refused_bytes'))}")
    out.append(f"loads    hot {v.get('loaded_hot', 0)}  warm {v.get('loaded_warm', 0)}  cold "
               f"{v.get('loaded_cold', 0)}  lost {v.get('lost', 0)}  migrations "
               f"{v.get('migrations', 0)}")
    return out


def _engine_summary(v: dict[str, Any]) -> list[str]:
    ex = v.get("executor") or {}
    q = ex.get("queued") or {}
    running = ", ".join(str(a.get("session")) for a in ex.get("active") or []) or "-"
    return [f"model    {v.get('model', '?')}  {v.get('dtype', '?')} on {v.get('device', '?')}  "
            f"{v.get('threads', '?')} threads  sessions {v.get('sessions', 0)}",
            f"dtype    {v.get('dtype_reason') or '-'}",
            f"executor queued tick {q.get('tick', 0)} ask {q.get('ask', 0)} report "
            f"{q.get('report', 0)} (max {ex.get('queue_size', '?')})  running {running}  "
            f"done {ex.get('completed', 0)}  failed {ex.get('failed', 0)}  busy "
            f"{ex.get('rejected', 0)}"] + _batch_summary(ex)


def _batch_summary(ex: dict[str, Any]) -> list[str]:
    b, mem = ex.get("batch") or {}, ex.get("memory") or {}
    if not b:
        return []
    step = b.get("step_s") or {}
    held = ((mem.get("rows_bytes") or 0) + (mem.get("working_copy_bytes") or 0)
            + (mem.get("paged_scratch_bytes") or 0))
    return [f"batch    size {b.get('size_mean', 0)} mean, {b.get('size_max', 0)} max of "
            f"{b.get('max_batch', '?')}  step p50 {1000 * (step.get('p50') or 0):.0f} ms  "
            f"preempted {ex.get('preemptions', 0)}  beyond hot pool {render.size(held)} of "
            f"{render.size(mem.get('budget_bytes'))} ({mem.get('layout', '?')}: "
            f"{mem.get('rows_in_use', 0)}/{mem.get('batch_rows', 0)} rows of "
            f"{mem.get('row_tokens', 0)} tokens)"]


def _placement_summary(v: dict[str, Any]) -> list[str]:
    last = v.get("last_round") or {}
    moves = sum((last.get("moves") or {}).values()) if last else 0
    mem = v.get("memory_bytes") or {}
    out = [f"placement {v.get('policy', '?')}  rounds {v.get('rounds', 0)}  errors "
           f"{v.get('errors', 0)}  last round {moves} moves, planned in "
           f"{1000 * (last.get('decision_s') or 0):.1f} ms  {v.get('blocks', 0)} blocks "
           f"known in {render.size(sum(mem.values()) if mem else None)}"]
    pre = v.get("prefetched_blocks") or {}
    if pre.get("raised"):
        out.append(f"         prefetched {pre['raised']} blocks: {pre.get('used', 0)} used, "
                   f"{pre.get('wasted', 0)} moved down or dropped unused, "
                   f"{pre.get('waiting', 0)} waiting")
    return out


def _maintenance_summary(v: dict[str, Any]) -> list[str]:
    fo = v.get("failover") or {}
    health = v.get("health") or {}
    defrag = v.get("defrag") or {}
    return [f"maint    SSD health {health.get('state', '?')}  cold served by "
            f"{fo.get('serving', '?')}  defrag runs {defrag.get('runs', 0)}"]


def _agent_summary(v: dict[str, Any]) -> list[str]:
    rows = []
    interval = float(v.get("tick_interval_s") or 0.0)
    for name, a in (v.get("assets") or {}).items():
        zone, age = a.get("last_zone") or "-", a.get("last_tick_age_s")
        if a.get("last_zone") and age is not None and interval and age > 2 * interval:
            zone += f" ({render.duration(age)} old)"  # the sensor stopped delivering
        fault = a.get("last_fault")
        rows.append({"asset": name, "zone": zone,
                     "diagnosis": "-" if fault is None else
                     fault if fault == "none" else f"{fault} ({a.get('last_severity')})",
                     "baseline": (a.get("baseline") or {}).get("state", "-"),
                     "withheld": f"{a.get('commentaries_withheld', 0)}/{a.get('commentaries', 0)}",
                     "assessed": render.duration(a.get("last_assessment_age_s")) + " ago"
                     if a.get("last_assessment_age_s") is not None else "-",
                     "p50": render.duration(a.get("tick_latency_p50_s")),
                     "p99": render.duration(a.get("tick_latency_p99_s")),
                     "ticks": a.get("ticks", 0),
                     # due ticks that did not run: skipped (overlap) and missed (a stall)
                     "skipped": a.get("skipped_ticks", 0) + a.get("missed_ticks", 0),
                     "bad": a.get("bad_samples_total", 0), "session": a.get("session") or "-"})
    table = render.table(rows, [("asset", "asset"), ("zone", "zone"), ("diagnosis", "diagnosis"),
                                ("baseline", "baseline"), ("withheld", "withheld"),
                                ("assessed", "assessed"),
                                ("p50", "tick p50"), ("p99", "tick p99"), ("ticks", "ticks"),
                                ("skipped", "skipped"), ("bad", "bad samples"),
                                ("session", "session")])
    return ["agent:", table]


def _remote_summary(v: dict[str, Any]) -> list[str]:
    link, wb = v.get("link") or {}, v.get("write_behind") or {}
    reads, ses = v.get("reads") or {}, v.get("sessions") or {}
    return [f"remote   {link.get('state', '?')}  {link.get('url', '?')}  queued "
            f"{render.size(wb.get('queued_bytes'))}  written {wb.get('written', 0)}  dropped "
            f"{wb.get('dropped', 0)}  reads hit {reads.get('remote_hits', 0)} / corrupt "
            f"{reads.get('remote_corrupt', 0)}",
            f"         box {ses.get('box', '?')}  sessions held {ses.get('held', 0)}, handed over "
            f"{ses.get('fenced_sessions', 0)}"]


_SUMMARIES = {"store": _store_summary, "engine": _engine_summary,
              "placement": _placement_summary, "maintenance": _maintenance_summary,
              "remote": _remote_summary, "agent": _agent_summary}


def render_health(h: dict[str, Any]) -> str:
    head = f"health: {h.get('status', '?')}"
    if h.get("acknowledged_at"):
        head += f"  (counters acknowledged {render.when(h['acknowledged_at'])})"
    checks = [{**c, "reason": c.get("reason", c.get("detail", ""))}
              for c in h.get("checks") or []]
    out = head + "\n" + render.table(checks, [("name", "check"), ("status", "status"),
                                              ("reason", "reason")])
    notes = h.get("commentary") or []
    if notes:
        out += "\n\ncommentary (the model's text on each tick; not part of health)\n"
        out += render.table(notes, [("asset", "asset"), ("state", "state"),
                                    ("reason", "reason")])
    return out


def render_ack(reply: dict[str, Any]) -> str:
    seen = reply.get("acknowledged") or {}
    lines = ["acknowledged: " + (", ".join(f"{k} ({v})" for k, v in sorted(seen.items()))
                                 or "nothing to acknowledge")]
    health = reply.get("health")
    if isinstance(health, dict):
        lines.append(render_health(health))
    return "\n".join(lines)


def render_config(reply: dict[str, Any]) -> str:
    """The config as TOML (valid TOML: `kvctl config show > file.toml` round-trips)."""
    lines = [f"# {reply.get('path') or '(built-in defaults)'}"]
    reloadable = set(reply.get("reloadable") or [])

    def emit_table(prefix: str, table: dict[str, Any], array: bool = False) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict)
                   and not (isinstance(v, list) and v and isinstance(v[0], dict))}
        lines.append(f"\n[[{prefix}]]" if array else f"\n[{prefix}]")
        for k, v in scalars.items():
            notes = []
            if k.endswith("_bytes") and isinstance(v, int) and not isinstance(v, bool):
                notes.append(render.size(v))
            if f"{prefix}.{k}" in reloadable:
                notes.append("reloadable (SIGHUP)")
            mark = f"  # {'; '.join(notes)}" if notes else ""
            value = f"0o{v:o}" if k.endswith("_mode") and isinstance(v, int) else _toml_value(v)
            lines.append(f"{k} = {value}{mark}")
        for k, v in table.items():
            if isinstance(v, dict):
                emit_table(f"{prefix}.{k}", v)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    emit_table(f"{prefix}.{k}", item, array=True)

    for section, table in (reply.get("config") or {}).items():
        emit_table(section, table)
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if v is None:
        return '""'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)
