"""Workloads of `bench.batch`: each builds a fresh store and engine over one loaded model, runs,
and returns a JSON-ready dict. Kept apart from the table and goal code in `batch.py`."""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from kvagentd.config import AgentConfig, AssetConfig, ExecutorConfig, FaultConfig
from kvagentd.engine.executor import GenerationRequest, Job, Priority
from kvagentd.engine.model import LoadedModel, model_geometry
from kvagentd.engine.service import Engine
from kvagentd.engine.sessions import ChatFormat, Session
from kvagentd.engine.threads import in_pool
from kvagentd.kvcache.base import ColdListener
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

BLOCK_TOKENS = 16
QUESTION = "Assess: rms 2.31 mm/s, crest 3.4, zone B."
SYSTEM = "You watch the vibration of industrial pumps. Answer in one short sentence."


def history_ids(tok: Any, n: int, seed: int) -> list[int]:
    """n token ids of a plausible agent history, different per `seed`."""
    lines, i = [], seed * 7
    while True:
        rms = 1.2 + (i % 37) * 0.05
        lines.append(f"<|im_start|>user\nasset {seed} tick {i}: rms {rms:.2f} mm/s, crest "
                     f"{3.1 + (i % 7) * 0.1:.1f}, zone {'A' if rms < 1.4 else 'B'}<|im_end|>\n"
                     f"<|im_start|>assistant\nVibration {'normal' if rms < 2.3 else 'elevated'};"
                     f" no action.<|im_end|>\n")
        i += 1
        if i % 16 == 0:
            ids = tok("".join(lines), add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                return list(ids[:n])


@contextmanager
def engine_for(lm: LoadedModel, root: Path, *, hot_tokens: int, **cfg: Any
               ) -> Iterator[tuple[Engine, TieredKVStore]]:
    """A fresh store (hot = `hot_tokens`, warm = hot, cold under a temporary directory) and a
    started engine with `ExecutorConfig(**cfg)`; both closed on exit."""
    d = Path(tempfile.mkdtemp(prefix="batch-", dir=root))
    geo = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    ns = make_namespace(lm.fingerprint, lm.dtype, BLOCK_TOKENS)
    hot = (hot_tokens // BLOCK_TOKENS + 64) * geo.block_bytes

    def cold(listener: ColdListener) -> ColdStore:
        return ColdStore(d / "cold", geo, ns, codec="raw", capacity_bytes=max(8 * hot, 1 << 30),
                         segment_bytes=64 << 20, io_unit_bytes=128 << 10, o_direct=False,
                         listener=listener)

    store = TieredKVStore(geo, ns, hot_bytes=hot, warm_bytes=hot, cold=cold)
    engine = Engine(lm, store, state_dir=d / "state", executor_config=ExecutorConfig(**cfg))
    engine.start()
    try:
        yield engine, store
    finally:
        engine.stop()
        store.close()
        shutil.rmtree(d, ignore_errors=True)


class StepLog:
    """Per-step figures (batch size, tokens, seconds) and the memory held beyond the hot pool."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[tuple[int, int, float]] = []
        self.peak_beyond_hot = 0
        self.per_sequence: list[float] = []
        self._engine = engine
        engine.executor.on_step = self._on_step

    def _on_step(self, size: int, tokens: int, seconds: float) -> None:
        self.steps.append((size, tokens, seconds))
        mem = self._engine.blocks.status()
        held = mem["working_copy_bytes"] + mem["paged_scratch_bytes"]
        self.peak_beyond_hot = max(self.peak_beyond_hot, held + self._engine.runner.nbytes())
        self.per_sequence.append(held / size)

    def figures(self) -> dict[str, Any]:
        dec = [(s, d) for s, t, d in self.steps if t == s]
        top = max((s for s, _ in dec), default=0)
        full = [d for s, d in dec if s == top]
        return {"steps": len(self.steps),
                "full_batch": top,
                "full_decode_step_ms_p50": 1e3 * statistics.median(full) if full else 0.0,
                "mean_batch": statistics.fmean(s for s, _, _ in self.steps) if self.steps else 0,
                "decode_tok_s": sum(s for s, _ in dec) / sum(d for _, d in dec) if dec else 0.0,
                "decode_step_ms_p50": 1e3 * statistics.median(d for _, d in dec) if dec else 0.0,
                "peak_beyond_hot_bytes": self.peak_beyond_hot,
                "beyond_hot_bytes_per_sequence": max(self.per_sequence, default=0.0)}


def run_jobs(submit: Callable[[], list[Job]]) -> tuple[list[Any], float]:
    t0 = time.perf_counter()
    jobs = submit()
    results = [j.result() for j in jobs]
    return results, time.perf_counter() - t0


def spread(n: int, hist: tuple[int, int]) -> list[int]:
    """n history lengths spread evenly over `hist[0]`..`hist[1]` (one: their middle)."""
    lo, hi = hist
    if n == 1:
        return [(lo + hi) // 2]
    return [lo + (hi - lo) * i // (n - 1) for i in range(n)]


def sessions(lm: LoadedModel, root: Path, n: int, hist: tuple[int, int], new: int,
             max_batch: int) -> dict[str, Any]:
    """n sessions with stored histories of `hist[0]`..`hist[1]` tokens ask one turn at once."""
    lengths = spread(n, hist)
    with engine_for(lm, root, hot_tokens=sum(lengths) + n * (new + 96),
                    max_batch=max_batch) as (eng, _):
        for i, length in enumerate(lengths):  # setup: store every history's blocks (not timed)
            eng.table.save(Session(f"s{i}", history_ids(lm.tokenizer, length, i)))
            eng.ask(f"s{i}", None, max_new_tokens=1)
        decode_all(eng)
        log = StepLog(eng)
        res, wall = run_jobs(lambda: [eng.submit(GenerationRequest(
            f"s{i}", QUESTION, None, new, Priority.TICK)) for i in range(n)])
    gen = sum(r.new_tokens for r in res)
    return {"sessions": n, "history": lengths, "max_batch": max_batch, "generated": gen,
            "wall_s": wall, "tok_s": gen / wall, "texts": [r.text for r in res],
            "ttft_p50_s": statistics.median(r.ttft_s for r in res), **log.figures()}


def decode_all(eng: Engine) -> None:
    """Throughput runs decode exactly the tokens asked for, whatever the model would stop at
    (transformers: `min_new_tokens`, and no end token for `generate_batch`), so every path
    does the same work; the greedy tokens up to a stop are unchanged."""
    eng.chat.stop_ids = frozenset()


def chat_prompts(tok: Any, n: int, length: int) -> list[list[int]]:
    """n distinct chat prompts of about `length` tokens (no shared prefix beyond the template)."""
    out = []
    for i in range(n):
        body = tok.decode(history_ids(tok, length - 24, 100 + i))
        text = tok.apply_chat_template([{"role": "user", "content": body}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


def fresh_engine(lm: LoadedModel, root: Path, prompts: list[list[int]], new: int,
                 max_batch: int) -> dict[str, Any]:
    """The prompts as new sessions, nothing stored: every prompt token is prefilled."""
    total = sum(len(p) + new for p in prompts)
    with engine_for(lm, root, hot_tokens=total, max_batch=max_batch) as (eng, _):
        for i, p in enumerate(prompts):
            eng.table.save(Session(f"p{i}", p))
        decode_all(eng)
        log = StepLog(eng)
        res, wall = run_jobs(lambda: [eng.submit(GenerationRequest(
            f"p{i}", None, None, new, Priority.TICK)) for i in range(len(prompts))])
    gen = sum(r.new_tokens for r in res)
    return {"generated": gen, "wall_s": wall, "tok_s": gen / wall, **log.figures()}


def hf_generate(lm: LoadedModel, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """transformers' `generate` over one left-padded batch (sdpa, DynamicCache), in a thread
    that owns the intra-op pool as the engine's worker does (`engine/threads.py`). Each
    decode step is timed from one logits-processor call to the next."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    model, tok = lm.model, lm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    def run() -> tuple[Any, float]:
        model.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad,
                                 logits_processor=LogitsProcessorList([Stamp()]))
        return out, t0

    out, t0 = in_pool(run, lm.threads)
    wall = time.perf_counter() - t0
    gen = int(out[:, width:].numel())  # min_new_tokens: every row decodes `new` tokens
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    step = statistics.median(steps) if steps else float("nan")
    return {"generated": gen, "wall_s": wall, "tok_s": gen / wall, "rows": len(prompts),
            "width": width, "prefill_s": stamps[0] - t0 if stamps else None,
            "decode_step_ms_p50": 1e3 * step, "decode_tok_s": len(prompts) / step}


def hf_generate_batch(lm: LoadedModel, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """transformers' continuous batching (`generate_batch`, paged cache), sized to the load."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model, tok = lm.model, lm.tokenizer
    page = 64
    blocks = sum(-(-(len(p) + new) // page) for p in prompts) + 4
    cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1,  # -1: no stop
                           pad_token_id=tok.pad_token_id or 0)
    cb = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=256, page_size=page)

    def run() -> tuple[Any, float]:
        model.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=cfg,
                                   continuous_batching_config=cb, warmup=False)
        return out, t0

    out, t0 = in_pool(run, lm.threads)
    wall = time.perf_counter() - t0
    gen = sum(len(o.generated_tokens) for o in out.values())
    return {"generated": gen, "wall_s": wall, "tok_s": gen / wall}


def turn_ids(lm: LoadedModel, history: list[int], text: str) -> list[int]:
    """The ids the engine runs for `text` asked in a session holding `history`."""
    return history + ChatFormat(lm.tokenizer).next_turn(text)


def hf_prefill(lm: LoadedModel, prompts: list[list[int]]) -> dict[str, Any]:
    """transformers' one-shot prefill of each prompt alone (logits of the last token only),
    in a thread that owns the intra-op pool; the median of the prompts."""
    import torch

    def run() -> list[float]:
        lm.model.set_attn_implementation("sdpa")
        out = []
        with torch.no_grad():
            for p in prompts:
                t0 = time.perf_counter()
                lm.model(input_ids=torch.tensor([p]), logits_to_keep=1)
                out.append(time.perf_counter() - t0)
        return out

    times = in_pool(run, lm.threads)
    s = statistics.median(times)
    return {"tokens": statistics.fmean(len(p) for p in prompts), "prefill_s": s,
            "tok_s": statistics.fmean(len(p) for p in prompts) / s, "all_s": times}


def engine_prefill(lm: LoadedModel, root: Path, prompts: list[list[int]]) -> dict[str, Any]:
    """Each prompt alone as a new session's whole input (nothing stored): time from
    admission to its first token, the median of the prompts."""
    total = max(len(p) for p in prompts) + 64
    with engine_for(lm, root, hot_tokens=len(prompts) * total) as (eng, _):
        decode_all(eng)
        log = StepLog(eng)
        times = []
        for i, p in enumerate(prompts):
            eng.table.save(Session(f"prefill{i}", p))
            r = eng.submit(GenerationRequest(f"prefill{i}", None, None, 1,
                                             Priority.TICK)).result()
            times.append(r.ttft_s)
        steps = [t for _, t, _ in log.steps]
    s = statistics.median(times)
    return {"tokens": statistics.fmean(len(p) for p in prompts), "prefill_s": s,
            "tok_s": statistics.fmean(len(p) for p in prompts) / s, "all_s": times,
            "steps_per_prompt": len(steps) / len(prompts)}


def bandwidth(threads: int) -> dict[str, float]:
    """Memory bandwidth of this machine now, in the engine's thread setting: a 512 MiB copy
    (bytes copied per second) and a 512 MiB read (sum), best of three each."""
    import torch

    def run() -> dict[str, float]:
        src = torch.ones(128 << 20)
        dst = torch.zeros(128 << 20)
        n = src.numel() * src.element_size()
        copy, read = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            copy.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            src.sum()
            read.append(time.perf_counter() - t0)
        return {"copy_gb_s": n / min(copy) / 1e9, "read_gb_s": n / min(read) / 1e9}

    return in_pool(run, threads)


def weight_bytes(lm: LoadedModel) -> int:
    """Bytes of the model's parameters (a tied embedding counted once)."""
    return sum(p.numel() * p.element_size() for p in lm.model.parameters())


def kv_bytes_per_token(lm: LoadedModel) -> int:
    g = model_geometry(lm.model, BLOCK_TOKENS, lm.dtype)
    return g.block_bytes // BLOCK_TOKENS


def agent_config(n: int, **kw: Any) -> AgentConfig:
    assets = tuple(AssetConfig(name=f"pump-{i}", seed=i + 1, fault=FaultConfig(
        kind="outer_race" if i % 2 else "none", onset_s=60.0)) for i in range(n))
    return AgentConfig(tick_interval_s=3.0, assessment_max_tokens=24, session_token_budget=1536,
                       report_max_tokens=kw.pop("report_tokens", 96), assets=assets, **kw)


@contextmanager
def agent_for(lm: LoadedModel, root: Path, n: int, max_batch: int, **agent_kw: Any
              ) -> Iterator[tuple[Any, Engine, TieredKVStore]]:
    """An engine with `max_batch` and the real agent ticking `n` simulated assets every 3 s
    (the product's APScheduler jobs: max_instances=1, coalesce; skips are counted)."""
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers.background import BackgroundScheduler

    from kvagentd.agent.agent import Agent

    with engine_for(lm, root, hot_tokens=n * 2048 + 4096, max_batch=max_batch,
                    queue_size=max(32, 4 * n)) as (eng, store):
        sched = BackgroundScheduler(timezone="UTC",
                                    executors={"default": ThreadPoolExecutor(max(10, n + 4))})
        sched.start()
        d = Path(tempfile.mkdtemp(prefix="agent-", dir=root))
        agent = Agent(agent_config(n, **agent_kw), eng.executor, sched, d,
                      store_stats=store.stats)
        agent.start()
        try:
            yield agent, eng, store
        finally:
            sched.pause()
            agent.stop()
            sched.shutdown(wait=False)
            shutil.rmtree(d, ignore_errors=True)


def assets(lm: LoadedModel, root: Path, n: int, seconds: float, max_batch: int
           ) -> dict[str, Any]:
    """n assets ticking for `seconds`: tick latency (pooled), skipped and missed ticks."""
    with agent_for(lm, root, n, max_batch) as (agent, eng, _):
        log = StepLog(eng)
        time.sleep(seconds)
        states = list(agent.assets.values())
        lat = np.asarray([x for st in states for x in st.latencies], dtype=float)
        skipped = sum(st.skipped + st.missed for st in states)
        errors = sum(st.llm_errors for st in states)
        ticks = sum(st.ticks for st in states)
        commented = sum(st.commentaries for st in states)
        shown = sum(st.commentaries - st.withheld for st in states)
        cut = eng.metrics.registry.get_sample_value(
            "kvagentd_engine_requests_total", {"priority": "tick", "outcome": "deadline"}) or 0
        figures = log.figures()
        turn = [st.turn_tokens for st in states]
    share = commented / ticks if ticks else 0.0
    return {"assets": n, "max_batch": max_batch, "seconds": seconds, "ticks": int(lat.size),
            "expected_ticks": int(n * seconds / 3.0), "skipped": skipped, "llm_errors": errors,
            "cut_at_deadline": int(cut), "commented_share": share,
            "shown_share": shown / ticks if ticks else 0.0, "turn_tokens_last": turn,
            "p50_s": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_s": float(np.percentile(lat, 99)) if lat.size else None,
            "ok": bool(lat.size) and float(np.percentile(lat, 99)) < 3.0 and skipped == 0
            and errors == 0 and share >= 0.9, **figures}


def fairness(lm: LoadedModel, root: Path, n: int, warmup_s: float, max_batch: int,
             report_tokens: int) -> dict[str, Any]:
    """With n assets ticking, an operator question's time to first token and a weekly
    report's completion time."""
    with agent_for(lm, root, n, max_batch, report_tokens=report_tokens) as (agent, eng, _):
        time.sleep(warmup_s)
        busy = eng.executor.status()["batch"]
        t0 = time.perf_counter()
        rid = agent.reports.start("weekly", asset="pump-0")
        t1 = time.perf_counter()
        ask = eng.submit(GenerationRequest("operator", "What needs attention first?", SYSTEM,
                                           64, Priority.ASK))
        first = threading.Event()
        ttft: list[float] = []

        def watch() -> None:
            for _ in ask.stream():
                if not first.is_set():
                    ttft.append(time.perf_counter() - t1)
                    first.set()

        th = threading.Thread(target=watch)
        th.start()
        res = ask.result()
        th.join()
        doc = agent.reports.wait_for(rid, timeout=3600)
        report_s = time.perf_counter() - t0
        skipped = sum(st.skipped + st.missed for st in agent.assets.values())
    return {"assets": n, "ask_ttft_s": ttft[0] if ttft else None, "ask_tokens": res.new_tokens,
            "report_s": report_s, "report_state": (doc or {}).get("state"),
            "skipped_ticks": skipped, "batch_before": busy}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def record_ticks(lm: LoadedModel, root: Path, n: int, seconds: float
                 ) -> list[tuple[list[int], GenerationRequest]]:
    """The agent's tick requests over `seconds` with n assets, each with its session's ids at
    submit time (a session's ticks run one after the other, so those ids are final)."""
    recorded: list[tuple[list[int], GenerationRequest]] = []
    with agent_for(lm, root, n, 16) as (_, eng, _store):
        submit_all = eng.executor.submit_all

        def recording(reqs: Any) -> Any:
            reqs = list(reqs)
            for req in reqs:
                s = eng.table.get(req.session)
                recorded.append((list(s.token_ids) if s else [], req))
            return submit_all(reqs)

        eng.executor.submit_all = recording  # type: ignore[method-assign]
        time.sleep(seconds)
    return recorded


def replay_ticks(lm: LoadedModel, root: Path, ticks: list[tuple[list[int], GenerationRequest]]
                 ) -> dict[str, Any]:
    """Each recorded tick as its own request (its session's ids, then its turn), batched."""
    # the hot pool holds a full batch; the rest of the replayed sessions go warm and cold
    longest = max((len(ids) for ids, _ in ticks), default=0) + 128
    with engine_for(lm, root, hot_tokens=16 * longest,
                    queue_size=max(32, len(ticks))) as (eng, _):
        for k, (ids, _) in enumerate(ticks):
            if ids:
                eng.table.save(Session(f"r{k}", ids))
        # as the agent asked: one sentence, its constraints; no deadline (text, not time)
        res, wall = run_jobs(lambda: [eng.submit(dataclasses.replace(
            r, session=f"r{k}", deadline_s=None)) for k, (_, r) in enumerate(ticks)])
    return {"texts": [r.text for r in res], "wall_s": wall,
            "generated": sum(r.new_tokens for r in res)}


def first_logits_error(ref: LoadedModel, other: LoadedModel,
                       ticks: list[tuple[list[int], GenerationRequest]]) -> float:
    """Largest |difference| of the first-token logits of `other` against `ref` over the ticks'
    full prompts (session ids + the tick's turn), each model in a pool thread of its own."""
    import torch

    chat = ChatFormat(ref.tokenizer)
    prompts = []
    for ids, req in ticks:
        text = req.text or ""
        prompts.append(ids + chat.next_turn(text) if ids else chat.first_turn(req.system, text))

    def logits(lm: LoadedModel) -> list[Any]:
        lm.model.set_attn_implementation("sdpa")
        with torch.no_grad():
            return [lm.model(input_ids=torch.tensor([p]), logits_to_keep=1).logits[0, -1].float()
                    for p in prompts]

    a = in_pool(lambda: logits(ref), ref.threads)
    b = in_pool(lambda: logits(other), other.threads)
    return max((float((x - y).abs().max()) for x, y in zip(a, b)), default=0.0)


def rss_mib() -> float:
    """Resident set size of this process now (not the peak)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * (os.sysconf("SC_PAGE_SIZE") / 2**20)


def memory_flat(lm: LoadedModel, root: Path, n: int, seconds: float,
                every_s: float = 30.0) -> dict[str, Any]:
    """n assets ticking for `seconds`: RSS and Python heap (tracemalloc) sampled every
    `every_s`; growth measured after the first fifth (warm-up: sessions, caches, pools fill)."""
    import tracemalloc

    tracemalloc.start()
    samples: list[tuple[float, float, float]] = []
    try:
        with agent_for(lm, root, n, 16) as (agent, eng, _):
            t0 = time.monotonic()
            while (now := time.monotonic() - t0) < seconds:
                time.sleep(min(every_s, seconds - now))
                cur, _peak = tracemalloc.get_traced_memory()
                samples.append((time.monotonic() - t0, rss_mib(), cur / 2**20))
            steps = eng.executor.step_count
            ticks = sum(st.ticks for st in agent.assets.values())
    finally:
        tracemalloc.stop()
    warm = [s for s in samples if s[0] >= seconds / 5] or samples
    span_min = max(1e-9, (warm[-1][0] - warm[0][0]) / 60.0)
    return {"assets": n, "seconds": seconds, "steps": steps, "ticks": ticks,
            "samples": samples,
            "rss_growth_mib_per_min": (warm[-1][1] - warm[0][1]) / span_min,
            "heap_growth_mib_per_min": (warm[-1][2] - warm[0][2]) / span_min,
            "rss_first_mib": warm[0][1], "rss_last_mib": warm[-1][1]}
