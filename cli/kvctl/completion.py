"""Shell completion of what the daemon knows: session ids, asset names, job ids (asked over the
control socket with a short timeout; nothing is offered when it does not answer), and tiers.

The `--socket` given on the command line so far (or $KVAGENTD_SOCKET, or the default) is the
one asked. A completion never prints an error: the shell shows no candidates instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kvctl.client import Client
from kvctl.common import DEFAULT_SOCKET, SOCKET_ENV

COMPLETE_TIMEOUT_S = 0.5  # a shell waits for this; a busy daemon offers nothing
TIERS = ("hot", "warm", "cold")


def _socket(ctx: typer.Context | None) -> Path:
    node: Any = ctx  # a click context; its parents are plain click contexts
    while node is not None:
        given = node.params.get("socket") if node.params else None
        if given:
            return Path(given)
        node = node.parent
    return Path(os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)


def _ask(ctx: typer.Context | None, path: str, pick: Callable[[Any], list[str]]) -> list[str]:
    try:
        with Client(_socket(ctx), COMPLETE_TIMEOUT_S) as client:
            return sorted(set(pick(client.request("GET", path))))
    except Exception:  # noqa: BLE001 - no daemon, no permission, a slow one: no candidates
        return []


def _starting(names: list[str], incomplete: str) -> list[str]:
    return [n for n in names if n.startswith(incomplete)]


def sessions(ctx: typer.Context, incomplete: str) -> list[str]:
    return _starting(_ask(ctx, "/v1/sessions",
                          lambda r: [s["id"] for s in r.get("sessions", [])]), incomplete)


def assets(ctx: typer.Context, incomplete: str) -> list[str]:
    return _starting(_ask(ctx, "/v1/status",
                          lambda r: list((r.get("agent") or {}).get("assets") or {})),
                     incomplete)


def jobs(ctx: typer.Context, incomplete: str) -> list[str]:
    return _starting(_ask(ctx, "/v1/jobs", lambda r: [j["id"] for j in r.get("jobs", [])]),
                     incomplete)


def tiers(incomplete: str) -> list[str]:
    return _starting(list(TIERS), incomplete)
