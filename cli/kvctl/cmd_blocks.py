"""kvctl blocks | migrate | pin | unpin | verify."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from kvctl import completion, render
from kvctl.common import (EX_FAILURE, JsonOpt, SocketOpt, TimeoutOpt, call, fail, opts,
                          progress_wanted, stream, usage_error)

VERIFY_TIMEOUT_S = 3600.0
TIERS = ("hot", "warm", "cold")

SessionOpt = Annotated[str | None, typer.Option("--session", help="all blocks of this session",
                                                autocompletion=completion.sessions)]
BlockOpt = Annotated[str | None, typer.Option("--block", help="one block, by its hex key")]


def register(app: typer.Typer) -> None:
    app.command("blocks")(blocks)
    app.command("migrate")(migrate)
    app.command("pin")(pin)
    app.command("unpin")(unpin)
    app.command("verify")(verify)


def render_blocks(data: dict[str, Any]) -> str:
    rows = []
    for name in ("hot", "warm", "cold"):
        t = data.get("tiers", {}).get(name, {})
        cap = t.get("capacity") if name != "cold" else t.get("capacity_bytes")
        used = t.get("bytes_used", t.get("bytes")) if name == "cold" else t.get("bytes")
        rows.append({"tier": name, "blocks": t.get("blocks"), "bytes": render.size(used),
                     "capacity": (f"{cap} blocks" if name != "cold" else render.size(cap))
                     if cap is not None else None,
                     "frag": None if t.get("fragmentation") is None else f"{100 * t['fragmentation']:.1f}%"})
    out = render.table(rows, [("tier", "tier"), ("blocks", "blocks"), ("bytes", "bytes"),
                              ("capacity", "capacity"), ("frag", "frag")])
    out += (f"\n\n{data.get('blocks', 0)} blocks, {data.get('pinned', 0)} pinned, "
            f"{data.get('in_use', 0)} in use, {data.get('lost', 0)} lost since start")
    if data.get("sessions"):
        out += "\n\n" + render.table(data["sessions"], [("session", "session"), ("hot", "hot"),
                                                        ("warm", "warm"), ("cold", "cold"),
                                                        ("total", "total")])
    if data.get("session_blocks") is not None:
        out += "\n\n" + render.table(data["session_blocks"], [("key", "block"), ("tier", "tier"),
                                                              ("pinned", "pinned"),
                                                              ("in_use", "in use")])
    return out


def blocks(ctx: typer.Context, session: SessionOpt = None, socket: SocketOpt = None,
           json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Blocks per tier (count, bytes, capacity) and per session."""
    o = opts(ctx, socket, json_out, timeout)
    data = call(o, "GET", "/v1/blocks", params={"session": session} if session else None)
    render.emit(o, data, render_blocks)


def _target(o: Any, session: str | None, block: str | None) -> dict[str, str]:
    if (session is None) == (block is None):
        usage_error(o, "give exactly one of --session or --block")
    if session is not None:
        return {"session": session}
    assert block is not None
    return {"block": block}


def migrate(ctx: typer.Context,
            to: Annotated[str, typer.Option("--to", help="hot, warm or cold",
                                            autocompletion=completion.tiers)],
            session: SessionOpt = None, block: BlockOpt = None, socket: SocketOpt = None,
            json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Move a session's blocks (or one block) to a tier."""
    o = opts(ctx, socket, json_out, timeout)
    if to not in TIERS:
        usage_error(o, f"--to must be one of {', '.join(TIERS)}, got {to!r}")
    body: dict[str, Any] = {**_target(o, session, block), "to": to}
    data = _with_progress(o, "/v1/blocks/migrate", body, f"moving blocks to {to}")
    render.emit(o, data, lambda d: f"moved {d['moved']} of {d['requested']} blocks to {d['to']} "
                                   f"({d['already']} already there, {d['skipped']} skipped: "
                                   f"in use, pinned or no room)")


def pin(ctx: typer.Context, session: SessionOpt = None, block: BlockOpt = None,
        socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Keep blocks where they are (no demotion, no eviction) until unpinned."""
    o = opts(ctx, socket, json_out, timeout)
    data = call(o, "POST", "/v1/blocks/pin", body=_target(o, session, block))
    render.emit(o, data, lambda d: f"pinned {d['pinned']} blocks")


def unpin(ctx: typer.Context, session: SessionOpt = None, block: BlockOpt = None,
          socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Undo one `pin` of these blocks."""
    o = opts(ctx, socket, json_out, timeout)
    data = call(o, "POST", "/v1/blocks/unpin", body=_target(o, session, block))
    render.emit(o, data, lambda d: f"unpinned {d['unpinned']} blocks")


def _with_progress(o: Any, path: str, body: dict[str, Any], label: str) -> dict[str, Any]:
    """POST `body`; on a terminal, streamed with a progress line (records or blocks done of
    the total) until the result."""
    if not progress_wanted(o):
        return dict(call(o, "POST", path, body=body))
    result: dict[str, Any] | None = None
    with render.Progress(label, True) as bar:
        for item in stream(o, "POST", path, body={**body, "stream": True}):
            if not isinstance(item, dict):
                continue
            if "progress" in item:
                p = item["progress"]
                bar.update(done=p.get("done"), total=p.get("total"))
            elif "error" in item:
                bar.clear()
                fail(o, EX_FAILURE, item["error"].get("kind", "error"),
                     item["error"].get("message", ""))
            elif "result" in item:
                result = item["result"]
    return result or {}


def verify(ctx: typer.Context,
           repair: Annotated[bool, typer.Option(
               "--repair", help="drop corrupt records from the index")] = False,
           socket: SocketOpt = None, json_out: JsonOpt = False, timeout: TimeoutOpt = None) -> None:
    """Scrub the cold tier now: read and checksum every record."""
    o = opts(ctx, socket, json_out, timeout if timeout is not None else VERIFY_TIMEOUT_S)
    data = _with_progress(o, "/v1/verify", {"repair": repair}, "verifying cold records")
    render.emit(o, data, lambda d: (f"checked {d['checked']} records ({render.size(d['bytes'])}): "
                                    f"{d['corrupt']} corrupt, {d['missing']} missing"
                                    + (f", {d['repaired']} dropped from the index" if repair else "")))
    if (data.get("corrupt") or data.get("missing")) and not repair:
        raise typer.Exit(1)
