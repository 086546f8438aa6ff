"""Loading: TOML file -> environment overrides -> typed, range-checked `Config`.

`load_config(path)` reads TOML, applies `KVAGENTD_SECTION__FIELD=value` environment overrides
and converts every field to its declared type. Any problem raises `ConfigError` naming the field
path, the bad value and what is allowed. Sizes (`ByteSize` fields) accept an integer or a string
such as "18GiB", "512 MB", "128KiB". Relative paths are resolved against the current working
directory at load time. Rules across fields are in `kvagentd.config.checks`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from kvagentd.scheduling import cron
from kvagentd.config.checks import cross_checks
from kvagentd.config.errors import ConfigError
from kvagentd.config.sections import Config
from kvagentd.config.values import ByteSize, CronText, parse_size

DEFAULT_CONFIG_PATH = Path("/etc/kvagentd/kvagentd.toml")
ENV_PREFIX = "KVAGENTD_"


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read TOML at `path` (None: built-in defaults only), apply env overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("<file>", str(p), "an existing readable TOML file") from None
        except OSError as exc:
            raise ConfigError("<file>", str(p), f"a file user {_user()} may read "
                                                f"({exc.strerror})") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("<file>", str(p), f"valid TOML ({exc})") from None
    _apply_env(raw, os.environ if env is None else env)
    cfg = _build(Config, raw, "")
    cross_checks(cfg)
    return _one_box_name(cfg)


def _one_box_name(cfg: Config) -> Config:
    """One box, one name: `agent.mqtt.box_id` (in MQTT client ids) and `remote.box_id` (in the
    fleet) name the same box, so either one set names it in both places; both set and
    different is an error (a fleet and its broker would know the box by two names)."""
    mqtt, remote = cfg.agent.mqtt.box_id, cfg.remote.box_id
    if mqtt and remote and mqtt != remote:
        raise ConfigError("remote.box_id", remote,
                          f"empty or the same as agent.mqtt.box_id ({mqtt!r}): one name per box")
    name = mqtt or remote
    if not name or (mqtt and remote):
        return cfg
    return dataclasses.replace(
        cfg, remote=dataclasses.replace(cfg.remote, box_id=name),
        agent=dataclasses.replace(cfg.agent, mqtt=dataclasses.replace(cfg.agent.mqtt,
                                                                      box_id=name)))


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX):].lower().split("__")
        try:
            value: Any = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(".".join(parts), text, "a field inside a table")
        node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix or "<root>", raw, "a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(where, raw[unknown[0]], f"known fields: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        fpath = f"{prefix}.{f.name}" if prefix else f.name
        kwargs[f.name] = _convert(hints[f.name], raw[f.name], fpath, f.metadata)
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str, meta: Mapping[str, Any]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None or value == "":
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, path, meta)
    if origin is Literal:
        if value not in args:
            raise ConfigError(path, value, "one of " + ", ".join(repr(a) for a in args))
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, value, "a list")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]", {}) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(path, value, f"a list of {len(args)} values")
        out = tuple(_convert(a, v, f"{path}[{i}]", {}) for i, (a, v) in enumerate(zip(args, value)))
        return out
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, value, "true or false")
        return value
    if tp is ByteSize:
        if isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError:
                raise ConfigError(path, value, 'a size such as 1048576, "512MiB" or "18GB"') from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, 'a size such as 1048576, "512MiB" or "18GB"')
        return ByteSize(_check_range(value, path, meta))
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, value, "an integer" + _range_text(meta))
        return _check_range(value, path, meta)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise ConfigError(path, value, "a finite number" + _range_text(meta))
        return float(_check_range(value, path, meta))
    if tp is CronText:
        if not isinstance(value, str):
            raise ConfigError(path, value, f"a schedule such as {cron.EXAMPLE}")
        try:
            cron.trigger(value)
        except cron.CronError as exc:
            raise ConfigError(path, value, f"a schedule such as {cron.EXAMPLE} ({exc})") from None
        return CronText(value.strip())
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, value, "a string")
        return value
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(path, value, "a non-empty path string")
        if "\0" in value:
            raise ConfigError(path, value, "a path without NUL bytes")
        return Path(value).expanduser().absolute()
    raise TypeError(f"unsupported config type {tp!r} at {path}")  # a bug in this module


def _range_text(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _check_range(value: int | float, path: str, meta: Mapping[str, Any]) -> Any:
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError(path, value, "a number" + _range_text(meta))
    return value


def _user() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())
