"""Options every kvctl command takes, the request helpers and the exit codes.

A command module uses them like this:

    @app.command()
    def status(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
               timeout: TimeoutOpt = None) -> None:
        o = opts(ctx, socket, json_out, timeout)
        render.emit(o, call(o, "GET", "/v1/status"), render_status)

`--socket/--json/--timeout` may also be given before the command (`kvctl --json status`);
an option given after the command wins.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from kvctl.client import (ApiFailure, Client, DaemonUnreachable, RequestTimedOut,
                          SocketForbidden)

# os.EX_* (sysexits.h)
EX_OK = 0
EX_FAILURE = 1
EX_USAGE = 64
EX_UNAVAILABLE = 69
EX_TEMPFAIL = 75
EX_NOPERM = 77
EX_CONFIG = 78
# `kvctl health`, as a Nagios check: 0 ok, 1 degraded (warning), 2 failing (critical)
HEALTH_EXIT = {"ok": EX_OK, "degraded": 1, "failing": 2}

DEFAULT_SOCKET = Path("/run/kvagentd/kvagentd.sock")
SOCKET_ENV = "KVAGENTD_SOCKET"
DEFAULT_TIMEOUT_S = 30.0

# NOTE: readable=False: click's default check of read access would turn a socket this user may
# not open into a usage error (64); connecting says so instead (77).
SocketOpt = Annotated[Path | None, typer.Option(
    "--socket", "-s", envvar=SOCKET_ENV, show_envvar=True, readable=False,
    help=f"control socket of the daemon [default: {DEFAULT_SOCKET}]")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the daemon's JSON reply")]
TimeoutOpt = Annotated[float | None, typer.Option(
    "--timeout", "-t", min=0.1, help=f"seconds to wait for the daemon [default: {DEFAULT_TIMEOUT_S:g}]")]


@dataclass(frozen=True, slots=True)
class Opts:
    socket: Path = DEFAULT_SOCKET
    json: bool = False
    timeout: float = DEFAULT_TIMEOUT_S


def opts(ctx: typer.Context | None, socket: Path | None = None, json_out: bool = False,
         timeout: float | None = None) -> Opts:
    """Merge a command's options with those given before the command."""
    base = ctx.find_object(Opts) if ctx is not None else None
    base = base or Opts(socket=Path(os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET))
    return Opts(socket=socket or base.socket, json=json_out or base.json,
                timeout=timeout if timeout is not None else base.timeout)


# -- exit-code mapping --------------------------------------------------------------------

class ExitCode(Exception):
    """Exit with exactly `code`. For codes click's standalone mode would misread: it exits 2
    for its usage errors, which `main` turns into EX_USAGE, while 2 is `kvctl health`'s
    failing."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def exit_code_for(status: int, kind: str) -> int:
    """The kvctl exit code for an API error reply."""
    if kind == "bad_config":
        return EX_CONFIG
    if kind == "not_configured":  # a feature this daemon runs without: retrying cannot help
        return EX_UNAVAILABLE
    if status == 403 or kind == "forbidden":
        return EX_NOPERM
    if kind in ("conflict", "session_fenced", "held_alive", "bad_manifest"):
        # e.g. a session id that is taken, or held by another box: retrying cannot help
        return EX_FAILURE
    if status in (409, 503, 504, 408) or kind in ("busy", "not_ready", "overloaded", "timeout"):
        return EX_TEMPFAIL
    if status in (400, 405, 411, 413, 414, 431):
        return EX_USAGE
    return EX_FAILURE


def fail(o: Opts, code: int, kind: str, message: str, hint: str | None = None) -> NoReturn:
    """Report an error (JSON on stdout with --json, text on stderr otherwise) and exit."""
    if o.json:
        err: dict[str, Any] = {"kind": kind, "message": message}
        if hint:
            err["hint"] = hint
        typer.echo(json.dumps({"error": err}, indent=2))
    else:
        typer.echo(f"kvctl: {message}", err=True)
        if hint:
            typer.echo(f"hint: {hint}", err=True)
    raise typer.Exit(code)


def _unreachable_hint(path: Path) -> str:
    return (f"no daemon answers on {path}; is the daemon running? systemctl status kvagentd "
            f"(or pass --socket / set ${SOCKET_ENV})")


@contextlib.contextmanager
def _failures_exit(o: Opts) -> Iterator[None]:
    """Report a failed request and exit with the matching code (the one mapping for kvctl)."""
    try:
        yield
    except ApiFailure as exc:
        fail(o, exit_code_for(exc.status, exc.kind), exc.kind, exc.message)
    except DaemonUnreachable as exc:
        fail(o, EX_UNAVAILABLE, "unreachable", f"cannot reach kvagentd: {exc.reason}",
             _unreachable_hint(exc.socket_path))
    except SocketForbidden as exc:
        fail(o, EX_NOPERM, "forbidden", f"may not connect to {exc.socket_path}: {exc.reason}",
             "the socket is for members of the kvagent group (see control.socket_group)")
    except RequestTimedOut as exc:
        fail(o, EX_TEMPFAIL, "timeout", f"no reply within {o.timeout:g} s ({exc})",
             "the daemon is busy; retry or raise --timeout")


def call(o: Opts, method: str, path: str, *, params: dict[str, Any] | None = None,
         body: Any = None, ok: tuple[int, ...] = ()) -> Any:
    """One request to the daemon; on failure, report and exit with the matching code."""
    with _failures_exit(o), Client(o.socket, o.timeout) as client:
        return client.request(method, path, params=params, body=body, ok=ok)


def stream(o: Opts, method: str, path: str, *, params: dict[str, Any] | None = None,
           body: Any = None) -> Iterator[Any]:
    """Like `call`, for streamed replies: yields NDJSON objects or text pieces."""
    with _failures_exit(o), Client(o.socket, o.timeout) as client:
        yield from client.stream(method, path, params=params, body=body)


def usage_error(o: Opts, message: str) -> NoReturn:
    """Bad arguments found by a command itself (exit 64)."""
    fail(o, EX_USAGE, "usage", message)


def stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def progress_wanted(o: Opts) -> bool:
    """Progress lines go to stderr, and only on a terminal and without --json."""
    return not o.json and sys.stderr.isatty()
