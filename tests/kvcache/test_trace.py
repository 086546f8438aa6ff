"""The daemon's block-access trace: the ring, dump/load in both formats, the control routes."""

from __future__ import annotations

import numpy as np
import pytest

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.placement.base import CODE_OF
from kvagentd.kvcache.placement.trace_recorder import (BlockSize, TraceRecorder,
                                                         load_block_size, load_trace)

from .sim_env import Env


def codes(*tiers: Tier | None) -> np.ndarray:
    return np.array([CODE_OF[t] for t in tiers], dtype=np.int8)


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_ring_keeps_the_last_events():
    r = TraceRecorder(5)
    for t in range(4):
        r.record(t, float(t), f"s{t % 2}", [k(t), k(t + 100)], codes(Tier.HOT, None))
    ev = r.events()
    assert len(ev) == 5 and r.recorded == 8
    assert ev[-1].key == k(103) and ev[0].tick == 1 and ev[0].tier is None
    assert [(e.tick, e.session) for e in ev] == [(1, "s1"), (2, "s0"), (2, "s0"), (3, "s1"),
                                                 (3, "s1")]
    st = r.stats()
    assert st["by_tier"] == {"hot": 2, "warm": 0, "cold": 0, "unknown": 3}
    assert st["sessions"] == 2 and st["blocks"] == 5 and st["span_s"] == 2.0


def test_a_request_longer_than_the_ring_keeps_its_last_blocks_and_keys_are_checked():
    r = TraceRecorder(3)
    r.record(0, 0.0, "s", [k(i) for i in range(5)])
    assert [e.key for e in r.events()] == [k(2), k(3), k(4)] and r.recorded == 5
    with pytest.raises(ValueError):
        r.record(1, 1.0, "s", [b"short"])


def test_session_names_stay_bounded():
    r = TraceRecorder(4)
    for i in range(3000):
        r.record(i, float(i), f"s{i}", [k(i)])
    assert len(r._names) < 2 * 4 + 1024 + 1
    assert [e.session for e in r.events()] == [f"s{i}" for i in range(2996, 3000)]


def test_zero_capacity_records_nothing():
    r = TraceRecorder(0)
    r.record(0, 0.0, "s", [k(1)])
    assert len(r) == 0


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_dump_and_load_round_trip(tmp_path, suffix):
    r = TraceRecorder(100)
    r.record(0, 10.5, "a", [k(1), k(2)], codes(Tier.COLD, Tier.WARM))
    r.record(1, 11.0, "b", [k(3)], None)
    r.record(2, 12.25, "a", [k(1)], codes(Tier.HOT))
    path = tmp_path / f"t{suffix}"
    assert r.dump(path) == 4
    back = load_trace(path)
    assert back == r.events()
    assert [(e.tick, e.session, e.key, e.tier) for e in back] == [
        (0, "a", k(1), Tier.COLD), (0, "a", k(2), Tier.WARM), (1, "b", k(3), None),
        (2, "a", k(1), Tier.HOT)]


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_a_dump_carries_the_block_size_where_known(tmp_path, suffix):
    r = TraceRecorder(10, block_size=BlockSize(16, 737_280))
    r.record(0, 1.0, "a", [k(1)])
    r.dump(tmp_path / f"sized{suffix}")
    assert load_block_size(tmp_path / f"sized{suffix}") == BlockSize(16, 737_280)
    assert [e.key for e in load_trace(tmp_path / f"sized{suffix}")] == [k(1)]
    bare = TraceRecorder(10)
    bare.record(0, 1.0, "a", [k(1)])
    bare.dump(tmp_path / f"bare{suffix}")
    assert load_block_size(tmp_path / f"bare{suffix}") is None
    assert r.stats()["block_tokens"] == 16 and "block_tokens" not in bare.stats()


@pytest.mark.parametrize("head", ['{"kvagentd_trace": 1, "block_tokens": 16}',
                                  '{"kvagentd_trace": 1, "block_tokens": 0, "block_bytes": 9}',
                                  '{"kvagentd_trace": 1, "block_tokens": "x", "block_bytes": 9}',
                                  '[1]'])
