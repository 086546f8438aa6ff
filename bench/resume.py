"""Session resume on SmolLM2: time to first token from hot / warm / cold vs full recompute.

For each dtype (fp32, bf16) and session length (512, 2048, 4096 tokens) one run:
  recompute  a session whose history is N token ids, nothing stored: prefill all N, next token
  hot/warm/cold  new sessions with the same N ids, their blocks placed in that tier first
                 (content-addressed: the recompute run stored them), in two modes:
                 next = restore and yield the next token (the llama.cpp anchor's measurement;
                 every block is stored, so the last token is re-run for its logits),
                 turn = restore + a new user turn (~20 tokens prefilled)
Every request is the real data path (match -> ensure_resident -> suffix prefill -> decode ->
commit) through the engine, one request at a time, asked for 2 tokens: TTFT and one decode step.
Also: decode tokens/s of the hot-pool cache vs transformers' DynamicCache at 2048 tokens,
peak RSS, and where the resume time goes.

    python -m bench.resume            (KVAGENTD_BENCH_QUICK=1: 512 and 2048 only)
"""

from __future__ import annotations

import itertools
from functools import partial
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Goal, Result, print_table, write_result
from kvagentd.config import ExecutorConfig, ModelConfig
from kvagentd.engine.cache import new_cache
from kvagentd.engine.model import LoadedModel, load_model, model_geometry
from kvagentd.engine.service import Engine
from kvagentd.engine.sessions import Session
from kvagentd.engine.threads import in_pool, single_threaded_default
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.base import ColdListener
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

BLOCK_TOKENS = 16
PREFILL_CHUNK = 512
LENGTHS = (512, 2048, 4096)
REPS = 3
ANCHOR = {"cold_ms": 67.0, "warm_ms": 45.0, "recompute_s": 17.0}
QUESTION = "Assess: rms 2.31 mm/s, crest 3.4, zone B."
CACHE_DIR = Path(os.environ.get("KVAGENTD_BENCH_CACHE",
                                Path(__file__).resolve().parents[1] / "var" / "test-cache"))


