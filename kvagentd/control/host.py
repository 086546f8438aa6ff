"""Where the control server, its accept loop and its connections meet: `ControlHost` is what
the listener and each connection use of the server (`server.ControlServer` satisfies it), and
`TrackedConnection` what the server keeps of a connection, so none of the three modules needs
another's class at run time or for its types."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from kvagentd.config import ControlConfig
from kvagentd.control.admission import Admission
from kvagentd.control.authz import AccessPolicy
from kvagentd.control.router import Router


class TrackedConnection(Protocol):
    """A connection as the server tracks it for draining (`connection.ControlHandler`)."""

    busy: bool  # a request is being served on it
    connection: socket.socket


class ControlHost(Protocol):
    """The control server as its listener and connections see it."""

    cfg: ControlConfig
    path: Path
    router: Router
    policy: AccessPolicy
    admission: Admission
    is_ready: Callable[[], bool]
    stopping: bool

    def register(self, h: TrackedConnection) -> None: ...

    def unregister(self, h: TrackedConnection) -> None: ...

    def observe(self, route: str, method: str, status: int, seconds: float) -> None: ...
