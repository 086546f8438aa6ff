"""`ConfigError`: the one exception for bad configuration.

It names the field's path (`agent.assets[0].rpm`), the bad value and what is allowed. The daemon
turns it into exit code 78 (EX_CONFIG) at start, the control API into a `bad_config` error.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""

    def __init__(self, path: str, value: object, allowed: str) -> None:
        self.path, self.value, self.allowed = path, value, allowed
        super().__init__(f"{path}: {value!r} is not valid; allowed: {allowed}")
