"""Accelerated soak: 72 simulated hours of 3-s ticks in minutes, with SSD faults midway.

What runs, on a simulated clock (no sleeping):
- the store (`TieredKVStore`: hot / warm arenas) over the shadow-failover cold tier
  (`build_tiers`, the SSD side wrapped in a `FaultyFileIO`);
- every tick (86 400 of them): store traffic of `--assets` synthetic assets, each appending one
  turn (48 tokens = 3 blocks) to its rolling session (match -> ensure_resident -> allocate_hot
  -> commit -> release -> record_access), old sessions aged hot -> warm -> cold and retired
  after `RETIRE_H` hours, and a replay that resumes a session from the cold tier every 10 min;
  every block's content is known (seeded), so every load is checked byte for byte;
- the real agent tick (`Agent.tick_once`: simulated vibration source, features, event log)
  every `--agent-every` ticks, and with the LLM step (the engine on the tiny random model)
  every `--llm-every` ticks: the LLM is far too slow on this CPU for all 86 400 ticks;
- maintenance timers on the simulated clock: health every 60 s, defrag every 2 h (at tick
  boundaries, i.e. idle), scrub every 6 h;
- SSD faults from hour 36: write EIO (1 h), ENOSPC (30 min), EROFS (15 min), read EIO 30 %
  plus torn writes (15 min); then the SSD heals and the cold tier fails back after good probes.

Reported: RSS at hour 1 and hour 72, hot-pool fragmentation hourly and after each defrag,
allocation failures, lost committed blocks (a block committed and not retired that cannot be
loaded, outside the fault window, or served with wrong bytes anywhere), skipped ticks.

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.soak            # full 72 h
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.soak --hours 4  # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import structlog
import torch
import xxhash

from bench.common import Goal, Result, print_table, write_result
from kvagentd.config import Config, ModelConfig, load_config
from kvagentd.kvcache.base import KVGeometry, Tier
from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache import keys as keymod
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.maintenance import health
from kvagentd.kvcache.cold.faults import FaultPlan, FaultyFileIO
from kvagentd.maintenance.service import Maintenance
from kvagentd.services import build_tiers

TICK_S = 3.0
TURN_BLOCKS = 3
SESSION_BLOCKS = 96  # 1536 tokens of 16
RETIRE_H = 0.75  # a session is resumable for 45 min, then retired (steady state before hour 1)
WARM_AFTER_S, COLD_AFTER_S = 120.0, 600.0
FAULTS = [  # (start hour, end hour, plan)
    (36.0, 37.0, FaultPlan(write_eio_rate=1.0)),
    (37.0, 37.5, FaultPlan(enospc=True)),
    (37.5, 37.75, FaultPlan(erofs=True)),
    (37.75, 38.0, FaultPlan(read_eio_rate=0.3, torn_write_rate=0.3)),
]
FAULT_START_H, FAULT_END_H = 36.0, 38.0
RECOVERY_H = 0.25  # failback after good probes: 3 health intervals, well inside this


class SimClock:
    def __init__(self, start: float) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class Counters:
    ticks: int = 0
    skipped: int = 0
    skipped_in_fault_window: int = 0
    alloc_failures: int = 0
    lost_committed: int = 0
    lost_in_fault_window: int = 0
    wrong_bytes: int = 0
    verified_blocks: int = 0
    replays: int = 0
    llm_ticks: int = 0
    agent_ticks: int = 0
    agent_llm_errors: int = 0


class Traffic:
    """Synthetic per-asset sessions through the store, every block's bytes known."""

    def __init__(self, store: TieredKVStore, geom: KVGeometry, assets: int, c: Counters) -> None:
        self.store, self.geom, self.c = store, geom, c
        self.assets = [f"syn{i}" for i in range(assets)]
        self.sessions: dict[str, dict[str, Any]] = {}  # name -> {tokens, created, asset}
        self.current: dict[str, str] = {}
        self.digest: dict[bytes, int] = {}
        self.serial = 0
        for a in self.assets:
            self._new_session(a, 0.0)

    def _new_session(self, asset: str, now: float) -> None:
        self.serial += 1
        name = f"{asset}-{self.serial}"
        self.sessions[name] = {"tokens": [], "keys": [], "created": now, "asset": asset,
                               "last": now, "phase": "hot"}
        self.current[asset] = name

    def _block(self, key: bytes) -> torch.Tensor:
        g = torch.Generator().manual_seed(xxhash.xxh3_64_intdigest(key) & 0x7FFFFFFF)
        return torch.randn(self.geom.block_shape, generator=g)

    def _check(self, key: bytes, slot: int) -> None:
        d = xxhash.xxh3_64_intdigest(self.store.hot_arena()[slot].contiguous().view(torch.uint8).numpy())
        self.c.verified_blocks += 1
        if d != self.digest.get(key):
            self.c.wrong_bytes += 1

    def turn(self, asset: str, now: float, in_fault: bool) -> bool:
        """One turn; False when the tick could not do its work (skipped)."""
        name = self.current[asset]
        s = self.sessions[name]
        if len(s["tokens"]) // self.geom.block_tokens + TURN_BLOCKS > SESSION_BLOCKS:
            self._new_session(asset, now)
            name = self.current[asset]
            s = self.sessions[name]
        base = self.serial * 10_000_000 + len(s["tokens"])
        turn = [base + i for i in range(TURN_BLOCKS * self.geom.block_tokens)]
        tokens = s["tokens"] + turn
        # Block-aligned turns: continue the key chain from the last key (same keys as
        # store.block_keys(tokens), without rehashing the whole session every tick).
        keys = s["keys"] + keymod.block_keys(s["keys"][-1] if s["keys"] else self.store.namespace,
                                             turn, self.geom.block_tokens)
        ok = self._run(name, len(s["keys"]), tokens, keys, in_fault, verify_all=False)
        if ok:
            s["tokens"], s["keys"], s["last"] = tokens, keys, now
        return ok

    def _run(self, name: str, committed: int, tokens: list[int], keys: list[bytes],
             in_fault: bool, *, verify_all: bool) -> bool:
        """`committed`: how many leading blocks of `keys` this session committed before."""
        st = self.store
        known = keys[:committed]
        res = st.ensure_resident(known, name)
        have = len(res.slots)
        lost = max(0, committed - have)
        if lost:
            if in_fault:
                self.c.lost_in_fault_window += lost
            else:
                self.c.lost_committed += lost
        probe = range(have) if verify_all else range(max(0, have - 2), have)
        for i in probe:
            self._check(known[i], res.slots[i])
        todo = len(keys) - have
        slots = st.allocate_hot(todo, name) if todo else []
        if slots is None:
            self.c.alloc_failures += 1
            st.release(name)
            return False
        if todo:
            new_keys = keys[have:]
            for k, slot in zip(new_keys, slots):
                b = self._block(k)
                st.hot_arena()[slot] = b
                self.digest[k] = xxhash.xxh3_64_intdigest(b.view(torch.uint8).numpy())
            st.commit(name, tokens, slots, have)
        st.record_access(keys, name)
        st.release(name)
        return True

    def age(self, now: float) -> None:
        """Placement stand-in: idle sessions go warm after 2 min, cold after 10 min, and are
        retired after RETIRE_H (the pools never fill, so allocation never has to demote)."""
        current = set(self.current.values())
        for name, s in list(self.sessions.items()):
            if name in current:
                continue
            idle = now - s["last"]
            if now - s["created"] > RETIRE_H * 3600:
                self.store.drop_session(name, s["keys"])
                for k in s["keys"]:
                    self.digest.pop(k, None)
                del self.sessions[name]
            elif idle > COLD_AFTER_S and s["phase"] != "cold":
                self.store.demote(s["keys"], Tier.COLD)
                s["phase"] = "cold"
            elif WARM_AFTER_S < idle <= COLD_AFTER_S and s["phase"] == "hot":
                self.store.demote(s["keys"], Tier.WARM)
                s["phase"] = "warm"

    def replay(self, now: float, in_fault: bool) -> None:
        """Resume the oldest retained idle session (a cold read), verify every block."""
        idle = [n for n in self.sessions if n not in self.current.values()]
        if not idle:
            return
        name = min(idle, key=lambda n: self.sessions[n]["last"])
        s = self.sessions[name]
        self.c.replays += 1
        self._run(name, len(s["keys"]), s["tokens"], s["keys"], in_fault, verify_all=True)
        s["last"], s["phase"] = now, "hot"


