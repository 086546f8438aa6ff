"""kvctl fleet: the boxes that share this daemon's remote store."""

from __future__ import annotations

from typing import Any

import typer

from kvctl import render
from kvctl.common import JsonOpt, SocketOpt, TimeoutOpt, call, opts


def register(app: typer.Typer) -> None:
    app.command("fleet")(fleet)


def fleet(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
          timeout: TimeoutOpt = None) -> None:
    """Every box the remote store knows: alive or not, last heartbeat, model, assets, health."""
    o = opts(ctx, socket, json_out, timeout)
    render.emit(o, call(o, "GET", "/v1/fleet"), render_fleet)


def render_fleet(data: dict[str, Any]) -> str:
    me = data.get("box")
    rows = []
    for b in data.get("boxes", []):
        assets = b.get("assets") or {}
        rows.append({
            "box": f"{b.get('box')}{' (this box)' if b.get('box') == me else ''}",
            "state": b.get("state"), "seen": f"{render.duration(b.get('age_s', 0.0))} ago",
            "health": (b.get("health") or {}).get("status"),
            "model": (b.get("model") or {}).get("name"),
            "assets": ", ".join(f"{a}:{(v or {}).get('session') or '-'}"
                                for a, v in sorted(assets.items())) or "-",
            "hot": _blocks(b, "hot"), "warm": _blocks(b, "warm"), "cold": _blocks(b, "cold"),
        })
    return render.table(rows, [("box", "box"), ("state", "state"), ("seen", "last seen"),
                               ("health", "health"), ("model", "model"), ("assets", "assets"),
                               ("hot", "hot"), ("warm", "warm"), ("cold", "cold")])


def _blocks(b: dict[str, Any], tier: str) -> Any:
    return ((b.get("tiers") or {}).get(tier) or {}).get("blocks")
