"""The cold index on a full or failing disk: no sqlite3 error escapes, no transaction stays open."""

from __future__ import annotations

import sqlite3
import time

import torch

from kvagentd.kvcache.base import Tier


class FailingIndex:
    """A sqlite3 connection whose writes fail as on a dying disk while `armed`: every
    statement matching one of `fail_on` raises OperationalError("disk I/O error")."""

    def __init__(self, db: sqlite3.Connection, fail_on: tuple[str, ...] = ("COMMIT",)) -> None:
        self.db = db
        self.fail_on = fail_on
        self.armed = False
        self.failed = 0

    def _check(self, sql: str) -> None:
        if self.armed and any(sql.lstrip().upper().startswith(w) for w in self.fail_on):
            self.failed += 1
            raise sqlite3.OperationalError("disk I/O error")

    def execute(self, sql: str, *args):
        self._check(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args):
        self._check(sql)
        return self.db.executemany(sql, *args)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def close(self) -> None:
        self._check("CLOSE")
        self.db.close()


def _blocks(geometry, n, start=0):
    return [torch.full(geometry.block_shape, float(start + i + 1)) for i in range(n)]


def _keys(n, start=0):
    return [(start + i).to_bytes(2, "big") * 8 for i in range(n)]


def test_full_disk_fails_the_put_and_rolls_back(make_cold, geometry):
    cs = make_cold()
    assert cs.put_many(_keys(4), _blocks(geometry, 4)) == [True] * 4
    # a real SQLITE_FULL: the index may not grow by a page
    pages = cs.index.db.execute("PRAGMA page_count").fetchone()[0]
    cs.index.db.execute(f"PRAGMA max_page_count={pages}")
    many = 400  # enough rows to need new index pages
    res = cs.put_many(_keys(many, 100), _blocks(geometry, many, 100))
    assert not any(res)
    assert not cs.index.db.in_transaction
    st = cs.stats()
    assert st["write_failures"] == many and st["index_errors"] >= 1
    assert st["blocks"] == 4 and st["bytes_used"] == cs.bytes_used
    cs.index.db.execute("PRAGMA max_page_count=1073741823")
    # the index works again and nothing was half-committed
    assert cs.put_many(_keys(2, 100), _blocks(geometry, 2, 100)) == [True, True]
    outs = [torch.empty(geometry.block_shape) for _ in range(6)]
    keys = _keys(4) + _keys(2, 100)
    assert cs.read_into(keys, outs) == [True] * 6
    for o, b in zip(outs, _blocks(geometry, 4) + _blocks(geometry, 2, 100)):
        assert torch.equal(o, b)
    cs.close()


def test_failed_commit_leaves_no_open_transaction(make_cold, geometry):
    cs = make_cold()
    cs.index.db = idx = FailingIndex(cs.index.db, fail_on=("COMMIT",))
    idx.armed = True
    assert cs.put_many(_keys(3), _blocks(geometry, 3)) == [False] * 3
    assert idx.failed >= 1 and not idx.in_transaction
    assert cs.stats()["write_failures"] == 3
    idx.armed = False
    assert cs.put_many(_keys(3), _blocks(geometry, 3)) == [True] * 3
    assert cs.delete(_keys(1)) == 1
    idx.armed = True
    assert cs.delete(_keys(1, 1)) == 0 and not idx.in_transaction  # kept, counted
    idx.armed = False
    assert cs.contains(_keys(1, 1)[0])
    cs.close()


def test_failed_last_access_update_never_fails_a_read(make_cold, geometry):
    cs = make_cold()
    keys, blocks = _keys(5), _blocks(geometry, 5)
    assert all(cs.put_many(keys, blocks))
    cs.index.db = idx = FailingIndex(cs.index.db, fail_on=("COMMIT", "UPDATE"))
    idx.armed = True
    for _ in range(3):
        outs = [torch.empty(geometry.block_shape) for _ in keys]
        assert cs.read_into(keys, outs) == [True] * 5
        for o, b in zip(outs, blocks):
            assert torch.equal(o, b)
        cs.touch(keys)  # an explicit touch is dropped the same way
    assert not idx.in_transaction
    assert cs.stats()["touch_dropped"] >= 5
    cs.close()


