"""Continuous batching on the embedded model (SmolLM2-135M, CPU), side by side with the serial
executor (the same engine with `executor.max_batch = 1`, one request at a time) and with
transformers' own batching on the same model and threads.

Sections (`--sections`, all by default):
  throughput  decode tokens/s with 1, 4, 8, 16 concurrent sessions of 1-2k tokens of stored
              history asking one turn, batched vs serial; and 16 fresh prompts of ~180 tokens
              with 32 new tokens, prefill included: batched, serial, transformers `generate`
              (one left-padded batch) and `generate_batch` (continuous batching, paged cache)
  assets      the real agent ticking N simulated assets every 3 s for `--minutes` per level:
              the largest N with tick p99 < 3 s and no skipped tick, batched vs serial
  fairness    with ticks using all capacity: an operator question's time to first token and a
              weekly report's completion time
  precision   fp32 against bf16 weights end to end: tick latency of the agent and greedy
              agreement on the agent's own tick prompts (recorded, then replayed in both)
Memory (peak RSS, bytes beyond the hot pool per active sequence) comes with every section.

    python -m bench.batch                     # the full run: about 3 h on 2 cores
    python -m bench.batch --quick             # smoke run: minutes, figures not comparable
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import batch_runs as runs
from bench.common import Goal, Result, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = Path(os.environ.get("KVAGENTD_BENCH_CACHE", ROOT / "var" / "test-cache"))
LEVELS = (1, 2, 4, 6, 8, 10, 12, 16)


def load(dtype: str, threads: int) -> Any:
    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model

    return load_model(ModelConfig(source="embedded", device="cpu", dtype=dtype,
                                  threads=threads), CACHE_DIR)


def throughput(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    rows = []
    for n in args.sessions:
        b = runs.sessions(lm, root, n, args.history, args.new, 16)
        s = runs.sessions(lm, root, n, args.history, args.new, 1)
        same = b.pop("texts") == s.pop("texts")  # greedy tokens do not depend on the batch
        rows += [{"mode": "batched", **b, "same_text_as_serial": same},
                 {"mode": "serial", **s, "same_text_as_serial": same}]
    fig["sessions"] = rows
    print_table(["mode", "sessions", "generated", "wall s", "tok/s", "decode tok/s",
                 "mean batch", "step ms", "ttft p50 s", "beyond hot/seq MiB", "same text"],
                [[r["mode"], r["sessions"], r["generated"], r["wall_s"], r["tok_s"],
                  r["decode_tok_s"], r["mean_batch"], r["decode_step_ms_p50"], r["ttft_p50_s"],
                  r["beyond_hot_bytes_per_sequence"] / 2**20, r["same_text_as_serial"]]
                 for r in rows],
                title=f"sessions with {args.history[0]}-{args.history[1]} tokens of stored "
                      f"history, one turn of {args.new} tokens each")
    prompts = runs.chat_prompts(lm.tokenizer, args.fresh, args.fresh_tokens)
    fresh = {"batched": runs.fresh_engine(lm, root, prompts, args.fresh_new, 16),
             "serial": runs.fresh_engine(lm, root, prompts, args.fresh_new, 1),
             "hf_generate_padded": runs.hf_generate(lm, prompts, args.fresh_new),
             "hf_generate_batch": runs.hf_generate_batch(lm, prompts, args.fresh_new)}
    fig["fresh_prompts"] = {"requests": len(prompts),
                            "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                            "new_tokens": args.fresh_new, **fresh}
    print_table(["path", "generated", "wall s", "tok/s (prefill included)"],
                [[k, v["generated"], v["wall_s"], v["tok_s"]] for k, v in fresh.items()],
                title=f"{len(prompts)} fresh prompts of ~{args.fresh_tokens} tokens, "
                      f"{args.fresh_new} new tokens each")


def assets(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    out: dict[str, Any] = {}
    for mode, mb in (("batched", 16), ("serial", 1)):
        rows, best = [], 0
        for n in args.levels:
            r = runs.assets(lm, root, n, args.minutes * 60.0, mb)
            rows.append(r)
            if not r["ok"]:
                break
            best = n
        out[mode] = {"largest_ok": best, "levels": rows}
    fig["assets"] = out
    print_table(["mode", "assets", "ticks", "expected", "p50 s", "p99 s", "skipped", "errors",
                 "cut", "mean batch", "ok"],
                [[m, r["assets"], r["ticks"], r["expected_ticks"], r["p50_s"], r["p99_s"],
                  r["skipped"], r["llm_errors"], r["cut_at_deadline"], r["mean_batch"], r["ok"]]
                 for m, v in out.items() for r in v["levels"]],
                title=f"assets ticking every 3 s, {args.minutes:g} min per level")


def fairness(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    found = fig.get("assets", {}).get("batched", {}).get("largest_ok", 0)
    n = args.fairness_assets or max(2, found + 2)  # past capacity: ticks use all of it
    r = runs.fairness(lm, root, n, args.warmup_s, 16, args.report_tokens)
    fig["fairness"] = r
    print_table(["assets", "ask ttft s", "ask tokens", "report s", "report", "skipped ticks"],
                [[r["assets"], r["ask_ttft_s"], r["ask_tokens"], r["report_s"],
                  r["report_state"], r["skipped_ticks"]]],
                title="fairness under a saturated tick load")


def precision(root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    f32 = load("float32", args.threads)
    ticks = runs.record_ticks(f32, root, args.precision_assets, args.precision_s)
    from kvagentd.engine.model import cpu_native_bf16

    out: dict[str, Any] = {"ticks": len(ticks), "cpu_native_bf16": cpu_native_bf16()}
    texts = {}
    for name in ("float32", "bfloat16"):
        lm = f32 if name == "float32" else load(name, args.threads)
        rep = runs.replay_ticks(lm, root, ticks)
        texts[name] = rep.pop("texts")
        live = runs.assets(lm, root, args.precision_assets, args.precision_s, 16)
        out[name] = {"replay": rep, "tick_p50_s": live["p50_s"], "tick_p99_s": live["p99_s"],
                     "skipped": live["skipped"], "decode_tok_s": live["decode_tok_s"]}
    same = sum(a == b for a, b in zip(texts["float32"], texts["bfloat16"]))
    out["greedy_same"] = same / max(1, len(ticks))
    faster = min(("float32", "bfloat16"), key=lambda k: out[k]["tick_p50_s"] or float("inf"))
    out["auto_choice"] = faster if out["greedy_same"] >= 0.75 else "float32"
    fig["precision"] = out
    print_table(["dtype", "tick p50 s", "tick p99 s", "replay s", "decode tok/s"],
                [[k, out[k]["tick_p50_s"], out[k]["tick_p99_s"], out[k]["replay"]["wall_s"],
                  out[k]["decode_tok_s"]] for k in ("float32", "bfloat16")],
                title=f"fp32 vs bf16 ({args.precision_assets} assets; greedy output the same in "
                      f"{same} of {len(ticks)} ticks) -> auto: {out['auto_choice']}")


def goals(fig: dict[str, Any], args: argparse.Namespace) -> list[Goal]:
    out = []
    if "sessions" in fig:
        one = next(r for r in fig["sessions"] if r["mode"] == "serial" and r["sessions"] == 1)
        top = max((r for r in fig["sessions"] if r["mode"] == "batched"),
                  key=lambda r: r["sessions"])
        out.append(Goal(f"batched tok/s at {top['sessions']} sessions / single session",
                        top["tok_s"] / one["tok_s"], ">=", 5.0, "x"))
        fresh = fig["fresh_prompts"]
        for hf in ("hf_generate_padded", "hf_generate_batch"):
            out.append(Goal(f"batched tok/s / transformers {hf[3:]}",
                            fresh["batched"]["tok_s"] / fresh[hf]["tok_s"], ">=", 1.0, "x"))
    if "assets" in fig:
        out.append(Goal("assets per box, batched (tick p99 < 3 s, none skipped)",
                        fig["assets"]["batched"]["largest_ok"], ">=", 8))
    if "fairness" in fig:
        f = fig["fairness"]
        out.append(Goal("ask first token under a full tick load", f["ask_ttft_s"] or 1e9,
                        "<=", 5.0, " s"))
        out.append(Goal("weekly report done under a full tick load", f["report_s"], "<=",
                        600.0, " s"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (minutes)")
    p.add_argument("--sections", default="throughput,assets,fairness,precision")
    p.add_argument("--minutes", type=float, default=10.0, help="per assets level")
    p.add_argument("--threads", type=int, default=2)
    args, _ = p.parse_known_args(argv)  # `python -m bench batch` passes the name through
    q = args.quick
    args.sessions = (1, 4) if q else (1, 4, 8, 16)
    args.history = (128, 192) if q else (1024, 2048)
    args.new = 8 if q else 32
    args.fresh, args.fresh_tokens, args.fresh_new = (4, 96, 8) if q else (16, 180, 32)
    args.levels = (1, 2) if q else LEVELS
    args.minutes = 0.35 if q else args.minutes
    args.fairness_assets = 2 if q else 0
    args.warmup_s, args.report_tokens = (8.0, 16) if q else (60.0, 96)
    args.precision_assets, args.precision_s = (2, 15.0) if q else (4, 180.0)
    sections = {s.strip() for s in args.sections.split(",")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="kvbatch-", dir=CACHE_DIR.parent))
    fig: dict[str, Any] = {"quick": q, "threads": args.threads, "block_tokens": runs.BLOCK_TOKENS}
    try:
        if sections & {"throughput", "assets", "fairness"}:
            lm = load("float32", args.threads)
            for name, fn in (("throughput", throughput), ("assets", assets),
                             ("fairness", fairness)):
                if name in sections:
                    fn(lm, root, args, fig)
            del lm
        if "precision" in sections:
            precision(root, args, fig)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fig["peak_rss_mib"] = runs.peak_rss_mib()
    print(f"\npeak RSS {fig['peak_rss_mib']:.0f} MiB")
    cmd = " ".join(["python -m bench.batch", *(sys.argv[1:] if argv is None else argv)])
    write_result(Result("batch", cmd, fig, goals(fig, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
