"""Which changes of a re-read configuration apply live (SIGHUP) and which wait for a restart."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvagentd.config import RELOADABLE, Config, diff_reloadable


def merge_reloadable(running: Config, new: Config
                     ) -> tuple[Config, dict[str, tuple[Any, Any]], list[str]]:
    """`running` with the reloadable fields of `new` applied; the applied changes
    (path -> (old, new)); the paths of changes that need a restart."""
    changes = diff_reloadable(running, new)
    live = {k: v for k, v in changes.items() if k in RELOADABLE}
    restart = sorted(k for k in changes if k not in RELOADABLE)
    merged = running
    for path in live:
        merged = with_field(merged, path.split("."), new)
    return merged, live, restart


def with_field(cfg: Any, parts: list[str], source: Any) -> Any:
    """`cfg` with the field at `parts` taken from `source` (same config type)."""
    head = parts[0]
    value = getattr(source, head)
    if len(parts) > 1:
        value = with_field(getattr(cfg, head), parts[1:], value)
    return dataclasses.replace(cfg, **{head: value})
