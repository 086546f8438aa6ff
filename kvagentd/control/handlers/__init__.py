"""Route modules of the control API; each has `register(router, daemon) -> None`."""

from __future__ import annotations

from typing import Any

from kvagentd.control.handlers import (agent, blocks, core, fleet, maintenance, placement,
                                       sessions)
from kvagentd.control.router import Router

MODULES = (core, blocks, placement, sessions, agent, maintenance, fleet)


def register_all(router: Router, daemon: Any) -> None:
    """Register the routes of every module in `MODULES` on `router`."""
    for module in MODULES:
        module.register(router, daemon)