def history_ids(tok, n: int) -> list[int]:
    """n token ids of a plausible agent history (sensor log lines and assessments)."""
    lines = []
    i = 0
    while True:
        rms = 1.2 + (i % 37) * 0.05
        lines.append(f"<|im_start|>user\ntick {i}: rms {rms:.2f} mm/s, crest {3.1 + (i % 7) * 0.1:.1f},"
                     f" kurtosis {2.9 + (i % 5) * 0.2:.1f}, zone {'A' if rms < 1.4 else 'B'}"
                     f"<|im_end|>\n<|im_start|>assistant\nVibration {'normal' if rms < 2.3 else 'elevated'};"
                     f" no action.<|im_end|>\n")
        i += 1
        if i % 20 == 0:
            ids = tok("".join(lines), add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                return list(ids[:n])


def build_store(lm: LoadedModel, root: Path, tokens: int) -> TieredKVStore:
    geo = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    ns = make_namespace(lm.fingerprint, lm.dtype, BLOCK_TOKENS)
    blocks = 2 * (tokens // BLOCK_TOKENS) + 64
    def cold(listener: ColdListener) -> ColdStore:
        return ColdStore(root / "cold", geo, ns, codec="raw",
                         capacity_bytes=4 * blocks * geo.block_bytes, segment_bytes=256 << 20,
                         io_unit_bytes=128 << 10, o_direct=True, listener=listener,
                         io_threads=4)

    return TieredKVStore(geo, ns, hot_bytes=blocks * geo.block_bytes,
                         warm_bytes=blocks * geo.block_bytes, cold=cold)


def run_once(engine: Engine, sid: str, history: list[int], text: str | None):
    engine.table.save(Session(sid, list(history)))
    return engine.ask(sid, text, max_new_tokens=2)


def measure_dtype(dtype: str, lengths: tuple[int, ...], root: Path) -> tuple[list[dict], LoadedModel]:
    lm = load_model(ModelConfig(source="embedded", device="cpu", dtype=dtype), CACHE_DIR)
    rows = []
    for n in lengths:
        d = root / f"{dtype}-{n}"
        d.mkdir(parents=True)
        store = build_store(lm, d, n + 64)
        engine = Engine(lm, store, state_dir=d / "state", executor_config=ExecutorConfig(
            step_tokens=PREFILL_CHUNK, prefill_chunk=PREFILL_CHUNK))
        engine.start()
        hist = history_ids(lm.tokenizer, n)
        rec = run_once(engine, f"recompute-{n}", hist, None)
        hist_keys = store.block_keys(hist)
        keep = set(hist_keys)
        for mode, text in (("next", None), ("turn", QUESTION)):
            row = {"dtype": dtype, "tokens": n, "mode": mode, "recompute_ttft_s": rec.ttft_s}
            for tier in (Tier.HOT, Tier.WARM, Tier.COLD):
                results = []
                for rep in range(REPS):
                    if tier is not Tier.HOT:
                        store.demote(hist_keys, tier)
                    results.append(run_once(engine, f"{mode}-{tier.value}-{n}-{rep}", hist, text))
                    # forget what this run added, so every repetition resumes the same prefix
                    store.evict([b.key for b in store.snapshot() if b.key not in keep])
                med = sorted(results, key=lambda r: r.ttft_s)[len(results) // 2]
                assert med.loaded[tier.value] == len(hist_keys), (tier, med.loaded)
                row[f"{tier.value}_ttft_s"] = med.ttft_s
                row[f"{tier.value}_speedup"] = rec.ttft_s / med.ttft_s
                row[f"{tier.value}_parts_ms"] = {
                    "read+copy to hot": 1e3 * med.timings["resident_s"],
                    "gather to working copy": 1e3 * med.timings["gather_s"],
                    "suffix prefill": 1e3 * med.timings["prefill_s"],
                    "first decode step": 1e3 * med.timings["decode_s"],
                }
                row[f"{tier.value}_prefill_tokens"] = med.prefill_tokens
            rows.append(row)
        engine.stop()
        store.close()
        shutil.rmtree(d, ignore_errors=True)
    return rows, lm


def decode_rate(lm: LoadedModel, n_ctx: int = 2048, steps: int = 16, reps: int = 2) -> dict:
    """tokens/s of greedy decode after an n_ctx-token prefix: hot-pool cache vs DynamicCache,
    interleaved so both see the same machine load."""
    from transformers import DynamicCache

    model = lm.model
    geo = model_geometry(model, BLOCK_TOKENS, lm.dtype)
    ids = torch.tensor([history_ids(lm.tokenizer, n_ctx)])
    nblk = n_ctx // BLOCK_TOKENS
    arena = torch.empty((nblk + steps // BLOCK_TOKENS + 2, *geo.block_shape), dtype=lm.dtype)
    with torch.no_grad():
        c = new_cache(geo, arena, n_ctx + steps)
        c.bind_new_slots(list(range(arena.shape[0])))
        out = model(input_ids=ids, cache=c, logits_to_keep=1)
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in c.layers]
    first = out.logits[:, -1:].argmax(-1)

    def run(cache) -> float:
        x = first
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                x = model(input_ids=x, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        return steps / (time.perf_counter() - t)

    dyn, hot = [], []
    for _ in range(reps):
        dyn.append(run(DynamicCache([(k.clone(), v.clone()) for k, v in kv])))
        hc = new_cache(geo, arena, n_ctx + steps)
        hc.load_blocks(list(range(nblk)))
        hc.bind_new_slots(list(range(nblk, arena.shape[0])))
        hot.append(run(hc))
    return {"dynamic_tok_s": statistics.median(dyn), "hot_pool_tok_s": statistics.median(hot),
            "ratio": statistics.median(hot) / statistics.median(dyn)}


def main() -> int:
    single_threaded_default()  # the engine's worker owns the pool (engine/threads.py)
    quick = os.environ.get("KVAGENTD_BENCH_QUICK") == "1"
    lengths = LENGTHS[:2] if quick else LENGTHS
    if os.environ.get("KVAGENTD_BENCH_LENGTHS"):
        lengths = tuple(int(x) for x in os.environ["KVAGENTD_BENCH_LENGTHS"].split(","))
    root = Path(tempfile.mkdtemp(prefix="kvresume-", dir=CACHE_DIR.parent))
    figures: dict = {"threads": 2, "block_tokens": BLOCK_TOKENS,
                     "anchor_llama_cpp": ANCHOR, "rows": []}
    try:
        rows32, lm32 = measure_dtype("float32", lengths, root)
        n_dec = 2048 if 2048 in lengths else max(lengths)
        figures["decode_2048_fp32"] = in_pool(partial(decode_rate, lm32, n_dec), lm32.threads)
        del lm32
        rows16, _ = measure_dtype("bfloat16", lengths, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = rows32 + rows16
    figures["rows"] = rows
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print_table(["dtype", "tokens", "mode", "recompute s", "hot ms", "warm ms", "cold ms",
                 "hot x", "warm x", "cold x"],
                [[r["dtype"], r["tokens"], r["mode"], r["recompute_ttft_s"], 1e3 * r["hot_ttft_s"],
                  1e3 * r["warm_ttft_s"], 1e3 * r["cold_ttft_s"], r["hot_speedup"],
                  r["warm_speedup"], r["cold_speedup"]] for r in rows],
                title="TTFT: resume vs full recompute of the session's N ids (SmolLM2-135M, CPU); "
                      "next = restore and yield the next token, turn = restore + a new user turn")
    parts = []
    for r in rows:
        for tier in ("hot", "warm", "cold"):
            p = r[f"{tier}_parts_ms"]
            parts.append([r["dtype"], r["tokens"], r["mode"], tier, r[f"{tier}_prefill_tokens"],
                          *(round(v, 1) for v in p.values())])
    print_table(["dtype", "tokens", "mode", "tier", "prefill tok", "read+copy ms", "gather ms",
                 "suffix prefill ms", "decode step ms"], parts,
                title="Where the resume time goes (medians)")
    dec = figures["decode_2048_fp32"]
    print_table(["cache", "tok/s at 2048 (fp32)"],
                [["DynamicCache", dec["dynamic_tok_s"]], ["hot-pool cache", dec["hot_pool_tok_s"]]],
                title="Decode")
    at = {(r["dtype"], r["tokens"]): r for r in rows if r["mode"] == "next"}
    r2048 = at[("float32", 2048 if 2048 in lengths else max(lengths))]
    print_table(["2048-token resume, fp32", "kvagentd", "llama.cpp anchor"],
                [["cold", f"{1e3 * r2048['cold_ttft_s']:.0f} ms", f"{ANCHOR['cold_ms']:.0f} ms"],
                 ["warm", f"{1e3 * r2048['warm_ttft_s']:.0f} ms", f"{ANCHOR['warm_ms']:.0f} ms"],
                 ["re-prefill", f"{r2048['recompute_ttft_s']:.1f} s",
                  f"{ANCHOR['recompute_s']:.0f} s"]], title="Anchor")
    print(f"\npeak RSS {figures['peak_rss_mib']:.0f} MiB; torch threads {figures['threads']}")
    cold_x = [at[("float32", n)]["cold_speedup"] for n in lengths]
    goals = [
        Goal("cold resume to the next token at 2048 fp32", 1e3 * r2048["cold_ttft_s"], "<=",
             70.0, " ms"),
        Goal("warm resume to the next token at 2048 fp32", 1e3 * r2048["warm_ttft_s"], "<=",
             45.0, " ms"),
        Goal("cold resume speedup at 2048 fp32", r2048["cold_speedup"], ">=", 20.0, "x"),
        Goal("warm resume speedup at 2048 fp32", r2048["warm_speedup"], ">=", 40.0, "x"),
        Goal("decode tok/s hot-pool / DynamicCache at 2048", dec["ratio"], ">=", 0.9),
    ]
    if len(cold_x) > 1:
        goals.append(Goal("cold speedup grows with length (min step ratio)",
                          min(b / a for a, b in itertools.pairwise(cold_x)), ">=", 1.0, "x"))
    write_result(Result("resume", "python -m bench.resume", figures, goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
