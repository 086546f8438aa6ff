"""Shared helpers for benchmarks: a printed table and a JSON result file per benchmark.

Each benchmark module `bench/NAME.py` has `main()`, is runnable as `python -m bench.NAME`, prints
a table and writes `bench/results/NAME.json` via `write_result`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

from kvagentd.daemon import log as _log

# NOTE: benchmarks time the data path, not log formatting: only warnings and errors are printed
# (per-block DEBUG events would otherwise dominate short operations).
_log.configure("warning")

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Goal:
    """A measured figure against a target: `value op target` (op is ">=" or "<=")."""

    name: str
    value: float
    op: str
    target: float
    unit: str = ""

    @property
    def passed(self) -> bool:
        return self.value >= self.target if self.op == ">=" else self.value <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "op": self.op, "target": self.target,
                "unit": self.unit, "pass": self.passed}


@dataclass(slots=True)
class Result:
    name: str
    command: str
    figures: dict[str, Any] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)


def add_agent_run_options(p: argparse.ArgumentParser, *, threads: int = 1) -> None:
    """The options of a benchmark that runs the agent on the embedded model (store sizes,
    model precision and threads, the agent's token limits); `threads`: the default of
    `--threads`."""
    p.add_argument("--assessment-tokens", type=int, default=24)
    p.add_argument("--session-budget", type=int, default=1536)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--hot-mib", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=threads,
                   help="torch threads (0: torch default)")
    p.add_argument("--o-direct", action="store_true")


def timeit(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_result(result: Result) -> Path:
    """Print the goals and write bench/results/NAME.json; returns the path."""
    if result.goals:
        print_table(["goal", "value", "target", "pass"],
                    [[g.name, f"{g.value:.4g}{g.unit}", f"{g.op} {g.target:g}{g.unit}",
                      "PASS" if g.passed else "FAIL"] for g in result.goals], title="Goals")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{result.name}.json"
    doc = {
        "name": result.name,
        "command": result.command,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "figures": result.figures,
        "goals": [g.as_dict() for g in result.goals],
        "pass": all(g.passed for g in result.goals),
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"\nwrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path
