"""Write-behind's cost on agent tick latency: the same ticks with and without it, side by side.

One loaded model; `--pairs` pairs of runs, each pair one run without write-behind and one
with it (`--wb-interval` s, `--wb-rate` bytes/s), in alternating order so drift on the machine
hits both alike. Each run is a fresh store and state directory with the product's APScheduler
tick job every `--interval` s for `--minutes`; tick latency is wall time from the tick's start
to its stored assessment. Goal (issue 12): tick p99 with write-behind within 5 % of without.
Figures also say what the write-behind did (rounds, blocks and bytes written, round seconds).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.writebehind            # SmolLM2, 2 x 2 x 10 min
    .venv/bin/python -m bench.writebehind --quick                      # smoke: tiny model, 2 x 20 s
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


def build_store(loaded: Any, directory: Path, args: argparse.Namespace, write_behind: bool):
    from kvagentd.engine.model import model_geometry
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.kvcache.keys import make_namespace
    from kvagentd.kvcache.store import TieredKVStore
    from kvagentd.kvcache.store.writebehind import WriteBehindPolicy

    geometry = model_geometry(loaded.model, args.block_tokens, loaded.dtype)
    ns = make_namespace(loaded.fingerprint, loaded.dtype, args.block_tokens)
    hot = args.hot_mib << 20
    policy = WriteBehindPolicy(interval_s=args.wb_interval if write_behind else 0.0,
                               rate_bytes_per_s=args.wb_rate)
    return TieredKVStore(geometry, ns, hot_bytes=hot, warm_bytes=int(hot * 0.35),
                         cold=lambda listener: ColdStore(
                             directory / "cold", geometry, ns, capacity_bytes=8 << 30,
                             segment_bytes=64 << 20, o_direct=args.o_direct, listener=listener),
                         write_behind=policy)


def run_case(name: str, loaded: Any, args: argparse.Namespace, write_behind: bool
             ) -> dict[str, Any]:
    from apscheduler.schedulers.background import BackgroundScheduler

    from kvagentd.agent.agent import Agent
    from kvagentd.config import AgentConfig, AssetConfig, ExecutorConfig, FaultConfig
    from kvagentd.engine.service import Engine

    base = ROOT / "var" / "bench-writebehind"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=base))
    store = build_store(loaded, d, args, write_behind)
    store.start()
    engine = Engine(loaded, store, state_dir=d / "engine", executor_config=ExecutorConfig())
    engine.start()
    sched = BackgroundScheduler(timezone="UTC")
    sched.start()
    cfg = AgentConfig(tick_interval_s=args.interval,
                      assessment_max_tokens=args.assessment_tokens,
                      session_token_budget=args.session_budget,
                      assets=(AssetConfig(fault=FaultConfig(kind="outer_race", onset_s=120.0)),))
    agent = Agent(cfg, engine.executor, sched, d, store_stats=store.stats)
    agent.start()
    time.sleep(args.minutes * 60.0)
    sched.pause()
    st = agent.assets["pump-1"]
    lat = np.asarray(st.latencies, dtype=float)
    wb = store.stats()["write_behind"]
    agent.stop()
    engine.stop()
    store.close()
    sched.shutdown(wait=False)
    shutil.rmtree(d, ignore_errors=True)
    return {"run": name, "write_behind": write_behind, "latencies": lat.tolist(),
            "ticks": int(lat.size), "skipped": st.skipped, "missed": st.missed,
            "wb_rounds": wb.get("rounds", 0), "wb_blocks": wb.get("written_blocks", 0),
            "wb_bytes": wb.get("written_bytes", 0), "wb_last_round_s": wb.get("last_round_s")}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.writebehind",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, one pair of 20 s runs")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--interval", type=float, default=3.0, help="tick interval, s")
    p.add_argument("--wb-interval", type=float, default=30.0, help="write-behind interval, s")
    p.add_argument("--wb-rate", type=int, default=64 << 20, help="write-behind bytes/s")
    add_agent_run_options(p)
    args = p.parse_args(argv)
    if args.quick:
        args.pairs, args.minutes, args.interval, args.wb_interval = 1, 1 / 3, 1.0, 2.0
        args.assessment_tokens = 4
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model

    if args.quick:
        from kvagentd.engine.tiny import tiny_model_dir

        mc = ModelConfig(source="hf_dir", path=tiny_model_dir(ROOT / "var" / "test-cache"),
                         dtype="float32", device="cpu", threads=args.threads)
    else:
        mc = ModelConfig(source="embedded", dtype=args.dtype, device="cpu", threads=args.threads)
    loaded = load_model(mc, ROOT / "var" / "cache")
    print(f"model {loaded.name} dtype {loaded.dtype} load {loaded.load_s:.1f} s", file=sys.stderr)
    runs = []
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for wb in order:
            name = f"{'with' if wb else 'without'} write-behind #{i + 1}"
            print(f"running {name} for {args.minutes:g} min ...", file=sys.stderr)
            runs.append(run_case(name, loaded, args, wb))
    off = [x for r in runs if not r["write_behind"] for x in r["latencies"]]
    on = [x for r in runs if r["write_behind"] for x in r["latencies"]]
    rows = [[r["run"], r["ticks"], _pct(r["latencies"], 50), _pct(r["latencies"], 99),
             r["skipped"] + r["missed"], r["wb_rounds"], r["wb_blocks"], r["wb_bytes"],
             r["wb_last_round_s"]] for r in runs]
    rows += [["all without", len(off), _pct(off, 50), _pct(off, 99), "", "", "", "", ""],
             ["all with", len(on), _pct(on, 50), _pct(on, 99), "", "", "", "", ""]]
    print_table(["run", "ticks", "p50 s", "p99 s", "skipped", "wb rounds", "wb blocks",
                 "wb bytes", "wb round s"], rows,
                title=f"agent ticks every {args.interval:g} s, {args.minutes:g} min per run, "
                      f"write-behind every {args.wb_interval:g} s at <= {args.wb_rate} B/s")
    goals = []
    p99_off, p99_on = _pct(off, 99), _pct(on, 99)
    if p99_off and p99_on is not None:
        goals.append(Goal("tick p99 with write-behind / without", p99_on / p99_off, "<=", 1.05))
    blocks = sum(r["wb_blocks"] for r in runs if r["write_behind"])
    goals.append(Goal("blocks the write-behind wrote", float(blocks), ">=", 1.0))
    for r in runs:
        del r["latencies"]
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python -m bench.writebehind " + " ".join(
        argv if argv is not None else sys.argv[1:])
    write_result(Result("writebehind", cmd.strip(),
                        figures={"runs": runs, "p99_without_s": p99_off, "p99_with_s": p99_on,
                                 "p50_without_s": _pct(off, 50), "p50_with_s": _pct(on, 50),
                                 "args": vars(args), "smoke": bool(args.quick)},
                        goals=goals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
