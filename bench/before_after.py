"""Before and after a change, side by side in one run: `python -m bench.before_after --rev REV`.

Checks out REV in a temporary git worktree and runs the named benchmarks (default: store and
resume) alternately in that tree and in this one (A B B A ...), so that both see the same
machine load. Each benchmark writes its goals to its own tree's `bench/results/NAME.json`;
this collects them and prints, per goal, the median before, the median after and the ratio,
and writes `bench/results/before_after.json`. A figure is "within noise" when the change
moves it by less than `--tolerance` (default 10 %) in the bad direction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import Goal, Result, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]


def _worktree(rev: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"kvagentd-before-{rev[:12]}"
    if not path.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev],
                       check=True, capture_output=True)
    return path


def _run(tree: Path, name: str, quick: bool) -> dict[str, tuple[float, str]]:
    """Run bench NAME with `tree`'s code; (value, op) of its goals by name."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree / 'cli'}")
    if quick:
        env["KVAGENTD_BENCH_QUICK"] = "1"
    out = tree / "bench" / "results" / f"{name}.json"
    out.unlink(missing_ok=True)
    # a benchmark exits non-zero when a goal fails: what counts here is that it wrote results
    subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=tree, env=env, check=False)
    if not out.exists():
        raise SystemExit(f"bench.{name} in {tree} wrote no {out.name}")
    doc = json.loads(out.read_text())
    return {g["name"]: (float(g["value"]), str(g["op"])) for g in doc["goals"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", required=True, help="the revision before the change")
    ap.add_argument("--bench", nargs="+", default=["store", "resume"])
    ap.add_argument("--rounds", type=int, default=2, help="runs of each tree (alternating)")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: KVAGENTD_BENCH_QUICK=1 for benchmarks that know it")
    args = ap.parse_args(argv)
    before = _worktree(args.rev)
    runs: dict[str, dict[str, list[dict[str, tuple[float, str]]]]] = {}
    for name in args.bench:
        runs[name] = {"before": [], "after": []}
        for r in range(args.rounds):
            order = [("before", before), ("after", ROOT)]
            for side, tree in (order if r % 2 == 0 else order[::-1]):
                print(f"\n===== bench.{name} {side} (round {r + 1}) =====", flush=True)
                runs[name][side].append(_run(tree, name, args.quick))
    rows: list[list[object]] = []
    goals: list[Goal] = []
    figures: dict[str, Any] = {"rev_before": args.rev, "loadavg_end": os.getloadavg()}
    for name, sides in runs.items():
        for goal in sides["after"][0]:
            if not all(goal in g for g in sides["before"]):
                continue
            op = sides["after"][0][goal][1]
            b = statistics.median(g[goal][0] for g in sides["before"])
            a = statistics.median(g[goal][0] for g in sides["after"])
            ratio = a / b if b else float("nan")
            # >= goals: higher is better; <= goals: lower is better
            worse = (1 - ratio) if op == ">=" else (ratio - 1)
            figures[f"{name}: {goal}"] = {"before": b, "after": a, "ratio": ratio,
                                          "before_runs": [g[goal][0] for g in sides["before"]],
                                          "after_runs": [g[goal][0] for g in sides["after"]]}
            rows.append([name, goal, b, a, ratio])
            goals.append(Goal(f"{name}: {goal} (worse by, after vs before)", worse, "<=",
                              args.tolerance))
    print_table(["bench", "figure", "before", "after", "after/before"], rows,
                title=f"before ({args.rev}) vs after (this tree), medians of {args.rounds} runs")
    write_result(Result("before_after", "python -m bench.before_after " + " ".join(
        argv if argv is not None else sys.argv[1:]), figures, goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
