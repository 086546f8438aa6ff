"""The simulator: accounting, capacity, and that it drives the daemon's placement code."""

from __future__ import annotations

import pytest

from kvagentd.kvcache.placement.policy import Capacities
from bench.placement_sim.replay import simulate
from bench.placement_sim.request_trace import Request
from bench.placement_sim.workloads import pure_scan, seed_workload, shifting_popularity


def k(s: str, i: int) -> bytes:
    return f"{s}:{i}".encode().ljust(16, b"\0")


def test_accounting_adds_up_and_capacity_holds():
    w = seed_workload(1, duration_s=240.0, chat_sessions=30, archived_sessions=4,
                      idle_sessions=2, report_every_s=100.0)
    for pol in ("lru", "heat", "heat+prefetch"):
        r = simulate(w.requests, pol, Capacities(120, 40), preload=w.preload, check=True)
        c = r.counters
        reads = c.hot_hits + c.warm_hits + c.cold_hits
        assert reads + c.new_blocks + c.recomputed == w.block_accesses
        assert r.hot_hit_rate + r.warm_hit_rate + r.cold_hit_rate == pytest.approx(1.0)
        assert c.stall_s == pytest.approx(c.cold_hits * 300e-6)
        assert r.rounds >= 200 and r.decided_blocks > 0


def test_a_trace_that_fits_hot_never_touches_cold():
    reqs = [Request(i, i * 0.5, "a", tuple(k("a", j) for j in range(4))) for i in range(40)]
    r = simulate(reqs, "heat", Capacities(16, 8))
    assert r.counters.new_blocks == 4 and r.counters.hot_hits == 156
    assert r.counters.cold_write_bytes == 0 and r.counters.cold_hits == 0


def test_neighbour_prefetch_turns_cold_stalls_of_a_repeated_scan_into_warm_hits():
    # two passes over an archive read in chunks; warm is big enough to hold prefetched chunks
    archive = [k("arc", i) for i in range(64)]
    reqs, t = [], 0.0
    for _ in range(2):
        for lo in range(0, 64, 8):
            reqs.append(Request(len(reqs), t, "report", tuple(archive[lo:lo + 8])))
            t += 0.5
        t += 30.0
    preload = [(x, "report") for x in archive]
    caps = Capacities(24, 24)
    lru = simulate(reqs, "lru", caps, preload=preload)
    pf = simulate(reqs, "heat+prefetch", caps, preload=preload)
    assert pf.counters.cold_hits < lru.counters.cold_hits
    assert pf.counters.background_promotions > 0


def test_predictive_preload_brings_a_periodic_session_back_before_its_tick():
    # a sensor session every 3 s; now and then a one-off burst flushes it out of hot and warm
    reqs = []
    sensor = tuple(k("asset", i) for i in range(6))
    for i in range(30):
        reqs.append(Request(0, 3.0 * i, "asset", sensor))
    for j, t in enumerate((16.5, 40.5, 64.5)):
        reqs.append(Request(0, t, f"burst-{j}", tuple(k(f"burst-{j}", i) for i in range(16))))
    reqs.sort(key=lambda r: r.time)
    caps = Capacities(12, 4)
    lru = simulate(reqs, "lru", caps, check=True)
    pf = simulate(reqs, "heat+prefetch", caps, check=True)
    assert lru.counters.misses_by_class.get("asset/cold", 0) > 0
    assert pf.counters.hot_hits > lru.counters.hot_hits
    assert pf.moves.get("promote:prefetch-predict", 0) > 0


def test_standard_traces_are_deterministic():
    a, b = pure_scan(3, sessions=5), pure_scan(3, sessions=5)
    assert [r.keys for r in a.requests] == [r.keys for r in b.requests]
    s1, s2 = shifting_popularity(2, duration_s=60.0), shifting_popularity(2, duration_s=60.0)
    assert [(r.time, r.session) for r in s1.requests] == [(r.time, r.session) for r in s2.requests]
    seed = seed_workload(0, duration_s=3600.0)
    names = {r.session for r in seed.requests}
    assert 120 <= len(names) <= 260  # 220 sessions defined; Zipf leaves some chats unused
    assert {n.split("-")[0] for n in names} == {"asset", "chat", "idle", "report:archive"}
