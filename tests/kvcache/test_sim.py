"""The placement simulator (bench/placement_sim): accounting, the offline optimum, request
traces in and out, and the shape of the synthetic workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.placement_sim.optimum import belady, next_use
from bench.placement_sim.replay import simulate
from bench.placement_sim.store import SimStore
from bench.placement_sim.request_trace import (TraceBuilder, from_events, read_trace,
                                               write_jsonl)
from bench.placement_sim.workloads import (edge_agent, multiturn, multiturn_with_truth,
                                           pure_scan, seed_workload, shifting_popularity)
from kvagentd.config import PlacementConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement.base import Capacities
from kvagentd.kvcache.placement.policy import POLICIES
from kvagentd.kvcache.placement.trace_recorder import TraceRecorder


def trace_of(reqs: list[tuple[float, str, list[int]]], preload: list[int] = ()):
    b = TraceBuilder()
    b.n_blocks = 1 + max(max(ids) for _, _, ids in reqs)
    for t, s, ids in reqs:
        b.add(t, s, ids)
    b.preload(preload)
    return b.finish("crafted")


def test_accounting_adds_up_and_capacity_holds():
    w = seed_workload(1, duration_s=240.0, chat_sessions=30, archived_sessions=4,
                      idle_sessions=2, report_every_s=100.0)
    distinct = int(np.unique(w.blocks).size)
    for pol in POLICIES:
        r = simulate(w, pol, Capacities(120, 40), check=True)
        c = r.counters
        assert c.hot_hits + c.warm_hits + c.cold_hits + c.first_touches + c.recomputed \
            == w.accesses
        assert r.reaccesses == w.accesses - distinct
        assert c.stall_s == pytest.approx(c.cold_hits * 300e-6)
        assert r.rounds >= 200 and r.decided_accesses > 0
        assert 0.0 < r.hot_hit_rate < r.hot_hit_rate_reaccess <= r.hot_warm_hit_rate_reaccess


def test_a_trace_that_fits_hot_never_touches_cold():
    reqs = [(i * 0.5, "a", [0, 1, 2, 3]) for i in range(40)]
    r = simulate(trace_of(reqs), "reuse", Capacities(16, 8))
    assert r.counters.first_touches == 4 and r.counters.hot_hits == 156
    assert r.counters.cold_write_bytes == 0 and r.counters.cold_hits == 0
    assert r.hot_hit_rate_reaccess == 1.0


def test_neighbour_prefetch_turns_cold_stalls_of_a_repeated_scan_into_warm_hits():
    reqs, t = [], 0.0
    for _ in range(2):  # two passes over an archive read in chunks
        for lo in range(0, 64, 8):
            reqs.append((t, "report", list(range(lo, lo + 8))))
            t += 0.5
        t += 30.0
    tr = trace_of(reqs, preload=list(range(64)))
    caps = Capacities(24, 24)
    lru = simulate(tr, "lru", caps)
    pf = simulate(tr, "heat+prefetch", caps)
    assert pf.counters.cold_hits < lru.counters.cold_hits
    assert pf.counters.background_promotions > 0


def test_predictive_preload_brings_a_periodic_session_back_before_its_tick():
    reqs = [(3.0 * i, "asset", list(range(6))) for i in range(30)]
    for j, t in enumerate((16.5, 40.5, 64.5)):  # one-off bursts flush it out of hot and warm
        reqs.append((t, f"burst-{j}", list(range(100 + 16 * j, 116 + 16 * j))))
    tr = trace_of(sorted(reqs, key=lambda r: r[0]))
    caps = Capacities(12, 4)
    lru = simulate(tr, "lru", caps, check=True)
    pf = simulate(tr, "heat+prefetch", caps, check=True)
    assert lru.counters.misses_by_class.get("asset/cold", 0) > 0
    assert pf.counters.hot_hits > lru.counters.hot_hits
    assert pf.moves.get("promote:prefetch-predict", 0) > 0


def test_reuse_keeps_a_returning_session_over_one_shot_traffic():
    """The admission lever: one-shot documents of an application whose blocks are never used
    twice pass through hot while a conversation that comes back keeps its blocks there."""
    reqs, t, doc = [], 0.0, 1000
    for r in range(40):
        reqs.append((t, "chat", [0] + list(range(1, 11))))  # back every 20 s
        for j in range(5):
            reqs.append((t + 2.0 + 3.0 * j, f"api-{r}-{j}", [500] + list(range(doc, doc + 8))))
            doc += 8
        t += 20.0
    tr = trace_of(reqs)
    caps = Capacities(32, 4)
    cfg = PlacementConfig(headroom_fraction=0.3, trace_capacity=0)  # room for a request
    lru = simulate(tr, "lru", caps, config=cfg)
    reuse = simulate(tr, "reuse", caps, config=cfg)
    assert reuse.hot_hit_rate_reaccess > lru.hot_hit_rate_reaccess + 0.2
    assert reuse.counters.bytes_migrated <= lru.counters.bytes_migrated


# ------------------------------------------------------------------------------------------
# the optimum
# ------------------------------------------------------------------------------------------

def test_next_use():
    assert next_use(np.array([5, 7, 5, 5, 9, 7])).tolist() == [2, 5, 3, 6, 6, 6]


def test_belady_by_hand():
    # capacity 2: a b c a b c ... MIN keeps one of the three each time; LRU would hit nothing
    seq = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    opt = belady(seq, 2)
    assert opt.reaccesses == 6 and opt.hits == 4  # proven optimal for this sequence
    assert belady(seq, 3).hits == 6 and belady(seq, 0).hits == 0
    assert belady(np.array([1, 2, 3]), 5).hit_rate == 0.0  # no reuse: nothing to hit


def test_no_demand_policy_beats_the_optimum():
    rng = np.random.default_rng(3)
    reqs, t = [], 0.0
    for _ in range(300):
        s = int(rng.integers(0, 12))
        reqs.append((t, f"s{s}", [s * 10 + j for j in range(int(rng.integers(1, 6)))]))
        t += float(rng.exponential(1.0))
    tr = trace_of(reqs)
    caps = Capacities(16, 8)
    opt_hot = belady(tr.blocks, caps.hot)
    opt_both = belady(tr.blocks, caps.hot + caps.warm)
    for pol in ("lru", "reuse"):
        r = simulate(tr, pol, caps)
        assert r.counters.hot_hits <= opt_hot.hits
        assert r.counters.hot_hits + r.counters.warm_hits <= opt_both.hits


# ------------------------------------------------------------------------------------------
# request traces
# ------------------------------------------------------------------------------------------

def test_jsonl_round_trip(tmp_path):
    w = shifting_popularity(2, duration_s=60.0)
    path = tmp_path / "t.jsonl"
    write_jsonl(w, path)
    back = read_trace(path)
    assert np.allclose(back.times, w.times, atol=1e-6)
    assert back.offsets.tolist() == w.offsets.tolist()
    assert back.accesses == w.accesses and back.n_blocks == len(np.unique(w.blocks))
    names = [back.session_names[i] for i in back.sessions]
    assert names == [w.session_names[i] for i in w.sessions]


def test_published_format_without_sessions(tmp_path):
    """Mooncake's lines: timestamp in ms, hash ids, no session: sessions are inferred from
    shared prefixes (a shared prompt does not merge two conversations)."""
    lines = [
        {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [46, 47, 48]},
        {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [46, 49]},
        {"timestamp": 3052, "input_length": 655, "output_length": 52, "hash_ids": [46, 50]},
        {"timestamp": 9000, "hash_ids": [46, 47, 48, 51]},
        {"timestamp": 12000, "hash_ids": [46, 49, 52, 53]},
    ]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    tr = read_trace(path)
    assert tr.times.tolist() == [0.0, 0.0, 3.052, 9.0, 12.0]
    assert tr.n_blocks == 8 and tr.request(3).tolist() == [0, 1, 2, 5]
    s = [tr.session_names[i] for i in tr.sessions]
    assert s[3] == s[0] and s[4] == s[1] and len({s[0], s[1], s[2]}) == 3
    r = simulate(tr, "lru", Capacities(4, 4))
    c = r.counters
    assert c.first_touches == 8 and r.reaccesses == 7
    assert c.hot_hits + c.warm_hits + c.cold_hits == 7 and c.hot_hits >= 3  # 46 stays hot


def test_malformed_lines_name_their_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "hash_ids": [1, 2]}\n{"timestamp": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_trace(bad)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    with pytest.raises(ValueError, match=":1:"):
        read_trace(junk)


def test_a_daemon_trace_dump_replays_with_its_keys(tmp_path):
    rec = TraceRecorder(100)
    k = [i.to_bytes(16, "big") for i in range(5)]
    rec.record(0, 10.0, "a", k[:3], np.array([3, 3, 0], np.int8))  # two blocks read from cold
    rec.record(1, 11.0, "b", k[3:], None)
    rec.record(2, 13.0, "a", k[:3], None)
    for suffix in (".jsonl", ".npz"):
        path = tmp_path / f"dump{suffix}"
        rec.dump(path)
        tr = read_trace(path)
        assert len(tr) == 3 and tr.keys == k
        assert tr.preload.tolist() == [0, 1]
        assert [tr.session_names[i] for i in tr.sessions] == ["a", "b", "a"]
    ev = rec.events()
    assert from_events(ev, "x").request(2).tolist() == [0, 1, 2]
    assert ev[0].tier is Tier.COLD


def test_a_replay_of_a_daemon_dump_counts_the_daemons_block_bytes(tmp_path, monkeypatch):
    import json

    import bench.common
    import bench.placement as bp
    from kvagentd.kvcache.placement.trace_recorder import BlockSize

    rec = TraceRecorder(100, block_size=BlockSize(16, 1000))
    keys = [i.to_bytes(16, "big") for i in range(40)]
    for t in range(30):
        rec.record(t, float(t), f"s{t % 3}", keys[(t % 3) * 10:(t % 3) * 10 + 8 + t % 5])
    path = tmp_path / "dump.jsonl"
    rec.dump(path)
    (case_default,) = [c for _, c in bp.file_cases([str(path)], [0.5], 0.35, None, None)]
    assert case_default.block_bytes == 1000
    (case_given,) = [c for _, c in bp.file_cases([str(path)], [0.5], 0.35, 512, None)]
    assert case_given.block_bytes == 512 * bp.BYTES_PER_TOKEN
    # a replay writes its own results file, not the recorded run's
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "results")
    bp.main(["--trace", str(path), "--hot", "0.5", "--policies", "lru", "--no-round-cost"])
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["placement-trace.json"]
    doc = json.loads((tmp_path / "results/placement-trace.json").read_text())
    assert doc["figures"]["runs"][0]["block_bytes"] == 1000
    assert "--trace" in doc["command"]


# ------------------------------------------------------------------------------------------
# workloads
# ------------------------------------------------------------------------------------------

def test_standard_traces_are_deterministic():
    a, b = pure_scan(3, sessions=5), pure_scan(3, sessions=5)
    assert a.blocks.tolist() == b.blocks.tolist()
    e1, e2 = edge_agent(2, duration_s=120.0), edge_agent(2, duration_s=120.0)
    assert e1.times.tolist() == e2.times.tolist() and e1.blocks.tolist() == e2.blocks.tolist()


def test_multiturn_has_the_shape_of_a_production_trace():
    s = multiturn(0).summary()
    assert 10_000 <= s["requests"] <= 13_000  # about 12,000 requests in an hour
    assert 20 <= s["block_accesses"] / s["requests"] <= 30  # about 24 blocks a request
    assert 0.58 <= s["first_touch_share"] <= 0.70  # 63 % first touches
    iid = multiturn(0, same_pace=False).summary()
    assert abs(iid["first_touch_share"] - s["first_touch_share"]) < 0.05


def test_multiturn_says_what_generated_it():
    """The generator's record (for the ceiling benchmark): the same trace as `multiturn`,
    each conversation's blocks read at its turns' times and only there, shared prompts
    marked as no conversation's."""
    tr, truth = multiturn_with_truth(0, duration_s=600.0, requests=2000)
    plain = multiturn(0, duration_s=600.0, requests=2000)
    assert tr.blocks.tolist() == plain.blocks.tolist() and tr.times.tolist() == plain.times.tolist()
    assert len(truth.pace) == len(truth.turns) and all(p > 0 for p in truth.pace)
    seen: dict[int, list[float]] = {}
    for i in range(len(tr)):
        conv = set(truth.conversation[tr.request(i)].tolist()) - {-1}
        assert len(conv) == 1  # one conversation's blocks (after its prompt's)
        seen.setdefault(conv.pop(), []).append(float(tr.times[i]))
    assert seen == {c: t for c, t in enumerate(truth.turns) if t}
    prompts = truth.conversation == -1
    assert (truth.app[prompts] == -1).all() and (truth.app[~prompts] >= 0).all()
    names = [a.name for a in truth.apps]
    for i in range(0, len(tr), 97):
        own = tr.request(i)[truth.conversation[tr.request(i)] >= 0]
        assert tr.session_names[tr.sessions[i]].split("-")[0] == names[truth.app[own[0]]]


