"""Continuous batching on the embedded model (SmolLM2-135M, CPU), side by side with
transformers on the same model, dtype and threads, in one run.

Sections (`--sections`, all by default); decode, fresh and prefill run once per `--dtypes`:
  decode      decode step with 1 and 16 (full: 1, 4, 8, 16) sessions of 1-2k tokens of stored
              history asking one turn: the engine's step against transformers' `generate` over
              the same ids (one left-padded batch, DynamicCache, sdpa); tokens/s at 16
              sessions against one; the 16-session step against the memory floor (weights
              once plus every sequence's KV, over the copy bandwidth measured in this run)
  fresh       16 fresh prompts of ~180 tokens, 32 new tokens each, prefill included: the
              engine, transformers `generate` (one left-padded batch) and `generate_batch`
              (continuous batching, paged cache)
  prefill     a 2,000-token prompt alone: the engine's time to its first token against
              transformers' one-shot prefill of the same ids
  assets      the real agent ticking N simulated assets every 3 s for `--minutes` per level:
              the largest N with tick p99 < 3 s, no skipped tick and >= 90 % of ticks with a
              finished commentary
  fairness    with ticks using all capacity: an operator question's time to first token and a
              weekly report's completion time
  memory      8 assets ticking for 10 minutes: RSS and the Python heap (tracemalloc) flat
  precision   the agent's tick requests recorded in fp32, replayed in fp32, bf16 and int8
              weights: share of ticks with the same greedy text, first-token logits error
Every timed path runs in a thread that owns torch's intra-op pool, as the engine's model worker
does (`kvagentd/engine/threads.py`); memory (peak RSS, bytes beyond the hot pool) comes along.

    python -m bench.batch                     # the full run: about an hour on 2 cores
    python -m bench.batch --quick             # smoke run: minutes, figures not comparable
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import batch_runs as runs
from bench.common import Goal, Result, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = Path(os.environ.get("KVAGENTD_BENCH_CACHE", ROOT / "var" / "test-cache"))
LEVELS = (1, 2, 4, 6, 8, 10, 12, 16)
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def load(dtype: str, threads: int, quantize: str = "none") -> Any:
    from kvagentd.config import ModelConfig
    from kvagentd.engine.model import load_model

    return load_model(ModelConfig(source="embedded", device="cpu", dtype=dtype,  # type: ignore[arg-type]
                                  threads=threads, quantize=quantize), CACHE_DIR)  # type: ignore[arg-type]


def decode(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    bw = runs.bandwidth(lm.threads)
    rows = []
    for n in args.sessions:
        e = runs.sessions(lm, root, n, args.history, args.new, 16)
        e.pop("texts")
        prompts = [runs.turn_ids(lm, runs.history_ids(lm.tokenizer, length, i), runs.QUESTION)
                   for i, length in enumerate(e["history"])]
        h = runs.hf_generate(lm, prompts, args.new)
        step = e["full_decode_step_ms_p50"]
        kv = sum(len(p) + args.new // 2 for p in prompts) * runs.kv_bytes_per_token(lm)
        floor_ms = 1e3 * (runs.weight_bytes(lm) + kv) / (bw["copy_gb_s"] * 1e9)
        rows.append({"sessions": n, "history": e["history"], "engine": e, "transformers": h,
                     "engine_step_ms": step, "hf_step_ms": h["decode_step_ms_p50"],
                     "engine_decode_tok_s": n / step * 1e3, "step_vs_hf": step / h[
                         "decode_step_ms_p50"], "floor_ms": floor_ms,
                     "step_vs_floor": step / floor_ms})
    one = rows[0]["engine_decode_tok_s"]
    for r in rows:
        r["rate_vs_single"] = r["engine_decode_tok_s"] / one
    fig["decode"] = {"bandwidth": bw, "weight_bytes": runs.weight_bytes(lm), "rows": rows}
    print_table(["sessions", "engine step ms", "transformers step ms", "engine / tf",
                 "engine tok/s", "x single", "floor ms", "x floor"],
                [[r["sessions"], r["engine_step_ms"], r["hf_step_ms"], r["step_vs_hf"],
                  r["engine_decode_tok_s"], r["rate_vs_single"], r["floor_ms"],
                  r["step_vs_floor"]] for r in rows],
                title=f"{SHORT.get(str(lm.dtype)[6:], lm.dtype)}: decode step, sessions with "
                      f"{args.history[0]}-{args.history[1]} tokens of history, {args.new} new "
                      f"(copy {bw['copy_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s)")


def fresh(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    prompts = runs.chat_prompts(lm.tokenizer, args.fresh, args.fresh_tokens)
    out = {"engine": runs.fresh_engine(lm, root, prompts, args.fresh_new, 16),
           "hf_generate_padded": runs.hf_generate(lm, prompts, args.fresh_new),
           "hf_generate_batch": runs.hf_generate_batch(lm, prompts, args.fresh_new)}
    fig["fresh"] = {"requests": len(prompts),
                    "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                    "new_tokens": args.fresh_new, **out}
    print_table(["path", "generated", "wall s", "tok/s (prefill included)"],
                [[k, v["generated"], v["wall_s"], v["tok_s"]] for k, v in out.items()],
                title=f"{len(prompts)} fresh prompts of ~{args.fresh_tokens} tokens, "
                      f"{args.fresh_new} new tokens each")


def prefill(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    prompts = runs.chat_prompts(lm.tokenizer, 3, args.prefill_tokens)
    e = runs.engine_prefill(lm, root, prompts)
    h = runs.hf_prefill(lm, prompts)
    fig["prefill"] = {"engine": e, "transformers": h, "ratio": e["tok_s"] / h["tok_s"]}
    print_table(["path", "tokens", "s (median of 3)", "tok/s", "steps"],
                [["engine", e["tokens"], e["prefill_s"], e["tok_s"], e["steps_per_prompt"]],
                 ["transformers one-shot", h["tokens"], h["prefill_s"], h["tok_s"], 1]],
                title=f"a {args.prefill_tokens}-token prompt alone")


def assets(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    rows, best = [], 0
    for n in args.levels:
        r = runs.assets(lm, root, n, args.minutes * 60.0, 16)
        rows.append(r)
        if not r["ok"]:
            break
        best = n
    fig["assets"] = {"largest_ok": best, "levels": rows}
    print_table(["assets", "ticks", "expected", "p50 s", "p99 s", "skipped", "errors",
                 "commented", "cut", "mean batch", "ok"],
                [[r["assets"], r["ticks"], r["expected_ticks"], r["p50_s"], r["p99_s"],
                  r["skipped"], r["llm_errors"], r["commented_share"], r["cut_at_deadline"],
                  r["mean_batch"], r["ok"]] for r in rows],
                title=f"assets ticking every 3 s, {args.minutes:g} min per level")


def memory(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    r = runs.memory_flat(lm, root, args.memory_assets, args.memory_minutes * 60.0)
    fig["memory"] = r
    print_table(["assets", "minutes", "steps", "ticks", "RSS MiB (after warm-up)", "RSS MiB/min",
                 "heap MiB/min"],
                [[r["assets"], args.memory_minutes, r["steps"], r["ticks"],
                  f"{r['rss_first_mib']:.0f} -> {r['rss_last_mib']:.0f}",
                  r["rss_growth_mib_per_min"], r["heap_growth_mib_per_min"]]],
                title="memory over a steady tick load")


def fairness(lm: Any, root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    found = fig.get("assets", {}).get("largest_ok", 0)
    n = args.fairness_assets or max(2, found + 2)  # past capacity: ticks use all of it
    r = runs.fairness(lm, root, n, args.warmup_s, 16, args.report_tokens)
    fig["fairness"] = r
    print_table(["assets", "ask ttft s", "ask tokens", "report s", "report", "skipped ticks"],
                [[r["assets"], r["ask_ttft_s"], r["ask_tokens"], r["report_s"],
                  r["report_state"], r["skipped_ticks"]]],
                title="fairness under a saturated tick load")


def precision(root: Path, args: argparse.Namespace, fig: dict[str, Any]) -> None:
    from kvagentd.engine.model import cpu_native_bf16

    f32 = load("float32", args.threads)
    ticks = runs.record_ticks(f32, root, args.precision_assets, args.precision_s)
    out: dict[str, Any] = {"ticks": len(ticks), "cpu_native_bf16": cpu_native_bf16()}
    ref = runs.replay_ticks(f32, root, ticks)
    variants = {"bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8")}
    for name, (dtype, quant) in variants.items():
        lm = load(dtype, args.threads, quant)
        rep = runs.replay_ticks(lm, root, ticks)
        same = sum(a == b for a, b in zip(ref["texts"], rep["texts"]))
        err = runs.first_logits_error(f32, lm, ticks)
        out[name] = {"greedy_same": same / max(1, len(ticks)), "replay_s": rep["wall_s"],
                     "first_logits_max_abs_err": err}
        del lm
    out["float32"] = {"replay_s": ref["wall_s"]}
    fig["precision"] = out
    print_table(["weights", "same greedy text", "first-token logits max |err|", "replay s"],
                [[k, out[k].get("greedy_same", 1.0), out[k].get("first_logits_max_abs_err", 0.0),
                  out[k]["replay_s"]] for k in ("float32", "bfloat16", "int8")],
                title=f"the agent's {len(ticks)} recorded ticks replayed")


def goals(figs: dict[str, dict[str, Any]]) -> list[Goal]:
    out = []
    for dtype, fig in figs.items():
        tag = SHORT.get(dtype, dtype)
        if "decode" in fig:
            rows = fig["decode"]["rows"]
            one, top = rows[0], rows[-1]
            out.append(Goal(f"{tag}: decode step, 1 session / transformers", one["step_vs_hf"],
                            "<=", 1.05, "x"))
            out.append(Goal(f"{tag}: decode step, {top['sessions']} sessions / transformers "
                            f"padded generate", top["step_vs_hf"], "<=", 1.1, "x"))
            out.append(Goal(f"{tag}: tok/s at {top['sessions']} sessions / 1 session",
                            top["rate_vs_single"], ">=", 6.0, "x"))
            out.append(Goal(f"{tag}: decode step, {top['sessions']} sessions / memory floor",
                            top["step_vs_floor"], "<=", 2.0, "x"))
        if "fresh" in fig:
            f = fig["fresh"]
            out.append(Goal(f"{tag}: fresh prompts tok/s / transformers generate (padded)",
                            f["engine"]["tok_s"] / f["hf_generate_padded"]["tok_s"], ">=", 1.2,
                            "x"))
            out.append(Goal(f"{tag}: fresh prompts tok/s / transformers generate_batch",
                            f["engine"]["tok_s"] / f["hf_generate_batch"]["tok_s"], ">=", 2.0,
                            "x"))
        if "prefill" in fig:
            out.append(Goal(f"{tag}: 2,000-token prefill tok/s / transformers one-shot",
                            fig["prefill"]["ratio"], ">=", 0.95, "x"))
        if "assets" in fig:
            out.append(Goal(f"{tag}: assets per box (p99 < 3 s, none skipped, >= 90 % "
                            f"commented)", fig["assets"]["largest_ok"], ">=", 8))
        if "memory" in fig:
            m = fig["memory"]
            # NOTE: flat within noise: under 1 MiB a minute after warm-up (a leak of one
            # 16-token block per step would be ~100 MiB a minute)
            out.append(Goal(f"{tag}: RSS growth over a steady tick load", m[
                "rss_growth_mib_per_min"], "<=", 1.0, " MiB/min"))
            out.append(Goal(f"{tag}: Python heap growth over a steady tick load",
                            m["heap_growth_mib_per_min"], "<=", 1.0, " MiB/min"))
        if "fairness" in fig:
            f = fig["fairness"]
            out.append(Goal(f"{tag}: ask first token under a full tick load",
                            f["ask_ttft_s"] or 1e9, "<=", 5.0, " s"))
            out.append(Goal(f"{tag}: weekly report done under a full tick load",
                            f["report_s"], "<=", 600.0, " s"))
    prec = figs.get("precision", {}).get("precision")
    if prec:
        out.append(Goal("bf16: greedy text equal to fp32 on recorded ticks",
                        prec["bfloat16"]["greedy_same"], ">=", 0.9))
        out.append(Goal("int8: greedy text equal to fp32 on recorded ticks",
                        prec["int8"]["greedy_same"], ">=", 0.9))
    return out


def machine() -> dict[str, Any]:
    flags = ""
    try:
        flags = next(line.split(":", 1)[1].strip() for line in
                     Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    keep = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
            "amx_int8", "avx512_fp16")
    model = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"],
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "flags": [f for f in keep if f in flags.split()],
            "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    from kvagentd.engine.threads import single_threaded_default

    single_threaded_default()
    p = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run (minutes)")
    p.add_argument("--sections", default="decode,fresh,prefill,assets,fairness,memory,precision")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--minutes", type=float, default=2.0, help="per assets level")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--full", action="store_true", help="decode at 1, 4, 8 and 16 sessions")
    p.add_argument("--memory-minutes", type=float, default=10.0)
    p.add_argument("--memory-assets", type=int, default=8)
    p.add_argument("--levels", default=",".join(map(str, LEVELS)),
                   help="asset counts to try in turn, until one fails")
    args, _ = p.parse_known_args(argv)  # `python -m bench batch` passes the name through
    q = args.quick
    args.sessions = (1, 4) if q else ((1, 4, 8, 16) if args.full else (1, 16))
    args.history = (128, 192) if q else (1024, 2048)
    args.new = 8 if q else 32
    args.fresh, args.fresh_tokens, args.fresh_new = (4, 96, 8) if q else (16, 180, 32)
    args.prefill_tokens = 256 if q else 2000
    args.levels = (1, 2) if q else tuple(int(n) for n in args.levels.split(","))
    args.minutes = 0.35 if q else args.minutes
    args.fairness_assets = 2 if q else 0
    args.memory_minutes = 1.0 if q else args.memory_minutes
    args.warmup_s, args.report_tokens = (8.0, 16) if q else (60.0, 96)
    args.precision_assets, args.precision_s = (2, 15.0) if q else (4, 120.0)
    sections = {s.strip() for s in args.sections.split(",")}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="kvbatch-", dir=CACHE_DIR.parent))
    figs: dict[str, dict[str, Any]] = {}
    before = machine()
    try:
        for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
            todo = [s for s in ("decode", "fresh", "prefill", "assets", "fairness", "memory")
                    if s in sections]
            if not todo:
                break
            lm = load(dtype, args.threads)
            fig = figs.setdefault(dtype, {})
            for name in todo:
                globals()[name](lm, root, args, fig)
            del lm
        if "precision" in sections:
            precision(root, args, figs.setdefault("precision", {}))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures: dict[str, Any] = {"quick": q, "threads": args.threads,
                               "block_tokens": runs.BLOCK_TOKENS, "machine_before": before,
                               "machine_after": machine(), **figs,
                               "peak_rss_mib": runs.peak_rss_mib()}
    print(f"\npeak RSS {figures['peak_rss_mib']:.0f} MiB; load average before "
          f"{before['loadavg']}, after {figures['machine_after']['loadavg']}")
    cmd = " ".join(["python -m bench.batch", *(sys.argv[1:] if argv is None else argv)])
    write_result(Result("batch", cmd, figures, goals(figs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
