"""How much of the LRU -> optimum gap the `reuse` score can close on the multi-turn trace when
its model is right, not learned: the ceiling the default's 50 % goal is judged against.

    OMP_NUM_THREADS=1 python -m bench.placement_ceiling [--quick] [--hours N]

The trace generator (`workloads.multiturn_with_truth`) knows what a learning policy cannot
read off the trace: each conversation's application and each user's own pace. Three models
feed the same `reuse_density` (LHD's hit density) and the same daemon placement code:
- `learned`: the default, `reuse_model` (counts and smoothed gaps, as the daemon learns them);
- `causal`: the generator's parameters, used as an online policy at best could: the true
  odds of another turn (by application and turn), and for the time to the next turn the
  Bayes predictive given the gaps the conversation has shown so far (the user's pace drawn
  log-normally around the application's, each gap log-normally around the pace): before the
  first gap the application's spread of paces and gaps, then narrowing to the user's;
- `clairvoyant`: the true odds and each user's own pace from the first turn on (what no online
  policy can know: a new user's pace).
System-prompt blocks (shared by sessions; every policy keeps them hot) keep the learned model.
`--hours N`: the same service for N hours at the first hour's capacities (the box running
longer: the learned model past its cold start), into `placement_ceiling-Nh.json`.
Gap closed = (policy - LRU) / (OPT - LRU) in hot hits over re-accesses, OPT Belady's MIN.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import numpy as np

from bench.common import Goal, Result, print_table, write_result
from bench.placement import BYTES_PER_TOKEN, _caps
from bench.placement_sim.optimum import belady
from bench.placement_sim.replay import simulate
from bench.placement_sim.workloads import MultiturnTruth, multiturn_with_truth
from kvagentd.config import PlacementConfig
from kvagentd.kvcache.placement.policy import ReusePolicy
from kvagentd.kvcache.placement.reuse import ReuseModel, ReuseTables, reuse_model
from kvagentd.kvcache.placement.service import params_of
from kvagentd.kvcache.placement.stats import CLASSES, AccessStats

GOAL_GAP = 0.5  # the goal for the default at hot 5 %


class _Truth:
    """The generator's parameters, indexed for a round's rows."""

    def __init__(self, truth: MultiturnTruth) -> None:
        self.t = truth
        apps = truth.apps
        self.first = np.array([a.continue_first for a in apps])
        self.later = np.array([a.continue_later for a in apps])
        self.m0 = np.log([a.pace_s for a in apps])  # users' log pace: mean
        self.tau2 = np.array([a.pace_sigma for a in apps]) ** 2  # ... and variance
        self.w2 = np.array([a.turn_sigma for a in apps]) ** 2  # a gap around the pace
        self.log_pace = np.log(np.maximum(np.asarray(truth.pace), 1e-3))
        # every conversation's turns, flattened, with the running sum of its log gaps
        lens = np.array([len(x) for x in truth.turns], np.int64)
        self.start = np.concatenate(([0], np.cumsum(lens)[:-1]))
        times = np.concatenate([np.asarray(x, np.float64) for x in truth.turns])
        self.key = np.repeat(np.arange(lens.size), lens) * 1e7 + times  # (conversation, time)
        lg = np.zeros(times.size)
        for c, x in enumerate(truth.turns):
            if len(x) > 1:
                s = int(self.start[c])
                lg[s + 1:s + len(x)] = np.cumsum(np.log(np.diff(np.asarray(x))))
        self.cum_log_gap = lg

    def rows(self, stats: AccessStats, rows: np.ndarray, q: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For `rows`: which are conversation blocks, their application, conversation and
        true odds of another turn (else `q`)."""
        keys = stats.keys[rows].tolist()
        bid = np.fromiter((-1 if k is None else int.from_bytes(k, "big") for k in keys),
                          np.int64, len(keys))
        safe = np.maximum(bid, 0)
        conv = np.where(bid >= 0, self.t.conversation[safe], -1)
        mine = conv >= 0
        app = np.where(mine, self.t.app[safe], 0)
        turn = np.minimum(stats.count[rows] + stats.base[rows], CLASSES)
        q = np.where(mine, np.where(turn <= 1, self.first[app], self.later[app]), q)
        return mine, app, np.maximum(conv, 0), q


