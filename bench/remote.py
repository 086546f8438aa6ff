"""The remote tier (Redis / Valkey) against plain GET/SET, resume on a second box, and its cost
to a tick. The benchmark starts its own redis-server on a free loopback port (no persistence),
or uses `--url`.

1. Throughput, SmolLM2-sized blocks (30 x 2 x 3 x 16 x 64 fp32, 737 KB; 128 = 94 MB):
   write = `RemoteStore.publish_blocks` (encode the cold record, checksum, queue) until the
   write-behind queue has sent everything, vs pipelined SETs of the same record bytes in the
   same batches with the same client; read = `RemoteColdTier.read_remote` (pipelined GETEX,
   every record verified and decoded into a tensor) vs pipelined GETs of the same keys in the
   same batches. Goal: tier / plain >= 0.8 both ways.
2. Resume of a 2048-token session on a second box: box A (composition root, remote on) writes
   the session; box B adopts it and answers a new turn (adoption + the turn's wall time:
   manifest, prefix lookup, remote reads, checks, local fill, suffix prefill, 2 tokens) vs the
   same turn on a box without the remote (a full prefill). Goal: >= 10x on loopback.
3. A tick's p99 with the remote tier on vs off: two boxes with the same asset and sensor, ticks
   alternating between them (`Agent.tick_once`, the model's turn included). Goal: p99 on /
   p99 off <= 1.05.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.remote            # SmolLM2 fp32, 2048 tokens
    .venv/bin/python -m bench.remote --quick                      # smoke: tiny model, small sizes
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import Goal, Result, print_table, write_result
from bench.resume import history_ids

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("KVAGENTD_BENCH_CACHE", ROOT / "var" / "test-cache"))
QUESTION = "Assess: rms 2.31 mm/s, crest 3.4, zone B."
COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python -m bench.remote"


# -- the server -------------------------------------------------------------------------------

class Server:
    """A redis-server on a free loopback port in `d`, without persistence."""

    def __init__(self, d: Path) -> None:
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(exe).exists():
            sys.exit("redis-server not found: apt-get install redis-server (or pass --url)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        d.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(d),
                                      "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        sys.exit("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


# -- 1. throughput ------------------------------------------------------------------------------

def _tier_write(client: Any, remote: Any, keys: list[bytes], blocks: torch.Tensor) -> float:
    client.flushall()
    t = time.perf_counter()
    remote.publish_blocks(keys, list(blocks))
    assert remote.writer.flush(600.0)
    return time.perf_counter() - t


def _plain_set(client: Any, names: list[str], values: list[bytes], ttl: int) -> float:
    from kvagentd.kvcache.remote.writer import BATCH_BYTES

    per = max(1, BATCH_BYTES // len(values[0]))
    client.flushall()
    t = time.perf_counter()
    for s in range(0, len(names), per):
        pipe = client.pipeline(transaction=False)
        for name, v in zip(names[s:s + per], values[s:s + per]):
            pipe.set(name, v, ex=ttl)
        pipe.execute()
    return time.perf_counter() - t


def _tier_read(tier: Any, keys: list[bytes], blocks: torch.Tensor, outs: torch.Tensor) -> float:
    outs.zero_()
    t = time.perf_counter()
    ok = tier.read_remote(list(keys), list(outs))
    dt = time.perf_counter() - t
    assert all(ok) and torch.equal(outs, blocks)
    return dt


def _plain_get(client: Any, names: list[str], values: list[bytes]) -> float:
    from kvagentd.kvcache.remote.tier import READ_BATCH_BYTES

    per = max(1, READ_BATCH_BYTES // len(values[0]))
    t = time.perf_counter()
    got = 0
    for s in range(0, len(names), per):
        pipe = client.pipeline(transaction=False)
        for name in names[s:s + per]:
            pipe.get(name)
        got += sum(len(v) for v in pipe.execute())
    dt = time.perf_counter() - t
    assert got == sum(len(v) for v in values)
    return dt


def throughput(url: str, n_blocks: int, reps: int) -> dict[str, Any]:
    from kvagentd.kvcache.base import KVGeometry
    from kvagentd.kvcache.cold import ColdTierSpec, build_cold_tier
    from kvagentd.kvcache.keys import block_keys, make_namespace
    from kvagentd.kvcache.remote import RemoteColdTier, RemoteSpec, RemoteStore, make_client

    geo = KVGeometry(30, 3, 64, 16, torch.float32)
    spec = RemoteSpec(url=url, write_rate_bytes_per_s=1 << 40, write_queue_bytes=4 << 30,
                      read_timeout_s=10.0, write_timeout_s=10.0)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randn((n_blocks, *geo.block_shape), generator=g)
    outs = torch.empty_like(blocks)
    client = make_client(spec, 10.0)
    rows: dict[str, list[float]] = {k: [] for k in ("tier_write", "plain_set", "tier_read",
                                                     "plain_get")}
    d = Path(tempfile.mkdtemp(prefix="kvbr", dir=ROOT / "var"))
    ns = make_namespace(f"bench-remote-{time.time()}", torch.float32, 16)
    remote = RemoteStore(spec, geo, ns)
    tier = RemoteColdTier(build_cold_tier(ColdTierSpec(cold_dir=d / "c", shadow_dir=d / "s",
                                                       o_direct=False), geo, ns), remote)
    try:
        for rep in range(reps + 1):  # the first round warms up (record buffers, connections)
            keys = block_keys(ns, list(range(rep * n_blocks * 16, (rep + 1) * n_blocks * 16)), 16)
            client.flushall()
            values = [bytes(remote.records.encode(k, b)) for k, b in zip(keys, blocks)]
            names = [remote.names.block(k) for k in keys]
            # the order alternates each round: whichever goes second may find the server's
            # memory (or this process's allocator) warmer
            if rep % 2:
                t_set = _plain_set(client, names, values, remote.ttl)
                t_write = _tier_write(client, remote, keys, blocks)
                t_get = _plain_get(client, names, values)
                t_read = _tier_read(tier, keys, blocks, outs)
            else:
                t_write = _tier_write(client, remote, keys, blocks)
                t_set = _plain_set(client, names, values, remote.ttl)
                t_read = _tier_read(tier, keys, blocks, outs)
                t_get = _plain_get(client, names, values)
            if rep:
                for k, v in (("tier_write", t_write), ("plain_set", t_set), ("tier_read", t_read),
                             ("plain_get", t_get)):
                    rows[k].append(v)
        assert remote.writer.status()["written"] == (reps + 1) * n_blocks
    finally:
        tier.close()
        shutil.rmtree(d, ignore_errors=True)
        client.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    nbytes = n_blocks * len(values[0])
    return {"blocks": n_blocks, "bytes": nbytes, "reps": reps,
            **{f"{k}_s": v for k, v in med.items()},
            **{f"{k}_MBps": nbytes / v / 1e6 for k, v in med.items()},
            "write_ratio": med["plain_set"] / med["tier_write"],
            "read_ratio": med["plain_get"] / med["tier_read"]}


# -- boxes from the composition root -----------------------------------------------------------

def box_config(d: Path, box: str, url: str | None, model: str, *, agent: bool,
               hot: str) -> Any:
    from kvagentd.config import load_config

    model_toml = ('source = "embedded"' if model == "smollm2" else
                  f'source = "hf_dir"\npath = "{tiny_dir()}"')
    remote = f'[remote]\nurl = "{url}"\nbox_id = "{box}"\nread_timeout_s = 1.0\n' \
             f'write_rate_bytes_per_s = "1GiB"\nheartbeat_interval_s = 60.0\n' if url else ""
    agent_toml = ('[agent]\nenabled = true\nassessment_max_tokens = 24\n'
                  '[[agent.assets]]\nname = "pump-1"\nseed = 3\n') if agent else \
        "[agent]\nenabled = false\n"
    path = d / f"{box}.toml"
    path.write_text(f"""
