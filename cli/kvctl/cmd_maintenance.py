"""kvctl defrag | tune | failover status|activate|restore."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl import render
from kvctl.common import (EX_FAILURE, JsonOpt, SocketOpt, TimeoutOpt, call, fail, opts,
                          progress_wanted, stream)

DEFRAG_TIMEOUT_S = 600.0
TIERS = ("hot", "warm", "cold", "all")


def register(app: typer.Typer) -> None:
    app.command("defrag")(defrag)
    app.command("tune")(tune)
    fo = typer.Typer(help="Shadow-partition failover of the cold tier.", invoke_without_command=True)
    fo.callback()(failover_default)
    fo.command("status")(failover_status)
    fo.command("activate")(failover_activate)
    fo.command("restore")(failover_restore)
    app.add_typer(fo, name="failover")


# ---- defrag ----------------------------------------------------------------------------------

def _frag_row(tier: str, when: str, f: dict[str, Any] | None) -> dict[str, Any]:
    f = f or {}
    return {"tier": tier, "when": when, "used": f.get("used"), "free": f.get("free"),
            "run": f.get("largest_free_run"),
            "ratio": None if f.get("ratio") is None else f"{100 * f['ratio']:.1f}%"}


def _cold_segments(f: dict[str, Any] | None) -> str:
    if not f:
        return "-"
    segs = f.get("segments")
    n = sum(segs.values()) if isinstance(segs, dict) else segs
    return (f"{n or 0} segments, {render.size(f.get('live_bytes'))} live, "
            f"{render.size(f.get('dead_bytes'))} dead")


def _cold_note(r: dict[str, Any]) -> str:
    """The cold tier's compaction in words (segments, live and dead bytes, reclaimed)."""
    if r.get("note"):
        return str(r["note"])
    before = _cold_segments(r.get("before"))
    if r.get("dry_run") or "after" not in r:
        return f"{before} (compaction rewrites mostly-dead segments)"
    reclaimed = r.get("compaction")
    got = f"reclaimed {render.size(reclaimed)}" if isinstance(reclaimed, int | float) \
        else render.cell(reclaimed)
    return f"{got}; before {before}; after {_cold_segments(r.get('after'))}"


def render_defrag(data: dict[str, Any]) -> str:
    rows, notes = [], []
    for r in data.get("results", []):
        tier = r.get("tier", "?")
        if tier == "cold":
            notes.append(f"cold: {_cold_note(r)}")
            continue
        rows.append(_frag_row(tier, "before", r.get("before")))
        if r.get("plan") and data.get("dry_run"):
            rows.append(_frag_row(tier, "planned", r["plan"].get("predicted")))
            moves = r["plan"].get("moves", [])
            if moves:
                shown = ", ".join(f"{a}->{b}" for a, b in moves[:12])
                more = r["plan"]["num_moves"] - len(moves[:12])
                notes.append(f"{tier}: {r['plan']['num_moves']} moves: {shown}"
                             + (f" (+{more} more)" if more > 0 else ""))
            else:
                notes.append(f"{tier}: nothing to move")
        if r.get("after"):
            rows.append(_frag_row(tier, "after", r.get("after")))
            notes.append(f"{tier}: moved {r.get('moved')} (skipped {r.get('skipped')} in use) in "
                         f"{r.get('chunks')} steps, longest pause {1000 * r.get('max_pause_s', 0):.1f} ms"
                         + (f"; {r['note']}" if r.get("note") else ""))
    out = render.table(rows, [("tier", "tier"), ("when", "when"), ("used", "used"),
                              ("free", "free"), ("run", "largest free run"),
                              ("ratio", "frag")]) if rows else ""
    return "\n".join(x for x in (out, *notes) if x)