def test_edge_agent_ticks_roll_over_and_replays_resume_old_sessions():
    tr = edge_agent(0, duration_s=600.0, assets=2)
    names = [tr.session_names[i] for i in tr.sessions]
    ticks = [n for n in names if n.startswith("asset-0-")]
    assert len(ticks) == pytest.approx(600.0 / 3.0, rel=0.05)
    assert len({n for n in ticks}) >= 10  # rolled over at the session budget
    assert any(n.startswith("report-") for n in names) and any(n.startswith("ask-") for n in names)
    replays = [i for i, n in enumerate(names) if n.startswith("replay-")]
    assert replays and tr.preload.size > 0
    first = tr.request(replays[0])
    assert len(first) >= 90  # a whole old session read back
    seed = seed_workload(0, duration_s=3600.0)
    assert {n.split("-")[0] for n in seed.session_names} == {"asset", "chat", "idle",
                                                             "report:archive"}


def test_the_sim_store_reads_ids_from_its_own_keys_and_looks_up_others():
    caps = Capacities(4, 8)
    keys = [i.to_bytes(16, "big") for i in range(10)]
    spelled = SimStore(caps, 10, keys, clock=lambda: 0.0)
    odd = [(10).to_bytes(16, "big"), (1 << 64 | 3).to_bytes(16, "big")]  # no block's
    assert spelled.ids_of([keys[7], *odd, keys[0]]).tolist() == [7, -1, -1, 0]
    many = [keys[7], *odd, keys[0]] * 40  # long enough to be read, not looked up
    assert spelled.ids_of(many).tolist() == [7, -1, -1, 0] * 40
    assert spelled.ids_of([keys[2], b"short"]).tolist() == [2, -1]
    assert spelled.ids_of([]).size == 0
    named = [f"k{i}".encode() for i in range(10)]
    other = SimStore(caps, 10, named, clock=lambda: 0.0)
    assert other.ids_of([named[3], b"k99"]).tolist() == [3, -1]


def test_the_ceiling_over_hours_keeps_the_first_hours_capacities(tmp_path, monkeypatch):
    import json

    import bench.common
    import bench.placement_ceiling as pc
    from bench.placement import _caps

    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path)
    with pytest.raises(SystemExit) as exc:
        pc.main(["--quick", "--hours", "0"])
    assert exc.value.code == 2
    pc.main(["--quick", "--hours", "2"])
    assert [p.name for p in tmp_path.iterdir()] == ["placement_ceiling-2h.json"]
    doc = json.loads((tmp_path / "placement_ceiling-2h.json").read_text())
    first = multiturn_with_truth(0, duration_s=450.0, requests=1500)[0]
    longer = multiturn_with_truth(0, duration_s=900.0, requests=3000)[0]
    five = doc["figures"]["hot 5% of the first hour's"]
    assert five["hot_blocks"] == _caps(first, 0.05, 0.35).hot != _caps(longer, 0.05, 0.35).hot
    assert doc["figures"]["trace"]["requests"] == len(longer)
    assert "--hours 2" in doc["command"]
    for model in ("learned", "causal", "clairvoyant"):
        assert 0.0 < five[model] <= five["optimum"]  # no policy beats MIN
