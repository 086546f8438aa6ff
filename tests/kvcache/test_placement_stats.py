"""What placement remembers of block accesses: rows, counts, gaps, inheritance, the reuse model,
arrivals, the sweep; and the access feed between the store and placement."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from kvagentd.kvcache.placement.base import HOT, NONE, WARM, Capacities
from kvagentd.kvcache.placement.feed import Access, AccessFeed
from kvagentd.kvcache.placement.reuse import reuse_density, reuse_model, reuse_tables
from kvagentd.kvcache.placement.stats import AccessStats, sorted_unique
from kvagentd.kvcache.placement.summary import load_summary, save_summary


def k(s: str, i: int = 0) -> bytes:
    return f"{s}:{i}".encode().ljust(16, b"\0")


def ev(keys: list[bytes], session: str, t: float) -> Access:
    return Access(keys, session, t)


def test_record_counts_uses_and_marks_blocks_hot():
    st = AccessStats()
    a, b = k("a"), k("b")
    r1 = st.record([ev([a, b], "s", 10.0)])
    assert r1.prev_tier.tolist() == [NONE, NONE] and r1.offsets.tolist() == [0, 2]
    r2 = st.record([ev([a], "s", 12.0)])
    assert r2.prev_tier.tolist() == [HOT] and r2.rows.tolist() == r1.rows[:1].tolist()
    ra, rb = st.rows_of([a, b]).tolist()
    assert st.count[ra] == 2 and st.count[rb] == 1
    assert st.last_t[ra] == 12.0 and st.last_t[rb] == 10.0
    assert st.tier[ra] == HOT and len(st) == 2 and st.tick == 2


def test_a_batch_with_repeats_counts_every_use_and_keeps_the_latest():
    st = AccessStats()
    a, b = k("a"), k("b")
    st.record([ev([a], "s", 1.0)])
    st.tier[st.rows_of([a])] = WARM  # placement moved it
    rec = st.record([ev([a, b], "s", 5.0), ev([a], "t", 7.0), ev([b, a], "s", 9.0)])
    # first use of `a` in the batch finds it in warm, later ones in hot; `b` is new
    assert rec.prev_tier.tolist() == [WARM, NONE, HOT, HOT, HOT]
    assert rec.ticks.tolist() == [1, 1, 2, 3, 3]
    ra, rb = st.rows_of([a, b]).tolist()
    assert st.count[ra] == 4 and st.count[rb] == 2
    assert st.last_t[ra] == 9.0 and st.last_tick[ra] == 3


def test_gaps_are_learned_and_new_blocks_of_a_session_inherit_them():
    st = AccessStats()
    sys_ = [k("sys")]
    conv = [k("c", 0)]
    for i, t in enumerate((0.0, 100.0, 200.0, 300.0)):
        conv = conv + [k("c", i + 1)]
        st.record([ev(sys_ + conv, "chat", t)])
    r0, r_new = st.rows_of([k("c", 0), k("c", 4)]).tolist()
    assert st.gaps[r0] == 3
    assert math.exp(float(st.gap_mu[r0])) == pytest.approx(100.0, rel=1e-4)
    assert st.gaps[r_new] == 3 and st.gap_mu[r_new] == st.gap_mu[r0]  # inherited
    # another session's first request after the shared prompt inherits nothing from it
    st.record([ev(sys_ + [k("other", 0)], "other", 301.0)])
    assert st.gaps[st.rows_of([k("other", 0)])[0]] == 0


def test_reuse_odds_follow_the_category_and_use_count():
    st = AccessStats()
    t = 0.0
    for i in range(50):  # api: a system prompt, one-shot documents
        st.record([ev([k("api-sys"), k("doc", i)], f"api-{i}", t)])
        t += 1.0
    for i in range(50):  # chat: every conversation comes back once
        st.record([ev([k("chat-sys"), k("conv", i)], f"chat-{i}", t)])
        st.record([ev([k("chat-sys"), k("conv", i)], f"chat-{i}", t + 30.0)])
        t += 1.0
    tables = reuse_tables(st)
    doc = st.rows_of([k("doc", 0)])
    st.count[doc] = 1  # as if used once
    q_doc, _, _ = reuse_model(st, doc, tables)
    conv = st.rows_of([k("conv", 0)])
    st.count[conv] = 1
    q_conv, mu, s = reuse_model(st, conv, tables)
    assert q_doc[0] < 0.05 and q_conv[0] > 0.9
    assert math.exp(float(mu[0])) == pytest.approx(30.0, rel=1e-3) and s[0] > 0


def test_a_block_new_in_a_later_turn_is_counted_in_its_sessions_use_class():
    """A block first used in a conversation's third turn inherits the two uses of the
    session's history, so it reaches use class 3, and its next use is a reuse of class 3: both
    counts in the same class. (Counting it as reaching class 1 and coming back in class 3 made
    first uses look rarely reused and later ones more than they are.)"""
    st = AccessStats()
    sys_, conv = [k("sys")], [k("c", 0)]
    for i, t in enumerate((0.0, 100.0, 200.0)):
        conv = conv + [k("c", i + 1)]
        st.record([ev(sys_ + conv, "chat", t)])
    c = st.cat[st.rows_of([k("c", 0)])[0]]
    reached = st.reached[c].copy()
    st.record([ev(sys_ + conv + [k("c", 9)], "chat", 300.0)])  # c:9 new in the 4th turn
    new = st.rows_of([k("c", 9)])[0]
    assert st.base[new] == 3  # the uses of its session's history, inherited from c:3
    grew = st.reached[c] - reached
    assert grew[1] == 0  # nothing new reached class 1 in this request
    reused = st.reused[c].copy()
    st.record([ev(sys_ + conv + [k("c", 9)], "chat", 400.0)])
    assert (st.reused[c] - reused)[1] == 0  # c:9's return is counted in class 3 ...
    assert grew[3] >= 1  # ... where its first use was counted as reaching


def test_density_charges_a_block_unlikely_to_return_the_slot_time_it_would_waste():
    """LHD's hit density: a block that rarely comes back (a one-shot document) is charged
    `hold_s`, so the longer placement holds blocks, the lower it ranks, while one that almost
    surely comes back (a conversation) barely is; and from one round to the next `hold_s`
    follows how long the blocks moved out of hot had been idle."""
    st = AccessStats()
    t = 0.0
    for i in range(50):  # documents never come back; conversations 30 s later (the last
        st.record([ev([k("api-sys"), k("doc", i)], f"api-{i}", t)])  # not yet)
        st.record([ev([k("chat-sys"), k("conv", i)], f"chat-{i}", t)])
        if i < 49:
            st.record([ev([k("chat-sys"), k("conv", i)], f"chat-{i}", t + 30.0)])
        t += 1.0
    rows = st.rows_of([k("doc", 49), k("conv", 49)])
    now = 49.0 + 5.0  # both idle 5 s
    short = reuse_density(st, rows, now, hold_s=10.0)
    long = reuse_density(st, rows, now, hold_s=1000.0)
    assert long[0] < short[0] / 20  # the document: charged the hold time
    assert long[1] > short[1] / 3  # the conversation: only for its small chance of not
    assert long[1] > long[0] and short[1] > short[0]

    assert st.hold_s is None
    st.note_left_hot(rows, 100.0)  # both idle 51 s
    assert st.hold_s == pytest.approx(51.0)
    st.note_left_hot(rows[:1], 110.0)  # 61 s: smoothed, not replaced
    assert st.hold_s == pytest.approx(51.0 + 0.2 * (61.0 - 51.0))


def test_arrivals_are_hot_ones_taken_once_and_trimmed():
    """Blocks that enter hot (used, or promoted there) are a round's candidates once; blocks
    that enter warm are hot's victims and are not kept as warm's."""
    st = AccessStats()
    st.record([ev([k("a"), k("b")], "s", 1.0), ev([k("a")], "s", 2.0)])
    got = st.take_arrived(HOT)
    assert sorted(got.tolist()) == sorted(st.rows_of([k("a"), k("b")]).tolist())
    assert st.take_arrived(HOT).size == 0
    b = st.rows_of([k("b")])
    st.moved(b, WARM)
    assert st.take_arrived(WARM).size == 0 and st.take_arrived(HOT).size == 0
    st.moved(b, HOT)  # promoted
    assert st.take_arrived(HOT).tolist() == b.tolist()
    for i in range(100):
        st.record([ev([k("x", i)], "s", 3.0 + i)])
    st.trim_arrived(10)
    last = st.take_arrived(HOT)
    assert last.tolist() == st.rows_of([k("x", i) for i in range(90, 100)]).tolist()


def test_forgotten_rows_are_reused_and_the_sweep_visits_every_row():
    st = AccessStats(capacity=16)
    st.record([ev([k("r", i) for i in range(40)], "s", 1.0)])  # grows past its capacity
    assert len(st) == 40
    seen: set[int] = set()
    for _ in range(5):
        seen.update(st.sweep(10).tolist())
    assert seen == set(st.rows_of([k("r", i) for i in range(40)]).tolist())
    gone = st.rows_of([k("r", 3)])
    st.forget(gone)
    assert st.rows_of([k("r", 3)])[0] == -1 and len(st) == 39
    st.record([ev([k("new")], "s", 2.0)])
    assert st.rows_of([k("new")])[0] == gone[0] and st.count[gone[0]] == 1
    made = st.ensure_rows([k("never-used"), k("new")])
    assert made[1] == gone[0] and st.count[made[0]] == 0 and len(st) == 41


def test_sessions_summary_round_trip(tmp_path):
    st = AccessStats()
    for t in range(5):
        st.record([ev([k("busy", 0), k("busy", 1)], "busy", float(t))])
    st.record([ev([k("quiet", 0)], "quiet", 5.0)])
    path = tmp_path / "summary.json"
    save_summary(path, st.sessions, max_sessions=8)
    s = load_summary(path)
    assert [x.session for x in s] == ["busy", "quiet"]
    assert s[0].keys == (k("busy", 0), k("busy", 1)) and s[0].score > s[1].score > 0
    save_summary(path, st.sessions, max_sessions=1)
    assert [x.session for x in load_summary(path)] == ["busy"]


def test_summary_missing_is_empty_and_malformed_raises(tmp_path):
    assert load_summary(tmp_path / "none.json") == []
    bad = tmp_path / "bad.json"
    bad.write_text('{"sessions": [{"session": 1}]}')
    with pytest.raises(ValueError):
        load_summary(bad)
    old = tmp_path / "v1.json"  # the heat summary of earlier versions still loads
    old.write_text('{"version": 1, "tick": 3, "sessions": [{"session": "a", "heat": 2.5, '
                   '"keys": ["' + k("a").hex() + '"]}]}')
    assert [(x.session, x.score, x.keys) for x in load_summary(old)] == [("a", 2.5, (k("a"),))]


def test_feed_buffers_in_order_and_drops_the_oldest_when_full():
    t = [0.0]
    feed = AccessFeed(capacity=3, clock=lambda: t[0])
    for i in range(5):
        t[0] = float(i)
        feed.record([k("b", i)], f"s{i}")
    got = feed.drain()
    assert [(e.session, e.time) for e in got] == [("s2", 2.0), ("s3", 3.0), ("s4", 4.0)]
    assert feed.dropped == 2 and feed.recorded == 5 and feed.drain() == []
    assert not feed.wait(0.0)
    done = threading.Event()

    def waiter() -> None:
        if feed.wait(5.0):
            done.set()

    th = threading.Thread(target=waiter)
    th.start()
    feed.record([k("x")], "s")
    th.join(5.0)
    assert done.is_set()
    with pytest.raises(ValueError):
        AccessFeed(capacity=0)


def test_sorted_unique_is_numpys_unique():
    rng = np.random.default_rng(3)
    for n, hi in ((0, 5), (1, 5), (2, 1), (50, 10), (1000, 200_000)):
        rows = rng.integers(0, hi, size=n)
        got = sorted_unique(rows)
        assert got.dtype == rows.dtype
        assert np.array_equal(got, np.unique(rows))
    one = np.array([7])
    assert sorted_unique(one) is not one  # a new array, as np.unique gives


def test_rows_of_unknown_keys_are_minus_one():
    st = AccessStats()
    assert st.rows_of([k("nope")]).tolist() == [-1]
    assert isinstance(st.keys_of(np.array([], dtype=np.int64)), list)


def test_the_normal_cdf_of_the_reuse_model_matches_erfc_everywhere():
    """The reuse model's CDF reads a uniform grid by index: it must agree with the exact
    function inside the grid, at its edges and beyond them (clamped to 0 and 1)."""
    from kvagentd.kvcache.placement.reuse import _norm_cdf

    x = np.concatenate([np.linspace(-12.0, 12.0, 48_001), [-9.0, 9.0, -1e9, 1e9, 0.0]])
    exact = np.array([0.5 * math.erfc(-z / math.sqrt(2.0)) for z in x])
    got = _norm_cdf(x.copy())
    assert np.max(np.abs(got - exact)) < 4e-6
    assert got[-3] < 1e-15
    assert got[-2] == pytest.approx(1.0)
    assert np.all(np.diff(got[:48_001]) >= 0)  # monotone, as a CDF


def test_prefetched_blocks_are_counted_used_or_wasted_once():
    """A raised block is used (counted once, however often it is used), moved below the tier
    it was raised to before any use (wasted), moved up and back (still waiting), or forgotten
    by placement before any use (wasted)."""
    st = AccessStats()
    keys = [k("b", i) for i in range(5)]
    rows = st.ensure_rows(keys)
    st.moved(rows, HOT)
    st.note_raised(rows[:2], HOT)
    st.moved(rows[2:4], WARM)
    st.note_raised(rows[2:4], WARM)
    st.note_raised(rows[:1], HOT)  # raised again before its use: one block, counted once
    assert st.prefetch_outcomes() == {"raised": 4, "used": 0, "wasted": 0, "waiting": 4}
    st.record([ev([keys[0], keys[0]], "s", 1.0)])  # used (twice in one request: once)
    st.record([ev([keys[0]], "s", 2.0)])
    st.moved(rows[1:2], WARM)  # raised to hot, moved down unused
    st.moved(rows[2:3], HOT)  # raised to warm, then further up: still waiting
    st.moved(rows[3:4], NONE)  # evicted unused
    assert st.prefetch_outcomes() == {"raised": 4, "used": 1, "wasted": 2, "waiting": 1}
    st.moved(rows[2:3], WARM)  # back to warm, where it was raised to: not below it
    assert st.prefetch_outcomes()["waiting"] == 1
    st.forget(rows[2:3])  # the store dropped it: never used
    assert st.prefetch_outcomes() == {"raised": 4, "used": 1, "wasted": 3, "waiting": 0}
    st.record([ev([keys[4]], "s", 3.0)])  # never raised: not a prefetch's
    assert st.prefetch_outcomes()["used"] == 1


def test_density_charges_half_the_stay_and_the_time_so_far_stands_in_for_it():
    """A block that will not come back is charged what is left of its stay: half the measured
    stay (`LEFT_OF_STAY`). Before placement has moved anything out, the candidates' own time in
    hot so far stands in for that half, so the two agree when the stay is twice that time."""
    st = AccessStats()
    for i in range(20):
        st.record([ev([k("api-sys"), k("doc", i)], f"api-{i}", float(i))])
    rows = st.rows_of([k("doc", i) for i in range(10, 20)])
    now = 40.0
    mean_idle = float(np.mean(now - st.last_t[rows]))
    fallback = reuse_density(st, rows, now)
    same = pytest.approx(fallback, rel=1e-9, abs=0.0)
    assert reuse_density(st, rows, now, hold_s=2.0 * mean_idle) == same
    # a stay as long as their time so far: half of it charged, twice the density (they do not
    # come back: the charge is all of the slot time)
    short_stay = reuse_density(st, rows, now, hold_s=mean_idle)
    assert short_stay == pytest.approx(2.0 * fallback, rel=1e-3, abs=0.0)


def test_records_are_the_columns_and_survive_growth():
    """A round reads a candidate's record in one gather (`records`); the column attributes are
    views of the same records, before and after the table grows; where placement believes a
    row is, and whether it holds a block, are columns of their own that grow with the rest."""
    st = AccessStats(capacity=16)
    keys = [k("r", i) for i in range(40)]  # more rows than the first capacity: it grows
    for i in range(0, 40, 4):
        st.record([ev(keys[i:i + 4], "s", float(i))])
    st.record([ev(keys[:2], "s", 100.0)])
    rows = st.rows_of(keys)
    assert st.rec.shape[0] >= 40
    assert st.tier.shape == st.live.shape == st.rec.shape
    rec = st.records(rows)
    for name in ("last_t", "count", "gap_mu", "gap_var", "gaps", "cat", "base"):
        assert np.array_equal(rec[name], getattr(st, name)[rows]), name
    assert rec["count"][:2].tolist() == [2, 2] and rec["last_t"][0] == 100.0
    st.count[rows[:3]] = 7  # a write through a column lands in the records
    assert st.records(rows[:3])["count"].tolist() == [7] * 3
    assert st.live[rows].all() and (st.tier[rows] == HOT).all()  # all used: in hot
    st.forget(rows[:2])
    assert not st.live[rows[:2]].any() and (st.tier[rows[:2]] == NONE).all()
    assert st.live[rows[2:]].all()


def test_density_is_the_closed_form_row_by_row():
    """`reuse_density` computes, for every row, p / (p t + (1 - p) h) with the log-normal
    survival and conditional mean written out with erfc: the vectorized form (both normal
    CDFs in one call) changes nothing but speed."""
    rng = np.random.default_rng(3)
    st = AccessStats()
    t = 0.0
    for i in range(300):
        sess = f"s{rng.integers(0, 40)}"
        blocks = [k(f"root{i % 3}")] + [k(f"b{sess}", j) for j in range(int(rng.integers(1, 5)))]
        st.record([ev(blocks, sess, t)])
        t += float(rng.exponential(3.0))
    rows = st.sample_tier(HOT, 200, rng)
    rows = np.unique(rows)
    now, hold = t + 20.0, 40.0
    got = reuse_density(st, rows, now, hold_s=hold)
    q, mu, s = reuse_model(st, rows, reuse_tables(st))

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))
    for i, r in enumerate(rows.tolist()):
        qi = float(q[i]) if st.count[r] > 0 else 0.5
        a = max(now - float(st.last_t[r]), 1e-3)
        m, sd = float(mu[i]), float(s[i])
        surv = max(1.0 - phi((math.log(a) - m) / sd), 1e-12)
        p = qi * surv / (1.0 - qi + qi * surv)
        after = math.exp(min(m + 0.5 * sd * sd, 50.0)) * phi((m + sd * sd - math.log(a)) / sd)
        wait = max(after / surv - a, 1.0)
        want = p / (p * wait + (1.0 - p) * max(0.5 * hold, 1.0))
        assert got[i] == pytest.approx(want, rel=1e-4, abs=1e-12), (r, got[i], want)


def test_a_tier_sample_holds_only_rows_of_that_tier_and_about_as_many_as_asked():
    st = AccessStats()
    keys = [k("m", i) for i in range(400)]
    st.record([ev(keys, "s", 1.0)])
    rows = st.rows_of(keys)
    st.believe(rows[:100], WARM)  # a quarter moved to warm: stale entries in hot's list
    rng = np.random.default_rng(0)
    hot = st.sample_tier(HOT, 50, rng)
    assert 25 <= hot.size <= 50 and (st.tier[hot] == HOT).all()
    warm = st.sample_tier(WARM, 50, rng)
    assert 25 <= warm.size <= 50 and (st.tier[warm] == WARM).all()
    assert set(warm.tolist()) <= set(rows[:100].tolist())
    seen = np.concatenate([st.sample_tier(HOT, 50, rng) for _ in range(60)])
    assert np.unique(seen).size > 250  # uniform over the 300 hot rows: nearly all are drawn


def test_placements_memory_is_a_few_hundred_bytes_a_block_and_status_says_it():
    """What placement keeps per block is bounded and reported (`kvctl status`): its arrays,
    the key -> row dict and the keys; a heat policy adds its heat map."""
    from .sim_env import Env
    st = AccessStats()
    keys = [i.to_bytes(16, "big") for i in range(60_000)]
    for i in range(0, 60_000, 1_000):
        st.record([ev(keys[i:i + 1_000], "s", float(i))])
    assert 100 * len(st) < st.nbytes < 400 * len(st)
    for policy in ("reuse", "heat"):
        env = Env(Capacities(8, 8), 200, policy)
        env.use(1.0, list(range(50)))
        env.svc.ingest()
        mem = env.svc.status()["memory_bytes"]
        assert mem["stats"] > 50 * 100
        assert (mem["heat"] > 0) == (policy == "heat"), (policy, mem)
