"""The paths of a configuration against this machine and the service user, for `check-config`
(which also checks memory the way `run` does: `services.check_host_memory`).

`host_checks(cfg, user)` raises `ConfigError` (naming the field) for the first path the
daemon could not use here, and returns notes for what it could not decide:
- directories the daemon writes (state, cache, cold tier, shadow, socket): writable by the
  service user, or creatable under a parent it may write; the ones systemd makes for the unit
  (StateDirectory=, CacheDirectory=, RuntimeDirectory=) may be missing until the first start.
- files the daemon reads (model, replay recordings, TLS and password files): readable by the
  service user.
The service user is `user` (check-config's `--user`), else the unit's `kvagent` when it
exists and the check runs as root, else whoever runs the check.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvagentd.config.errors import ConfigError
from kvagentd.config.sections import Config

SERVICE_USER = "kvagent"
# made by systemd for the unit (systemd/kvagentd.service): missing before the first start
UNIT_DIRS = (Path("/var/lib/kvagentd"), Path("/var/cache/kvagentd"), Path("/run/kvagentd"))


@dataclass(frozen=True, slots=True)
class Account:
    name: str
    uid: int
    gids: frozenset[int]

    @classmethod
    def named(cls, name: str) -> Account:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            raise ConfigError("--user", name, "a user that exists on this machine") from None
        return cls(name, pw.pw_uid, frozenset(os.getgrouplist(name, pw.pw_gid)))

    @classmethod
    def default(cls) -> Account:
        if os.geteuid() == 0:
            try:
                return cls.named(SERVICE_USER)
            except ConfigError:
                pass
        return cls.current()

    @classmethod
    def current(cls) -> Account:
        """Whoever runs this process (what `run` checks as)."""
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return cls(name, uid, frozenset(os.getgroups()) | {os.getegid()})

    def may(self, path: Path, mode: int) -> bool:
        """`path` grants `mode` (stat.S_IR/S_IW/S_IX of the owner) to this account by its
        permission bits (root may anything, as the kernel decides without ACLs)."""
        if self.uid == 0:
            return True
        st = path.stat()
        if st.st_uid == self.uid:
            return bool(st.st_mode & mode)
        if st.st_gid in self.gids:
            return bool(st.st_mode & (mode >> 3))
        return bool(st.st_mode & (mode >> 6))


def host_checks(cfg: Config, user: Account | None = None) -> list[str]:
    """Raises ConfigError for what `run` would refuse on this machine; returns notes."""
    account = user or Account.default()
    notes = [f"paths checked for user {account.name}"]
    for field, path in _dirs(cfg):
        notes += _writable_dir(field, path, account)
    _model_path(cfg)
    for field, path in _files(cfg):
        _readable(field, path, account)
    return notes


def _model_path(cfg: Config) -> None:
    m = cfg.model
    if m.source == "hf_dir" and m.path is not None and m.path.exists() and not m.path.is_dir():
        raise ConfigError("model.path", str(m.path), "a directory (a transformers model: "
                                                     "config.json, weights, tokenizer)")
    if m.source == "gguf" and m.path is not None and m.path.is_dir():
        raise ConfigError("model.path", str(m.path), "a .gguf file (this is a directory)")
    if m.source == "hf_dir" and m.path is not None and m.path.is_dir() \
            and not (m.path / "config.json").is_file():
        raise ConfigError("model.path", str(m.path), "a transformers model directory (no "
                                                     "config.json in it)")


def _dirs(cfg: Config) -> Iterator[tuple[str, Path]]:
    yield "daemon.state_dir", cfg.daemon.state_dir
    yield "daemon.cache_dir", cfg.daemon.cache_dir
    yield "kv.cold_dir", cfg.kv.cold_dir
    yield "maintenance.shadow_dir", cfg.maintenance.shadow_dir
    yield "control.socket", cfg.control.socket.parent


def _files(cfg: Config) -> Iterator[tuple[str, Path]]:
    if cfg.model.path is not None and cfg.model.source != "none":
        yield "model.path", cfg.model.path
    m = cfg.agent.mqtt
    for name in ("password_file", "ca_file", "cert_file", "key_file"):
        p = getattr(m, name)
        if p is not None:
            yield f"agent.mqtt.{name}", p
    r = cfg.remote
    for name in ("password_file", "tls_ca_file", "tls_cert_file", "tls_key_file"):
        p = getattr(r, name)
        if p is not None and r.url:
            yield f"remote.{name}", p
    if cfg.agent.enabled:
        for i, a in enumerate(cfg.agent.assets):
            if a.source == "replay" and a.replay_path is not None:
                yield f"agent.assets[{i}].replay_path", a.replay_path


def _writable_dir(field: str, path: Path, user: Account) -> list[str]:
    path = path.absolute()
    if path.is_dir():
        if not (user.may(path, stat.S_IWUSR) and user.may(path, stat.S_IXUSR)):
            raise ConfigError(field, str(path), f"a directory user {user.name} may write "
                                                f"(owner {_owner(path)}, mode "
                                                f"{stat.S_IMODE(path.stat().st_mode):o})")
        return []
    if path.exists():
        raise ConfigError(field, str(path), "a directory (this is a file)")
    if any(path == d or d in path.parents for d in UNIT_DIRS):
        return [f"{field} {path} does not exist yet: systemd makes it for the unit"]
    parent = next(p for p in path.parents if p.exists())
    if not parent.is_dir() or not user.may(parent, stat.S_IWUSR):
        raise ConfigError(field, str(path), f"a directory user {user.name} may create: "
                                            f"{parent} (owner {_owner(parent)}) is not "
                                            f"writable for it")
    return [f"{field} {path} does not exist yet: made at start"]


def _readable(field: str, path: Path, user: Account) -> None:
    path = path.absolute()
    if not path.exists():
        raise ConfigError(field, str(path), "an existing file")
    if not user.may(path, stat.S_IRUSR):
        raise ConfigError(field, str(path), f"a file user {user.name} may read "
                                            f"(owner {_owner(path)}, mode "
                                            f"{stat.S_IMODE(path.stat().st_mode):o})")


def _owner(path: Path) -> str:
    st = path.stat()
    try:
        u = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        u = str(st.st_uid)
    try:
        g = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        g = str(st.st_gid)
    return f"{u}:{g}"
