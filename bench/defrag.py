"""Defrag pause on a 1 GB hot pool (SmolLM2 block geometry) on this CPU.

Fills the hot pool with sessions of 1-8 blocks, drops a random half of the sessions to scatter
the free space, then compacts it with the maintenance service under
`maintenance.defrag_max_pause_s = 0.1`: reports the longest single pause (one `store.relocate`
chunk, which holds the store lock), the total time, the fragmentation ratio before and after,
and checks that every remaining block's bytes are unchanged (xxh3 per block).

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.defrag
"""

from __future__ import annotations

import random
import time

import torch
import xxhash

from bench.common import Goal, Result, print_table, write_result
from kvagentd.config import Config, MaintenanceConfig
from kvagentd.kvcache.base import KVGeometry, Tier
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore
from kvagentd.maintenance.service import Maintenance

HOT_BYTES = 1 << 30
GEOM = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=16, dtype=torch.float32)


def _digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy())


def fragmented_store(seed: int = 0) -> tuple[TieredKVStore, dict[str, list[int]]]:
    rng = random.Random(seed)
    store = TieredKVStore(GEOM, make_namespace("bench-defrag", torch.float32, 16),
                          hot_bytes=HOT_BYTES, warm_bytes=8 * GEOM.block_bytes, cold=None)
    cap = store.pool(Tier.HOT).capacity
    sessions: dict[str, list[int]] = {}
    used, s = 0, 0
    gen = torch.Generator().manual_seed(seed)
    while used < int(cap * 0.9):
        n = min(rng.randint(1, 8), int(cap * 0.9) - used)
        name = f"s{s}"
        tokens = [s * 1_000_000 + t for t in range(n * GEOM.block_tokens)]
        slots = store.allocate_hot(n, name)
        store.hot_arena()[slots] = torch.randn(n, *GEOM.block_shape, generator=gen)
        store.commit(name, tokens, slots, 0)
        store.release(name)
        sessions[name] = tokens
        used += n
        s += 1
    for name in rng.sample(sorted(sessions), len(sessions) // 2):
        store.drop_session(name, store.block_keys(sessions.pop(name)))
    return store, sessions


def digests(store: TieredKVStore, sessions: dict[str, list[int]]) -> dict[bytes, int]:
    out = {}
    for tokens in sessions.values():
        keys = store.block_keys(tokens)
        res = store.ensure_resident(keys, "bench-check")
        for k, slot in zip(keys, res.slots):
            out[k] = _digest(store.hot_arena()[slot])
        store.release("bench-check")
    return out


def main() -> int:
    torch.manual_seed(0)
    store, sessions = fragmented_store()
    cfg = Config(maintenance=MaintenanceConfig(defrag_max_pause_s=0.1))
    m = Maintenance(cfg, store, None, None)
    before_digests = digests(store, sessions)
    before = m.measure(Tier.HOT)
    t0 = time.perf_counter()
    m.plan(Tier.HOT)
    plan_s = time.perf_counter() - t0
    res = m.defrag("hot")["results"][0]
    after = m.measure(Tier.HOT)
    store.check_integrity()
    same = digests(store, sessions) == before_digests
    pool = store.pool(Tier.HOT)
    rows = [
        ["hot pool", f"{pool.capacity} blocks x {GEOM.block_bytes / 1e6:.2f} MB = "
                     f"{pool.capacity * GEOM.block_bytes / 1e9:.2f} GB"],
        ["used / free before", f"{before.used} / {before.free}"],
        ["fragmentation before", f"{100 * before.ratio:.1f} %"],
        ["moves", res["moved"]],
        ["plan time", f"{1000 * plan_s:.2f} ms"],
        ["chunks (pauses)", res["chunks"]],
        ["longest pause", f"{1000 * res['max_pause_s']:.1f} ms"],
        ["total defrag time", f"{1000 * res['total_s']:.1f} ms"],
        ["fragmentation after", f"{100 * after.ratio:.2f} %"],
        ["largest free run after", f"{after.largest_free_run} of {after.free}"],
        ["every block byte-identical", same],
    ]
    print_table(["figure", "value"], rows, title="Defrag of a 1 GB hot pool (CPU)")
    result = Result("defrag", "OMP_NUM_THREADS=1 .venv/bin/python -m bench.defrag", figures={
        "hot_pool_blocks": pool.capacity, "block_bytes": GEOM.block_bytes,
        "used_before": before.used, "free_before": before.free,
        "ratio_before": before.ratio, "ratio_after": after.ratio, "moves": res["moved"],
        "chunks": res["chunks"], "plan_s": plan_s, "max_pause_s": res["max_pause_s"],
        "total_s": res["total_s"], "byte_identical": same},
        goals=[Goal("longest defrag pause", 1000 * res["max_pause_s"], "<=", 100.0, " ms"),
               Goal("hot fragmentation after defrag", 100 * after.ratio, "<=", 10.0, " %"),
               Goal("blocks changed by defrag", 0 if same else 1, "<=", 0)])
    write_result(result)
    store.close()
    return 0 if all(g.passed for g in result.goals) else 1


if __name__ == "__main__":
    raise SystemExit(main())
