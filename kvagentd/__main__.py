"""`kvagentd run [--config PATH]`, `kvagentd check-config PATH`, `kvagentd config default` and
`kvagentd diagnose RECORDING`.

Exit codes: 0 clean stop, 78 bad configuration (the message names the field, the value and
what is allowed), 77 permission denied, 73 control socket in use, 70 other startup failure,
64 usage, 65 a recording that cannot be read or lacks its unit or rate (diagnose), 66 no such
recording.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kvagentd import __version__
from kvagentd.config import DEFAULT_CONFIG_PATH, Config, ConfigError, load_config
from kvagentd.daemon.exitcodes import EX_CONFIG, EX_DATAERR, EX_NOINPUT, EX_USAGE

_CLICK_USAGE = 2

app = typer.Typer(name="kvagentd", help="Tiered KV-cache agent daemon.", no_args_is_help=True,
                  add_completion=True, pretty_exceptions_enable=False, rich_markup_mode=None)

ConfigOpt = Annotated[Path, typer.Option(
    "--config", "-c", envvar="KVAGENTD_CONFIG", show_envvar=True, dir_okay=False,
    readable=False, help="TOML configuration file")]  # NOTE: load_config says why (78), not click (64)


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
    from kvagentd.config.host import Account, host_checks

    cfg = _load(config)
    try:  # what check-config checks of paths, as this process's user (exit 78, not 70)
        host_checks(cfg, Account.current())
    except ConfigError as exc:
        typer.echo(f"kvagentd: bad configuration {config}: {exc}", err=True)
        raise typer.Exit(EX_CONFIG) from None
    from kvagentd.daemon import log as logsetup

    # NOTE: before the daemon's imports: libraries read their progress-bar switches then.
    logsetup.configure(cfg.daemon.log_level, cfg.daemon.log_format,
                       repeat_interval_s=cfg.daemon.log_repeat_interval_s)
    from kvagentd.daemon.core import Daemon

    raise typer.Exit(Daemon(cfg, config.absolute()).run())


@app.command("check-config")
def check_config(
    path: Annotated[Path, typer.Argument(help="TOML configuration file", readable=False)],
    user: Annotated[str | None, typer.Option(
        "--user", help="the service user to check paths for (default: kvagent when it exists "
                       "and this runs as root, else you)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v",
                                          help="also print what was checked")] = False,
    host: Annotated[bool, typer.Option(help="also check against this machine (memory, paths); "
                                            "--no-host for a file made for another box")] = True,
) -> None:
    """Validate a configuration file (with KVAGENTD_* overrides) against this machine without
    starting: every check `run` makes before it loads the model (values, memory, paths)."""
    from kvagentd.config.host import Account, host_checks
    from kvagentd.health.report import size

    cfg = _load(path)
    try:
        notes = [_check_memory(cfg)] if host else ["values only (--no-host)"]
        if host:
            notes += host_checks(cfg, Account.named(user) if user else None)
    except ConfigError as exc:
        typer.echo(f"kvagentd: bad configuration {path}: {exc}", err=True)
        raise typer.Exit(EX_CONFIG) from None
    assets = ", ".join(a.name for a in cfg.agent.assets) if cfg.agent.enabled else "disabled"
    typer.echo(f"{path}: ok (model {cfg.model.source}, hot {size(cfg.kv.hot_bytes)}, "
               f"socket {cfg.control.socket}, agent: {assets})")
    if verbose:
        for n in notes:
            typer.echo(f"  {n}")


def _check_memory(cfg: Config) -> str:
    """The host KV arenas fit the memory available now (`services.check_host_memory`), on the
    device `run` would pick on this machine (`model.device = "auto"` without a GPU: the CPU)."""
    import torch

    from kvagentd.engine.model import ModelNotFound, resolve_device
    from kvagentd.services import check_host_memory

    try:
        device = (torch.device("cpu") if cfg.model.source == "none"
                  else resolve_device(cfg.model.device))
    except ModelNotFound as exc:
        raise ConfigError("model.device", cfg.model.device, str(exc)) from None
    check_host_memory(cfg, device)
    return (f"memory checked for the {device.type}"
            + (" (model.device = auto, no GPU here)"
               if cfg.model.device == "auto" and device.type == "cpu" else ""))


@app.command()
def deploy(
    config: ConfigOpt = DEFAULT_CONFIG_PATH,
    root: Annotated[Path, typer.Option(help="where the files go; / on the target")] = Path("/"),
    config_path: Annotated[str | None, typer.Option(
        help="the config's path on the host, for the files' comments")] = None,
) -> None:
    """Write this machine's install files from the configuration (as root, on the box it
    runs on): the udev rule for the cold tier's disk, the unit's path and device drop-ins
    (`make install` runs it; a DESTDIR tree leaves it to the target). Then run
    `udevadm control --reload` and `systemctl daemon-reload`."""
    from kvagentd.daemon import deploy as deploy_mod

    argv = ["--config", str(config), "--root", str(root)]
    if config_path:
        argv += ["--config-path", config_path]
    raise typer.Exit(deploy_mod.main(argv))


config_app = typer.Typer(help="Default configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("default")
def config_default(
    profile: Annotated[str, typer.Option(help="gpu (configs/kvagentd.toml) or cpu "
                                              "(configs/edge-cpu.toml)")] = "gpu",
    section: Annotated[str | None, typer.Option(help="only this section, e.g. kv")] = None,
) -> None:
    """Print a commented default configuration: every field, its value in the profile, and
    what it does (from the config classes)."""
    from kvagentd.config.reference import render

    try:
        typer.echo(render(profile, section), nl=False)
    except ConfigError as exc:
        typer.echo(f"kvagentd: {exc}", err=True)
        raise typer.Exit(EX_USAGE) from None


def _floats(text: str | None, n: int, what: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(float(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if len(vals) != n:
        typer.echo(f"kvagentd diagnose: {what} needs {n} comma-separated numbers, got {text!r}",
                   err=True)
        raise typer.Exit(EX_USAGE)
    return vals


@app.command()
def diagnose(
    recording: Annotated[Path, typer.Argument(help="a .npy, .csv or .wav recording")],
    rpm: Annotated[float | None, typer.Option(help="shaft speed (rpm); default: from the file")] = None,
    sample_rate: Annotated[float | None, typer.Option(
        "--sample-rate", help="Hz, when the file does not state it")] = None,
    unit: Annotated[str | None, typer.Option(
        help="g, m/s^2 or mm/s, when the file does not state it")] = None,
    bearing: Annotated[str | None, typer.Option(
        help="balls,ball_mm,pitch_mm,contact_deg (default 9,7.94,39.04,0: SKF 6205)")] = None,
    window_s: Annotated[float, typer.Option("--window-s", help="window length (s)")] = 1.0,
    zones: Annotated[str | None, typer.Option(
        help="ISO zone limits A/B,B/C,C/D in mm/s (default 1.4,2.8,4.5)")] = None,
    rpm_tolerance: Annotated[float | None, typer.Option(
        "--rpm-tolerance", help="how far the true speed may be from --rpm (fraction, 0.03)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per window")] = False,
) -> None:
    """Diagnose every window of a recording with the agent's analysis: a table, or JSON lines."""
    import json

    from kvagentd.agent.offline import asset_for, diagnose_recording
    from kvagentd.agent.recordings import RecordingError, load_recording
    from kvagentd.config import BearingConfig

    if not recording.exists():
        typer.echo(f"kvagentd diagnose: {recording}: no such file", err=True)
        raise typer.Exit(EX_NOINPUT)
    try:
        rec = load_recording(recording, sample_rate_hz=sample_rate, unit=unit)
    except RecordingError as exc:
        typer.echo(f"kvagentd diagnose: {exc}", err=True)
        raise typer.Exit(EX_DATAERR) from None
    speed = rpm if rpm is not None else rec.rpm
    if speed is None or not speed > 0:
        typer.echo("kvagentd diagnose: the shaft speed is unknown: give --rpm (or rpm in the "
                   "file's JSON sidecar)", err=True)
        raise typer.Exit(EX_USAGE)
    b = _floats(bearing, 4, "--bearing")
    z = _floats(zones, 3, "--zones")
    if not window_s > 0 or window_s * rec.sample_rate_hz < 64:
        typer.echo(f"kvagentd diagnose: --window-s {window_s} gives fewer than 64 samples",
                   err=True)
        raise typer.Exit(EX_USAGE)
    if window_s > rec.duration_s:
        typer.echo(f"kvagentd diagnose: the recording lasts {rec.duration_s:.2f} s, shorter than "
                   f"one window ({window_s} s)", err=True)
        raise typer.Exit(EX_DATAERR)
    if z is not None and not (0 < z[0] < z[1] < z[2]):
        typer.echo("kvagentd diagnose: --zones must be three increasing positive limits",
                   err=True)
        raise typer.Exit(EX_USAGE)
    try:
        bearing_cfg = BearingConfig(int(b[0]), b[1], b[2], b[3]) if b else None
        asset = asset_for(rec, rpm=speed, bearing=bearing_cfg,
                          zone_limits_mm_s=z if z else None,  # type: ignore[arg-type]
                          window_s=window_s, rpm_tolerance=rpm_tolerance)
    except ValueError as exc:
        typer.echo(f"kvagentd diagnose: {exc}", err=True)
        raise typer.Exit(EX_USAGE) from None
    results = list(diagnose_recording(rec, asset))
    if as_json:
        for r in results:
            typer.echo(json.dumps(r.as_dict(), separators=(",", ":")))
        return
    typer.echo(f"{rec.path.name}: {rec.duration_s:.1f} s at {rec.sample_rate_hz:g} Hz, "
               f"{rec.unit} ({rec.kind}), {speed:g} rpm, {len(results)} windows of {window_s:g} s")
    typer.echo(f"{'win':>4} {'t_s':>7} {'fault':<12} {'sev':<6} {'conf':>4} {'zone':<4} "
               f"{'rms':>6} {'kurt':>5}  evidence")
    counts: dict[str, int] = {}
    for r in results:
        d = r.diagnosis
        if d is None:
            counts["refused"] = counts.get("refused", 0) + 1
            typer.echo(f"{r.index:>4} {r.t_s:>7.2f} {'REFUSED':<12} {r.refused}")
            continue
        counts[d.fault] = counts.get(d.fault, 0) + 1
        typer.echo(f"{r.index:>4} {r.t_s:>7.2f} {d.fault:<12} {d.severity:<6} "
                   f"{d.confidence:>4.2f} {d.zone:<4} {d.rms_mm_s:>6.2f} {d.kurtosis:>5.1f}  "
                   f"{d.summary}")
    typer.echo("windows: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


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
