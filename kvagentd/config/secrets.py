"""Secrets the daemon reads at start: a password from a file, or from a systemd credential
(`LoadCredential=` puts it in `$CREDENTIALS_DIRECTORY/<name>`), never from the configuration
or the command line."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kvagentd.config import ConfigError


def read_secret(section: str, password_file: Path | None, credential: str | None,
                env: Mapping[str, str]) -> str | None:
    """The password `<section>.password_credential` or `<section>.password_file` names (the
    credential first); None when neither is set. Raises ConfigError naming the field when it
    cannot be read or is empty."""
    if credential:
        creds = env.get("CREDENTIALS_DIRECTORY")
        if not creds:
            raise ConfigError(f"{section}.password_credential", credential,
                              "the name of a credential the unit passes (LoadCredential=); "
                              "$CREDENTIALS_DIRECTORY is not set")
        path, field = Path(creds) / credential, f"{section}.password_credential"
    elif password_file is not None:
        path, field = Path(password_file), f"{section}.password_file"
    else:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or exc
        raise ConfigError(field, str(path), f"a readable file holding the password ({reason})"
                          ) from None
    password = text.rstrip("\r\n")
    if not password:
        raise ConfigError(field, str(path), "a file holding a non-empty password")
    return password
