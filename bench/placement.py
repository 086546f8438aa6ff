"""Placement policies against Belady's optimum, on production-style and edge-agent traces, and
the cost of a round at 10k, 100k and 1M stored blocks.

    OMP_NUM_THREADS=1 python -m bench.placement [--quick]
    python -m bench.placement --trace conversation_trace.jsonl --block-tokens 512 \\
        --hot 0.05,0.1 --warm 0.35 --out results.json
    python -m bench.placement --trace /var/lib/kvagentd/dumps/trace-....jsonl --hot 0.3

A replay of given traces writes bench/results/placement-trace.json (the standard run writes
placement.json); a daemon trace dump carries the daemon's block size.

Every run replays a trace through `bench.placement_sim.replay.simulate`, which drives the
daemon's own PlacementService (AccessStats, policy, heat map, prefetcher, apply step, fed by an
AccessFeed) over a simulated store. Per policy: hot hits over all accesses and over
re-accesses, hot-or-warm hits over re-accesses, the optimum (MIN over hot, and over hot + warm),
the share of the LRU -> optimum gap closed, bytes moved between tiers (and per hit gained over
LRU), decision CPU time per accessed block, simulator speed. Capacities given as fractions
(< 1) are of the trace's distinct blocks; warm as a fraction is of hot (the `kv.warm_ratio`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from bench.common import Goal, Result, print_table, write_result
from bench.placement_sim.optimum import belady
from bench.placement_sim.replay import SimClock, SimResult, simulate
from bench.placement_sim.request_trace import RequestTrace, read_trace, write_jsonl
from bench.placement_sim.store import SimStore
from bench.placement_sim.workloads import (edge_agent, multiturn, pure_scan, seed_workload,
                                           shifting_popularity)
from kvagentd.config import PlacementConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.base import Capacities
from kvagentd.kvcache.placement.policy import POLICIES

COMMAND = "OMP_NUM_THREADS=1 python -m bench.placement"
BYTES_PER_TOKEN = 23_040  # SmolLM2-135M KV, bf16: 30 layers x 2 x 3 heads x 64 x 2 bytes
FILE_BLOCK_TOKENS = 512  # tokens per block of published traces (Mooncake's)
DEFAULT_POLICY = PlacementConfig().policy


@dataclass(frozen=True, slots=True)
class Case:
    """One trace at one capacity."""

    trace: RequestTrace
    caps: Capacities
    label: str  # e.g. "hot 5%"
    block_bytes: int


def _caps(trace: RequestTrace, hot: float, warm: float) -> Capacities:
    distinct = int(np.unique(trace.blocks).size)
    h = int(hot * distinct) if hot < 1 else int(hot)
    w = int(warm * h) if warm < 1 else int(warm)
    return Capacities(max(h, 1), max(w, 0))


def _label(hot: float) -> str:
    return f"hot {100 * hot:g}%" if hot < 1 else f"hot {int(hot)} blocks"


STEADY_HOURS = 3  # the steady-state case: the production-style service for this long


def standard_cases(quick: bool, warm: float) -> list[tuple[str, Case]]:
    """(goal group, case): the production-style trace at 5 % and 10 % (goals), its ablation
    without per-user pace, the same service for `STEADY_HOURS` at the first hour's
    capacities (the learned model past its cold start, and the conversations that come back
    after an hour or more), the edge agent, and the first traces."""
    bb = 16 * BYTES_PER_TOKEN
    n = 1500 if quick else 12_000
    dur = 450.0 if quick else 3600.0
    mt = multiturn(0, duration_s=dur, requests=n)
    iid = multiturn(0, duration_s=dur, requests=n, same_pace=False)
    edge = edge_agent(0, duration_s=600.0 if quick else 3600.0)
    seed = seed_workload(0, duration_s=600.0 if quick else 3600.0)
    out = []
    mt_caps = {hot: _caps(mt, hot, warm) for hot in (0.05, 0.10)}
    for hot, caps in mt_caps.items():
        out.append(("multiturn", Case(mt, caps, _label(hot), bb)))
    if not quick:
        for hot in (0.05, 0.10):
            out.append(("ablation", Case(iid, _caps(iid, hot, warm), _label(hot), bb)))
        long = multiturn(0, duration_s=STEADY_HOURS * dur, requests=STEADY_HOURS * n)
        long = replace(long, name=f"multiturn-{STEADY_HOURS}h")
        for hot, caps in mt_caps.items():  # the first hour's: the same box, running longer
            out.append(("steady", Case(long, caps, f"hot {caps.hot} blocks "
                                       f"({100 * hot:g}% of the first hour's)", bb)))
    for hot in (640.0, 960.0):  # 0.8x and 1.2x the ticking sessions' ~800 blocks
        out.append(("edge", Case(edge, _caps(edge, hot, warm), _label(hot), bb)))
    out.append(("seed", Case(seed, Capacities(400, 140), "hot 400 blocks", bb)))
    if not quick:
        out.append(("other", Case(pure_scan(0), Capacities(256, 90), "hot 256 blocks", bb)))
        shift = shifting_popularity(0)
        out.append(("other", Case(shift, Capacities(600, 210), "hot 600 blocks", bb)))
    return out


def file_cases(paths: Sequence[str], hots: Sequence[float], warm: float,
               block_tokens: int | None, bytes_per_token: int | None) -> list[tuple[str, Case]]:
    """Cases of trace files. A block's bytes: `block_tokens` x `bytes_per_token` where either
    is given, else the block size a daemon trace's header gives, else 512 tokens (Mooncake's
    blocks) of SmolLM2-135M's KV."""
    out = []
    for p in paths:
        tr = read_trace(p)
        if block_tokens is None and bytes_per_token is None and tr.block_size is not None:
            block_bytes = tr.block_size.bytes
        else:
            block_bytes = (block_tokens or FILE_BLOCK_TOKENS) * (bytes_per_token
                                                                 or BYTES_PER_TOKEN)
        for hot in hots:
            out.append(("file", Case(tr, _caps(tr, hot, warm), _label(hot), block_bytes)))
    return out