def test_a_malformed_block_size_is_an_error(tmp_path, head):
    p = tmp_path / "bad.jsonl"
    p.write_text(head + "\n")
    with pytest.raises(ValueError, match="header"):
        load_block_size(p)


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

    from kvagentd.control.errors import BadRequest, NotFound
    from kvagentd.control.handlers import placement as handler
    from kvagentd.control.router import Response, Router
    from kvagentd.kvcache.placement.base import Capacities

    env = Env(Capacities(4, 4), 4, "lru", sessions=("a",))
    env.use(5.0, [1, 2])
    svc = env.svc
    svc.ingest()
    config = types.SimpleNamespace(daemon=types.SimpleNamespace(state_dir=tmp_path))
    daemon = types.SimpleNamespace(services=types.SimpleNamespace(placement=svc), config=config)
    router = Router()
    handler.register(router, daemon)
    route, st = _call(router, "GET", "/v1/placement")
    assert not route.change and st["policy"] == "lru" and st["blocks"] == 2
    route, out = _call(router, "POST", "/v1/trace/dump", b'{"name": "t.jsonl"}')
    assert route.change and out["events"] == 2 and out["path"] == str(tmp_path / "dumps/t.jsonl")
    assert [e.key for e in load_trace(tmp_path / "dumps/t.jsonl")] == [k(1), k(2)]
    assert load_block_size(tmp_path / "dumps/t.jsonl") is None  # this store gave no size
    svc.trace.block_size = BlockSize(16, 4096)
    _call(router, "POST", "/v1/trace/dump", b'{"name": "sized.npz"}')
    assert load_block_size(tmp_path / "dumps/sized.npz") == BlockSize(16, 4096)
    with pytest.raises(BadRequest):  # the daemon chooses where it writes
        _call(router, "POST", "/v1/trace/dump",
              json.dumps({"path": str(tmp_path / "x.jsonl")}).encode())
    _, summary = _call(router, "GET", "/v1/trace")
    assert summary["events"] == 2 and summary["sessions"] == 1
    _, resp = _call(router, "GET", "/v1/trace", query={"format": "ndjson"})
    assert isinstance(resp, Response)
    lines = "".join(resp.body).splitlines()
    assert json.loads(lines[0]) == {"kvagentd_trace": 1, "block_tokens": 16,
                                    "block_bytes": 4096} and len(lines) == 3
    router2 = Router()
    handler.register(router2, types.SimpleNamespace(services=types.SimpleNamespace(placement=None),
                                                   config=config))
    with pytest.raises(NotFound) as exc:  # a ready daemon without placement: not configured
        _call(router2, "GET", "/v1/placement")
    assert exc.value.kind == "not_configured"


def test_a_dump_under_heat_prefetch_holds_the_accesses_the_prefetcher_saw_first(tmp_path):
    import types

    from kvagentd.control.handlers import placement as handler
    from kvagentd.control.router import Router
    from kvagentd.kvcache.placement.base import Capacities

    env = Env(Capacities(4, 4), 4, "heat+prefetch", sessions=("a",))
    env.use(5.0, [1, 2])
    env.svc.flush_prefetch()  # seen by the prefetcher; stats and trace record them later
    assert len(env.svc.trace) == 0
    config = types.SimpleNamespace(daemon=types.SimpleNamespace(state_dir=tmp_path))
    router = Router()
    handler.register(router, types.SimpleNamespace(services=types.SimpleNamespace(placement=env.svc),
                                                  config=config))
    _, out = _call(router, "POST", "/v1/trace/dump", b'{"name": "t.jsonl"}')
    assert out["events"] == 2
    assert [e.key for e in load_trace(tmp_path / "dumps/t.jsonl")] == [k(1), k(2)]


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
    assert "cold" in text and "3" in text and "block:" not in text
    sized = cmd_trace.render_stats({"events": 1, "by_tier": {}, "block_tokens": 16,
                                    "block_bytes": 737_280})
    assert "block: 16 tokens, 720.0 KiB" in sized
