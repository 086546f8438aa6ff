"""The daemon's exit codes (sysexits.h), and which one a failed start gets."""

from __future__ import annotations

from kvagentd.config import ConfigError

EX_OK = 0
EX_USAGE = 64
EX_DATAERR = 65
EX_NOINPUT = 66
EX_SOFTWARE = 70
EX_CANTCREAT = 73
EX_NOPERM = 77
EX_CONFIG = 78  # systemd does not restart after it (RestartPreventExitStatus=78)


def startup_exit_code(exc: BaseException) -> int:
    """Bad configuration 78, permission denied 77, the control socket held by another
    process 73, anything else 70."""
    from kvagentd.control.socketfile import ControlSocketInUse

    if isinstance(exc, ConfigError):
        return EX_CONFIG
    if isinstance(exc, PermissionError):
        return EX_NOPERM
    if isinstance(exc, ControlSocketInUse):
        return EX_CANTCREAT
    return EX_SOFTWARE
