"""A config as plain data (`config_to_dict`, for `kvctl config` and logs), the changed leaves
between two configs (`diff_reloadable`) and the leaves SIGHUP may change (`RELOADABLE`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvagentd.config.sections import Config, HealthConfig

# Settings that SIGHUP may change without a restart (field paths).
RELOADABLE = frozenset({
    "daemon.log_level", "daemon.log_repeat_interval_s", "agent.tick_interval_s",
    "agent.weekly_report_cron",
    "maintenance.defrag_interval_s", "maintenance.health_interval_s",
    "maintenance.scrub_interval_s",
    # placement applies its policy and tuning at the next round (`PlacementService.reload`);
    # its trace buffer, warm-up and the store's prefetch queue are sized at start
    *(f"placement.{name}" for name in (
        "policy", "heatmap_window", "hot_factor", "warm_factor", "window_fraction",
        "hysteresis", "headroom_fraction", "interval_s", "prefetch_lead_s")),
    *(f"health.{f.name}" for f in dataclasses.fields(HealthConfig)),
})


def config_to_dict(cfg: Any) -> Any:
    """JSON-ready view of a config (paths as strings)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [config_to_dict(v) for v in cfg]
    if isinstance(cfg, Path):
        return str(cfg)
    return cfg


def diff_reloadable(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    """Changed fields between two configs: {path: (old, new)} for every changed leaf."""
    a, b = _flatten(config_to_dict(old)), _flatten(config_to_dict(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}
