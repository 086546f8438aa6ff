"""A per-asset baseline learned from its first healthy hours, so "anomaly" means "unlike this
machine" while the absolute ISO zones still apply.

`Baseline.observe(t, sample)` collects windows diagnosed `none` in zone A/B from the first one
seen until `baseline_s` have passed (and at least `MIN_WINDOWS` were seen); it then freezes
`BaselineStats` (median and 95th percentile of each measure) and keeps them. Windows with a
fault pattern never enter it, so a machine that starts faulty does not learn its fault as
normal. The state is a small JSON file (`path`), written every `SAVE_EVERY` windows and when
learned; a restart continues where it was. `baseline_s = 0` turns it off.

How the diagnosis uses it (see BENCHMARKS.md, "Diagnosis"): a bearing line must reach twice the
machine's normal 95th percentile (6 dB), and the overall RMS counts as elevated once it exceeds
the normal median by 25 % of the B/C zone limit (the change criterion of ISO 10816-3 / 20816-1).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger(__name__)

MIN_WINDOWS = 30
MAX_WINDOWS = 20_000
SAVE_EVERY = 100


@dataclass(frozen=True, slots=True)
class BaselineStats:
    windows: int
    since: float
    until: float
    median: dict[str, float]
    p95: dict[str, float]

    def ratio_p95(self) -> dict[str, float]:
        """95th percentile of each envelope line ratio (keys "ratio:<line>" -> "<line>")."""
        return {k.split(":", 1)[1]: v for k, v in self.p95.items() if k.startswith("ratio:")}


@dataclass(slots=True)
class Baseline:
    baseline_s: float
    path: Path | None = None
    first_t: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    stats: BaselineStats | None = None

    @property
    def state(self) -> str:
        if self.baseline_s <= 0:
            return "off"
        return "learned" if self.stats is not None else "learning"

    @property
    def count(self) -> int:
        return len(next(iter(self.samples.values()), []))

    def observe(self, t: float, sample: dict[str, float], healthy: bool) -> None:
        """Add one window's measures (only while learning, only if `healthy`)."""
        if self.state != "learning":
            return
        if self.first_t is None:
            self.first_t = t
        if healthy and self.count < MAX_WINDOWS:
            for k, v in sample.items():
                self.samples.setdefault(k, []).append(float(v))
        if t - self.first_t >= self.baseline_s and self.count >= MIN_WINDOWS:
            self.stats = BaselineStats(
                windows=self.count, since=self.first_t, until=t,
                median={k: float(np.median(v)) for k, v in self.samples.items()},
                p95={k: float(np.percentile(v, 95)) for k, v in self.samples.items()})
            self.samples = {}
            log.info("baseline.learned", path=str(self.path), windows=self.stats.windows)
            self.save()
        elif healthy and self.count % SAVE_EVERY == 0:
            self.save()

    def as_dict(self) -> dict[str, Any]:
        return {"baseline_s": self.baseline_s, "first_t": self.first_t, "samples": self.samples,
                "stats": asdict(self.stats) if self.stats else None}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.as_dict()), encoding="utf-8")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: Path, baseline_s: float) -> Baseline:
        """The saved baseline at `path`, or a new one (a missing or unreadable file)."""
        b = cls(baseline_s, path)
        if baseline_s <= 0 or not path.is_file():
            return b
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            b.first_t = doc.get("first_t")
            b.samples = {k: [float(x) for x in v] for k, v in (doc.get("samples") or {}).items()}
            st = doc.get("stats")
            if st:
                b.stats = BaselineStats(int(st["windows"]), float(st["since"]),
                                        float(st["until"]), dict(st["median"]), dict(st["p95"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("baseline.unreadable", path=str(path), error=str(exc))
            return cls(baseline_s, path)
        return b