def causal_model(truth: _Truth) -> ReuseModel:
    def model(stats: AccessStats, rows: np.ndarray, tables: ReuseTables,
              rec: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, mu, s = reuse_model(stats, rows, tables, rec)
        mine, app, conv, q = truth.rows(stats, rows, q)
        # the conversation's turns up to the block's last use: n gaps seen, their log sum
        g = np.searchsorted(truth.key, conv * 1e7 + stats.last_t[rows] + 1e-6, "right") - 1
        g = np.maximum(g, 0)
        n = g - truth.start[conv]
        prec = 1.0 / truth.tau2[app] + n / truth.w2[app]
        post = (truth.m0[app] / truth.tau2[app] + truth.cum_log_gap[g] / truth.w2[app]) / prec
        mu = np.where(mine, post, mu).astype(np.float32)
        s = np.where(mine, np.sqrt(1.0 / prec + truth.w2[app]), s).astype(np.float32)
        return q, mu, s
    return model


def clairvoyant_model(truth: _Truth) -> ReuseModel:
    def model(stats: AccessStats, rows: np.ndarray, tables: ReuseTables,
              rec: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, mu, s = reuse_model(stats, rows, tables, rec)
        mine, app, conv, q = truth.rows(stats, rows, q)
        mu = np.where(mine, truth.log_pace[conv], mu).astype(np.float32)
        s = np.where(mine, np.sqrt(truth.w2[app]), s).astype(np.float32)
        return q, mu, s
    return model


def main(argv: Sequence[str] | None = ()) -> int:
    """`argv=None`: the command line; `()` (as `python -m bench` calls it): the standard run,
    or the smoke run when `KVAGENTD_BENCH_QUICK=1`."""
    if argv == () and os.environ.get("KVAGENTD_BENCH_QUICK") == "1":
        argv = ["--quick"]
    ap = argparse.ArgumentParser(prog="python -m bench.placement_ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a shortened trace (smoke run)")
    ap.add_argument("--hours", type=int, default=1,
                    help="the same service for this many hours, at the first hour's "
                         "capacities (steady state; writes placement_ceiling-Nh.json)")
    args = ap.parse_args(argv)
    if args.hours < 1:
        ap.error("--hours must be at least 1")
    n, dur = (1500, 450.0) if args.quick else (12_000, 3600.0)
    trace, gen = multiturn_with_truth(0, duration_s=args.hours * dur, requests=args.hours * n)
    first_hour = trace if args.hours == 1 else multiturn_with_truth(0, duration_s=dur,
                                                                    requests=n)[0]
    truth = _Truth(gen)
    models = {"learned": reuse_model, "causal": causal_model(truth),
              "clairvoyant": clairvoyant_model(truth)}
    bb = 16 * BYTES_PER_TOKEN
    figures: dict[str, dict[str, float]] = {}
    rows = []
    of_first = " of the first hour's" if args.hours > 1 else ""
    for hot in (0.05, 0.10):
        caps = _caps(first_hour, hot, 0.35)  # with --hours, the same box running longer
        opt = belady(trace.blocks, caps.hot).hit_rate_reaccess
        lru = simulate(trace, "lru", caps, block_bytes=bb).hot_hit_rate_reaccess
        label = f"hot {100 * hot:g}%{of_first}"
        figures[label] = {"lru": lru, "optimum": opt, "hot_blocks": caps.hot}
        rows.append([label, "lru", f"{100 * lru:.1f}%", f"{100 * opt:.1f}%", "-"])
        for name, model in models.items():
            policy = ReusePolicy(params_of(PlacementConfig()), model)  # as the daemon's
            r = simulate(trace, "reuse", caps, block_bytes=bb, instance=policy)
            hit = r.hot_hit_rate_reaccess
            gap = (hit - lru) / (opt - lru) if opt - lru > 1e-9 else 0.0
            figures[label][name] = hit
            figures[label][f"{name}_gap_closed"] = gap
            rows.append([label, f"reuse ({name})", f"{100 * hit:.1f}%", f"{100 * opt:.1f}%",
                         f"{100 * gap:.1f}%"])
            print(f"  {label} {name}: {100 * gap:.1f}% of the gap", file=sys.stderr, flush=True)
    print_table(["capacity", "policy (model)", "hot/re", "OPT hot/re", "gap closed"], rows,
                title=f"multiturn, {args.hours * dur / 3600:g} h ({len(trace)} requests): "
                      "the reuse score with a learned, a causal and a clairvoyant model")
    five = figures[f"hot 5%{of_first}"]
    name = "placement_ceiling" + (f"-{args.hours}h" if args.hours > 1 else "")
    result = Result(name, "OMP_NUM_THREADS=1 python -m bench.placement_ceiling"
                    + (" --quick" if args.quick else "")
                    + (f" --hours {args.hours}" if args.hours > 1 else ""),
                    {"trace": trace.summary(), **figures})
    result.goals = [
        Goal("multiturn hot 5 %: default (learned) closes the LRU -> optimum gap",
             five["learned_gap_closed"], ">=", GOAL_GAP)]
    write_result(result)
    return 0 if all(g.passed for g in result.goals) else 1


if __name__ == "__main__":
    sys.exit(main(None))