# ------------------------------------------------------------------------------------------
# replay
# ------------------------------------------------------------------------------------------

def run_case(case: Case, policies: Sequence[str]) -> dict[str, object]:
    tr, caps = case.trace, case.caps
    opt_hot = belady(tr.blocks, caps.hot)
    opt_both = belady(tr.blocks, caps.hot + caps.warm)
    runs: dict[str, SimResult] = {}
    for pol in policies:
        runs[pol] = simulate(tr, pol, caps, block_bytes=case.block_bytes)
        print(f"  {tr.name:11s} {case.label:16s} {pol:14s} "
              f"{runs[pol].accesses_per_s:8.0f} accesses/s", file=sys.stderr, flush=True)
    lru = runs.get("lru")
    rows = {}
    for pol, r in runs.items():
        d = r.as_dict()
        gap = opt_hot.hit_rate_reaccess - (lru.hot_hit_rate_reaccess if lru else 0.0)
        d["gap_closed"] = ((r.hot_hit_rate_reaccess - lru.hot_hit_rate_reaccess) / gap
                           if lru is not None and gap > 1e-9 else None)
        if lru is not None:
            d["bytes_vs_lru"] = (r.counters.bytes_migrated / lru.counters.bytes_migrated
                                 if lru.counters.bytes_migrated else None)
            gained = r.counters.hot_hits - lru.counters.hot_hits
            d["hot_hits_gained"] = gained
            d["bytes_per_hit_gained"] = ((r.counters.bytes_migrated
                                          - lru.counters.bytes_migrated) / gained
                                         if gained > 0 else None)
        rows[pol] = d
    return {"trace": tr.name, "shape": tr.summary(), "capacity": case.label,
            "capacity_blocks": {"hot": caps.hot, "warm": caps.warm},
            "block_bytes": case.block_bytes,
            "optimum": {"hot_hit_rate_all": opt_hot.hit_rate,
                        "hot_hit_rate_reaccess": opt_hot.hit_rate_reaccess,
                        "hot_warm_hit_rate_reaccess": opt_both.hit_rate_reaccess},
            "policies": rows}


def _pct(x: object) -> str:
    return "-" if x is None else f"{100 * float(x):.1f}%"  # type: ignore[arg-type]


def print_runs(results: list[dict[str, object]]) -> None:
    rows = []
    for res in results:
        opt = res["optimum"]
        assert isinstance(opt, dict)
        pols = res["policies"]
        assert isinstance(pols, dict)
        for pol, d in pols.items():
            rows.append([res["trace"], res["capacity"], pol, _pct(d["hot_hit_rate_all"]),
                         _pct(d["hot_hit_rate_reaccess"]), _pct(d["hot_warm_hit_rate_reaccess"]),
                         _pct(opt["hot_hit_rate_reaccess"]),
                         _pct(opt["hot_warm_hit_rate_reaccess"]), _pct(d.get("gap_closed")),
                         f"{d['bytes_migrated'] / 2**30:.1f}",
                         "-" if d.get("bytes_vs_lru") is None else f"{d['bytes_vs_lru']:.2f}",
                         "-" if d.get("bytes_per_hit_gained") is None
                         else f"{d['bytes_per_hit_gained'] / 2**20:.1f}",
                         d["cold_stalls"], f"{d['decision_us_per_accessed_block']:.2f}",
                         f"{d['sim_accesses_per_s'] / 1000:.0f}k"])
    print_table(["trace", "capacity", "policy", "hot/all", "hot/re", "hot+warm/re",
                 "OPT hot/re", "OPT h+w/re", "gap closed", "moved GiB", "x LRU bytes",
                 "MiB/hit gained", "cold stalls", "decide us/acc", "sim acc/s"], rows,
                title="Policies vs the offline optimum (hit rates over all accesses / over "
                      "re-accesses; gap closed: share of LRU -> optimum in hot hits)")


