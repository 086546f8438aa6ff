"""What the control API's handlers use of the daemon, declared: `ControlDeps`.

`kvagentd.daemon.core.Daemon` satisfies it; tests hand the handlers smaller stand-ins. The
services are read through `services` at each request (the daemon builds them after the control
socket is up, so a handler must not keep one from registration time)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from apscheduler.schedulers.base import BaseScheduler
    from prometheus_client import CollectorRegistry

    from kvagentd.config import Config
    from kvagentd.services import Services


class ControlDeps(Protocol):
    """The daemon as the control handlers see it."""

    @property
    def services(self) -> Services:
        """The running services; a field is None where absent or not built yet."""
        ...

    @property
    def config(self) -> Config: ...

    @property
    def config_path(self) -> Path | None: ...

    @property
    def scheduler(self) -> BaseScheduler: ...

    @property
    def metrics(self) -> CollectorRegistry: ...

    @property
    def ready(self) -> bool: ...

    @property
    def phase(self) -> str: ...

    def status(self) -> dict[str, Any]: ...

    def health(self) -> dict[str, Any]: ...

    def ack_health(self, names: list[str]) -> dict[str, Any]: ...

    def reload(self) -> dict[str, Any]: ...

    def request_shutdown(self, reason: str) -> None: ...
