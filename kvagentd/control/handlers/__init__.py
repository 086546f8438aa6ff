"""Route modules of the control API; each has `register(router, deps) -> None`, `deps` the
daemon as the handlers see it (`ControlDeps`)."""

from __future__ import annotations

from kvagentd.control.deps import ControlDeps
from kvagentd.control.handlers import (agent, blocks, core, fleet, maintenance, placement,
                                       sessions)
from kvagentd.control.router import Router

MODULES = (core, blocks, placement, sessions, agent, maintenance, fleet)


def register_all(router: Router, deps: ControlDeps) -> None:
    """Register the routes of every module in `MODULES` on `router`."""
    for module in MODULES:
        module.register(router, deps)
