"""`kvagentd config default`: a commented default generated from the config classes, equal
to the shipped profile files, one section when asked."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvagentd.config import ConfigError, load_config
from kvagentd.config.reference import SECTIONS, render

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = {"gpu": "kvagentd.toml", "cpu": "edge-cpu.toml"}


@pytest.mark.parametrize("profile", sorted(SHIPPED))
def test_each_profile_is_the_shipped_file(tmp_path: Path, profile: str) -> None:
    text = render(profile)
    out = tmp_path / "c.toml"
    out.write_text(text)
    assert load_config(out, env={}) == load_config(ROOT / "configs" / SHIPPED[profile], env={})
    assert {k for k in tomllib.loads(text)} == set(SECTIONS)


def test_fields_carry_their_comments_and_sizes_read_as_sizes() -> None:
    text = render("cpu", "kv")
    assert text.startswith("[kv]\n") and "[control]" not in text
    assert 'hot_bytes = "512MiB"' in text
    assert 'cold_capacity_bytes = "20GB"' in text
    # a comment written beside or above the field in sections.py comes along
    assert "# committed hot and warm blocks are written to the cold tier" in text
    control = render("gpu", "control")
    assert "socket_mode = 0o660" in control
    assert tomllib.loads(control)["control"]["socket_mode"] == 0o660
    assert 'listen_backlog = 1024  # capped by somaxconn' in control


def test_unset_fields_are_shown_commented_out() -> None:
    model = render("gpu", "model")
    assert "# path = (unset)" in model and "path" not in tomllib.loads(model)["model"]


def test_bad_profile_or_section_is_refused() -> None:
    with pytest.raises(ConfigError, match="gpu or cpu"):
        render("tpu")
    with pytest.raises(ConfigError, match="daemon, control"):
        render("gpu", "nope")
    r = subprocess.run([sys.executable, "-m", "kvagentd", "config", "default", "--section",
                        "nope"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 64 and "--section" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvagentd", "config", "default", "--profile",
                        "cpu", "--section", "health"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and tomllib.loads(r.stdout)["health"]["wear_unknown"] == "degraded"
