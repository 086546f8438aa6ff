"""The agent at its real cadence on SmolLM2 (CPU): tick latency, skipped ticks, tier hit rates.

Three runs side by side, each a fresh store and state directory over one loaded model, each
`--minutes` of wall time with the product's own APScheduler tick job every `--interval` s
(max_instances=1, coalesce; skipped and missed ticks counted by scheduler listeners):
  (a) ticks only;
  (b) ticks while weekly reports generate back to back at REPORT priority;
  (c) ticks with KV reuse disabled: the store's prefix match always answers "nothing stored",
      so every tick recomputes its whole session prompt.
Tick latency is wall time from the tick's start to its stored assessment. Hit rates are the
blocks each tier supplied to requests (store counters `loaded_hot/warm/cold`).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.agent            # 3 x 10 minutes
    .venv/bin/python -m bench.agent --minutes 1 --runs a,c       # quick look
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Goal, Result, add_agent_run_options, print_table, write_result

ROOT = Path(__file__).resolve().parent.parent


class NoReuseStore:
    """A KVStore view whose prefix match finds nothing: every request recomputes its prompt."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def match_prefix(self, token_ids):
        from kvagentd.kvcache.base import MatchResult

        return MatchResult([], 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def build_store(loaded: Any, directory: Path, args: argparse.Namespace):
    from kvagentd.engine.model import model_geometry
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.kvcache.keys import make_namespace
    from kvagentd.kvcache.store import TieredKVStore

    geometry = model_geometry(loaded.model, args.block_tokens, loaded.dtype)
    ns = make_namespace(loaded.fingerprint, loaded.dtype, args.block_tokens)
    hot = args.hot_mib << 20
    return TieredKVStore(geometry, ns, hot_bytes=hot, warm_bytes=int(hot * 0.35),
                         cold=lambda listener: ColdStore(
                             directory / "cold", geometry, ns, capacity_bytes=8 << 30,
                             segment_bytes=64 << 20, o_direct=args.o_direct, listener=listener))


def run_case(name: str, loaded: Any, args: argparse.Namespace, *, reports: bool,
             reuse: bool) -> dict[str, Any]:
    from apscheduler.schedulers.background import BackgroundScheduler

    from kvagentd.agent.agent import Agent
    from kvagentd.config import AgentConfig, AssetConfig, ExecutorConfig, FaultConfig
    from kvagentd.engine.service import Engine

    base = ROOT / "var" / "bench-agent"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    store = build_store(loaded, d, args)
    engine = Engine(loaded, store if reuse else NoReuseStore(store), state_dir=d / "engine",
                    executor_config=ExecutorConfig())
    engine.start()
    sched = BackgroundScheduler(timezone="UTC")
    sched.start()
    cfg = AgentConfig(tick_interval_s=args.interval,
                      assessment_max_tokens=args.assessment_tokens,
                      session_token_budget=args.session_budget,
                      report_max_tokens=args.report_tokens,
                      assets=(AssetConfig(fault=FaultConfig(kind="outer_race", onset_s=120.0)),))
    agent = Agent(cfg, engine.executor, sched, d, store_stats=store.stats)
    s0 = store.stats()
    cpu0 = time.process_time()
    agent.start()
    t_end = time.monotonic() + args.minutes * 60.0
    report_ids: list[str] = []
    loads: list[float] = []
    while time.monotonic() < t_end:
        loads.append(os.getloadavg()[0])
        if reports and agent.reports.running() == 0 and agent.assets["pump-1"].ticks >= 3:
            report_ids.append(agent.reports.start("weekly", asset="pump-1"))
        time.sleep(0.25)
    sched.pause()
    cpu_s = time.process_time() - cpu0
    st = agent.assets["pump-1"]
    lat = np.asarray(st.latencies, dtype=float)
    status = agent.status()["assets"]["pump-1"]
    agent.stop()
    s1 = store.stats()
    engine.stop()
    store.close()
    sched.shutdown(wait=False)
    loaded_by = {t: int(s1[f"loaded_{t}"]) - int(s0[f"loaded_{t}"]) for t in ("hot", "warm", "cold")}
    total = sum(loaded_by.values())
    done = [agent.reports.get(r) for r in report_ids]
    out = {
        "run": name, "ticks": int(lat.size), "expected_ticks": int(args.minutes * 60 / args.interval),
        "p50_s": float(np.percentile(lat, 50)) if lat.size else None,
        "p99_s": float(np.percentile(lat, 99)) if lat.size else None,
        "max_s": float(lat.max()) if lat.size else None,
        "skipped": st.skipped, "missed": st.missed, "llm_errors": st.llm_errors,
        "rollovers": st.rollovers, "prompt_tokens_reused": status["prompt_tokens_reused"],
        "prefill_tokens_per_tick": (st.prompt_tokens - st.reused_tokens) / lat.size
        if lat.size else None,
        "cpu_s_per_tick": cpu_s / lat.size if lat.size else None,
        "hot_hit": loaded_by["hot"] / total if total else 0.0,
        "warm_hit": loaded_by["warm"] / total if total else 0.0,
        "cold_hit": loaded_by["cold"] / total if total else 0.0,
        "blocks_loaded": loaded_by,
        "loadavg_1m_mean": float(np.mean(loads)) if loads else None,
        "reports_started": len(report_ids),
        "reports_done": sum(1 for r in done if r and r.get("state") == "done"),
    }
    shutil.rmtree(d, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agent", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=3.0)
    p.add_argument("--runs", default="a,b,c")
    add_agent_run_options(p)
    p.add_argument("--report-tokens", type=int, default=200)
    p.add_argument("--result-name", default="agent", help="bench/results/NAME.json")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model

    loaded = load_model(ModelConfig(source="embedded", dtype=args.dtype, device="cpu",
                                    threads=args.threads), ROOT / "var" / "cache")
    import torch

    print(f"model {loaded.name} dtype {loaded.dtype} threads {torch.get_num_threads()} "
          f"load {loaded.load_s:.1f} s", file=sys.stderr)
    cases = {"a": ("a ticks", False, True), "b": ("b ticks+report", True, True),
             "c": ("c no reuse", False, False)}
    rows = []
    for key in args.runs.split(","):
        name, reports, reuse = cases[key.strip()]
        print(f"running {name} for {args.minutes:g} min ...", file=sys.stderr)
        rows.append(run_case(name, loaded, args, reports=reports, reuse=reuse))
    headers = ["run", "ticks", "p50 s", "p99 s", "max s", "skipped", "missed", "hot", "warm",
               "cold", "reused tok", "prefill tok/tick", "cpu s/tick", "reports", "load"]
    print_table(headers, [[r["run"], r["ticks"], r["p50_s"], r["p99_s"], r["max_s"], r["skipped"],
                           r["missed"], f"{r['hot_hit']:.1%}", f"{r['warm_hit']:.1%}",
                           f"{r['cold_hit']:.1%}", r["prompt_tokens_reused"],
                           r["prefill_tokens_per_tick"], r["cpu_s_per_tick"],
                           f"{r['reports_done']}/{r['reports_started']}",
                           r["loadavg_1m_mean"]] for r in rows],
                title=f"agent ticks every {args.interval:g} s for {args.minutes:g} min per run, "
                      f"SmolLM2 {loaded.dtype}, {torch.get_num_threads()} threads")
    goals = []
    by = {r["run"][0]: r for r in rows}
    if "b" in by and by["b"]["p99_s"] is not None:
        goals += [Goal("(b) tick p99 with a report generating", by["b"]["p99_s"], "<=",
                       args.interval, " s"),
                  Goal("(b) skipped + missed ticks", by["b"]["skipped"] + by["b"]["missed"], "<=",
                       0)]
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python -m bench.agent " + " ".join(argv or sys.argv[1:])
    write_result(Result(args.result_name, cmd.strip(), figures={"runs": rows, "args": vars(args)},
                        goals=goals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
