"""Recorded vibration signals on disk, with their unit and sample rate.

`load_recording(path, sample_rate_hz=None, unit=None)` reads
- `.wav` (scipy): the sample rate is in the file; integer PCM is scaled to +-1.0 full scale and
  then multiplied by the sidecar's `scale` (units per full scale; default 1). First channel.
- `.csv`: the first numeric column, or the second when the first column's header is a time
  (`t`, `time`, `time_s`, `timestamp`); `#` comment lines may state `sample_rate_hz`, `unit`
  and `rpm` as `# key: value` or `# key = value`; a header cell may carry the unit in brackets
  (`accel [g]`); without a stated rate a time column gives it (1 / mean step).
- `.npy`: a 1-D float array (or the first column of a 2-D one); its metadata in a JSON sidecar
  next to it, `NAME.npy.json` or `NAME.json`: `{"sample_rate_hz": 12000, "unit": "g",
  "rpm": 1797}` (`sample_rate` is accepted for `sample_rate_hz`).
A sidecar is read for every format (it may also carry `scale` and `rpm`).

Units: `g` and `m/s^2` are accelerations (g is converted to m/s^2 with 9.80665), `mm/s` is a
velocity. A rate or unit given by the caller that contradicts the file raises `RecordingError`;
so does a file that states neither and a caller that gives neither. The samples come back in
the unit the features expect (m/s^2 or mm/s) with `kind` "acceleration" or "velocity".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

G = 9.80665
UNITS: dict[str, tuple[Literal["acceleration", "velocity"], float]] = {
    "g": ("acceleration", G), "m/s^2": ("acceleration", 1.0), "mm/s": ("velocity", 1.0)}
_UNIT_ALIASES = {"g": "g", "m/s^2": "m/s^2", "m/s2": "m/s^2", "m/s**2": "m/s^2", "ms-2": "m/s^2",
                 "mm/s": "mm/s", "mms-1": "mm/s"}
_TIME_HEADERS = {"t", "time", "time_s", "timestamp", "t_s", "seconds"}
_META_RE = re.compile(r"^#\s*([A-Za-z_]+)\s*[:=]\s*(.+?)\s*$")
_BRACKET_UNIT_RE = re.compile(r"[\[(]\s*([^\])]+?)\s*[\])]")
RATE_TOLERANCE = 0.005


class RecordingError(ValueError):
    """The file cannot be read, or its unit/rate is missing or contradicts what was given."""


@dataclass(frozen=True, slots=True)
class Recording:
    """Samples in m/s^2 (acceleration) or mm/s (velocity), with where each fact came from."""

    path: Path
    samples: np.ndarray
    sample_rate_hz: float
    kind: Literal["acceleration", "velocity"]
    unit: str  # the unit the file's samples were in before conversion
    rpm: float | None = None  # when the file states it
    # fact -> "file" | "sidecar" | "given" | "config"
    provenance: dict[str, str] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.samples.size / self.sample_rate_hz


def normalize_unit(text: str) -> str:
    """Canonical unit name ("g", "m/s^2", "mm/s"); raises RecordingError."""
    key = text.strip().lower().replace(" ", "").replace("²", "^2")
    if key not in _UNIT_ALIASES:
        raise RecordingError(f"unit {text!r}: use g, m/s^2 or mm/s")
    return _UNIT_ALIASES[key]


def sidecar_path(path: Path) -> Path | None:
    for cand in (path.with_name(path.name + ".json"), path.with_suffix(".json")):
        if cand.is_file():
            return cand
    return None


def _read_sidecar(path: Path) -> dict[str, Any]:
    side = sidecar_path(path)
    if side is None:
        return {}
    try:
        doc = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecordingError(f"{side}: not a readable JSON object ({exc})") from None
    if not isinstance(doc, dict):
        raise RecordingError(f"{side}: not a JSON object")
    if "sample_rate" in doc and "sample_rate_hz" not in doc:
        doc["sample_rate_hz"] = doc["sample_rate"]
    return doc


def load_recording(path: str | Path, *, sample_rate_hz: float | None = None,
                   unit: str | None = None, fallback_rate_hz: float | None = None,
                   fallback_unit: str | None = None) -> Recording:
    """Read `path` (see module docstring). `sample_rate_hz`/`unit`: what the caller states
    (checked against the file); `fallback_*`: used only where neither the file nor the caller
    says (a configured asset's defaults)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".npy", ".csv", ".wav"):
        raise RecordingError(f"{p}: unsupported format {suffix!r} (use .npy, .csv or .wav)")
    if not p.is_file():
        raise RecordingError(f"{p}: no such file")
    side = _read_sidecar(p)
    stated: dict[str, Any] = {}
    prov: dict[str, str] = {}
    try:
        if suffix == ".npy":
            x = np.load(p, allow_pickle=False)
            x = np.asarray(x, dtype=np.float64)
            if x.ndim == 2:
                x = x[:, 0]
            x = x.reshape(-1)
        elif suffix == ".wav":
            x, file_rate = _read_wav(p)
            stated["sample_rate_hz"] = file_rate
            prov["sample_rate_hz"] = "file"
        else:
            x, meta = _read_csv(p)
            for k, v in meta.items():
                stated[k] = v
                prov[k] = "file"
    except (OSError, ValueError) as exc:
        if isinstance(exc, RecordingError):
            raise
        raise RecordingError(f"{p}: cannot read samples ({exc})") from None
    for key in ("sample_rate_hz", "unit", "rpm", "scale"):
        if key in side:
            if key in stated and not _same(key, stated[key], side[key]):
                raise RecordingError(f"{p}: the file states {key} {stated[key]} but its sidecar "
                                     f"says {side[key]}")
            stated.setdefault(key, side[key])
            prov.setdefault(key, "sidecar")
    if "sample_rate_hz" not in stated and sample_rate_hz is None and fallback_rate_hz:
        stated["sample_rate_hz"], prov["sample_rate_hz"] = fallback_rate_hz, "config"
    if "unit" not in stated and unit is None and fallback_unit:
        stated["unit"], prov["unit"] = fallback_unit, "config"
    rate = _resolve_rate(p, stated.get("sample_rate_hz"), sample_rate_hz, prov)
    unit_name = _resolve_unit(p, stated.get("unit"), unit, prov)
    if x.size == 0:
        raise RecordingError(f"{p}: holds no samples")
    if not np.all(np.isfinite(x)):
        raise RecordingError(f"{p}: {int(np.count_nonzero(~np.isfinite(x)))} samples are not "
                             f"finite")
    kind, factor = UNITS[unit_name]
    scale = float(stated.get("scale", 1.0))
    rpm = float(stated["rpm"]) if stated.get("rpm") not in (None, "") else None
    return Recording(p, x * factor * scale, rate, kind, unit_name, rpm, prov)


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "unit":
        return normalize_unit(str(a)) == normalize_unit(str(b))
    return math.isclose(float(a), float(b), rel_tol=RATE_TOLERANCE)


def _resolve_rate(p: Path, stated: Any, given: float | None, prov: dict[str, str]) -> float:
    if stated is not None:
        try:
            rate = float(stated)
        except (TypeError, ValueError):
            raise RecordingError(f"{p}: sample rate {stated!r} is not a number") from None
        if given is not None and not math.isclose(rate, given, rel_tol=RATE_TOLERANCE):
            raise RecordingError(f"{p}: the file states {rate:g} Hz but {given:g} Hz was given; "
                                 f"drop the option or fix the file")
    elif given is not None:
        rate = float(given)
        prov["sample_rate_hz"] = "given"
    else:
        raise RecordingError(f"{p}: the file does not state its sample rate; give it "
                             f"(--sample-rate, or sample_rate_hz in a {p.name}.json sidecar)")
    if not (rate > 0 and math.isfinite(rate)):
        raise RecordingError(f"{p}: sample rate {rate!r} must be positive")
    return rate


def _resolve_unit(p: Path, stated: Any, given: str | None, prov: dict[str, str]) -> str:
    if stated is not None:
        name = normalize_unit(str(stated))
        if given is not None and normalize_unit(given) != name:
            raise RecordingError(f"{p}: the file states unit {name} but {given} was given")
        return name
    if given is None:
        raise RecordingError(f"{p}: the file does not state its unit; give it (--unit g|m/s^2|"
                             f"mm/s, or unit in a {p.name}.json sidecar)")
    prov["unit"] = "given"
    return normalize_unit(given)


def _read_wav(p: Path) -> tuple[np.ndarray, float]:
    from scipy.io import wavfile

    rate, data = wavfile.read(str(p), mmap=False)
    x = np.asarray(data)
    if x.ndim == 2:
        x = x[:, 0]
    if x.dtype.kind == "i":
        x = x.astype(np.float64) / float(2 ** (8 * x.dtype.itemsize - 1))
    elif x.dtype.kind == "u":  # 8-bit PCM is unsigned, centred on 128
        x = (x.astype(np.float64) - 128.0) / 128.0
    return x.astype(np.float64), float(rate)


def _read_csv(p: Path) -> tuple[np.ndarray, dict[str, Any]]:
    meta: dict[str, Any] = {}
    header: list[str] | None = None
    rows: list[list[float]] = []
    with p.open(encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                m = _META_RE.match(line)
                if m:
                    key = m.group(1).lower()
                    key = {"sample_rate": "sample_rate_hz", "fs": "sample_rate_hz",
                           "rate": "sample_rate_hz"}.get(key, key)
                    if key in ("sample_rate_hz", "unit", "rpm"):
                        meta[key] = m.group(2)
                continue
            cells = [c.strip() for c in line.split(",")]
            try:
                rows.append([float(c) for c in cells[:2]])
            except ValueError:
                if rows or header is not None:
                    raise RecordingError(f"{p}: line {line[:40]!r} is not numeric") from None
                header = cells
    if not rows:
        return np.zeros(0), meta
    time_first = header is not None and header[0].lower() in _TIME_HEADERS and len(rows[0]) > 1
    col = 1 if time_first else 0
    if any(len(r) <= col for r in rows):
        raise RecordingError(f"{p}: rows without a value in column {col + 1}")
    x = np.asarray([r[col] for r in rows], dtype=np.float64)
    if header is not None and len(header) > col and "unit" not in meta:
        m = _BRACKET_UNIT_RE.search(header[col])
        if m:
            meta["unit"] = m.group(1)
    if time_first and "sample_rate_hz" not in meta and len(rows) > 2:
        t = np.asarray([r[0] for r in rows])
        if np.any(np.diff(t) <= 0):
            raise RecordingError(f"{p}: the time column does not increase")
        # NOTE: the mean step: written times are rounded, one step can be off by the rounding.
        step = float(t[-1] - t[0]) / (t.size - 1)
        meta["sample_rate_hz"] = 1.0 / step
    return x, meta
