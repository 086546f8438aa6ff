"""The CWRU development recordings (`shared/data/cwru-dev/`): where they are and what they hold.

`cwru_dir()` is `$KVAGENTD_CWRU_DIR`, or the first `shared/data/cwru-dev` found beside the
repository or above it. `load_manifest(dir)` returns the manifest's bearing and its files (each
with rpm, sample rate and the true fault); `recording(dir, entry)` reads one file with the rate
and unit the manifest states (acceleration in m/s^2).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvagentd.agent.recordings import Recording, load_recording
from kvagentd.config import BearingConfig

ROOT = Path(__file__).resolve().parent.parent


def cwru_dir() -> Path | None:
    env = os.environ.get("KVAGENTD_CWRU_DIR")
    if env:
        return Path(env)
    for base in (ROOT, *ROOT.parents):
        cand = base / "shared" / "data" / "cwru-dev"
        if (cand / "manifest.json").is_file():
            return cand
    return None


def load_manifest(directory: Path) -> tuple[BearingConfig, list[dict[str, Any]]]:
    doc = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    return BearingConfig(**doc["bearing"]), list(doc["files"])


def recording(directory: Path, entry: dict[str, Any]) -> Recording:
    return load_recording(directory / entry["file"], sample_rate_hz=float(entry["sample_rate_hz"]),
                          unit="m/s^2")
