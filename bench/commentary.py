"""How often the model's commentary contradicts the measured diagnosis, over a simulated day.

One simulated asset per fault kind (and one healthy), each fault starting two hours into the
day and growing. The day's ticks are sampled, not all run: `--samples` ticks per asset spread
evenly over the 24 simulated hours (the simulator and the clock are simulated, so a sample is
the product's own tick at that moment: read -> diagnose -> prompt -> model -> check). With the
default 24 samples x 8 assets that is 192 model turns: a few minutes on the embedded model.
The baseline is off (`baseline_s = 0`): sampled ticks are too sparse to learn it.

Reported: commentaries, how many were withheld and why (says normal/healthy/idle while a
fault or zone C/D is diagnosed; raises an alarm when none is, or overstates a low severity;
names another fault; states a number not in its prompt; empty; copies what it was given before
the tick: withheld, but not counted as a contradiction), per fault kind, and a few examples of
each. The tick interval is set to 60 s so a turn on a loaded CPU gets its deadline:
this measures text, not latency.

    .venv/bin/python -m bench.commentary                     # embedded SmolLM2-135M, 24 samples
    .venv/bin/python -m bench.commentary --quick             # smoke: 3 samples x 3 assets
    .venv/bin/python -m bench.commentary --model-dir DIR     # a local HF model directory
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Goal, Result, add_agent_run_options, print_table, write_result

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("none", "outer_race", "inner_race", "ball", "cage", "imbalance", "misalignment",
         "looseness")
DAY_S = 86400.0
ONSET_S = 2 * 3600.0
# Fault growth per hour, by kind, so that each kind reaches a clear signature during the day;
# running-speed faults cross into zone C and D.
GROWTH = {"imbalance": 0.25, "misalignment": 0.25, "looseness": 0.4}
COPY = "copies what it was given"  # withheld, but no contradiction
CATEGORIES = (("says normal", "says '"), ("raises an alarm", "raises an alarm"),
              ("overstates the severity", "overstates"),
              ("names another fault", "names "), ("states a number not given", "states "),
              ("empty", "empty"), (COPY, "copies "))


def _category(note: str) -> str:
    reason = note.split("commentary withheld: ", 1)[-1]
    for name, prefix in CATEGORIES:
        if reason.startswith(prefix):
            return name
    return "other"


def run(args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    from apscheduler.schedulers.background import BackgroundScheduler

    from bench.agent import build_store
    from kvagentd.agent.agent import Agent
    from kvagentd.config import AgentConfig, AssetConfig, ExecutorConfig, FaultConfig
    from kvagentd.engine.service import Engine

    base = ROOT / "var" / "bench-commentary"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(dir=base))
    store = build_store(loaded, d, args)
    engine = Engine(loaded, store, state_dir=d / "engine", executor_config=ExecutorConfig())
    engine.start()
    sched = BackgroundScheduler(timezone="UTC")
    sched.start(paused=True)
    kinds = KINDS[:3] if args.quick else KINDS
    assets = tuple(AssetConfig(name=k.replace("_", "-"), seed=i + 1, baseline_s=0.0,
                               fault=FaultConfig(kind=k, onset_s=ONSET_S,  # type: ignore[arg-type]
                                                 growth_per_hour=GROWTH.get(k, 1.0)))
                   for i, k in enumerate(kinds))
    # NOTE: this measures text, not latency: a long tick interval gives each sampled turn the
    # deadline (10 intervals) it needs on a loaded CPU.
    cfg = AgentConfig(tick_interval_s=60.0, assessment_max_tokens=args.assessment_tokens,
                      session_token_budget=args.session_budget, assets=assets)
    t0 = 1_800_000_000.0
    clock = [t0]
    agent = Agent(cfg, engine.executor, sched, d / "agent", clock=lambda: clock[0])
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for i in range(args.samples):
        clock[0] = t0 + (i + 0.5) * DAY_S / args.samples
        for a in assets:
            row = agent.tick_once(a.name)
            rows.append({**row, "kind": a.fault.kind})
        print(f"  sample {i + 1}/{args.samples} done ({time.monotonic() - started:.0f} s)",
              file=sys.stderr)
    wall = time.monotonic() - started
    ex = engine.executor.status()
    reg = engine.metrics.registry
    generated = reg.get_sample_value("kvagentd_engine_generated_tokens_total") or 0.0
    prefill = reg.get_sample_value("kvagentd_engine_prefill_tokens_total") or 0.0
    requests = sum(reg.get_sample_value("kvagentd_engine_requests_total",
                                        {"priority": "tick", "outcome": o}) or 0.0
                   for o in ("stop", "length", "deadline", "cancelled"))
    rewinds = sum(st.rewinds for st in agent.assets.values())
    agent.stop()
    engine.stop()
    store.close()
    sched.shutdown(wait=False)
    shutil.rmtree(d, ignore_errors=True)
    out = summarize(rows, wall)
    step_s = ex["batch"].get("step_s", {}).get("p50") or 0.0
    c = ex["constraints"]
    per_step = c["seconds"] / c["steps"] if c["steps"] else 0.0
    out.update(tokens_per_commentary=generated / requests if requests else None,
               prefill_tokens_per_tick=prefill / requests if requests else None,
               rewinds=rewinds, constraint_ms_per_step=1e3 * per_step,
               step_ms_p50=1e3 * step_s,
               constraint_share_of_step=per_step / step_s if step_s else None)
    return out


def summarize(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    commented = [r for r in rows if r.get("assessment") or r.get("withheld")]
    withheld = [r for r in commented if r.get("withheld")]
    contradicting = [r for r in withheld if _category(r["note"]) != COPY]
    per_kind: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in commented if r["kind"] == kind]
        bad = [r for r in mine if r.get("withheld")]
        diagnosed = Counter(str(r.get("fault")) for r in rows if r["kind"] == kind)
        per_kind[kind] = {"commentaries": len(mine), "withheld": len(bad),
                          "rate": len(bad) / len(mine) if mine else None,
                          "diagnosed": dict(diagnosed),
                          "why": dict(Counter(_category(r["note"]) for r in bad))}
    examples: dict[str, list[dict[str, str]]] = {}
    for r in withheld:
        cat = _category(r["note"])
        if len(examples.setdefault(cat, [])) < 3:
            examples[cat].append({"fault": str(r.get("fault")), "note": r["note"]})
    shown = [r for r in commented if not r.get("withheld")]
    return {
        "ticks": len(rows), "commentaries": len(commented), "withheld": len(withheld),
        "contradicting": len(contradicting),
        "contradiction_rate": len(contradicting) / len(commented) if commented else None,
        "why": dict(Counter(_category(r["note"]) for r in withheld)),
        "per_kind": per_kind, "examples_withheld": examples,
        "examples_shown": [{"fault": str(r.get("fault")), "text": str(r["assessment"])}
                           for r in shown[:5]],
        "llm_errors": sum(1 for r in rows if str(r.get("note", "")).startswith("llm:")),
        "wall_s": round(wall_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.commentary", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 samples x 3 assets")
    p.add_argument("--samples", type=int, default=24, help="sampled ticks per asset over the day")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="a Hugging Face model directory (model.source = hf_dir); default: the "
                        "embedded SmolLM2-135M")
    add_agent_run_options(p, threads=0)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.samples = min(args.samples, 3)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model

    mc = (ModelConfig(source="hf_dir", path=args.model_dir.absolute(), dtype=args.dtype,
                      device="auto", threads=args.threads) if args.model_dir else
          ModelConfig(source="embedded", dtype=args.dtype, device="cpu", threads=args.threads))
    loaded = load_model(mc, ROOT / "var" / "cache")
    print(f"model {loaded.name} dtype {loaded.dtype}; {args.samples} sampled ticks per asset "
          f"over a simulated day", file=sys.stderr)
    res = run(args, loaded)
    print_table(["fault kind", "commentaries", "withheld", "rate", "why withheld"],
                [[k, v["commentaries"], v["withheld"],
                  "-" if v["rate"] is None else f"{v['rate']:.0%}",
                  ", ".join(f"{a} {b}" for a, b in v["why"].items()) or "-"]
                 for k, v in res["per_kind"].items()],
                title=f"Commentary of {loaded.name} checked against the diagnosis")
    rate = res["contradiction_rate"]
    print(f"\ncontradiction rate: {res['contradicting']}/{res['commentaries']} = "
          f"{'-' if rate is None else f'{rate:.1%}'} ({res['withheld']} withheld in all, copies "
          f"of the prompt included); llm errors {res['llm_errors']}; {res['wall_s']} s")
    print(f"tokens per commentary {res['tokens_per_commentary']:.1f}, prefill tokens per tick "
          f"{res['prefill_tokens_per_tick']:.0f}, sessions rewound {res['rewinds']}; "
          f"constraints {res['constraint_ms_per_step']:.2f} ms per step = "
          f"{100 * (res['constraint_share_of_step'] or 0):.1f} % of a step "
          f"(p50 {res['step_ms_p50']:.1f} ms)")
    for cat, ex in res["examples_withheld"].items():
        print(f"  withheld ({cat}), e.g.: {ex[0]['note'][:150]}")
    for ex in res["examples_shown"][:3]:
        print(f"  shown ({ex['fault']}): {ex['text'][:150]}")
    cmd = " ".join(["python -m bench.commentary", *(sys.argv[1:] if argv is None else argv)])
    res["model"] = loaded.name
    goals = [Goal("commentaries withheld", res["withheld"] / max(1, res["commentaries"]), "<=",
                  0.10),
             Goal("constraints' cost per step / decode step",
                  res["constraint_share_of_step"] or 0.0, "<=", 0.05)]
    write_result(Result("commentary", cmd, res, goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
