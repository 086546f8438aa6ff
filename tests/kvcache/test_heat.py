"""Heat formula, ring window, batches with repeats, rebase, growth."""

from __future__ import annotations

import numpy as np
import pytest

from kvagentd.kvcache.placement.heat import HeatMap


def rec(h: HeatMap, rows: list[int], tick: int) -> None:
    h.record(np.array(rows, dtype=np.int64), np.full(len(rows), tick, dtype=np.int64))


def test_single_access_one_tick_ago_has_heat_one():
    h = HeatMap(200)
    rec(h, [1], 0)
    assert h.heat(np.array([1]), 1)[0] == pytest.approx(1.0)


def test_ten_accesses_at_distances_one_to_ten():
    h = HeatMap(200)
    for t in range(10):
        rec(h, [1], t)
    expected = sum(1.0 / d for d in range(1, 11))
    assert expected == pytest.approx(2.929, abs=1e-3)
    assert h.heat(np.array([1]), 10)[0] == pytest.approx(expected, rel=1e-6)


def test_distance_is_at_least_one_and_unknown_rows_are_cold():
    h = HeatMap(200)
    rec(h, [1], 5)
    got = h.heat(np.array([1, 2, 10_000, -1]), 5)
    assert got.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_window_keeps_only_the_last_w_accesses():
    h = HeatMap(3)
    for t in range(10):
        rec(h, [1], t)
    assert h.heat(np.array([1]), 10)[0] == pytest.approx(1 + 1 / 2 + 1 / 3)


def test_a_batch_with_repeats_equals_the_same_accesses_one_by_one():
    one, batch = HeatMap(4), HeatMap(4)
    rows = [3, 1, 3, 3, 2, 3, 1, 3, 3]
    ticks = [0, 0, 1, 2, 2, 3, 4, 5, 6]
    for r, t in zip(rows, ticks):
        rec(one, [r], t)
    batch.record(np.array(rows), np.array(ticks))
    probe = np.array([1, 2, 3])
    assert batch.heat(probe, 7).tolist() == pytest.approx(one.heat(probe, 7).tolist())
    rec(one, [3], 8)
    rec(batch, [3], 8)  # the ring positions continue where the batch left them
    assert batch.heat(probe, 9).tolist() == pytest.approx(one.heat(probe, 9).tolist())


def test_cleared_rows_start_cold_and_the_map_grows():
    h = HeatMap(8, capacity=16)
    rec(h, list(range(100)), 0)
    assert h.capacity >= 100
    assert np.allclose(h.heat(np.arange(100), 1), 1.0)
    h.clear(np.array([7]))
    assert h.heat(np.array([7]), 1)[0] == 0.0


def test_rebase_keeps_heat():
    h = HeatMap(16)
    big = (1 << 23) - 5
    for t in range(30):
        rec(h, [t % 3], big + t)  # crosses the rebase point
    before = h.heat(np.array([0, 1, 2]), big + 30)
    assert h._base > 0
    expected = [sum(1.0 / (30 - t) for t in range(30) if t % 3 == r) for r in range(3)]
    assert before.tolist() == pytest.approx(expected, rel=1e-5)


def test_rows_read_in_buckets_of_their_tick_count_have_the_exact_heat():
    """Rows used once, a few times, tens of times and more than the window (wrapped rings),
    recorded in batches with repeats: each row's heat is the sum over its last W ticks."""
    rng = np.random.default_rng(3)
    w = 50
    h = HeatMap(w, capacity=16)
    uses: dict[int, list[int]] = {}
    tick = 0
    for _ in range(60):
        rows = rng.choice(400, size=40) % (1 + rng.integers(0, 400, size=40))  # skewed
        rows = np.sort(np.concatenate([rows, [7] * 3]))  # row 7 wraps its ring
        ticks = tick + np.arange(rows.size) // 8
        h.record(rows.astype(np.int64), ticks.astype(np.int64))
        for r, t in zip(rows.tolist(), ticks.tolist()):
            uses.setdefault(r, []).append(t)
        tick = int(ticks[-1]) + 1
    h.clear(np.array([0]))  # a forgotten row reads cold, then starts over
    uses.pop(0, None)
    h.record(np.array([0]), np.array([tick - 1]))
    uses[0] = [tick - 1]
    probe = np.arange(-1, 420)
    want = [sum(1.0 / max(1, tick - t) for t in sorted(uses.get(r, []))[-w:]) for r in probe]
    counts = {len(v) for v in uses.values()}
    assert min(counts) == 1 and max(counts) > w  # every bucket is exercised
    assert h.heat(probe, tick).tolist() == pytest.approx(want, rel=1e-5)


def test_a_freed_row_reused_reads_only_its_new_ticks():
    h = HeatMap(8, capacity=16)
    rows = np.array([3] * 6, dtype=np.int64)
    h.record(rows, np.arange(6, dtype=np.int64))
    h.clear(np.array([3]))
    assert h.heat(np.array([3]), 10).tolist() == [0.0]
    h.record(np.array([3]), np.array([8]))
    assert h.heat(np.array([3]), 10).tolist() == [np.float32(0.5)]  # 1 / (10 - 8), no more


def test_rows_used_a_few_times_hold_no_ring_and_a_cleared_ring_is_reused():
    """Most blocks are used a few times: they keep their ticks in their own `INLINE` slots
    (a million rows cost tens of MB, not 4 W bytes each); a row used more often takes a ring
    of W slots from the pool, its earlier ticks carried over, and gives it back when cleared."""
    from kvagentd.kvcache.placement.heat import INLINE
    h = HeatMap(200, capacity=16)
    n = 20_000
    for t in range(INLINE):
        rec(h, list(range(n)), t)
    assert h.rings == 0 and h.nbytes < 40 * n
    assert np.allclose(h.heat(np.arange(n), INLINE), sum(1.0 / d for d in range(1, INLINE + 1)))
    for t in range(INLINE, 10):  # row 5 goes on: a ring, with its first ticks in it
        rec(h, [5], t)
    assert h.rings == 1
    assert h.heat(np.array([5]), 10)[0] == pytest.approx(sum(1.0 / d for d in range(1, 11)))
    size = h._wide.shape[0]
    h.clear(np.array([5, 6]))
    assert h.rings == 0 and h.heat(np.array([5]), 10)[0] == 0.0
    for t in range(10, 20):  # another row takes the ring row 5 gave back
        rec(h, [7], t)
    assert h.rings == 1 and h._wide.shape[0] == size
    want = sum(1.0 / (20 - t) for t in (*range(INLINE), *range(10, 20)))
    assert h.heat(np.array([7]), 20)[0] == pytest.approx(want, rel=1e-6)