def defrag(ctx: typer.Context,
           tier: Annotated[str, typer.Option("--tier", help="hot, warm, cold or all")] = "all",
           dry_run: Annotated[bool, typer.Option("--dry-run", help="show the plan only")] = False,
           socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Compact the block pools (cold: segment compaction); shows the plan and before/after."""
    o = opts(ctx, socket, json_out, timeout if timeout is not None else DEFRAG_TIMEOUT_S)
    if tier not in TIERS:
        fail(o, 64, "usage", f"--tier must be one of {', '.join(TIERS)}, got {tier!r}")
    body = {"tier": tier, "dry_run": dry_run}
    if dry_run or not progress_wanted(o):
        render.emit(o, call(o, "POST", "/v1/defrag", body=body), render_defrag)
        return
    result: dict[str, Any] | None = None
    with render.Progress("defrag", True) as bar:
        for item in stream(o, "POST", "/v1/defrag", body={**body, "stream": True}):
            if not isinstance(item, dict):
                continue
            if "progress" in item:
                p = item["progress"]
                bar.update(text=f"{p['tier']} moves", done=p["done"], total=p["total"])
            elif "error" in item:
                bar.clear()
                fail(o, EX_FAILURE, item["error"].get("kind", "error"),
                     item["error"].get("message", ""))
            elif "result" in item:
                result = item["result"]
    render.emit(o, result or {}, render_defrag)


# ---- tune ------------------------------------------------------------------------------------

def render_tune(data: dict[str, Any]) -> str:
    head = (f"cold dir {data.get('cold_dir')}: device {data.get('device') or '?'} "
            f"({data.get('dev')}), mount {data.get('mount_point') or '?'}")
    rows = [{**c, "ok": c.get("ok")} for c in data.get("checks", [])]
    out = [head, render.table(rows, [("name", "check"), ("current", "current"),
                                     ("recommended", "recommended"), ("ok", "ok")])]
    out += [f"  {c['name']}: {c['advice']}" for c in rows if c.get("advice") and not c.get("ok")]
    if data.get("applied"):
        out.append("applied: " + ", ".join(data["applied"]))
    return "\n".join(out)


def tune(ctx: typer.Context,
         apply: Annotated[bool, typer.Option("--apply", help="write the fixable sysfs values")] = False,
         socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Cold-tier NVMe settings, current vs recommended.

    --apply needs root in the daemon; under systemd the daemon is unprivileged and /sys is
    read-only for it, so kvagentd-tune.service (a root oneshot at boot) applies them instead.
    """
    o = opts(ctx, socket, json_out, timeout)
    if apply:
        render.emit(o, call(o, "POST", "/v1/tune/apply", body={}), render_tune)
    else:
        render.emit(o, call(o, "GET", "/v1/tune"), render_tune)


# ---- failover --------------------------------------------------------------------------------

def render_failover(d: dict[str, Any]) -> str:
    since = d.get("since")
    cap = d.get("shadow_capacity_bytes")
    fill = d.get("shadow_fill")
    lines = [f"cold tier served by: {d.get('serving')}",
             f"since:               {render.when(since)}",
             f"reason:              {d.get('reason', '-')}",
             f"shadow:              {d.get('shadow_blocks', 0)} blocks, "
             f"{render.size(d.get('shadow_bytes'))} of {render.size(cap)}"
             + (f" ({100 * fill:.1f}%)" if fill is not None else ""),
             f"good probes:         {d.get('good_probes', 0)} / {d.get('failback_after', '-')}",
             f"failovers/failbacks: {d.get('failovers', 0)} / {d.get('failbacks', 0)}"]
    if "activated" in d:
        lines.insert(0, "activated" if d["activated"] else "already serving from the shadow")
    if "restored" in d:
        lines.insert(0, f"restored {d['restored']} blocks to the SSD")
    return "\n".join(lines)


def failover_default(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
                     timeout: TimeoutOpt = None) -> None:
    """Shadow failover state (same as `failover status`)."""
    if ctx.invoked_subcommand is None:
        failover_status(ctx, socket, json_out, timeout)


def failover_status(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
                    timeout: TimeoutOpt = None) -> None:
    """Which tier serves cold writes, since when, and how full the shadow is."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/failover"), render_failover)


def failover_activate(ctx: typer.Context,
                      reason: Annotated[str, typer.Option("--reason", help="for the log")] = "",
                      socket: SocketOpt = None, json_out: JsonOpt = False,
                      timeout: TimeoutOpt = None) -> None:
    """Send new cold writes to the shadow directory now (e.g. before swapping the SSD)."""
    o = opts(ctx, socket, json_out, timeout)
    body = {"reason": reason} if reason else {}
    render.emit(o, call(o, "POST", "/v1/failover/activate", body=body), render_failover)


def failover_restore(ctx: typer.Context,
                     reason: Annotated[str, typer.Option("--reason", help="for the log")] = "",
                     socket: SocketOpt = None, json_out: JsonOpt = False,
                     timeout: TimeoutOpt = None) -> None:
    """Write the shadow's blocks back to the SSD, empty the shadow and serve from the SSD."""
    o = opts(ctx, socket, json_out, timeout if timeout is not None else DEFRAG_TIMEOUT_S)
    body = {"reason": reason} if reason else {}
    render.emit(o, call(o, "POST", "/v1/failover/restore", body=body), render_failover)
