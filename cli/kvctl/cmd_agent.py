"""kvctl report list|show|run, kvctl events, kvctl jobs list|run|pause|resume."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from kvctl import completion, render
from kvctl.common import (EX_FAILURE, EX_TEMPFAIL, JsonOpt, SocketOpt, TimeoutOpt, call, opts,
                          progress_wanted, usage_error)


def register(app: typer.Typer) -> None:
    report_app = typer.Typer(help="Weekly reports and anomaly replays.", no_args_is_help=True)
    report_app.command("list")(report_list)
    report_app.command("show")(report_show)
    run_app = typer.Typer(help="Start a report.", no_args_is_help=True)
    run_app.command("weekly")(report_run_weekly)
    run_app.command("replay")(report_run_replay)
    report_app.add_typer(run_app, name="run")
    app.add_typer(report_app, name="report")
    events_app = typer.Typer(help="Event-log rows (ticks and bad data), newest first.",
                             invoke_without_command=True)
    events_app.callback()(events)
    events_app.command("show")(event_show)
    app.add_typer(events_app, name="events")
    jobs_app = typer.Typer(help="Scheduled jobs (ticks, reports, maintenance).",
                           no_args_is_help=True)
    jobs_app.command("list")(jobs_list)
    jobs_app.command("run")(jobs_run)
    jobs_app.command("pause")(jobs_pause)
    jobs_app.command("resume")(jobs_resume)
    app.add_typer(jobs_app, name="jobs")


WaitOpt = Annotated[bool, typer.Option("--wait", help="wait until the report is written")]


def report_list(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
                timeout: TimeoutOpt = None) -> None:
    """Reports in the state directory, newest first."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/reports"), lambda r: render.table(
        r["reports"], [("id", "id"), ("kind", "kind"), ("asset", "asset"), ("event", "event"),
                       ("state", "state"), ("created", "created")],
        {"created": _when}))


def report_show(ctx: typer.Context, report_id: Annotated[str, typer.Argument(metavar="ID")],
                socket: SocketOpt = None, json_out: JsonOpt = False,
                timeout: TimeoutOpt = None) -> None:
    """One report: its Markdown text and the paths of its files.

    Exits 1 when the report failed and 75 while it is still being written."""
    o = opts(ctx, socket, json_out, timeout)
    doc = call(o, "GET", f"/v1/reports/{report_id}")
    render.emit(o, doc, _render_report)
    _exit_for_state(doc)


def _exit_for_state(doc: dict[str, Any]) -> None:
    """A failed report exits 1, one still running 75 (try again later), a written one 0."""
    state = doc.get("state")
    if state == "running":
        raise typer.Exit(EX_TEMPFAIL)
    if state != "done":
        raise typer.Exit(EX_FAILURE)


def report_run_weekly(ctx: typer.Context,
                      asset: Annotated[str, typer.Option("--asset", "-a", help="asset name",
                                                         autocompletion=completion.assets)],
                      wait: WaitOpt = False, socket: SocketOpt = None,
                      json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Write the weekly report of an asset (--asset) now."""
    _run(opts(ctx, socket, json_out, timeout), {"kind": "weekly", "asset": asset}, wait)


def report_run_replay(ctx: typer.Context,
                      event: Annotated[int, typer.Option("--event", "-e", help="event id")],
                      wait: WaitOpt = False, socket: SocketOpt = None,
                      json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Resume the session that flagged EVENT and ask for a detailed explanation."""
    _run(opts(ctx, socket, json_out, timeout), {"kind": "replay", "event": event}, wait)


def _run(o, body: dict[str, Any], wait: bool) -> None:
    started = call(o, "POST", "/v1/reports/run", body=body)
    if not wait:
        render.emit(o, started, lambda r: f"report {r['id']} started; "
                                          f"kvctl report show {r['id']}")
        return
    deadline = time.monotonic() + max(o.timeout, 600.0)
    doc = started
    with render.Progress(f"writing report {started['id']}", progress_wanted(o)) as bar:
        while time.monotonic() < deadline:
            doc = call(o, "GET", f"/v1/reports/{started['id']}")
            if doc.get("state") != "running":
                break
            bar.update(text=str(doc.get("phase") or ""))
            time.sleep(1.0)
    render.emit(o, doc, _render_report)
    _exit_for_state(doc)


FOLLOW_EVERY_S = 1.0  # how often --follow asks for new rows


def events(ctx: typer.Context,
           asset: Annotated[str | None, typer.Option(
               "--asset", "-a", autocompletion=completion.assets)] = None,
           since: Annotated[str | None, typer.Option(
               "--since", help="unix seconds or an age: 90s, 15m, 2h, 7d")] = None,
           anomalies: Annotated[bool, typer.Option("--anomalies", help="only anomalies")] = False,
           kind: Annotated[str | None, typer.Option(
               "--kind", help="tick or bad_data")] = None,
           follow: Annotated[bool, typer.Option(
               "--follow", "-f", help="then print new rows as they are written (Ctrl-C ends)")
           ] = False,
           limit: Annotated[int, typer.Option("--limit", "-n", min=1)] = 50,
           socket: SocketOpt = None, json_out: JsonOpt = False,
           timeout: TimeoutOpt = None) -> None:
    """Event-log rows (ticks and bad data), newest first; with --follow, oldest first and
    then each new row as it comes (--json: one object per line)."""
    if ctx.invoked_subcommand is not None:
        return
    o = opts(ctx, socket, json_out, timeout)
    params: dict[str, Any] = {"limit": limit}
    if asset:
        params["asset"] = asset
    if since:
        params["since"] = since
    if anomalies:
        params["anomalies"] = "true"
    if kind:
        params["kind"] = kind
    first = call(o, "GET", "/v1/events", params=params)
    if not follow:
        render.emit(o, first, _render_events)
        return
    rows = list(reversed(first["events"]))
    last = max((int(e["id"]) for e in rows), default=0)
    _print_rows(o, rows, header=True)
    params.pop("since", None)
    try:
        while True:
            time.sleep(FOLLOW_EVERY_S)
            new = call(o, "GET", "/v1/events", params={**params, "after": last})["events"]
            if new:
                last = max(int(e["id"]) for e in new)
                _print_rows(o, new, header=False)
    except KeyboardInterrupt:
        return


def _print_rows(o: Any, rows: list[dict[str, Any]], *, header: bool) -> None:
    if o.json:
        for e in rows:
            typer.echo(json.dumps(e, sort_keys=True, default=str))
        return
    if not rows:
        return
    text = _render_events({"events": rows})
    lines = text.splitlines()
    typer.echo("\n".join(lines if header else lines[1:]))


def event_show(ctx: typer.Context,
               event_id: Annotated[int, typer.Argument(metavar="ID", min=1)],
               socket: SocketOpt = None, json_out: JsonOpt = False,
               timeout: TimeoutOpt = None) -> None:
    """One event-log row whole: features, diagnosis, the commentary and why it was shown or
    withheld."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", f"/v1/events/{event_id}"), lambda r: render.kv(r["event"]))


def jobs_list(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
              timeout: TimeoutOpt = None) -> None:
    """Every scheduled job with its trigger and next run."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/jobs"), lambda r: render.table(
        [{**j, "schedule": j.get("schedule") or j.get("trigger")} for j in r["jobs"]],
        [("id", "id"), ("schedule", "schedule"), ("next_run", "next run"),
         ("paused", "paused")]))