def rss_bytes() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="accelerated 72 h soak")
    ap.add_argument("--hours", type=float, default=72.0)
    ap.add_argument("--assets", type=int, default=2, help="synthetic assets (store traffic)")
    ap.add_argument("--agent-every", type=int, default=40, help="real agent tick every N ticks")
    ap.add_argument("--llm-every", type=int, default=1200, help="LLM step every N ticks (0: none)")
    ap.add_argument("--log-level", default="error", help="structlog level for the run")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    # NOTE: per-block DEBUG/INFO events would dominate a run of 86 400 ticks.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(
        getattr(logging, args.log_level.upper())))
    root = Path(tempfile.mkdtemp(prefix="kvagentd-soak-", dir=Path.cwd() / "var"
                                 if (Path.cwd() / "var").is_dir() else None))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    shadow = Path(tempfile.mkdtemp(prefix="kvagentd-soak-shadow-", dir=shm))
    clock = SimClock(1_800_000_000.0)
    t_wall0 = time.perf_counter()
    c = Counters()
    try:
        return _run(args, root, shadow, clock, c, t_wall0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shadow, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path, shadow: Path, clock: SimClock, c: Counters,
         t_wall0: float) -> int:
    base = load_config(None, env={})
    cache = Path.cwd() / "var" / "test-cache"
    cache.mkdir(parents=True, exist_ok=True)
    loaded = None
    if args.llm_every:
        from kvagentd.engine.model import load_model, model_geometry
        from kvagentd.engine.tiny import tiny_model_dir

        loaded = load_model(ModelConfig(source="hf_dir", path=tiny_model_dir(cache), device="cpu",
                                        dtype="float32"), cache)
        geom = model_geometry(loaded.model, 16, loaded.dtype)
        ns = make_namespace(loaded.fingerprint, loaded.dtype, 16)
    else:
        geom = KVGeometry(2, 2, 32, 16, torch.float32)
        ns = make_namespace("soak-synthetic", torch.float32, 16)
    asset = dataclasses.replace(base.agent.assets[0], name="pump-1", llm=True)
    cfg: Config = dataclasses.replace(
        base,
        daemon=dataclasses.replace(base.daemon, state_dir=root / "state", cache_dir=cache),
        kv=dataclasses.replace(base.kv, cold_dir=root / "cold", cold_capacity_bytes=2 << 30,
                               segment_bytes=16 << 20, io_unit_bytes=128 << 10,
                               o_direct=False,  # stability, not I/O speed, is measured here
                               cold_ttl_s=RETIRE_H * 3600 * 2),
        agent=dataclasses.replace(base.agent, enabled=False, assets=(asset,),
                                  assessment_max_tokens=8),
        maintenance=dataclasses.replace(
            base.maintenance, shadow_dir=shadow, shadow_bytes=256 << 20,
            health_status_file=root / "ssd-health.json", failback_good_probes=3,
            free_space_floor_bytes=0, defrag_max_pause_s=0.1,
            scrub_rate_bytes_per_s=1 << 30))
    fio = FaultyFileIO(FileIO(), FaultPlan(), seed=7)
    hot_blocks, warm_blocks = 4096, 4096
    cfg = dataclasses.replace(cfg, kv=dataclasses.replace(
        cfg.kv, hot_bytes=hot_blocks * geom.block_bytes, warm_ratio=warm_blocks / hot_blocks))
    store, cold = build_tiers(cfg, geom, ns, file_io=fio)
    health.write_status(cfg.maintenance.health_status_file, health.HealthStatus(
        health.HealthState.OK, clock(), "/dev/nvme0n1",
        health.SmartData("nvme-cli", 3, 0, 0, 100, 10), ()))
    m = Maintenance(cfg, store, cold, None)
    m.monitor.clock = clock
    engine = agent = None
    if loaded is not None:
        from apscheduler.schedulers.background import BackgroundScheduler

        from kvagentd.agent.agent import Agent
        from kvagentd.agent.model_client import ModelClient
        from kvagentd.engine.service import Engine

        engine = Engine(loaded, store, state_dir=root / "engine")
        engine.start()
        sched = BackgroundScheduler()
        agent = Agent(cfg.agent, None, sched, root / "agent", clock=clock,
                      store_stats=store.stats)
        llm = ModelClient(engine, cfg.agent)
        agent.start()
    traffic = Traffic(store, geom, args.assets, c)
    total = int(args.hours * 3600 / TICK_S)
    per_hour = int(3600 / TICK_S)
    frag_hourly: list[float] = []
    defrags: list[dict[str, Any]] = []
    rss_h1 = rss_end = None
    serving_log: list[tuple[float, str]] = []
    last_serving = cold.serving.value
    fault_idx = -1
    for tick in range(1, total + 1):
        clock.t += TICK_S
        hour = tick / per_hour
        # faults
        want = next((i for i, (a, b, _) in enumerate(FAULTS) if a <= hour < b), -1)
        if want != fault_idx:
            fio.clear()
            if want >= 0:
                fio.set(**dataclasses.asdict(FAULTS[want][2]))
            fault_idx = want
        in_window = FAULT_START_H <= hour < FAULT_END_H + RECOVERY_H
        reading_faulty = want >= 0 and FAULTS[want][2].read_eio_rate > 0
        # the tick
        c.ticks += 1
        ok = True
        for a in traffic.assets:
            ok = traffic.turn(a, clock(), reading_faulty) and ok
        if agent is not None and tick % args.agent_every == 0:
            # NOTE: the LLM step runs on every `llm_every`-th agent tick only.
            agent.model = llm if (args.llm_every and tick % args.llm_every == 0) else None
            row = agent.tick_once("pump-1")
            c.agent_ticks += 1
            if agent.model is not None:
                c.llm_ticks += 1
                if row.get("assessment") is None:
                    c.agent_llm_errors += 1
                    ok = False
        if not ok:
            c.skipped += 1
            if in_window:
                c.skipped_in_fault_window += 1
        # background work on the simulated clock
        if tick % 200 == 0:  # the root oneshot's timer (10 min) refreshes the status file
            health.write_status(cfg.maintenance.health_status_file, health.HealthStatus(
                health.HealthState.OK, clock(), "/dev/nvme0n1",
                health.SmartData("nvme-cli", 3, 0, 0, 100, 10), ()))
        if tick % 20 == 0:
            traffic.age(clock())
            m._health_job()
        if tick % 200 == 0:
            traffic.replay(clock(), reading_faulty)
        if tick % 2400 == 0:
            out = m.defrag("hot")["results"][0]
            defrags.append({"hour": round(hour, 2), "ratio_before": out["before"]["ratio"],
                            "ratio_after": out["after"]["ratio"], "moved": out["moved"],
                            "max_pause_ms": round(1000 * out["max_pause_s"], 2)})
        if tick % 2400 == 1200:
            m.defrag("cold")  # segment compaction
        if tick % 7200 == 0:
            m.scrub()
        if tick % per_hour == 0:
            frag_hourly.append(round(m.measure(Tier.HOT).ratio, 4))
        if tick == per_hour:
            rss_h1 = rss_bytes()
        if cold.serving.value != last_serving:
            last_serving = cold.serving.value
            serving_log.append((round(hour, 3), last_serving))
        if tick % (per_hour * 6) == 0:
            print(f"h{hour:5.1f}  wall {time.perf_counter() - t_wall0:6.1f} s  "
                  f"hot frag {frag_hourly[-1]:.3f}  cold {cold.serving.value}  "
                  f"lost {c.lost_committed}  skipped {c.skipped}", flush=True)
    rss_end = rss_bytes()
    wall = time.perf_counter() - t_wall0
    store.check_integrity()
    stats = store.stats()
    if agent is not None:
        agent.stop()
    if engine is not None:
        engine.stop()
    fo = cold.status()
    store.close()
    growth = (rss_end - rss_h1) / rss_h1 if rss_h1 else 0.0
    worst_after = max((d["ratio_after"] for d in defrags), default=0.0)
    rows = [
        ["simulated", f"{args.hours:g} h = {c.ticks} ticks of {TICK_S:g} s"],
        ["wall time", f"{wall:.1f} s"],
        ["store traffic", f"{args.assets} synthetic assets, every tick"],
        ["agent ticks (features)", f"{c.agent_ticks} (every {args.agent_every})"],
        ["LLM ticks (tiny model)", f"{c.llm_ticks} (every {args.llm_every})"],
        ["RSS hour 1 / end", f"{(rss_h1 or 0) / 2**20:.1f} / {rss_end / 2**20:.1f} MiB"],
        ["RSS growth", f"{100 * growth:+.2f} %"],
        ["hot frag hourly (max)", f"{100 * max(frag_hourly or [0]):.1f} %"],
        ["hot frag after each defrag (max)", f"{100 * worst_after:.2f} % over {len(defrags)} runs"],
        ["defrag longest pause", f"{max((d['max_pause_ms'] for d in defrags), default=0):.1f} ms"],
        ["allocation failures", c.alloc_failures],
        ["lost committed blocks", c.lost_committed],
        ["lost during read-fault window", c.lost_in_fault_window],
        ["wrong bytes served", c.wrong_bytes],
        ["blocks verified", c.verified_blocks],
        ["skipped ticks (outside / inside fault window)",
         f"{c.skipped - c.skipped_in_fault_window} / {c.skipped_in_fault_window}"],
        ["cold tier serving changes", serving_log],
        ["failovers / failbacks", f"{fo['failovers']} / {fo['failbacks']}"],
        ["replays (cold resumes)", c.replays],
    ]
    print_table(["figure", "value"], rows, title="Accelerated soak")
    cmd = "OMP_NUM_THREADS=1 .venv/bin/python -m bench.soak" + (
        f" --hours {args.hours:g}" if args.hours != 72 else "")
    result = Result("soak", cmd, figures={
        "hours": args.hours, "ticks": c.ticks, "wall_s": wall, "assets": args.assets,
        "agent_every": args.agent_every, "llm_every": args.llm_every,
        "agent_ticks": c.agent_ticks, "llm_ticks": c.llm_ticks, "rss_h1": rss_h1,
        "rss_end": rss_end, "rss_growth": growth, "frag_hourly": frag_hourly,
        "defrags": defrags, "alloc_failures": c.alloc_failures,
        "lost_committed": c.lost_committed, "lost_in_fault_window": c.lost_in_fault_window,
        "wrong_bytes": c.wrong_bytes, "verified_blocks": c.verified_blocks,
        "skipped": c.skipped, "skipped_in_fault_window": c.skipped_in_fault_window,
        "agent_llm_errors": c.agent_llm_errors, "serving_log": serving_log, "failover": fo,
        "store": {k: stats.get(k) for k in ("lost", "evicted", "relocated", "demoted")}},
        goals=[Goal("allocation failures", c.alloc_failures, "<=", 0),
               Goal("lost committed blocks", c.lost_committed, "<=", 0),
               Goal("wrong bytes served", c.wrong_bytes, "<=", 0),
               Goal("skipped ticks outside the fault window", c.skipped - c.skipped_in_fault_window,
                    "<=", 0),
               Goal("RSS growth hour 1 -> end", 100 * growth, "<=", 2.0, " %"),
               Goal("hot fragmentation after each defrag (max)", 100 * worst_after, "<=", 10.0, " %"),
               Goal("simulated time wall clock", wall, "<=", 600.0, " s")])
    write_result(result)
    return 0 if all(g.passed for g in result.goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
