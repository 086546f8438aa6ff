"""Generate the documents made from the code: man pages of `kvagentd` and `kvctl` (from their
command-line definitions, through click-man) and the configuration reference (from the config
classes, `kvagentd config default`).

    python docs/generate.py man DIR          # kvagentd.1, kvctl.1 and one page per command
    python docs/generate.py configuration    # docs/configuration.md (checked in; a test
                                             # fails when it differs from the code)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import typer

ROOT = Path(__file__).resolve().parents[1]


def man_pages(target: Path) -> list[Path]:
    """Write the man pages of both programs into `target`; returns the files written."""
    from click_man.core import write_man_pages

    from kvagentd import __version__
    from kvagentd.__main__ import app as kvagentd_app
    from kvctl.main import app as kvctl_app

    target.mkdir(parents=True, exist_ok=True)
    for name, app in (("kvagentd", kvagentd_app), ("kvctl", kvctl_app)):
        write_man_pages(name, typer.main.get_command(app), version=__version__,
                        target_dir=str(target))
    return sorted(target.glob("*.1"))


def configuration() -> str:
    """docs/configuration.md: every section and field, the GPU profile's values, the comments
    of the config classes, and what the CPU profile changes."""
    from kvagentd.config.reference import SECTIONS, profile_config, render

    out = ["# Configuration reference", "",
           "Generated from the config classes (`python docs/generate.py configuration`; "
           "`kvagentd config default [--profile gpu|cpu] [--section NAME]` prints the same). "
           "Every field can be overridden from the environment: "
           "`KVAGENTD_<SECTION>__<FIELD>=value` (TOML syntax). Validate a file with "
           "`kvagentd check-config PATH`.", "",
           "The CPU edge profile (`configs/edge-cpu.toml`) differs from the GPU profile below in:",
           ""]
    gpu, cpu = _flat(profile_config("gpu")), _flat(profile_config("cpu"))
    out += [f"- `{k}` = `{cpu[k]!r}` (GPU profile: `{gpu[k]!r}`)" for k in gpu if gpu[k] != cpu[k]]
    out.append("")
    for name in SECTIONS:
        out += [f"## [{name}]", "", "```toml", render("gpu", name).rstrip("\n"), "```", ""]
    return "\n".join(out)


def _flat(obj: object, prefix: str = "") -> dict[str, object]:
    import dataclasses

    out: dict[str, object] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        v, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            out.update(_flat(v, key + "."))
        elif isinstance(v, tuple) and v and dataclasses.is_dataclass(v[0]):
            for i, item in enumerate(v):
                out.update(_flat(item, f"{key}[{i}]."))
        else:
            out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("man")
    m.add_argument("dir", type=Path)
    sub.add_parser("configuration")
    args = p.parse_args(argv)
    if args.what == "man":
        for f in man_pages(args.dir):
            print(f)
    else:
        (ROOT / "docs" / "configuration.md").write_text(configuration(), encoding="utf-8")
        print(ROOT / "docs" / "configuration.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
