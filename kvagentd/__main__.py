"""`kvagentd run [--config PATH]` and `kvagentd check-config PATH`.

Exit codes: 0 clean stop, 78 bad configuration (the message names the field, the value and
what is allowed), 77 permission denied, 73 control socket in use, 70 other startup failure,
64 usage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvagentd import __version__
from kvagentd.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config

EX_USAGE = 64
EX_CONFIG = 78
_CLICK_USAGE = 2

app = typer.Typer(name="kvagentd", help="Tiered KV-cache agent daemon.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

ConfigOpt = Annotated[Path, typer.Option(
    "--config", "-c", envvar="KVAGENTD_CONFIG", show_envvar=True, dir_okay=False,
    help="TOML configuration file")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvagentd {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="print the version and exit")) -> None:
    """Tiered KV-cache agent daemon."""


def _load(path: Path) -> Config:
    try:
        return load_config(path)
    except ConfigError as exc:
        typer.echo(f"kvagentd: bad configuration {path}: {exc}", err=True)
        raise typer.Exit(EX_CONFIG) from None


@app.command()
def run(config: ConfigOpt = DEFAULT_CONFIG_PATH) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    cfg = _load(config)
    from kvagentd import log as logsetup
    from kvagentd.daemon import Daemon

    logsetup.configure(cfg.daemon.log_level, cfg.daemon.log_format)
    raise typer.Exit(Daemon(cfg, config.absolute()).run())


@app.command("check-config")
def check_config(path: Annotated[Path, typer.Argument(help="TOML configuration file")]) -> None:
    """Validate a configuration file (with KVAGENTD_* overrides) without starting."""
    cfg = _load(path)
    assets = ", ".join(a.name for a in cfg.agent.assets) if cfg.agent.enabled else "disabled"
    typer.echo(f"{path}: ok (model {cfg.model.source}, hot {cfg.kv.hot_bytes} B, "
               f"socket {cfg.control.socket}, agent: {assets})")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvagentd` script."""
    try:
        app(args=argv, prog_name="kvagentd")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    if code == _CLICK_USAGE:  # click's usage status -> EX_USAGE
        code = EX_USAGE
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
