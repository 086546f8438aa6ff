"""The documents made from the code stay current: the configuration reference equals what the
config classes generate, and the man pages cover every command of both programs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))

import generate  # noqa: E402  (docs/generate.py)


def test_the_configuration_reference_is_current() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert doc == generate.configuration(), "run: make docs"
    assert "## [kv]" in doc and "hot_bytes" in doc and "`kv.hot_bytes`" in doc


def _commands(group: typer.Typer, prefix: str) -> set[str]:
    import click

    out: set[str] = set()

    def walk(cmd: click.Command, name: str) -> None:
        out.add(name)
        if isinstance(cmd, click.Group):
            for sub_name, sub in cmd.commands.items():
                walk(sub, f"{name}-{sub_name}")

    walk(typer.main.get_command(group), prefix)
    return out


def test_man_pages_cover_every_command(tmp_path: Path) -> None:
    from kvagentd.__main__ import app as kvagentd_app
    from kvctl.main import app as kvctl_app

    r = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "man",
                        str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": f"{ROOT}:{ROOT / 'cli'}", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    pages = {p.stem for p in tmp_path.glob("*.1")}
    want = _commands(kvagentd_app, "kvagentd") | _commands(kvctl_app, "kvctl")
    assert want <= pages, sorted(want - pages)
    health = (tmp_path / "kvctl-health.1").read_text()
    assert ".TH" in health and "health" in health
