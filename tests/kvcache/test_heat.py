"""Heat formula, ring window, rows, thresholds and the persisted summary."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvagentd.kvcache.placement.heat import HeatMap, load_summary


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_single_access_one_tick_ago_has_heat_one():
    h = HeatMap(200)
    h.record([k(1)], "s")
    assert h.heat_of([k(1)])[0] == pytest.approx(1.0)


def test_ten_accesses_at_distances_one_to_ten():
    h = HeatMap(200)
    for _ in range(10):
        h.record([k(1)], "s")
    expected = sum(1.0 / d for d in range(1, 11))
    assert expected == pytest.approx(2.929, abs=1e-3)
    assert h.heat_of([k(1)])[0] == pytest.approx(expected, rel=1e-6)


def test_other_events_age_a_block_and_unknown_blocks_are_cold():
    h = HeatMap(200)
    h.record([k(1)], "a")
    for _ in range(3):
        h.record([k(2)], "b")
    heat = h.heat_of([k(1), k(2), k(99)])
    assert heat[0] == pytest.approx(1 / 4)
    assert heat[1] == pytest.approx(1 + 1 / 2 + 1 / 3)
    assert heat[2] == 0.0


def test_distance_is_at_least_one_when_asked_at_the_access_tick():
    h = HeatMap(200)
    t = h.record([k(1)], "s")
    assert h.heat_of([k(1)], now=t)[0] == pytest.approx(1.0)


def test_window_keeps_only_the_last_w_accesses():
    h = HeatMap(3)
    for _ in range(10):
        h.record([k(1)], "s")
    assert h.heat_of([k(1)])[0] == pytest.approx(1 + 1 / 2 + 1 / 3)


def test_forgotten_rows_are_reused_and_start_cold():
    h = HeatMap(8, capacity=16)
    h.record([k(i) for i in range(16)], "s")
    r = h.row_of(k(3))
    h.forget([k(3)])
    assert h.row_of(k(3)) is None and len(h) == 15
    h.record([k(100)], "t")
    assert h.row_of(k(100)) == r
    assert h.heat_of([k(100)])[0] == pytest.approx(1.0)


def test_grows_past_its_initial_capacity():
    h = HeatMap(4, capacity=16)
    h.record([k(i) for i in range(100)], "s")
    assert len(h) == 100
    assert np.allclose(h.heat_of([k(i) for i in range(100)]), 1.0)


def test_rebase_keeps_heat():
    h = HeatMap(16)
    for i in range(30):
        h.record([k(i % 3)], "s")
    before = h.heat_of([k(0), k(1), k(2)])
    h._rebase()
    assert np.allclose(h.heat_of([k(0), k(1), k(2)]), before)


def test_summary_round_trip_hottest_session_first(tmp_path):
    h = HeatMap(200)
    for _ in range(5):
        h.record([k(1), k(2)], "busy")
    h.record([k(3)], "quiet")
    path = tmp_path / "heat.json"
    h.save_summary(path)
    s = load_summary(path)
    assert [x.session for x in s] == ["busy", "quiet"]
    assert set(s[0].keys) == {k(1), k(2)}
    assert s[0].heat > s[1].heat > 0
    assert not math.isnan(s[1].heat)
    h.save_summary(path, max_sessions=1)
    assert [x.session for x in load_summary(path)] == ["busy"]


def test_summary_missing_is_empty_and_malformed_raises(tmp_path):
    assert load_summary(tmp_path / "none.json") == []
    bad = tmp_path / "bad.json"
    bad.write_text('{"sessions": [{"session": 1}]}')
    with pytest.raises(ValueError):
        load_summary(bad)