def test_reads_refresh_ttl_once_flushed(make_cold, geometry):
    cs = make_cold(ttl_s=10.0)
    keys, blocks = _keys(3), _blocks(geometry, 3)
    assert all(cs.put_many(keys, blocks))
    cs.touch(keys, now=0.0)
    assert sorted(cs.expired(now=100.0)) == sorted(keys)
    cs.read_into(keys[:1], [torch.empty(geometry.block_shape)])
    # deferred, but expiry sees it: the read record is no longer expired
    assert sorted(cs.expired(now=time.time() + 5)) == sorted(keys[1:])
    cs.close()


def test_close_continues_past_a_failing_index(make_cold, geometry):
    cs = make_cold()
    assert all(cs.put_many(_keys(2), _blocks(geometry, 2)))
    cs.index.db = idx = FailingIndex(cs.index.db, fail_on=("UPDATE", "PRAGMA", "CLOSE"))
    idx.armed = True
    cs.close()  # logs and continues: the connection is closed all the same
    assert idx.failed >= 2 and cs.stats()["index_errors"] >= 2


def test_store_stays_serving_when_the_index_refuses_writes(make_store, make_cold, geometry):
    from .conftest import compute_blocks, fill_value

    st = make_store(hot=2, warm=0)
    cold = st.cold
    toks = list(range(16))
    keys = compute_blocks(st, "s", toks, 0, 2)
    st.release("s")
    assert st.demote(keys, Tier.COLD) == 2
    cold.index.db = idx = FailingIndex(cold.index.db, fail_on=("COMMIT", "UPDATE", "INSERT", "DELETE"))
    idx.armed = True
    r = st.ensure_resident(keys, "t")  # reads verify; their touches are dropped
    assert r.missing_from is None
    assert [st.hot_arena()[s].flatten()[0].item() for s in r.slots] == [fill_value(k) for k in keys]
    st.release("t")
    more = compute_blocks(st, "u", toks, 2, 2)  # the old blocks have cold copies: room is made
    st.release("u")
    assert st.demote(more, Tier.COLD) == 0  # the index refuses the new records: a status
    r = st.ensure_resident(more, "u")
    assert r.missing_from is None
    assert [st.hot_arena()[s].flatten()[0].item() for s in r.slots] == [fill_value(k) for k in more]
    st.release("u")
    st.check_integrity()
    assert cold.counters["write_failures"] == 2 and cold.stats()["index_errors"] >= 1
    idx.armed = False
    st.close()


def test_compaction_on_a_failing_index_keeps_every_record(make_cold, geometry):
    cs = make_cold(segment_bytes=64 << 10)
    keys, blocks = _keys(24), _blocks(geometry, 24)
    for i in range(0, 24, 8):  # one 64 KiB segment each
        assert all(cs.put_many(keys[i:i + 8], blocks[i:i + 8]))
    assert cs.delete(keys[::2]) == 12
    cs.index.db = idx = FailingIndex(cs.index.db, fail_on=("UPDATE", "DELETE", "INSERT", "COMMIT"))
    idx.armed = True
    cs.compact(min_dead_ratio=0.1)  # no raise; nothing half-moved
    assert cs.stats()["index_errors"] >= 1 and not idx.in_transaction
    outs = [torch.empty(geometry.block_shape) for _ in keys[1::2]]
    assert cs.read_into(keys[1::2], outs) == [True] * 12
    for o, b in zip(outs, blocks[1::2]):
        assert torch.equal(o, b)
    idx.armed = False
    assert cs.compact(min_dead_ratio=0.1) > 0
    outs = [torch.empty(geometry.block_shape) for _ in keys[1::2]]
    assert cs.read_into(keys[1::2], outs) == [True] * 12
    for o, b in zip(outs, blocks[1::2]):
        assert torch.equal(o, b)
    cs.close()