[daemon]
state_dir = "{d}/{box}/state"
cache_dir = "{CACHE_DIR}"
[control]
socket = "{d}/{box}/k.sock"
socket_group = ""
operator_group = ""
[model]
{model_toml}
device = "cpu"
dtype = "float32"
[kv]
cold_dir = "{d}/{box}/cold"
hot_bytes = "{hot}"
warm_ratio = 1.0
cold_capacity_bytes = "2GiB"
segment_bytes = "64MiB"
o_direct = false
[maintenance]
shadow_dir = "{d}/{box}/shm"
shadow_bytes = "64MiB"
health_status_file = "{d}/{box}/state/ssd-health.json"
{remote}
{agent_toml}
""")
    return load_config(path, env={})


def tiny_dir() -> Path:
    from kvagentd.engine.tiny import tiny_model_dir

    return tiny_model_dir(CACHE_DIR)


class Box:
    def __init__(self, config: Any) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler
        from prometheus_client import CollectorRegistry

        from kvagentd.services import BuildContext, build_services

        self.scheduler = BackgroundScheduler()
        self.scheduler.start(paused=True)
        self.services = build_services(config, BuildContext(self.scheduler, CollectorRegistry()))
        self.started = []
        for _n, s in self.services.in_order():
            s.start()
            self.started.append(s)

    def stop(self) -> None:
        for s in reversed(self.started):
            s.stop()
        self.scheduler.shutdown(wait=False)


def resume(url: str, model: str, tokens: int, root: Path) -> dict[str, Any]:
    from kvagentd.engine.sessions import Session

    hot = f"{max(64, tokens // 16 * 3 // 2)}MiB"
    a = Box(box_config(root, "box-a", url, model, agent=False, hot=hot))
    hist = history_ids(a.services.engine.tokenizer, tokens)
    sid = "resume-1"
    a.services.engine.table.save(Session(sid, list(hist)))
    a.services.engine.ask(sid, QUESTION, max_new_tokens=2, timeout=600)
    assert a.services.remote.remote.writer.flush(600.0)
    a.stop()

    b = Box(box_config(root, "box-b", url, model, agent=False, hot=hot))
    c = Box(box_config(root, "box-c", None, model, agent=False, hot=hot))
    try:
        t = time.perf_counter()
        adopted = b.services.remote.adopt(sid, force=True, uid=None)
        t_adopt = time.perf_counter() - t
        res = b.services.engine.ask(sid, QUESTION, max_new_tokens=2, timeout=600)
        t_resume = time.perf_counter() - t

        after = b.services.engine.table.get(sid)  # the adopted ids, then B's turn
        assert after is not None
        c.services.engine.table.save(Session(sid, list(after.token_ids[:adopted["tokens"]])))
        t = time.perf_counter()
        rec = c.services.engine.ask(sid, QUESTION, max_new_tokens=2, timeout=600)
        t_recompute = time.perf_counter() - t
        reads = b.services.remote.status()["reads"]
        return {"model": model, "tokens": len(hist), "session_tokens": adopted["tokens"],
                "adopt_s": t_adopt, "resume_s": t_resume, "recompute_s": t_recompute,
                "speedup": t_recompute / t_resume, "resume_reused_tokens": res.reused_tokens,
                "resume_recomputed_tokens": res.recomputed_tokens,
                "resume_prefill_tokens": res.prefill_tokens,
                "recompute_prefill_tokens": rec.prefill_tokens, "resume_loaded": res.loaded,
                "resume_timings_s": res.timings, "remote_hits": reads["remote_hits"],
                "same_answer": res.text == rec.text}
    finally:
        b.stop()
        c.stop()


# -- 3. tick p99 -------------------------------------------------------------------------------

def ticks(url: str, model: str, n: int, root: Path) -> dict[str, Any]:
    on = Box(box_config(root, "tick-on", url, model, agent=True, hot="256MiB"))
    off = Box(box_config(root, "tick-off", None, model, agent=True, hot="256MiB"))
    lat: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for i in range(n + 2):
            for name, box in (("on", on), ("off", off)) if i % 2 == 0 else (("off", off),
                                                                             ("on", on)):
                t = time.perf_counter()
                row = box.services.agent.tick_once("pump-1")
                dt = time.perf_counter() - t
                assert row.get("session") is not None and "llm:" not in (row.get("note") or ""), row
                if i >= 2:  # the first two ticks warm up
                    lat[name].append(dt)
        written = on.services.remote.remote.writer.status()["written"]
    finally:
        on.stop()
        off.stop()
    p = {k: float(np.percentile(v, 99)) for k, v in lat.items()}
    return {"ticks": n, "p99_on_s": p["on"], "p99_off_s": p["off"],
            "p50_on_s": statistics.median(lat["on"]), "p50_off_s": statistics.median(lat["off"]),
            "p99_ratio": p["on"] / p["off"], "blocks_written_behind": written}


# -- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, small sizes")
    p.add_argument("--url", help="an existing Redis / Valkey (default: start one here)")
    p.add_argument("--ticks", type=int, default=None, help="ticks per box for the p99")
    # NOTE: run by `python -m bench` (make bench), sys.argv holds that command's arguments
    args = p.parse_args(argv if argv is not None else
                        sys.argv[1:] if __name__ == "__main__" else [])
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    from kvagentd.daemon import log

    log.configure("warning")
    (ROOT / "var").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvbench-remote", dir=ROOT / "var"))
    server = None if args.url else Server(root / "redis")
    url = args.url or server.url  # type: ignore[union-attr]
    model = "tiny" if args.quick else "smollm2"
    try:
        tp = throughput(url, 16 if args.quick else 128, 2 if args.quick else 6)
        print_table(["path", "tier s", "plain s", "tier MB/s", "plain MB/s", "ratio"], [
            ["write", tp["tier_write_s"], tp["plain_set_s"], tp["tier_write_MBps"],
             tp["plain_set_MBps"], tp["write_ratio"]],
            ["read", tp["tier_read_s"], tp["plain_get_s"], tp["tier_read_MBps"],
             tp["plain_get_MBps"], tp["read_ratio"]]],
            title=f"Throughput, {tp['blocks']} blocks ({tp['bytes'] / 1e6:.0f} MB), median of "
                  f"{tp['reps']}")
        rs = resume(url, model, 512 if args.quick else 2048, root)
        print_table(["model", "tokens", "adopt s", "resume s", "recompute s", "speedup",
                     "reused", "recomputed", "same answer"],
                    [[rs["model"], rs["session_tokens"], rs["adopt_s"], rs["resume_s"],
                      rs["recompute_s"], rs["speedup"], rs["resume_reused_tokens"],
                      rs["resume_recomputed_tokens"], rs["same_answer"]]],
                    title="Resume on a second box from the remote tier vs recompute")
        tk = ticks(url, model, args.ticks or (6 if args.quick else 60), root)
        print_table(["ticks", "p50 on", "p50 off", "p99 on", "p99 off", "p99 on/off"],
                    [[tk["ticks"], tk["p50_on_s"], tk["p50_off_s"], tk["p99_on_s"],
                      tk["p99_off_s"], tk["p99_ratio"]]], title="Tick latency, remote on vs off")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    res = Result("remote", COMMAND + (" --quick" if args.quick else ""),
                 figures={"quick": args.quick, "throughput": tp, "resume": rs, "ticks": tk})
    res.goals = [Goal("remote write / plain SET", tp["write_ratio"], ">=", 0.8),
                 Goal("remote read / plain GET", tp["read_ratio"], ">=", 0.8),
                 Goal(f"resume {rs['session_tokens']} tokens from remote vs recompute",
                      rs["speedup"], ">=", 10.0, " x"),
                 Goal("tick p99 remote on / off", tk["p99_ratio"], "<=", 1.05)]
    write_result(res)
    return 0 if all(g.passed for g in res.goals) else 1


if __name__ == "__main__":
    sys.exit(main())
