from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvagentd.kvcache.store.pool import BlockPool
from kvagentd.kvcache.store.state import IntegrityError


def test_allocate_lowest_first_and_never_grows():
    p = BlockPool("t", 4, (2, 3), torch.float32)
    arena = p.arena
    assert p.allocate(3) == [0, 1, 2]
    assert not p.can_allocate(2) and p.allocate(2) is None
    p.free([1])
    assert p.allocate(1) == [1]
    assert p.arena is arena and p.arena.shape == (4, 2, 3)
    p.check_integrity()


def test_double_free_raises():
    p = BlockPool("t", 2, (1,), torch.float32)
    s = p.allocate(1)
    p.free(s)
    with pytest.raises(IntegrityError):
        p.free(s)


def test_fragmentation_and_move():
    p = BlockPool("t", 8, (2,), torch.float32)
    p.allocate(8)
    p.free([1, 3, 5, 6])
    f = p.fragmentation()
    assert (f.used, f.free, f.largest_free_run) == (4, 4, 2)
    assert f.ratio == pytest.approx(0.5)
    p.arena[7].fill_(3.0)
    p.move(7, 1)
    assert p.arena[1].eq(3.0).all() and not p.is_used(7) and p.is_used(1)
    with pytest.raises(IntegrityError):
        p.move(7, 3)
    p.check_integrity()


def test_from_bytes_capacity():
    p = BlockPool.from_bytes("t", 1000, (10,), torch.float32)
    assert p.capacity == 25


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_random_alloc_free_keeps_integrity(ops):
    p = BlockPool("t", 10, (1,), torch.float32)
    held: list[int] = []
    for alloc, n in ops:
        if alloc:
            got = p.allocate(n)
            assert (got is None) == (n > 10 - len(held))
            if got:
                assert not set(got) & set(held)
                held += got
        elif held:
            p.free(held[:n])
            held = held[n:]
        p.check_integrity()
        assert p.num_used == len(held)


def test_a_host_arena_is_taken_at_creation() -> None:
    """Host pools touch their pages when created (as pinned memory is taken at once): the
    process's resident memory grows by the arena's size before any slot is used. Measured in
    a fresh interpreter: in this one, memory freed by earlier tests may be reused already
    resident."""
    import subprocess
    import sys

    code = (
        "import psutil, torch\n"
        "from kvagentd.kvcache.store.pool import BlockPool\n"
        "before = psutil.Process().memory_info().rss\n"
        "pool = BlockPool('warm', 256, (2, 2, 4, 16, 256), torch.float32)  # 64 MiB\n"
        "grown = psutil.Process().memory_info().rss - before\n"
        "assert pool.num_free == 256 and torch.count_nonzero(pool.arena) == 0\n"
        "print(grown)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    grown = int(out.stdout.split()[-1])
    assert grown >= 60 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"
