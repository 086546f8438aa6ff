"""The typed config tree: defaults, every kind of invalid value, env overrides, shipped files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvagentd.config import (RELOADABLE, Config, ConfigError, config_to_dict, diff_reloadable,
                             load_config, parse_size)

ROOT = Path(__file__).resolve().parents[1]


def _load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p, env=env or {})


def _error(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        _load(tmp_path, text, env)
    return exc.value


def test_defaults_are_valid_and_frozen() -> None:
    cfg = load_config(None, env={})
    assert cfg.kv.hot_bytes == 18 * 1000**3 and cfg.kv.io_unit_bytes == 128 * 1024
    assert cfg.warm_bytes == int(cfg.kv.hot_bytes * 0.35)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv.hot_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("text,path,value,allowed", [
    # wrong type
    ("[control]\nmax_connections = \"many\"", "control.max_connections", "many", "an integer"),
    ("[daemon]\ndrain_timeout_s = \"soon\"", "daemon.drain_timeout_s", "soon", "a finite number"),
    ("[kv]\no_direct = 1", "kv.o_direct", 1, "true or false"),
    ("[control]\nsocket_group = 5", "control.socket_group", 5, "a string"),
    ("[kv]\ncold_dir = \"\"", "kv.cold_dir", "", "a non-empty path string"),
    ("[control]\nmax_connections = true", "control.max_connections", True, "an integer"),
    # out of range
    ("[control]\nmax_connections = 0", "control.max_connections", 0, "[1, 4096]"),
    ("[placement]\nwindow_fraction = 1.5", "placement.window_fraction", 1.5, "[0.01, 1.0]"),
    ("[kv]\nhot_bytes = \"1KiB\"", "kv.hot_bytes", 1024, ">= 1048576"),
    # bad Literal
    ("[model]\nsource = \"cloud\"", "model.source", "cloud", "'embedded'"),
    ("[daemon]\nlog_level = \"loud\"", "daemon.log_level", "loud", "'debug'"),
    # bad size string
    ("[kv]\nhot_bytes = \"18 parsecs\"", "kv.hot_bytes", "18 parsecs", '"512MiB"'),
    ("[kv]\ncold_capacity_bytes = -5", "kv.cold_capacity_bytes", -5, ">= 1048576"),
    # shapes
    ("daemon = 3", "daemon", 3, "a table"),
    ("[[agent.assets]]\nzone_limits_mm_s = [1.0, 2.0]", "agent.assets[0].zone_limits_mm_s",
     [1.0, 2.0], "a list of 3 values"),
    ("[agent]\nassets = 4", "agent.assets", 4, "a list"),
])
def test_each_invalid_value_names_field_value_and_allowed(tmp_path: Path, text: str, path: str,
                                                          value: object, allowed: str) -> None:
    err = _error(tmp_path, text)
    assert err.path == path
    assert err.value == value
    assert allowed in err.allowed
    assert str(err).startswith(f"{path}: {value!r} is not valid; allowed: ")


def test_unknown_field_and_section_list_the_known_ones(tmp_path: Path) -> None:
    err = _error(tmp_path, "[kv]\nhot_byte = 5")
    assert err.path == "kv.hot_byte" and "hot_bytes" in err.allowed
    err = _error(tmp_path, "[kvcache]\nx = 1")
    assert err.path == "kvcache" and "kv" in err.allowed.split(", ")


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    err = _error(tmp_path, "[kv\nhot_bytes = 1")
    assert err.path == "<file>" and "valid TOML" in err.allowed
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path / "absent.toml", env={})
    assert exc.value.path == "<file>" and "existing readable" in exc.value.allowed
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="valid TOML"):
        load_config(tmp_path / "bin.toml", env={})


@pytest.mark.parametrize("text,path", [
    ("[[agent.assets]]\nzone_limits_mm_s = [4.5, 2.8, 1.4]", "agent.assets[0].zone_limits_mm_s"),
    ("[[agent.assets]]\nname = \"a\"\n[[agent.assets]]\nname = \"a\"", "agent.assets[1].name"),
    ("[[agent.assets]]\nname = \"bad name!\"", "agent.assets[0].name"),
    ("[[agent.assets]]\nsource = \"replay\"", "agent.assets[0].replay_path"),
    ("[[agent.assets]]\nsource = \"mqtt\"", "agent.assets[0].mqtt_topic"),
    ("[placement]\nwarm_factor = 2.0\nhot_factor = 1.0", "placement.warm_factor"),
    ("[model]\nsource = \"gguf\"", "model.path"),
    ("[kv]\nio_unit_bytes = 5000", "kv.io_unit_bytes"),
])
def test_cross_field_checks(tmp_path: Path, text: str, path: str) -> None:
    assert _error(tmp_path, text).path == path


def test_sizes_accept_units() -> None:
    assert parse_size("18GiB") == 18 * 1024**3
    assert parse_size("512 MB") == 512 * 1000**2
    assert parse_size("128KiB") == 131072
    assert parse_size("4096") == 4096
    assert parse_size("1.5g") == 1_500_000_000
    for bad in ("", "GiB", "12 parsecs", "-1MiB", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_env_overrides(tmp_path: Path) -> None:
    cfg = _load(tmp_path, "[kv]\nhot_bytes = \"1GiB\"\n", env={
        "KVAGENTD_KV__HOT_BYTES": "\"4GiB\"",          # TOML string
        "KVAGENTD_CONTROL__MAX_CONNECTIONS": "8",      # TOML integer
        "KVAGENTD_MODEL__SOURCE": "none",              # bare word: taken as a string
        "KVAGENTD_DAEMON__LOG_LEVEL": "debug",
        "KVAGENTD_KV__O_DIRECT": "false",
        "OTHER_KV__HOT_BYTES": "1",                    # other prefixes are ignored
        "KVAGENTD_NO_SEPARATOR": "x",
    })
    assert cfg.kv.hot_bytes == 4 * 1024**3
    assert cfg.control.max_connections == 8
    assert cfg.model.source == "none" and cfg.daemon.log_level == "debug"
    assert cfg.kv.o_direct is False


def test_env_override_with_bad_value_names_the_field(tmp_path: Path) -> None:
    err = _error(tmp_path, "", env={"KVAGENTD_KV__HOT_BYTES": "lots"})
    assert err.path == "kv.hot_bytes" and err.value == "lots"
    err = _error(tmp_path, "", env={"KVAGENTD_KV__NOPE": "1"})
    assert err.path == "kv.nope"


def test_env_applies_without_a_file() -> None:
    cfg = load_config(None, env={"KVAGENTD_KV__BLOCK_TOKENS": "32"})
    assert cfg.kv.block_tokens == 32


def test_relative_paths_resolve_against_cwd(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _load(tmp_path, "[daemon]\nstate_dir = \"./var/state\"\n")
    assert cfg.daemon.state_dir == tmp_path / "var" / "state"


def test_reload_diff_and_dict_view(tmp_path: Path) -> None:
    a = _load(tmp_path, "[daemon]\nlog_level = \"info\"\n")
    b = _load(tmp_path, "[daemon]\nlog_level = \"debug\"\n[kv]\nblock_tokens = 32\n")
    diff = diff_reloadable(a, b)
    assert diff == {"daemon.log_level": ("info", "debug"), "kv.block_tokens": (16, 32)}
    assert "daemon.log_level" in RELOADABLE and "kv.block_tokens" not in RELOADABLE
    d = config_to_dict(a)
    assert d["daemon"]["state_dir"] == str(a.daemon.state_dir)
    assert isinstance(d["agent"]["assets"], list)


def test_every_reloadable_path_exists() -> None:
    flat = config_to_dict(load_config(None, env={}))
    for path in RELOADABLE:
        section, name = path.split(".")
        assert name in flat[section], path


@pytest.mark.parametrize("name", ["kvagentd.toml", "demo.toml", "edge-cpu.toml",
                                  "demo-8-assets.toml"])
def test_shipped_configs_load(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / name, env={})
    assert cfg.agent.assets


def test_industrial_profile_has_the_seed_parameters() -> None:
    cfg = load_config(ROOT / "configs" / "kvagentd.toml", env={})
    assert cfg.kv.hot_bytes == 18 * 1000**3
    assert cfg.kv.warm_ratio == 0.35
    assert cfg.kv.io_unit_bytes == 128 * 1024
    assert cfg.placement.heatmap_window == 200
    assert (cfg.placement.hot_factor, cfg.placement.warm_factor) == (1.8, 0.9)
    assert cfg.kv.cold_ttl_s == 3600.0
    assert 0.2 <= cfg.placement.window_fraction <= 0.3
    assert cfg.maintenance.nr_requests_min >= 64
    assert cfg.maintenance.defrag_interval_s == 7200.0
    assert cfg.maintenance.shadow_bytes == 1 << 30
    assert cfg.maintenance.wear_readonly_percent == 80.0
    assert cfg.agent.tick_interval_s == 3.0
    assert cfg.control.socket == Path("/run/kvagentd/kvagentd.sock")


def test_edge_profile_is_cpu_only_and_fits_8_gib() -> None:
    cfg = load_config(ROOT / "configs" / "edge-cpu.toml", env={})
    assert cfg.model.source == "embedded" and cfg.model.device == "cpu"
    assert cfg.model.dtype == "auto"
    assert cfg.agent.assets[0].source == "simulated"  # runs without a broker out of the box
    # the RAM it takes beside the model (~0.6 GiB): KV tiers, batch memory, windows, shadow
    ram = (cfg.kv.hot_bytes * (1 + cfg.kv.warm_ratio) + cfg.executor.batch_memory_bytes
           + cfg.agent.windows_store_bytes + cfg.maintenance.shadow_bytes)
    assert ram + (1 << 30) <= 8 << 30
    # the fp32 batch workspace (16 rows of 2048 tokens of SmolLM2-135M KV) and a 4096-token
    # working copy fit the batch memory
    kv_token = 30 * 2 * 3 * 64 * 4
    assert (cfg.executor.max_batch * cfg.executor.row_tokens
            + cfg.executor.warm_workspace_tokens) * kv_token <= cfg.executor.batch_memory_bytes


def test_eight_asset_demo_ticks_eight_assets_under_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "demo-8-assets.toml", env={})
    assert [a.name for a in cfg.agent.assets] == [f"pump-{i}" for i in range(1, 9)]
    assert {a.source for a in cfg.agent.assets} == {"simulated"}
    assert ROOT / "var" in cfg.daemon.state_dir.parents


def test_demo_profile_keeps_state_under_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    cfg = load_config(ROOT / "configs" / "demo.toml", env={})
    var = ROOT / "var"
    for p in (cfg.daemon.state_dir, cfg.daemon.cache_dir, cfg.control.socket, cfg.kv.cold_dir,
              cfg.maintenance.shadow_dir, cfg.maintenance.health_status_file):
        assert var in p.parents, p
    assert cfg.control.socket == var / "run" / "kvagentd.sock"
    assert cfg.model.source == "embedded" and cfg.model.device == "cpu"
    assert cfg.kv.hot_bytes == 256 * 1024**2 and cfg.kv.warm_ratio == 1.0
    assert cfg.kv.cold_capacity_bytes == 2 * 1024**3 and cfg.kv.o_direct is True
    assert (cfg.control.socket_group, cfg.control.operator_group) == ("", "")
    (asset,) = cfg.agent.assets
    assert asset.source == "simulated" and asset.fault.kind == "outer_race"
    assert 60 <= asset.fault.onset_s <= 600


@pytest.mark.parametrize("text,mqtt,remote", [
    ('[agent.mqtt]\nbox_id = "line1-box7"\n', "line1-box7", "line1-box7"),
    ('[remote]\nurl = "redis://h/0"\nbox_id = "line1-box7"\n', "line1-box7", "line1-box7"),
    ('[agent.mqtt]\nbox_id = "b7"\n[remote]\nurl = "redis://h/0"\nbox_id = "b7"\n', "b7", "b7"),
    ("", "", ""),
])
def test_one_box_name_for_mqtt_and_the_fleet(tmp_path: Path, text: str, mqtt: str,
                                             remote: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    cfg = load_config(p, env={})
    assert (cfg.agent.mqtt.box_id, cfg.remote.box_id) == (mqtt, remote)


def test_two_box_names_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[agent.mqtt]\nbox_id = "b7"\n[remote]\nurl = "redis://h/0"\nbox_id = "b8"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(p, env={})
    assert exc.value.path == "remote.box_id" and "b7" in str(exc.value)