def _job_action(action: str):
    def command(ctx: typer.Context, job_id: Annotated[str, typer.Argument(
                    metavar="ID", autocompletion=completion.jobs)],
                socket: SocketOpt = None, json_out: JsonOpt = False,
                timeout: TimeoutOpt = None) -> None:
        o = opts(ctx, socket, json_out, timeout)
        if not job_id.strip():
            usage_error(o, "a job id is required (kvctl jobs list)")
        render.emit(o, call(o, "POST", f"/v1/jobs/{job_id}/{action}"),
                    lambda r: f"{action} {r['job']['id']}: next run "
                              f"{render.when(r['job']['next_run']) if r['job']['next_run'] else '(paused)'}")
    command.__doc__ = {"run": "Run a job now.", "pause": "Pause a job.",
                       "resume": "Resume a paused job."}[action]
    return command


jobs_run = _job_action("run")
jobs_pause = _job_action("pause")
jobs_resume = _job_action("resume")


# -- human renderers ----------------------------------------------------------------------

def _when(t: Any) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))


def _cut(text: str, n: int) -> str:
    """`text` up to `n` characters, an ellipsis where it was cut (`events show ID` has all)."""
    return text if len(text) <= n else text[:n - 1] + "\u2026"


def _render_events(r: dict[str, Any]) -> str:
    rows = []
    for e in r["events"]:
        f = e.get("features") or {}
        d = e.get("diagnosis") or {}
        ratios = d.get("ratios") or {}
        top = max(ratios.items(), key=lambda kv: kv[1]) if ratios else None
        fault = e.get("fault")
        rows.append({
            "id": e["id"], "time": _when(e["t"]), "asset": e["asset"],
            "zone": e.get("zone") or "-",
            "rms": f"{f['rms_mm_s']:.2f}" if "rms_mm_s" in f else "-",
            "kurt": f"{f['kurtosis']:.1f}" if "kurtosis" in f else "-",
            "env": f"{top[0]} {top[1]:.1f}x" if top else "-",
            "fault": ("bad data" if e["kind"] == "bad_data" else
                      f"{fault} ({e.get('severity')})" if fault and fault != "none" else
                      (fault or "")),
            "text": _cut(("model: " + e["assessment"] if e.get("assessment") else
                          e.get("note") or ""), 70),
        })
    return render.table(rows, [("id", "id"), ("time", "time"), ("asset", "asset"),
                               ("zone", "zone"), ("rms", "rms mm/s"), ("kurt", "kurt"),
                               ("env", "top envelope line"), ("fault", "diagnosis"),
                               ("text", "commentary / note")])


def _render_report(doc: dict[str, Any]) -> str:
    if doc.get("state") == "running":
        return f"report {doc['id']} is being written"
    if doc.get("state") == "failed":
        return f"report {doc['id']} failed: {doc.get('error')}"
    files = "\n".join(f"  {p}" for p in doc.get("files") or [])
    return f"{doc.get('markdown') or ''}\nfiles:\n{files}"
