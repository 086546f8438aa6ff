"""Each prefetch kind triggers on a crafted access pattern."""

from __future__ import annotations

from kvagentd.config import KVConfig, PlacementConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement.heat import HeatMap, SessionHeat
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.policy import Capacities, Reason
from kvagentd.kvcache.placement.prefetch import Prefetcher
from bench.placement_sim.replay import Latencies, SimClock, SimStore


def k(s: str, i: int) -> bytes:
    return f"{s}:{i}".encode().ljust(16, b"\0")


def test_predictive_preload_fires_shortly_before_the_next_access():
    p = Prefetcher(lead_s=1.0, interval_s=1.0)
    keys = [k("a", i) for i in range(3)]
    for t in (0.0, 3.0, 6.0, 9.0):
        p.observe("a", keys, t)
    assert p.predicted_next("a") == 12.0
    assert p.wants(9.5) == {}  # due at 12, horizon 2 s: not yet
    w = p.wants(10.5)
    assert set(w) == set(keys)
    assert all(x.tier is Tier.HOT and x.reason is Reason.PREDICT for x in w.values())
    assert p.wants(30.0) == {}  # long overdue: a missed beat is not a pattern


def test_an_irregular_session_is_not_predicted():
    p = Prefetcher(lead_s=1.0, interval_s=1.0)
    t = 0.0
    for gap in (1.0, 9.0, 1.5, 8.0, 1.0, 9.0):
        t += gap
        p.observe("a", [k("a", 0)], t)
    assert not any(p.wants(x) for x in (t + 1.0, t + 3.0, t + 5.0, t + 7.0))


def test_interval_is_exponentially_smoothed():
    p = Prefetcher(alpha=0.5)
    for t in (0.0, 2.0, 6.0):
        p.observe("a", [k("a", 0)], t)
    assert p.predicted_next("a") == 6.0 + (0.5 * 4.0 + 0.5 * 2.0)


def test_coaccess_neighbours_are_wanted_warm():
    p = Prefetcher(coaccess_window_s=5.0, coaccess_min_weight=3)
    a, b, c = [k("a", 0), k("a", 1)], [k("b", 0), k("b", 1)], [k("c", 0)]
    t = 0.0
    for _ in range(3):  # a and b used together three times; c alone, far apart
        p.observe("a", a, t)
        p.observe("b", b, t + 1.0)
        t += 100.0
    p.observe("c", c, t + 50)
    t += 200.0
    p.observe("a", a, t)
    w = p.wants(t + 0.5)
    assert {x for x, v in w.items() if v.reason is Reason.COACCESS} >= set(b)
    assert all(w[x].tier is Tier.WARM for x in b)
    assert not set(c) & set(w)


def test_neighbour_prefetch_after_a_cold_read():
    p = Prefetcher(neighbour_blocks=2)
    chunk = [k("r", i) for i in range(6)]
    p.observe("r", chunk, 0.0)  # the session's block order is learned
    p.observe("r", chunk[:2], 10.0, cold_keys=[chunk[1]])
    urgent = p.take_urgent()
    assert [(u.keys, u.tier, u.reason) for u in urgent] == [
        ((chunk[2], chunk[3]), Tier.WARM, Reason.NEIGHBOUR)]
    assert p.take_urgent() == []
    p.observe("r", chunk[2:4], 11.0)  # no cold read: nothing queued
    assert p.take_urgent() == []


def test_service_turns_a_cold_read_into_a_background_prefetch():
    clock = SimClock(0.0)
    caps = Capacities(8, 8)
    feed = AccessFeed(clock=clock)
    store = SimStore(caps, Latencies(), 100, clock, feed.record)
    blocks = [k("r", i) for i in range(6)]
    store.preload_cold([(x, "r") for x in blocks], 0.0)
    # thresholds out of reach: heat alone never promotes, only the neighbour prefetch does
    cfg = PlacementConfig(policy="heat+prefetch", hot_factor=100.0, warm_factor=100.0)
    svc = PlacementService(store, feed, cfg, KVConfig(), clock=clock, persist_summary=False)
    store.access("r", blocks)  # the session's block order is learned
    store.demote(blocks, Tier.COLD)
    clock.t = 5.0
    svc.run_round()  # the access path now knows these blocks are cold
    store.access("r", blocks[:2])
    svc.ingest()
    assert svc.trace.events()[-1].tier is Tier.COLD
    assert svc.flush_prefetch() == 4  # neighbour_blocks = 8, four blocks follow
    assert set(store.pending) == set(blocks[2:])
    clock.t = 6.0
    store.complete_pending(clock.t)
    assert all(store.blocks[x].tier is Tier.WARM for x in blocks[2:])


def test_lru_and_heat_do_not_prefetch_neighbours():
    clock = SimClock(0.0)
    caps = Capacities(8, 8)
    feed = AccessFeed(clock=clock)
    store = SimStore(caps, Latencies(), 100, clock, feed.record)
    blocks = [k("r", i) for i in range(6)]
    store.preload_cold([(x, "r") for x in blocks], 0.0)
    svc = PlacementService(store, feed, PlacementConfig(policy="lru"), KVConfig(), clock=clock,
                           persist_summary=False)
    store.access("r", blocks)
    store.demote(blocks, Tier.COLD)
    svc.run_round()
    store.access("r", blocks[:2])
    assert svc.flush_prefetch() == 0 and not store.pending


def test_warmup_loads_the_hottest_sessions_before_the_first_tick(tmp_path):
    clock = SimClock(0.0)
    caps = Capacities(4, 8)
    feed = AccessFeed(clock=clock)
    store = SimStore(caps, Latencies(), 100, clock, feed.record)
    hot_s = [k("h", i) for i in range(3)]
    mid_s = [k("m", i) for i in range(3)]
    cold_s = [k("c", i) for i in range(3)]
    store.preload_cold([(x, "s") for x in hot_s + mid_s + cold_s], 0.0)
    h = HeatMap(16)
    for _ in range(5):
        h.record(hot_s, "hot")
    h.record(cold_s, "cold")
    h.record(mid_s, "mid")
    h.record([k("z", 0)], "other")
    h.record([k("z", 1)], "other2")
    path = tmp_path / "heat.json"
    h.save_summary(path)
    svc = PlacementService(store, feed, PlacementConfig(warmup_sessions=2), KVConfig(), clock=clock,
                           summary_path=path)
    assert svc.warmup() == 6
    tiers = {x: b.tier for x, b in store.blocks.items()}
    assert [tiers[x] for x in hot_s[1:]] == [Tier.HOT, Tier.HOT]  # hot budget: caps.hot // 2
    assert tiers[hot_s[0]] is Tier.WARM and all(tiers[x] is Tier.WARM for x in mid_s)
    assert all(tiers[x] is Tier.COLD for x in cold_s)


def test_warmup_wants_orders_and_splits():
    p = Prefetcher()
    summary = [SessionHeat("a", 5.0, (k("a", 0), k("a", 1))), SessionHeat("b", 1.0, (k("b", 0),))]
    got = p.warmup_wants(summary, 2, hot_blocks=1)
    assert got == [([k("a", 1)], Tier.HOT), ([k("a", 0)], Tier.WARM), ([k("b", 0)], Tier.WARM)]
