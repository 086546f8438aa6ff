"""kvctl trace dump [NAME] | trace stats."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl import render
from kvctl.common import JsonOpt, SocketOpt, TimeoutOpt, call, opts

trace_app = typer.Typer(help="Block access trace of the placement service.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(trace_app, name="trace")


def render_stats(d: dict[str, Any]) -> str:
    tiers = d.get("by_tier") or {}
    rows = [{"tier": t, "events": tiers.get(t, 0)} for t in ("hot", "warm", "cold", "unknown")]
    return (render.kv({k: d.get(k) for k in ("capacity", "events", "recorded", "sessions",
                                             "blocks", "first_tick", "last_tick")})
            + f"\nspan: {render.duration(d.get('span_s'))}\n"
            + (f"block: {d['block_tokens']} tokens, {render.size(d.get('block_bytes'))}\n"
               if d.get("block_tokens") else "")
            + "\n"
            + render.table(rows, [("tier", "tier at access"), ("events", "events")]))


@trace_app.command("dump")
def dump(ctx: typer.Context,
         name: Annotated[str | None, typer.Argument(
             help="file name in the daemon's dump directory (<state_dir>/dumps), ending in "
                  ".jsonl or .npz [default: the daemon picks trace-<time>-<n>]")] = None,
         fmt: Annotated[str | None, typer.Option(
             "--format", help="jsonl (JSON lines) or npz (numpy archive)")] = None,
         socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Write the daemon's recent block accesses to a file in its dump directory."""
    o = opts(ctx, socket, json_out, timeout)
    body: dict[str, Any] = {}
    if name is not None:
        body["name"] = name
    if fmt is not None:
        body["format"] = fmt
    data = call(o, "POST", "/v1/trace/dump", body=body)
    render.emit(o, data, lambda d: f"wrote {d['events']} events to {d['path']}")


@trace_app.command("stats")
def stats(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
          timeout: TimeoutOpt = None) -> None:
    """How many access events the trace ring holds, by tier at access."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/trace", params={"format": "summary"}), render_stats)