# ------------------------------------------------------------------------------------------
# round cost
# ------------------------------------------------------------------------------------------

def round_cost(stored: int, policy: str, accesses: int = 1000, rounds: int = 12,
               seed: int = 0) -> dict[str, float]:
    """A store of `stored` blocks (1 % hot, 0.5 % warm, the rest cold), every block known to
    placement; each round `accesses` block accesses (a third new) then a round. Returns the
    mean decision CPU time per round and per accessed block, over rounds that demoted."""
    rng = np.random.default_rng(seed)
    n_new = accesses // 3
    total = stored + rounds * n_new + 1
    keys = [i.to_bytes(16, "big") for i in range(total)]
    hot, warm = max(64, stored // 100), max(32, stored // 200)
    clock = SimClock(0.0)
    feed = AccessFeed(capacity=1 << 20, clock=clock)
    store = SimStore(Capacities(hot, warm), total, keys, clock=clock,
                     access_listener=feed.record, session_names=["s"], seed=seed)
    store.preload_cold(np.arange(stored), 0.0)
    # fill hot and warm, and let placement know every stored block
    store.access(np.arange(warm), 0)
    store.demote(keys[:warm], Tier.WARM)
    store.access(np.arange(warm, warm + hot - 1), 0)
    svc = PlacementService(store, feed, PlacementConfig(policy=policy, trace_capacity=0),
                           clock=clock, seed=seed)
    svc.ingest()
    svc.stats.ensure_rows(keys[:stored])
    per_round, per_access = [], []
    nxt = stored
    for r in range(rounds):
        clock.t = 10.0 * (r + 1)
        old = rng.integers(0, stored, size=accesses - n_new)
        ids = np.concatenate([old, np.arange(nxt, nxt + n_new)])
        nxt += n_new
        for chunk in np.array_split(ids, max(1, accesses // 25)):  # requests of ~25 blocks
            store.access(chunk, 0)
        clock.t += 0.5
        svc.run_round()
        rr = svc.last_round
        assert rr is not None
        if rr.moves and r >= 2:
            per_round.append(rr.decision_s)
            per_access.append(rr.decision_s / max(1, rr.accessed))
    return {"stored_blocks": float(stored), "accesses_per_round": float(accesses),
            "decision_ms_per_round": 1e3 * float(np.median(per_round)) if per_round else 0.0,
            "decision_us_per_accessed_block":
                1e6 * float(np.median(per_access)) if per_access else 0.0,
            "rows_known": float(len(svc.stats))}


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------

def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def main(argv: Sequence[str] | None = ()) -> int:
    """`argv=None`: the command line; the default `()` (as `python -m bench` calls it): the
    standard run, or the smoke run when `KVAGENTD_BENCH_QUICK=1`."""
    if argv == () and os.environ.get("KVAGENTD_BENCH_QUICK") == "1":
        argv = ["--quick"]
    ap = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run (shorter traces)")
    ap.add_argument("--trace", action="append", default=[],
                    help="replay this trace file instead of the synthetic ones (request JSON "
                         "lines, or a daemon dump .jsonl/.npz); repeatable")
    ap.add_argument("--hot", type=_floats, default=[0.05, 0.10],
                    help="hot capacities for --trace: fractions of distinct blocks or counts")
    ap.add_argument("--warm", type=float, default=0.35,
                    help="warm capacity: a fraction of hot (< 1) or a count")
    ap.add_argument("--block-tokens", type=int, default=None,
                    help="tokens per block of --trace files (default: the daemon's, from a "
                         "trace dump's header; else 512, as Mooncake's traces)")
    ap.add_argument("--bytes-per-token", type=int, default=None,
                    help="KV bytes per token (default: the daemon's, from a trace dump's "
                         "header; else SmolLM2-135M, bf16)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="policies to replay (default: all; lru is the baseline)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results JSON here")
    ap.add_argument("--write-traces", type=Path, default=None,
                    help="write the synthetic traces as request JSON lines into this folder")
    ap.add_argument("--no-round-cost", action="store_true", help="skip the round cost table")
    args = ap.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    if unknown := [p for p in policies if p not in POLICIES]:
        ap.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if "lru" not in policies:
        policies.insert(0, "lru")
    if args.trace:
        try:
            cases = file_cases(args.trace, args.hot, args.warm, args.block_tokens,
                               args.bytes_per_token)
        except (OSError, ValueError) as exc:
            print(f"cannot read trace: {exc}", file=sys.stderr)
            return 2
    else:
        cases = standard_cases(args.quick, args.warm)
    if args.write_traces is not None:
        for tr in {id(c.trace): c.trace for _, c in cases}.values():
            write_jsonl(tr, args.write_traces / f"{tr.name}.jsonl")
    results = []
    groups: dict[str, list[dict[str, object]]] = {}
    for group, case in cases:
        res = run_case(case, policies)
        results.append(res)
        groups.setdefault(group, []).append(res)
    print_runs(results)
    figures: dict[str, object] = {"default_policy": DEFAULT_POLICY, "runs": results}
    goals: list[Goal] = []
    if not args.no_round_cost:
        sizes = (10_000, 100_000) if args.quick else (10_000, 100_000, 1_000_000)
        cost = [dict(round_cost(n, pol), policy=pol)
                for n in sizes for pol in dict.fromkeys(("lru", DEFAULT_POLICY))]
        figures["round_cost"] = cost
        print_table(["policy", "stored blocks", "decision ms/round (1,000 accesses)",
                     "decision us/accessed block"],
                    [[c["policy"], int(c["stored_blocks"]), f"{c['decision_ms_per_round']:.2f}",
                      f"{c['decision_us_per_accessed_block']:.2f}"] for c in cost],
                    title="One round's decision (CPU time), by stored blocks")
        big = [c for c in cost if c["policy"] == DEFAULT_POLICY]
        goals.append(Goal(f"round at {int(big[-1]['stored_blocks'])} stored blocks, 1,000 "
                          f"accesses ({DEFAULT_POLICY})", float(big[-1]["decision_ms_per_round"]),
                          "<=", 5.0, " ms"))
        goals.append(Goal(f"round decision per accessed block, worst size ({DEFAULT_POLICY})",
                          max(float(c["decision_us_per_accessed_block"]) for c in big), "<=",
                          1.0, " us"))
    goals += _goals(groups, policies)
    if args.trace:  # a replay of given traces: its own results file, not the recorded run's
        given = sys.argv[1:] if argv is None else list(argv)
        result = Result("placement-trace", f"{COMMAND} {shlex.join(given)}", figures, goals)
    else:
        result = Result("placement", COMMAND + (" --quick" if args.quick else ""), figures,
                        goals)
    write_result(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"figures": figures,
                                        "goals": [g.as_dict() for g in goals]}, indent=2,
                                       default=str) + "\n")
    return 0 if all(g.passed for g in goals) else 1


def _goals(groups: dict[str, list[dict[str, object]]], policies: list[str]) -> list[Goal]:
    goals: list[Goal] = []
    d = DEFAULT_POLICY

    def pol(res: dict[str, object], name: str) -> dict[str, float]:
        p = res["policies"]
        assert isinstance(p, dict)
        return p[name]  # type: ignore[no-any-return]

    if d in policies:
        for res in groups.get("multiturn", []):
            cap = res["capacity"]
            p = pol(res, d)
            goals.append(Goal(f"multiturn {cap}: {d} share of LRU -> optimum gap closed",
                              float(p["gap_closed"] or 0.0), ">=", 0.5))
            goals.append(Goal(f"multiturn {cap}: {d} bytes moved / LRU's",
                              float(p["bytes_vs_lru"] or 0.0), "<=", 1.3))
            goals.append(Goal(f"multiturn {cap}: {d} decision per accessed block",
                              float(p["decision_us_per_accessed_block"]), "<=", 1.0, " us"))
        for res in groups.get("seed", []):
            goals.append(Goal(f"seed: {d} hot hits on re-accesses - LRU's",
                              100 * (float(pol(res, d)["hot_hit_rate_reaccess"])
                                     - float(pol(res, "lru")["hot_hit_rate_reaccess"])),
                              ">=", 0.0, " pt"))
    speeds = [float(pol(res, p)["sim_accesses_per_s"]) for rs in groups.values() for res in rs
              for p in policies if res["trace"] in ("multiturn", "edge-agent")]
    if speeds:
        goals.append(Goal("simulator: slowest policy on multiturn / edge-agent",
                          min(speeds), ">=", 50_000.0, " accesses/s"))
    return goals


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(None))

