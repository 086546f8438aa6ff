"""The remote tier against a real redis-server: blocks computed on one box are found, read,
verified and kept locally on another; bad records are refused; faults never block a request."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.remote import LinkState, RemoteRecords
from tests.redisd import RedisServer

from .conftest import GEOM, NS, compute, expected, make_box, spec_for

IDS = list(range(1000, 1000 + 5 * 16 + 7))  # five full blocks and a partial one


def _flush(box) -> None:
    assert box.remote.writer.flush(10.0), box.remote.status()


def _resumes_all(box, session: str):
    """Every block of IDS resident on `box` for `session`, each with the data computed for it."""
    res = box.store.ensure_resident(box.store.match_prefix(IDS).keys, session)
    assert res.missing_from is None and len(res.slots) == 5
    for slot, want in zip(res.slots, expected(IDS)):
        assert torch.equal(box.store.hot_arena()[slot], want)
    box.store.release(session)
    return res


def test_blocks_computed_on_one_box_are_read_verified_and_kept_on_another(
        rdir: Path, redis: RedisServer) -> None:
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        assert a.remote.status()["write_behind"]["written"] == len(keys) == 5

        match = b.store.match_prefix(IDS)
        assert match.keys == keys and match.num_tokens == 5 * 16
        res = b.store.ensure_resident(match.keys, "s2")
        assert res.missing_from is None and res.loaded["cold"] == 5
        arena = b.store.hot_arena()
        for slot, want in zip(res.slots, expected(IDS)):
            assert torch.equal(arena[slot], want)
        b.store.release("s2")
        b.store.check_integrity()
        # the records are now local too (written behind the request): B no longer needs the
        # remote for them
        assert b.tier.fill.flush(10.0)
        assert all(b.tier.local.contains(k) for k in keys)
        reads = b.remote.status()["reads"]
        assert reads["remote_hits"] == 5 and reads["filled_local"] == 5
    finally:
        a.close()
        b.close()


def test_a_corrupted_remote_record_is_refused_and_the_block_recomputed(
        rdir: Path, redis: RedisServer) -> None:
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    c = make_box(rdir / "c", spec_for(redis))
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        name = a.remote.names.block(keys[2])
        with redis.client() as r:
            value = bytearray(r.get(name))
            value[-100] ^= 0x40  # one bit of the payload
            r.set(name, bytes(value))

        match = b.store.match_prefix(IDS)
        assert len(match.keys) == 5
        res = b.store.ensure_resident(match.keys, "s2")
        assert res.missing_from == 2 and len(res.slots) == 2  # blocks 0-1 served, 2 refused
        b.store.release("s2")
        reads = b.remote.status()["reads"]
        assert reads["remote_corrupt"] == 1 and reads["remote_hits"] == 4  # one batched read
        assert b.remote.health()["status"] == "degraded"
        assert "corrupt remote record" in b.remote.health()["detail"]

        # B recomputes blocks 2-4 (its commit revives the LOST block) and writes them behind:
        # the bad record is replaced, a third box reads every block
        compute(b, "s2", IDS)
        _flush(b)
        _resumes_all(c, "s3")
    finally:
        for box in (a, b, c):
            box.close()


def test_a_record_of_another_namespace_is_never_served(rdir: Path, redis: RedisServer) -> None:
    other = make_namespace("another-model", torch.float32, 16)
    b = make_box(rdir / "b", spec_for(redis))
    try:
        key = b.store.block_keys(IDS)[0]
        foreign = RemoteRecords(GEOM, other).encode(key, torch.ones(GEOM.block_shape))
        with redis.client() as r:
            r.set(b.remote.names.block(key), bytes(foreign))
        out = torch.zeros(GEOM.block_shape)
        assert b.tier.read_into([key], [out]) == [False]
        assert b.remote.status()["reads"]["remote_corrupt"] == 1
        assert not b.tier.local.contains(key)
    finally:
        b.close()


def test_remote_killed_requests_go_on_writes_queue_and_drain_after_restart(
        rdir: Path, redis: RedisServer) -> None:
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    try:
        first = compute(a, "s", IDS)
        _flush(a)
        redis.kill()
        # a request on B: the lookup fails once, the link is down, B recomputes
        assert b.store.match_prefix(IDS).keys == []
        assert b.remote.link.state is LinkState.DOWN
        skipped = b.remote.link.counters["reads_skipped"]
        assert b.store.match_prefix(IDS).keys == []  # not even tried now
        assert b.remote.link.counters["reads_skipped"] == skipped + 1
        health = b.remote.health()
        assert health["status"] == "degraded" and "unreachable" in health["detail"]

        # A keeps computing: its writes wait in the queue
        more = list(range(5000, 5000 + 3 * 16))
        compute(a, "t", more, seed=1)
        assert not a.remote.writer.flush(1.0)
        assert a.remote.status()["write_behind"]["queued"] >= 1

        redis.restart()
        _flush(a)  # the writer probes, finds the server again and sends what waited
        assert a.remote.link.state is LinkState.UP
        assert b.remote.link.probe(force=True)
        assert b.store.match_prefix(more).num_tokens == 3 * 16
        # the restarted server is empty: blocks sent before the crash are gone, so B recomputes
        # them (the remote is a cache), and A sends them again when it offers them next
        assert b.store.match_prefix(IDS).keys == []
        assert first and a.remote.publish_blocks(first[:1], [torch.zeros(GEOM.block_shape)]) == 1
    finally:
        a.close()
        b.close()


def test_write_budget_drops_and_counts(rdir: Path, redis: RedisServer) -> None:
    rec = RemoteRecords(GEOM, NS).length
    a = make_box(rdir / "a", spec_for(redis, write_queue_bytes=3 * rec))
    try:
        redis.kill()
        a.remote.link.read(lambda c: c.ping())  # finds the link down
        ids = list(range(7000, 7000 + 10 * 16))
        compute(a, "s", ids)
        st = a.remote.status()
        assert st["write_behind"]["queued"] == 3
        assert st["published"]["no_room"] == 7
        assert a.remote.health()["status"] == "degraded"
    finally:
        a.close()
        st = a.remote.status()["write_behind"]
        assert st["dropped"] == 3 and st["queued"] == 0  # what waited at stop was dropped


def test_a_full_remote_refuses_writes_counted(rdir: Path) -> None:
    from tests.redisd import redis_fixture

    for server in redis_fixture(rdir / "full", maxmemory="1mb"):
        a = make_box(rdir / "a", spec_for(server))
        try:
            with server.client() as r:  # fill it up to its limit
                try:
                    for i in range(10_000):
                        r.set(f"filler:{i}", b"x" * 4096)
                except Exception:  # noqa: BLE001 - OOM once full
                    pass
            compute(a, "s", IDS)
            _flush(a)
            st = a.remote.status()
            assert st["link"]["full"] >= 1 and st["write_behind"]["failed"] >= 1
            assert a.remote.link.state is LinkState.UP  # full is not down
            assert a.remote.health()["status"] == "degraded"
        finally:
            a.close()


def test_store_lists_remote_blocks_as_cold_and_evicts_nothing_remote(
        rdir: Path, redis: RedisServer) -> None:
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        b.store.match_prefix(IDS)
        tiers = {i.key: i.tier for i in b.store.snapshot()}
        assert [tiers[k] for k in keys] == [Tier.COLD] * 5
        seen: list[tuple[int, int]] = []  # the scrub covers the local records, as a cold tier
        assert b.store.verify(progress=lambda done, total: seen.append((done, total))) \
            ["corrupt"] == 0
        b.store.drop_session("x", keys)
        b.store.evict(keys)
        with redis.client() as r:  # another box may still need them
            assert all(r.exists(a.remote.names.block(k)) for k in keys)
    finally:
        a.close()
        b.close()


def test_a_remote_read_does_not_wait_for_the_local_copy(rdir: Path, redis: RedisServer,
                                                       monkeypatch) -> None:
    """The local cold copy of blocks read from the remote is written behind the request: a
    resume is served while that write is still held up, and the copy lands afterwards."""
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    gate = threading.Event()
    put_many = b.tier.local.put_many

    def slow_put_many(*args, **kw):
        assert gate.wait(30.0)
        return put_many(*args, **kw)

    monkeypatch.setattr(b.tier.local, "put_many", slow_put_many)
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        _resumes_all(b, "s2")
        assert not any(b.tier.local.contains(k) for k in keys)  # not yet written
        assert b.tier.fill.pending() == 5 * b.remote.records.length
        gate.set()
        assert b.tier.fill.flush(10.0)
        assert all(b.tier.local.contains(k) for k in keys)
        assert b.remote.status()["reads"]["filled_local"] == 5
        assert b.tier.fill.pending() == 0
    finally:
        gate.set()
        a.close()
        b.close()


def test_a_read_in_several_batches_serves_every_block_and_refuses_a_bad_one(
        rdir: Path, redis: RedisServer, monkeypatch) -> None:
    """A read larger than one pipelined batch: each record is checked and served into its
    own tensor, in order, and a bad one in a later batch is refused."""
    import kvagentd.kvcache.remote.tier as tiermod

    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    monkeypatch.setattr(tiermod, "READ_BATCH_BYTES", 2 * b.remote.records.length)
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        with redis.client() as r:
            name = a.remote.names.block(keys[3])  # in the second batch of three
            value = bytearray(r.get(name))
            value[-50] ^= 0x01
            r.set(name, bytes(value))
        reads_before = b.remote.link.counters["reads"]
        outs = [torch.zeros(GEOM.block_shape) for _ in keys]
        served: list[tuple[bytes, bytes]] = []
        ok = b.tier.read_remote(list(keys), outs, served)
        assert ok == [True, True, True, False, True]
        assert b.remote.link.counters["reads"] - reads_before == 3
        want = expected(IDS)
        for i in (0, 1, 2, 4):
            assert torch.equal(outs[i], want[i])
        assert [k for k, _ in served] == [keys[i] for i in (0, 1, 2, 4)]
        assert b.remote.status()["reads"]["remote_corrupt"] == 1
    finally:
        a.close()
        b.close()


def test_the_local_copy_is_bounded_and_what_does_not_fit_stays_remote(
        rdir: Path, redis: RedisServer, monkeypatch) -> None:
    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    gate = threading.Event()
    put_many = b.tier.local.put_many
    monkeypatch.setattr(b.tier.local, "put_many",
                        lambda *args, **kw: gate.wait(30.0) and put_many(*args, **kw))
    b.tier.fill.budget_bytes = 2 * b.remote.records.length
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        outs = [torch.zeros(GEOM.block_shape) for _ in keys]
        assert b.tier.read_into(keys, outs) == [True] * 5
        reads = b.remote.status()["reads"]
        assert reads["fill_skipped"] == 3  # past the budget: not queued
        gate.set()
        assert b.tier.fill.flush(10.0)
        assert [b.tier.local.contains(k) for k in keys] == [True, True, False, False, False]
        # the next read takes the two local ones from disk, the other three from the remote
        hits = b.remote.status()["reads"]["remote_hits"]
        outs = [torch.zeros(GEOM.block_shape) for _ in keys]
        assert b.tier.read_into(keys, outs) == [True] * 5
        assert b.remote.status()["reads"]["remote_hits"] == hits + 3
        assert all(torch.equal(o, w) for o, w in zip(outs, expected(IDS)))
    finally:
        gate.set()
        a.close()
        b.close()


def test_the_local_copy_waits_until_reads_settle(rdir: Path, redis: RedisServer) -> None:
    """Blocks are read from the remote because a request needs them now: their local copy
    starts once no read has queued more for `settle_s` (here never, within the test), or on a
    flush, or when the tier closes."""
    import time

    a = make_box(rdir / "a", spec_for(redis))
    b = make_box(rdir / "b", spec_for(redis))
    b.tier.fill.settle_s = 3600.0
    try:
        keys = compute(a, "s", IDS)
        _flush(a)
        outs = [torch.zeros(GEOM.block_shape) for _ in keys]
        assert b.tier.read_into(keys[:2], outs[:2]) == [True] * 2
        time.sleep(0.3)
        assert not any(b.tier.local.contains(k) for k in keys)
        assert b.tier.fill.flush(10.0)
        assert [b.tier.local.contains(k) for k in keys] == [True] * 2 + [False] * 3
        assert b.tier.read_into(keys[2:], outs[2:]) == [True] * 3
    finally:
        a.close()
        b.close()  # closing writes what waited
    c = make_box(rdir / "b", spec_for(redis))  # box B again, on its own cold tier
    try:
        assert all(c.tier.local.contains(k) for k in keys)
    finally:
        c.close()
