"""kvctl: operate kvagentd over its control socket.

Exit codes (sysexits): 0 ok, 1 not found or other failure, 64 usage, 69 daemon unreachable
or the feature not configured, 75 busy / not ready / timed out (try again), 77 not permitted,
78 bad configuration. `kvctl health`: 0 ok, 1 degraded, 2 failing (as a Nagios check).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from kvctl import (cmd_agent, cmd_blocks, cmd_core, cmd_fleet, cmd_maintenance, cmd_sessions,
                   cmd_trace)
from kvctl.common import (DEFAULT_SOCKET, DEFAULT_TIMEOUT_S, EX_USAGE, ExitCode, JsonOpt, Opts,
                          SocketOpt, TimeoutOpt)

def _installed_version() -> str:
    """The installed distribution's version (kvctl ships with the daemon)."""
    try:
        return version("kvagentd")
    except PackageNotFoundError:
        return "unknown"


app = typer.Typer(name="kvctl", help=__doc__, no_args_is_help=True, add_completion=True,
                  pretty_exceptions_enable=False, rich_markup_mode=None)

_CLICK_USAGE = 2

# Command modules; each has register(app).
COMMAND_MODULES = (cmd_core, cmd_sessions, cmd_blocks, cmd_trace, cmd_agent, cmd_maintenance,
                   cmd_fleet)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvctl {_installed_version()}")
        raise typer.Exit(0)


@app.callback()
def root(ctx: typer.Context, socket: SocketOpt = None, json_out: JsonOpt = False,
         timeout: TimeoutOpt = None,
         version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="print the version and exit")) -> None:
    """Operate kvagentd over its control socket."""
    ctx.obj = Opts(socket=socket or DEFAULT_SOCKET, json=json_out,
                   timeout=timeout if timeout is not None else DEFAULT_TIMEOUT_S)


for _module in COMMAND_MODULES:
    _module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvctl` script; returns (and exits with) the exit code."""
    try:
        app(args=argv, prog_name="kvctl")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        # NOTE: click reports usage errors with exit status 2; kvctl promises EX_USAGE.
        if code == _CLICK_USAGE:
            code = EX_USAGE
    except ExitCode as exc:  # passes click by, so a 2 stays 2
        code = exc.code
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
