"""Trace ring, dump/load in both formats, regrouping into requests."""

from __future__ import annotations

import pytest

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.trace import TraceRecorder, load_trace, to_requests


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_ring_keeps_the_last_events():
    r = TraceRecorder(5)
    for t in range(4):
        r.record(t, float(t), "s", [k(t), k(t + 100)], [Tier.HOT, None])
    ev = r.events()
    assert len(ev) == 5 and r.recorded == 8
    assert ev[-1].key == k(103) and ev[0].tick == 1
    assert r.stats()["by_tier"] == {"hot": 2, "warm": 0, "cold": 0, "unknown": 3}


def test_zero_capacity_records_nothing():
    r = TraceRecorder(0)
    r.record(0, 0.0, "s", [k(1)])
    assert len(r) == 0


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_dump_and_load_round_trip(tmp_path, suffix):
    r = TraceRecorder(100)
    r.record(0, 10.5, "a", [k(1), k(2)], [Tier.COLD, Tier.WARM])
    r.record(1, 11.0, "b", [k(3)], None)
    r.record(2, 12.25, "a", [k(1)], [Tier.HOT])
    path = tmp_path / f"t{suffix}"
    assert r.dump(path) == 4
    back = load_trace(path)
    assert back == r.events()
    reqs = to_requests(back)
    assert [(q.tick, q.session, q.keys) for q in reqs] == [
        (0, "a", (k(1), k(2))), (1, "b", (k(3),)), (2, "a", (k(1),))]


def test_load_rejects_a_foreign_file(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"something": 1}\n')
    with pytest.raises(ValueError):
        load_trace(p)
