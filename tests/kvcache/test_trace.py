"""Trace ring, dump/load in both formats, regrouping into requests."""

from __future__ import annotations

import pytest

from kvagentd.kvcache.base import Tier
from bench.placement_sim.request_trace import to_requests
from kvagentd.kvcache.placement.trace_recorder import TraceRecorder, load_trace


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


def _call(router, method, path, body=b"", query=None):
    from kvagentd.control.router import Peer, Request as HttpRequest

    route, params = router.match(method, path)
    return route, route.handler(HttpRequest(method, path, params, query or {}, {}, body,
                                            Peer(1, 0, 0), route.pattern))


def test_control_routes_dump_stream_and_status(tmp_path):
    import json
    import types

    from kvagentd.config import KVConfig, PlacementConfig
    from kvagentd.control.errors import BadRequest, NotReady
    from kvagentd.control.handlers import placement as handler
    from kvagentd.control.router import Response, Router
    from kvagentd.kvcache.placement import AccessFeed, PlacementService
    from kvagentd.kvcache.placement.policy import Capacities
    from bench.placement_sim.replay import Latencies, SimClock, SimStore

    clock = SimClock(5.0)
    feed = AccessFeed(clock=clock)
    store = SimStore(Capacities(4, 4), Latencies(), 100, clock, feed.record)
    svc = PlacementService(store, feed, PlacementConfig(), KVConfig(), clock=clock,
                           persist_summary=False)
    store.access("a", [k(1), k(2)])
    svc.ingest()
    config = types.SimpleNamespace(daemon=types.SimpleNamespace(state_dir=tmp_path))
    daemon = types.SimpleNamespace(placement=svc, config=config)
    router = Router()
    handler.register(router, daemon)
    route, st = _call(router, "GET", "/v1/placement")
    assert not route.change and st["policy"] == "heat+prefetch" and st["heat"]["blocks"] == 2
    route, out = _call(router, "POST", "/v1/trace/dump", b'{"name": "t.jsonl"}')
    assert route.change and out["events"] == 2 and out["path"] == str(tmp_path / "dumps/t.jsonl")
    assert [e.key for e in load_trace(tmp_path / "dumps/t.jsonl")] == [k(1), k(2)]
    with pytest.raises(BadRequest):  # the daemon chooses where it writes
        _call(router, "POST", "/v1/trace/dump",
              json.dumps({"path": str(tmp_path / "x.jsonl")}).encode())
    _, summary = _call(router, "GET", "/v1/trace")
    assert summary["events"] == 2 and summary["sessions"] == 1
    _, resp = _call(router, "GET", "/v1/trace", query={"format": "ndjson"})
    assert isinstance(resp, Response)
    lines = "".join(resp.body).splitlines()
    assert json.loads(lines[0]) == {"kvagentd_trace": 1} and len(lines) == 3
    router2 = Router()
    handler.register(router2, types.SimpleNamespace(placement=None, config=config))
    with pytest.raises(NotReady):
        _call(router2, "GET", "/v1/placement")


def test_kvctl_trace_commands_register():
    import typer
    from typer.testing import CliRunner

    from kvctl import cmd_trace

    app = typer.Typer()
    app.command("noop")(lambda: None)
    cmd_trace.register(app)
    out = CliRunner().invoke(app, ["trace", "--help"])
    assert out.exit_code == 0 and "dump" in out.output and "stats" in out.output
    text = cmd_trace.render_stats({"capacity": 10, "events": 3, "recorded": 5, "sessions": 1,
                                   "blocks": 2, "first_tick": 0, "last_tick": 2, "span_s": 1.5,
                                   "by_tier": {"hot": 1, "cold": 2}})
    assert "cold" in text and "3" in text
