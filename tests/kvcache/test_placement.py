"""Placement policies (crafted rounds, properties) and the placement service (simulated and
real store): capacity, admission, cost that follows accesses, resilience, reload."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.placement_sim.store import SimStore
from kvagentd.config import PlacementConfig
from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement import AccessFeed, PlacementService
from kvagentd.kvcache.placement.base import CODE_OF, HOT, WARM, Action, Capacities, Reason, Want
from kvagentd.kvcache.placement.feed import Access
from kvagentd.kvcache.placement.gather import WishRows
from kvagentd.kvcache.placement.prefetch import Wish
from kvagentd.kvcache.placement.service import SWEEP_ROWS
from kvagentd.kvcache.placement.policy import (Candidates, LRUPolicy, PolicyParams, ReusePolicy,
                                               RoundView, make_policy)
from kvagentd.kvcache.placement.reuse import reuse_model
from kvagentd.kvcache.placement.stats import AccessStats

from .conftest import compute_blocks
from .sim_env import Env, key

H, W, C = Tier.HOT, Tier.WARM, Tier.COLD


# ------------------------------------------------------------------------------------------
# policies on crafted rounds
# ------------------------------------------------------------------------------------------

def test_lru_demotes_in_the_stores_order_one_tier_down():
    keys = [key(i) for i in range(20)]
    caps = Capacities(100, 100)
    p = PolicyParams(headroom_fraction=0.05, batch_fraction=0.02)
    hot = Candidates(np.zeros(0, np.int64), np.full(10, HOT, np.int8), keys[:10])
    view = RoundView(0.0, caps, {H: 2, W: 50}, {H: hot})
    plan = LRUPolicy(p).plan(view, AccessStats(), None)
    # need: head-room 5 - free 2 = 3, plus a batch of 2
    assert [(b.src, b.dst, b.keys) for b in plan.batches] == [(H, W, tuple(keys[:5]))]
    assert plan.counts() == {"demote:lru": 5}
    # warm short as well: its least recent blocks go to cold first, then hot's go to warm
    warm = Candidates(np.zeros(0, np.int64), np.full(10, WARM, np.int8), keys[10:])
    view = RoundView(0.0, caps, {H: 2, W: 4}, {H: hot, W: warm})
    plan = LRUPolicy(p).plan(view, AccessStats(), None)
    assert [(b.src, b.dst, len(b)) for b in plan.batches] == [(W, C, 8), (H, W, 5)]
    assert plan.batches[0].keys == tuple(keys[10:18])


def _docs_and_chats():
    """40 one-shot documents of one application, then 40 conversations of another that came
    back a minute later; the last ten of each in hot, which has 1 free slot of 100."""
    st = AccessStats()
    t = 0.0
    docs, convs = [], []
    for i in range(40):  # api: each document used once
        st.record([Access([key(1000), key(i)], f"api-{i}", t)])
        docs.append(key(i))
        t += 1.0
    for i in range(40):  # chat: each conversation comes back a minute later
        c = key(2000 + i)
        st.record([Access([key(3000), c], f"chat-{i}", t)])
        st.record([Access([key(3000), c], f"chat-{i}", t + 60.0)])
        convs.append(c)
        t += 1.0
    cand = st.rows_of(docs[-10:] + convs[-10:])
    hot = Candidates(cand, np.full(cand.size, HOT, np.int8))
    view = RoundView(t + 5.0, Capacities(100, 100), {H: 1, W: 0},
                     {H: hot, W: Candidates(np.zeros(0, np.int64), np.zeros(0, np.int8))})
    return st, view, docs[-10:], convs[-10:]


def test_reuse_sends_one_shot_blocks_down_first_and_straight_to_cold():
    st, view, docs, convs = _docs_and_chats()
    # which go when hot needs 6 slots?
    p = PolicyParams(headroom_fraction=0.03, batch_fraction=0.03)
    plan = ReusePolicy(p).plan(view, st, None)
    moved = {m.key: m.dst for m in plan}
    assert set(moved) <= set(docs) and len(moved) == 5  # need: 3 - 1 + 3
    assert set(moved.values()) == {C}  # warm has no room and nothing worse to give it up for
    assert all(m.reason is Reason.REUSE and m.action is Action.DEMOTE for m in plan)


def test_reuse_ranks_by_the_model_it_is_given():
    """The score follows the reuse model the policy holds (the learned one by default): a
    model that says the conversations never return and the documents surely do sends the
    conversations down instead."""
    st, view, docs, convs = _docs_and_chats()
    chat = set(st.rows_of(convs).tolist())

    def inverted(stats, rows, tables, rec=None):
        q, mu, s = reuse_model(stats, rows, tables, rec)
        is_chat = np.isin(rows, list(chat))
        return np.where(is_chat, 0.0, 0.99), mu, s

    p = PolicyParams(headroom_fraction=0.03, batch_fraction=0.03)
    moved = {m.key for m in ReusePolicy(p, inverted).plan(view, st, None)}
    assert moved <= set(convs) and len(moved) == 5


def test_unknown_policy_names_are_refused():
    try:
        make_policy("random", PolicyParams())
    except ValueError as exc:
        assert "lru" in str(exc) and "reuse" in str(exc)
    else:
        raise AssertionError("accepted an unknown policy")


@st.composite
def workloads(draw):
    n = draw(st.integers(20, 80))
    hot = draw(st.integers(4, 30))
    warm = draw(st.integers(0, 30))
    reqs = draw(st.lists(st.lists(st.integers(0, n - 1), min_size=1, max_size=8, unique=True),
                         min_size=1, max_size=40))
    return n, Capacities(hot, warm), reqs


@settings(max_examples=60, deadline=None)
@given(workloads(), st.sampled_from(["lru", "heat", "heat+prefetch", "reuse"]))
def test_rounds_never_exceed_capacity_nor_move_a_block_twice(wl, policy):
    n, caps, reqs = wl
    env = Env(caps, n, policy, interval_s=1.0)
    t = 0.0
    for i, ids in enumerate(reqs):
        if len(ids) > caps.hot:
            ids = ids[:caps.hot]
        env.use(t, ids, i % 3)
        env.store.check()
        if i % 2:
            env.clock.t = t + 0.5
            plan = env.svc.run_round()
            keys = [m.key for m in plan]
            assert len(keys) == len(set(keys))
            cap = env.svc.policy.params.max_moves(caps)
            assert sum(1 for m in plan if m.action is Action.DEMOTE) <= cap
            assert sum(1 for m in plan if m.action is Action.PROMOTE) <= cap
            env.store.check()
        t += 1.0


# ------------------------------------------------------------------------------------------
# the service over the simulated store
# ------------------------------------------------------------------------------------------

def test_a_round_restores_head_room_and_reuse_keeps_what_comes_back():
    env = Env(Capacities(40, 10), 600, "reuse", headroom_fraction=0.25)
    t = 0.0
    # a chat session that returns every 30 s, between one-shot documents (8 blocks, 2 s apart)
    for r in range(12):
        if r == 2:  # from its second return on, its blocks wait in hot
            hits, fallback = env.store.c.hot_hits, env.store.c.foreground_demotions
        env.use(t, list(range(10)), 1)
        for j in range(4):
            t += 2.0
            env.use(t, list(range(100 + 40 * r + 8 * j, 108 + 40 * r + 8 * j)), 0)
            env.clock.t = t + 0.5
            env.svc.run_round()
            assert env.store.pool(H).num_free >= 10  # head-room: 25 % of 40
        t += 22.0
    assert env.store.c.hot_hits - hits == 10 * 10  # every later return is all hot
    assert env.store.c.foreground_demotions == fallback  # the store never had to make room
    assert env.svc.errors == 0
    # what the rounds moved out of hot had been idle a few seconds (documents), never the 22 s+
    # the chat waits: that is how long the policy charges a block that does not come back
    assert env.svc.stats.hold_s is not None and 1.0 < env.svc.stats.hold_s < 22.0


def test_round_cost_follows_accesses_not_stored_blocks():
    """Each round looks at the same number of blocks whether the store holds 200 or 20,000
    (the accesses since the last round plus bounded samples), never at every block."""
    looked: dict[int, list[int]] = {}
    swept: dict[int, list[int]] = {}
    for n in (200, 20_000):
        env = Env(Capacities(32, 16), n + 100, "reuse")
        env.store.preload_cold(np.arange(100, n + 100), 0.0)
        env.svc.stats.ensure_rows([key(i) for i in range(100, n + 100)])  # placement knows all
        seen: list[int] = []
        sweeps: list[int] = []
        in_sweep = [False]
        for name in ("block_states", "least_recent_idle", "sample_idle"):
            f = getattr(env.store, name)

            def counted(*a, f=f, name=name, seen=seen, sweeps=sweeps, flag=in_sweep):
                out = f(*a)
                (sweeps if flag[0] else seen).append(
                    len(out) if name != "block_states" else len(a[0]))
                return out
            setattr(env.store, name, counted)
        sweep = env.svc._sweep

        def sweeping(sweep=sweep, flag=in_sweep):
            flag[0] = True
            sweep()
            flag[0] = False
        env.svc._sweep = sweeping
        t = 1.0
        for r in range(30):
            env.use(t, [r % 20, (r + 1) % 20, 20 + r, 50 + r % 7])
            env.clock.t = t + 0.5
            env.svc.run_round()
            t += 1.0
        looked[n], swept[n] = seen, sweeps
    assert looked[200] == looked[20_000]  # deciding: the same blocks looked at
    assert max(looked[20_000]) <= 64  # a sample, or a tail of the LRU order
    assert max(swept[20_000]) <= SWEEP_ROWS and len(swept[20_000]) <= 30  # forgetting: bounded


def test_a_round_with_room_to_spare_looks_at_no_block():
    """Where hot and warm have their head-room there is nothing to decide: a round asks the
    store for its room and looks at no block (`heat` too: it promotes its risers in the rounds
    that make room). The sweep, which forgets dropped blocks, is bounded apart and left out."""
    for policy in ("lru", "heat", "reuse"):
        env = Env(Capacities(64, 32), 40, policy)
        asked: list[str] = []
        for name in ("block_states", "least_recent_idle", "sample_idle"):
            f = getattr(env.store, name)
            setattr(env.store, name,
                    lambda *a, f=f, name=name, asked=asked: (asked.append(name), f(*a))[1])
        env.svc._sweep = lambda: None
        t = 1.0
        for r in range(10):
            env.use(t, [r % 8, (r + 1) % 8, 10 + r])
            env.clock.t = t + 0.5
            assert len(env.svc.run_round()) == 0
            t += 1.0
        assert not asked, (policy, asked)


def test_the_sweep_forgets_blocks_the_store_dropped():
    env = Env(Capacities(8, 8), 40, "lru")
    env.use(1.0, list(range(6)))
    env.svc.ingest()
    assert len(env.svc.stats) == 6
    env.store.evict([key(i) for i in range(6)])
    env.clock.t = 2.0
    env.svc.run_round()
    assert len(env.svc.stats) == 0


def test_a_failing_round_is_counted_and_the_service_keeps_running():
    class Broken(SimStore):
        def __init__(self) -> None:
            super().__init__(Capacities(4, 4), 8, [key(i) for i in range(8)], clock=lambda: 0.0)
            self.calls = 0
            self.ok = threading.Event()

        def pool(self, tier):
            self.calls += 1
            if self.calls >= 3:
                self.ok.set()
            raise OSError("disk on fire")

    b = Broken()
    svc = PlacementService(b, AccessFeed(), PlacementConfig(interval_s=0.05))
    svc.start()
    try:
        assert b.ok.wait(10)
        assert svc.status()["running"] is True
        deadline = time.time() + 10
        while svc.errors < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert svc.errors >= 2 and "disk on fire" in (svc.last_error or "")
    finally:
        svc.stop()


def test_scheduler_job_and_reload():
    from apscheduler.schedulers.background import BackgroundScheduler

    env = Env(Capacities(4, 4), 16, "lru", interval_s=0.05)
    sched = BackgroundScheduler()
    sched.start()
    svc = PlacementService(env.store, env.feed, PlacementConfig(policy="lru", interval_s=0.05),
                           sched)
    try:
        svc.start()
        deadline = time.time() + 10
        while svc.rounds < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert svc.rounds >= 2
        assert svc.heat is None
        svc.reload(type("Cfg", (), {"placement": PlacementConfig(policy="heat",
                                                                  interval_s=0.1)})())
        assert svc.status()["policy"] == "heat" and svc.heat is not None
    finally:
        svc.stop()
        sched.shutdown(wait=False)


def test_a_working_set_that_fits_moves_nothing_once_settled():
    for policy in ("lru", "heat", "heat+prefetch", "reuse"):
        env = Env(Capacities(16, 6), 12, policy)
        moves: Counter = Counter()
        t = 0.0
        for r in range(40):
            for s, ids in ((0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])):
                env.use(t, ids, s)
                t += 0.3
            env.clock.t = t
            plan = env.svc.run_round()
            if r > 5:
                moves.update(m.key for m in plan)
        assert not moves, (policy, moves)
        assert env.tiers(list(range(12))) == [H] * 12


# ------------------------------------------------------------------------------------------
# the service over the real store
# ------------------------------------------------------------------------------------------

def test_service_demotes_to_head_room_in_the_real_store(make_store):
    feed = AccessFeed()
    store = make_store(hot=8, warm=8, access_listener=feed.record)
    svc = PlacementService(store, feed, PlacementConfig(policy="reuse",
                                                        headroom_fraction=0.25))
    assert svc.capacities() == Capacities(8, 8)
    for s in range(4):  # 8 blocks: hot is full
        keys = compute_blocks(store, f"s{s}", list(range(100 * s, 100 * s + 8)), 0, 2)
        store.record_access(keys, f"s{s}")
        store.release(f"s{s}")
    assert store.pool(Tier.HOT).num_free == 0
    plan = svc.run_round()
    assert len(plan) >= 2 and all(m.src is H and m.action is Action.DEMOTE for m in plan)
    assert store.pool(Tier.HOT).num_free >= 2
    assert svc.last_round is not None and svc.last_round.applied == len(plan)
    assert svc.last_round.accessed == 8
    assert svc.status()["blocks"] == 8
    states = store.block_states([m.key for m in plan])
    assert set(states.tier.tolist()) <= {CODE_OF[W], CODE_OF[C]}
    store.check_integrity()
    store.close()


def test_wish_rows_are_remembered_until_a_row_is_freed_and_the_first_wish_holds():
    stats = AccessStats()
    keys = [key(i) for i in range(4)]
    stats.record([Access(keys, "s", 0.0)])
    a = Wish("a", tuple(keys[:3]), Want(H, Reason.PREDICT))
    b = Wish("b", tuple(keys[2:]), Want(W, Reason.COACCESS))
    rows = WishRows()
    got = rows(stats, [a, b])
    assert got.rows.tolist() == stats.rows_of(keys).tolist()
    assert got.tier.tolist() == [HOT, HOT, HOT, WARM]  # keys[2] is wished by a first
    assert rows(stats, [a, b]) is got  # the same wishes: no key is looked up again
    assert rows(stats, [b]).rows.tolist() == stats.rows_of(keys[2:]).tolist()
    stats.forget(stats.rows_of(keys[:1]))
    stats.record([Access([key(99)], "t", 1.0)])  # takes the freed row
    again = rows(stats, [a, b])
    assert again.rows.tolist() == stats.rows_of(keys).tolist()
    assert stats.key_of(int(again.rows[0])) == keys[0] and again.rows[0] != got.rows[0]


def test_positions_finds_rows_among_others():
    stats = AccessStats()
    stats.record([Access([key(i) for i in range(6)], "s", 0.0)])
    among = np.array([4, 1, 3])
    assert stats.positions(np.array([1, 2, 3, 4, 1]), among).tolist() == [1, -1, 2, 0, 1]


def test_warm_is_sampled_for_its_own_shortfall_and_lru_frees_room_for_hots_victims():
    """When hot is short, warm is looked at too (hot's victims need its room). A scoring
    policy samples warm in proportion to warm's own shortfall (`warm_sample_per_victim`), not
    to hot's victims as well, and asks the store for `lru_candidates` of warm's least recently
    used blocks; LRU takes as many of them as hot's victims need."""
    caps = Capacities(4000, 2000)
    p = PolicyParams()
    for policy in ("reuse", "lru"):
        env = Env(caps, 9000, policy)
        sampled: list[tuple[int, int]] = []
        tails: list[tuple[Tier, int]] = []
        f = env.svc.stats.sample_tier
        env.svc.stats.sample_tier = lambda code, n, rng, f=f, s=sampled: (s.append((code, n)),
                                                                           f(code, n, rng))[1]
        g = env.store.least_recent_idle
        env.store.least_recent_idle = lambda tier, n, g=g, s=tails: (s.append((tier, n)),
                                                                     g(tier, n))[1]
        t = 1.0
        for r in range(8):  # 8 x 1000 new blocks: hot and warm fill, then both are short
            env.use(t, list(range(1000 * r, 1000 * r + 1000)))
            env.clock.t = t + 0.5
            env.svc.run_round()
            t += 1.0
        hot_victims = p.headroom(caps.hot) + p.batch(caps.hot)  # hot full: short by its head-room
        warm_own_most = p.headroom(caps.warm) + p.batch(caps.warm)  # warm: at most its own
        if policy == "reuse":
            warm = [n for code, n in sampled if code == WARM]
            assert warm and max(warm) <= max(p.sample,
                                             int(p.warm_sample_per_victim * warm_own_most))
            assert {n for tier, n in tails if tier is W} == {p.lru_candidates}
            hot = [n for code, n in sampled if code == HOT]
            assert min(hot) >= p.sample_per_victim * hot_victims  # hot: its own victims
        else:
            warm_tail = [n for tier, n in tails if tier is W]
            assert warm_tail and max(warm_tail) >= hot_victims + p.batch(caps.warm)
        assert env.svc.errors == 0


def test_promotions_go_best_first_into_each_tiers_room_within_the_budget():
    """`heat` raises its risers by heat, wishes first (each to the tier wished for), while the
    tier has room beyond its head-room and the budget lasts: a riser whose tier is full is
    passed over, the next one bound elsewhere still rises; never down, never sideways. One
    batch per (from, to, reason), in the order each first rises."""
    from kvagentd.kvcache.placement.heat import HeatMap
    from kvagentd.kvcache.placement.policy import HeatPolicy, Wanted, REASONS
    st = AccessStats()
    heat = HeatMap(16)
    keys = [key(i) for i in range(12)]
    st.record([Access(keys, "s", 0.0)])
    rows = st.rows_of(keys)
    # uses per riser: more uses, more heat (riser 11 none: it never rises by heat)
    for i in range(11):
        heat.record(np.full(i + 1, rows[i]), np.arange(i + 1, dtype=np.int64))
    st.tick = 20
    tiers = np.array([C, W, C, W, C, W, C, W, C, W, C, C], dtype=object)
    codes = np.array([CODE_OF[t] for t in tiers], np.int8)
    risers = Candidates(rows, codes)
    # rows 0 and 2 (cold) are wished up to warm, for a reason of its own
    pre = REASONS.index(Reason.PREDICT)
    wanted = Wanted(rows[[0, 2]], np.array([CODE_OF[W]] * 2, np.int8),
                    np.array([pre, pre], np.int8))
    p = PolicyParams(hot_factor=0.0, hysteresis=0.0, headroom_fraction=0.0, window_fraction=0.05)
    caps = Capacities(100, 100)  # budget: 5 moves; hot has room for 3, warm for 1
    view = RoundView(20.0, caps, {H: 3, W: 1}, {}, risers, wanted)
    plan = HeatPolicy(p).plan(view, st, heat)
    got = [(b.src, b.dst, b.reason, [int(r) for r in b.rows]) for b in plan.batches]
    # wishes first (rows 2 and 0 by heat, 2 hotter): only one fits warm's one slot; then by
    # heat: 10, 9, 8 take hot's three slots, and the budget of 5 is spent
    assert got == [(C, W, Reason.PREDICT, [int(rows[2])]),
                   (C, H, Reason.HEAT, [int(rows[10]), int(rows[8])]),
                   (W, H, Reason.HEAT, [int(rows[9])])]
    assert sum(len(b) for b in plan.batches) == 4  # hot full after 3, warm after 1


def test_a_round_reuses_its_gatherer_until_the_policy_or_capacities_change():
    """The gatherer serves round after round (no per-round setup) yet sees each round's own
    free room: a round with room moves nothing, the next one, with hot full, makes room. A new
    policy or new capacities get a new gatherer."""
    caps = Capacities(100, 50)
    env = Env(caps, 1000, "reuse")
    env.use(1.0, list(range(40)))
    env.clock.t = 1.5
    assert not env.svc.run_round().batches  # hot has room
    first = env.svc._gather
    assert first is not None and first.policy is env.svc.policy
    env.use(2.0, list(range(40, 100)))  # hot full: short of its head-room
    env.clock.t = 2.5
    plan = env.svc.run_round()
    assert env.svc._gather is first  # the same gatherer ...
    assert sum(len(b) for b in plan.batches if b.src is Tier.HOT) > 0  # ... with fresh room
    assert env.store.pool(Tier.HOT).num_free >= PolicyParams().headroom(caps.hot)
    env.svc.reload(type("Cfg", (), {"placement": PlacementConfig(policy="lru",
                                                                 trace_capacity=1000)})())
    env.clock.t = 3.0
    env.svc.run_round()
    assert env.svc._gather is not first and env.svc._gather.policy.name == "lru"
    lru = env.svc._gather
    env.svc._caps = Capacities(120, 50)  # as `capacities()` finds after a resize
    env.svc.run_round()
    assert env.svc._gather is not lru and env.svc._gather.caps == Capacities(120, 50)


def test_reuse_hands_on_the_candidates_ranked_next_after_its_victims():
    """The plan names hot's runners-up: `carry_per_victim` x hot's need candidates, the
    lowest-ranked of those that stay, none of them a victim; LRU (the store's keys) has none."""
    st, view, docs, convs = _docs_and_chats()
    p = PolicyParams(headroom_fraction=0.03, batch_fraction=0.02, carry_per_victim=1.0)
    plan = ReusePolicy(p).plan(view, st, None)
    need = view.need(H, p)  # 3 - 1 + 2
    moved = [m.key for m in plan]
    assert len(moved) == need and set(moved) <= set(docs)
    runners = st.keys_of(plan.runners_up)
    # the documents rank below every conversation: the next `need` after the victims
    assert len(runners) == need and set(runners) <= set(docs) and not set(runners) & set(moved)
    none = ReusePolicy(PolicyParams(headroom_fraction=0.03, batch_fraction=0.02,
                                    carry_per_victim=0.0)).plan(view, st, None)
    assert none.runners_up is None and len(list(none)) == need  # the same count, no runners
    assert {m.key for m in none} <= set(docs)
    keys = [key(i) for i in range(10)]
    lru_view = RoundView(0.0, Capacities(100, 100), {H: 1, W: 50},
                         {H: Candidates(np.zeros(0, np.int64), np.full(10, HOT, np.int8), keys)})
    assert LRUPolicy(p).plan(lru_view, AccessStats(), None).runners_up is None


def test_the_next_round_that_makes_room_in_hot_looks_at_the_runners_up_again():
    """A deciding round's runners-up join hot's candidates the next time hot is short (once;
    those that left hot since are dropped), whether or not that round's sample finds them."""
    caps = Capacities(400, 200)
    env = Env(caps, 5000, "reuse")
    svc = env.svc
    t = 1.0
    for r in range(4):  # hot fills, then is short
        env.use(t, list(range(150 * r, 150 * r + 150)))
        env.clock.t = t + 0.5
        plan = svc.run_round()
        t += 1.0
    assert plan.runners_up is not None and plan.runners_up.size > 0
    runners = plan.runners_up.copy()
    assert svc._gather is not None and np.array_equal(svc._gather._runners_up, runners)
    gone = runners[:3]  # moved out of hot meanwhile (by a request elsewhere, say)
    env.store.demote(svc.stats.keys_of(gone), Tier.WARM)
    svc.stats.believe(gone, WARM)
    seen: list[np.ndarray] = []
    orig = svc.policy.plan
    svc.policy.plan = lambda view, stats, heat: (seen.append(view.victims[H].rows.copy()),
                                                 orig(view, stats, heat))[1]
    svc.stats.sample_tier = lambda code, n, rng: np.zeros(0, np.int64)  # no sample: only
    env.use(t, list(range(600, 750)))  # the LRU tail, arrivals and the runners-up
    env.clock.t = t + 0.5
    svc.run_round()
    assert seen, "hot was short"
    cand = set(seen[0].tolist())
    assert set(runners[3:].tolist()) <= cand and not set(gone.tolist()) & cand
    assert env.svc.errors == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40), st.integers(0, 45), st.integers(0, 45))
def test_victims_and_runners_up_come_from_one_partition(scores, n, m):
    """`_lowest_then`: the `n` lowest scores in order (as `_lowest`), then the `m` ranked next,
    together the `n + m` lowest, no index twice."""
    from kvagentd.kvcache.placement.policy import _lowest, _lowest_then
    s = np.asarray(scores, dtype=np.float64)
    first, after = _lowest_then(s, n, m)
    assert s[first].tolist() == s[_lowest(s, n)].tolist()
    assert first.size + after.size == min(n + m, s.size)
    assert len(set(first.tolist()) | set(after.tolist())) == first.size + after.size
    both = np.concatenate([s[first], s[after]])
    assert sorted(both.tolist()) == sorted(s.tolist())[:both.size]
