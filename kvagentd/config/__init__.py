"""One frozen, typed configuration tree, loaded from TOML and the environment.

`load_config(path)` reads TOML, applies `KVAGENTD_SECTION__FIELD=value` environment overrides
and validates every field. Any problem raises `ConfigError` naming the field path, the bad value
and what is allowed; the daemon turns that into exit code 78 (EX_CONFIG).

The package's modules, each one noun; import the names from here:
- `errors`: `ConfigError`.
- `values`: field value types beyond the builtins (`ByteSize`, `CronText`) and their parsers.
- `sections`: the tree, one dataclass per TOML section, and `Config`, the root.
- `load`: `load_config` (TOML, environment overrides, per-field types and ranges).
- `checks`: rules across fields, run by `load_config` after the fields are typed.
- `view`: `config_to_dict`, `diff_reloadable` and `RELOADABLE` (what SIGHUP may change).
"""

from __future__ import annotations

from kvagentd.config.errors import ConfigError
from kvagentd.config.load import DEFAULT_CONFIG_PATH, ENV_PREFIX, load_config
from kvagentd.config.sections import (AgentConfig, AssetConfig, BearingConfig, Config,
                                      ControlConfig, DaemonConfig, DebugConfig, ExecutorConfig,
                                      FaultConfig, HealthConfig, KVConfig, LogLevel,
                                      MaintenanceConfig, MetricsConfig, ModelConfig, MqttConfig,
                                      PlacementConfig, RemoteConfig)
from kvagentd.config.values import ByteSize, CronText, parse_listen, parse_size
from kvagentd.config.view import RELOADABLE, config_to_dict, diff_reloadable

__all__ = [
    "DEFAULT_CONFIG_PATH", "ENV_PREFIX", "RELOADABLE", "AgentConfig", "AssetConfig",
    "BearingConfig", "ByteSize", "Config", "ConfigError", "ControlConfig", "CronText",
    "DaemonConfig", "DebugConfig", "ExecutorConfig", "FaultConfig", "HealthConfig", "KVConfig",
    "LogLevel", "MaintenanceConfig", "MetricsConfig", "ModelConfig", "MqttConfig",
    "PlacementConfig", "RemoteConfig", "config_to_dict", "diff_reloadable", "load_config",
    "parse_listen", "parse_size",
]
