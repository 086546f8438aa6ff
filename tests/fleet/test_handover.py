"""Session hand-over between two daemons (separate state directories, one redis-server): the
session resumes on B from the remote tier with its history reused, not recomputed, and B gives
the greedy answer a full recompute gives; A, when it comes back, can no longer write it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvagentd.engine.sessions import Session, SessionFenced
from kvagentd.fleet.service import AdoptRefused
from tests.engine.conftest import greedy_reference
from tests.redisd import RedisServer

from .conftest import Box, box_config

SID = "handover-1"


def test_session_written_on_a_resumes_on_b_without_recompute(fdir: Path,
                                                             redis: RedisServer) -> None:
    a = Box(box_config(fdir, redis.url, "box-a"))
    b = Box(box_config(fdir, redis.url, "box-b"))
    try:
        a.ask(SID, "Pump 1 runs at 1797 rpm with a rising 2x component.")
        a.ask(SID, "What should the next inspection check first?")
        a.flush()
        history = a.engine.table.get(SID)
        assert history is not None and len(history.token_ids) > 64

        # A is alive: B must not take the session by accident
        with pytest.raises(AdoptRefused) as exc:
            b.fleet.adopt(SID, force=False, uid=None)
        assert exc.value.kind == "alive"

        a.stop()  # a clean stop: its last heartbeat says so
        got = b.fleet.adopt(SID, force=False, uid=None)
        assert got["from_box"] == "box-a" and got["epoch"] == 2
        assert got["tokens"] == len(history.token_ids)
        assert got["blocks_found"] == got["blocks"] == len(history.block_keys) > 0
        mine = b.engine.table.get(SID)
        assert mine is not None and mine.token_ids == history.token_ids and mine.owner is None

        question = "And the bearing temperature?"
        prompt = history.token_ids + b.engine.chat.next_turn(question)
        res = b.ask(SID, question, n=6)
        full_blocks = len(history.token_ids) // 16 * 16
        assert res.recomputed_tokens == 0
        assert res.reused_tokens == full_blocks  # the whole history but its partial last block
        assert res.prefill_tokens == len(prompt) - full_blocks
        reads = b.fleet.status()["reads"]
        assert reads["remote_hits"] >= len(history.block_keys)  # they came from the remote
        after = b.engine.table.get(SID)
        assert after is not None
        generated = after.token_ids[len(prompt):len(prompt) + res.new_tokens]
        assert generated == greedy_reference(b.engine.loaded, prompt, res.new_tokens)
    finally:
        a.stop()
        b.stop()


def test_after_adoption_the_first_box_cannot_write_the_session(fdir: Path,
                                                               redis: RedisServer) -> None:
    a = Box(box_config(fdir, redis.url, "box-a"))
    b = Box(box_config(fdir, redis.url, "box-b"))
    try:
        a.ask(SID, "First observation of pump 1.")
        a.flush()
        stale = a.engine.table.get(SID)
        assert stale is not None
        assert a.fleet.leases.get(SID).epoch == 1
        with redis.client() as r:  # the session's blocks live as long as it does
            names = [a.fleet.remote.names.block(k) for k in stale.block_keys]
            assert names and all(r.ttl(n) > 0 for n in names)
            r.delete(names[0])  # lost by the remote (evicted): counted at the next publish
        a.fleet.handover.saved(stale)
        a.flush()
        assert a.fleet.handover.status()["blocks_missing"] == 1

        got = b.fleet.adopt(SID, force=True, uid=None)  # A is alive: an operator forces it
        assert got["epoch"] == 2
        b.ask(SID, "Second observation, taken on box B.")
        b.flush()
        with redis.client() as r:
            manifest = r.hgetall(b.fleet.remote.names.session(SID))
        assert manifest[b"box"] == b"box-b" and manifest[b"turns"] == b"2"

        # A writes anyway (a turn it had queued before it learned): the remote refuses it
        a.fleet.handover.saved(Session(SID, stale.token_ids + [1, 2, 3], stale.block_keys,
                                       stale.created, stale.last_used, 7, None))
        a.flush()
        with redis.client() as r:
            assert r.hgetall(b.fleet.remote.names.session(SID)) == manifest
        assert a.fleet.leases.get(SID).fenced_by == "box-b"

        # and A refuses every further turn in it, before any compute
        with pytest.raises(SessionFenced):
            a.ask(SID, "Third observation?")
        assert a.engine.table.get(SID).turns == 1

        # A restarted (same state directory) still refuses it
        a.stop()
        a = Box(box_config(fdir, redis.url, "box-a"))
        with pytest.raises(SessionFenced):
            a.ask(SID, "After my restart?")
        assert a.fleet.status()["sessions"]["fenced_sessions"] == 1
    finally:
        a.stop()
        b.stop()


def test_a_box_that_never_knew_it_lost_a_session_learns_before_its_next_turn(
        fdir: Path, redis: RedisServer) -> None:
    """A crashed (no lease news), B adopted meanwhile; A comes back: the check before the turn
    asks the remote, so A refuses without writing anything."""
    a = Box(box_config(fdir, redis.url, "box-a"))
    b = Box(box_config(fdir, redis.url, "box-b"))
    try:
        a.ask(SID, "Observation before the crash.")
        a.flush()
        b.fleet.adopt(SID, force=True, uid=None)
        assert a.fleet.leases.get(SID).held  # A does not know yet
        with pytest.raises(SessionFenced):
            a.ask(SID, "Observation after coming back.")
        assert a.fleet.leases.get(SID).fenced_by == "box-b"
    finally:
        a.stop()
        b.stop()


def test_a_manifest_queued_at_stop_records_its_lease(fdir: Path, redis: RedisServer) -> None:
    """A box stopped while the session's manifest still waits in its write queue (here: a
    remote that stalls for a second) sends it during the stop and records the fencing token it
    got in its lease book; the lease book used to close first and the token was lost. A reply
    after the book closed is logged, not raised."""
    import threading

    from kvagentd.fleet.leases import LeaseBook

    a = Box(box_config(fdir, redis.url, "box-a"))
    gate = threading.Event()
    link = a.fleet.remote.link
    write = link.write
    link.write = lambda op: (gate.wait(30.0), write(op))[1]  # type: ignore[method-assign]
    try:
        a.ask(SID, "Pump 1 runs at 1797 rpm with a rising 2x component.")
        assert a.fleet.remote.writer.status()["queued"] >= 1
        threading.Timer(1.0, gate.set).start()
    finally:
        a.stop()
        gate.set()
    book = LeaseBook(fdir / "box-a" / "state")
    try:
        lease = book.get(SID)
        assert lease is not None and lease.held and lease.epoch >= 1
    finally:
        book.close()
    book.hold(SID, 7)  # closed: a warning, no exception
