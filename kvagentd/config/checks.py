"""Rules that span fields or sections, checked after every field is typed and in range.

`cross_checks(cfg)` raises `ConfigError` for the first rule broken (zone limits increasing,
unique asset names, a replay file for a replay source, MQTT and remote credentials given once,
health thresholds ordered, ...), naming the field to change.
"""

from __future__ import annotations

import ipaddress
import os
import re
from urllib.parse import urlsplit

from kvagentd.config.errors import ConfigError
from kvagentd.config.sections import Config, MqttConfig, RemoteConfig
from kvagentd.config.values import parse_listen


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host_name(text: str) -> bool:
    """An IP address or a DNS host name (RFC 1123 labels)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(x) for x in name.split("."))


# sockaddr_un.sun_path: 108 bytes with the terminating NUL
_SOCKET_PATH_MAX = 107


def cross_checks(cfg: Config) -> None:
    sock = os.fsencode(cfg.control.socket)
    if len(sock) > _SOCKET_PATH_MAX:
        raise ConfigError("control.socket", str(cfg.control.socket),
                          f"a path of at most {_SOCKET_PATH_MAX} bytes (a Unix socket "
                          f"address; this one has {len(sock)})")
    lim = [tuple(a.zone_limits_mm_s) for a in cfg.agent.assets]
    for i, z in enumerate(lim):
        if not (0 < z[0] < z[1] < z[2]):
            raise ConfigError(f"agent.assets[{i}].zone_limits_mm_s", list(z),
                              "three increasing positive limits (A/B, B/C, C/D)")
    names = [a.name for a in cfg.agent.assets]
    for i, n in enumerate(names):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", n):
            raise ConfigError(f"agent.assets[{i}].name", n, "1-64 of letters, digits, _ . -")
        if names.index(n) != i:
            raise ConfigError(f"agent.assets[{i}].name", n, "a name not used by another asset")
    for i, a in enumerate(cfg.agent.assets):
        if a.source == "replay" and a.replay_path is None:
            raise ConfigError(f"agent.assets[{i}].replay_path", None,
                              "a .npy, .csv or .wav file when source = 'replay'")
        if a.replay_path is not None and a.replay_path.suffix.lower() not in (".npy", ".csv",
                                                                             ".wav"):
            raise ConfigError(f"agent.assets[{i}].replay_path", str(a.replay_path),
                              "a .npy, .csv or .wav file")
        if a.source == "mqtt" and not a.mqtt_topic:
            raise ConfigError(f"agent.assets[{i}].mqtt_topic", "",
                              "a topic when source = 'mqtt'")
        if not _host_name(a.mqtt_host):
            raise ConfigError(f"agent.assets[{i}].mqtt_host", a.mqtt_host,
                              "a host name or IP address, without scheme or port (the port "
                              "is mqtt_port)")
    if cfg.agent.events_retention_s < cfg.agent.events_raw_retention_s:
        raise ConfigError("agent.events_retention_s", cfg.agent.events_retention_s,
                          f"a number >= agent.events_raw_retention_s "
                          f"({cfg.agent.events_raw_retention_s})")
    if cfg.placement.warm_factor > cfg.placement.hot_factor:
        raise ConfigError("placement.warm_factor", cfg.placement.warm_factor,
                          f"a number <= placement.hot_factor ({cfg.placement.hot_factor})")
    if cfg.metrics.listen:
        try:
            parse_listen(cfg.metrics.listen)
        except ValueError as exc:
            raise ConfigError("metrics.listen", cfg.metrics.listen,
                              f'"" (off), a port ("9464", on 127.0.0.1) or "HOST:PORT" ({exc})'
                              ) from None
    h = cfg.health
    for low, high in (("skip_rate_degraded", "skip_rate_failing"),
                      ("tick_p99_degraded", "tick_p99_failing"),
                      ("shadow_fill_degraded", "shadow_fill_failing")):
        if getattr(h, low) > getattr(h, high):
            raise ConfigError(f"health.{low}", getattr(h, low),
                              f"a number <= health.{high} ({getattr(h, high)})")
    if h.wear_degraded_percent > cfg.maintenance.wear_readonly_percent:
        raise ConfigError("health.wear_degraded_percent", h.wear_degraded_percent,
                          "a number <= maintenance.wear_readonly_percent "
                          f"({cfg.maintenance.wear_readonly_percent})")
    if cfg.model.source in ("hf_dir", "gguf") and cfg.model.path is None:
        raise ConfigError("model.path", None, f"a path when model.source = {cfg.model.source!r}")
    _remote_checks(cfg.remote)
    if cfg.kv.io_unit_bytes % 4096:
        raise ConfigError("kv.io_unit_bytes", cfg.kv.io_unit_bytes, "a multiple of 4096")
    if cfg.executor.step_tokens < cfg.executor.max_batch:
        raise ConfigError("executor.step_tokens", cfg.executor.step_tokens,
                          f"a number >= executor.max_batch ({cfg.executor.max_batch}): every "
                          f"running sequence decodes one token per step")
    _check_mqtt(cfg.agent.mqtt)


def _check_mqtt(m: MqttConfig) -> None:
    if m.password_file is not None and m.password_credential:
        raise ConfigError("agent.mqtt.password_credential", m.password_credential,
                          "empty when agent.mqtt.password_file is set (one source of the password)")
    if (m.password_file is not None or m.password_credential) and not m.username:
        raise ConfigError("agent.mqtt.username", "", "a user name when a password is configured")
    if (m.cert_file is None) != (m.key_file is None):
        raise ConfigError("agent.mqtt.key_file" if m.key_file is None else "agent.mqtt.cert_file",
                          None, "both cert_file and key_file, or neither")
    for name in ("ca_file", "cert_file"):
        if getattr(m, name) is not None and not m.tls:
            raise ConfigError(f"agent.mqtt.{name}", str(getattr(m, name)),
                              "unset unless agent.mqtt.tls = true")
    if m.password_credential and not re.fullmatch(r"[A-Za-z0-9_.-]{1,255}", m.password_credential):
        raise ConfigError("agent.mqtt.password_credential", m.password_credential,
                          "a credential name (letters, digits, _ . -)")
    for name, least in (("client_id_prefix", 1), ("box_id", 0)):
        if not re.fullmatch(rf"[A-Za-z0-9_.-]{{{least},64}}", getattr(m, name)):
            raise ConfigError(f"agent.mqtt.{name}", getattr(m, name),
                              f"{least}-64 of letters, digits, _ . -")


_REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")


def _remote_checks(r: RemoteConfig) -> None:
    if not r.url:
        return
    if not r.url.startswith(_REMOTE_SCHEMES):
        raise ConfigError("remote.url", r.url, "a URL starting with " + ", ".join(_REMOTE_SCHEMES))
    if r.cluster and r.url.startswith("unix://"):
        raise ConfigError("remote.cluster", True, "false with a unix:// URL")
    if r.password_file is not None and r.password_credential:
        raise ConfigError("remote.password_credential", r.password_credential,
                          "empty when remote.password_file is set (one source of the password)")
    if urlsplit(r.url).password is not None:
        raise ConfigError("remote.url", "<a URL with a password>",
                          "a URL without a password; use remote.password_file or "
                          "remote.password_credential")
    tls = (r.tls_ca_file, r.tls_cert_file, r.tls_key_file)
    if any(t is not None for t in tls) and not r.url.startswith("rediss://"):
        raise ConfigError("remote.url", r.url, "a rediss:// URL when TLS files are set")
    if (r.tls_cert_file is None) != (r.tls_key_file is None):
        raise ConfigError("remote.tls_key_file", str(r.tls_key_file),
                          "set together with remote.tls_cert_file")
    if r.box_id and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", r.box_id):
        raise ConfigError("remote.box_id", r.box_id,
                          "1-64 of letters, digits, _ . - (as agent.mqtt.box_id)")
    if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", r.key_prefix):
        raise ConfigError("remote.key_prefix", r.key_prefix, "1-64 of letters, digits, _ . : -")

