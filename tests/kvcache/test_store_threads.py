"""Concurrent requests, moves and defrag on one store: no deadlock, no wrong KV, integrity holds."""

from __future__ import annotations

import errno
import random
import threading
import traceback

import pytest

from kvagentd.kvcache.base import Tier
from kvagentd.kvcache.fileio import FileIO

from .conftest import fill_value

PREFIXES = [list(range(p, p + 4)) * 2 for p in (0, 100, 200)]  # 2 blocks each, shared


class _FlakyReads(FileIO):
    """Every fifth read fails with EIO."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def preadv(self, fd, buffers, offset):
        with self.lock:
            self.n += 1
            fail = self.n % 5 == 0
        if fail:
            raise OSError(errno.EIO, "injected")
        return super().preadv(fd, buffers, offset)


@pytest.mark.parametrize("faults", [False, True])
def test_concurrent_requests_moves_and_relocation(make_store, make_cold, faults):
    cold = dict(file_io=_FlakyReads()) if faults else True
    st = make_store(hot=6, warm=3, cold=cold)
    errors: list[str] = []
    stop = threading.Event()

    def request_loop(name: str, seed: int) -> None:
        try:
            requests(name, seed)
        except Exception as exc:  # reported by the assertion below
            errors.append(f"{name}: {exc!r}\n{traceback.format_exc()}")

    def requests(name: str, seed: int) -> None:
        rng = random.Random(seed)
        for i in range(60):
            toks = rng.choice(PREFIXES) + [seed * 1000 + i % 5] * rng.choice([0, 4])
            m = st.match_prefix(toks)
            r = st.ensure_resident(m.keys, name)
            for slot, key in zip(r.slots, m.keys):
                v = st.hot_arena()[slot].flatten()[0].item()
                if v != fill_value(key):
                    errors.append(f"{name}: block {key.hex()} read {v}")
            got = len(r.slots)
            need = len(toks) // 4 - got
            if need > 0:
                slots = st.allocate_hot(need, name)
                if slots is not None:
                    keys = st.block_keys(toks)[got:]
                    for s, k in zip(slots, keys):
                        st.hot_arena()[s].fill_(fill_value(k))
                    st.commit(name, toks, slots, got)
            st.release(name)

    def mover(seed: int) -> None:
        try:
            moves(seed)
        except Exception as exc:  # reported by the assertion below
            errors.append(f"mover: {exc!r}")

    def moves(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            keys = [b.key for b in st.snapshot()]
            if not keys:
                continue
            pick = rng.sample(keys, min(3, len(keys)))
            op = rng.random()
            if op < 0.05:
                st.evict(pick[:1])
            elif op < 0.3:
                st.demote(pick, rng.choice([Tier.WARM, Tier.COLD]))
            elif op < 0.6:
                st.promote(pick, rng.choice([Tier.HOT, Tier.WARM]), background=rng.random() < 0.5)
            else:
                occ = st.occupancy(Tier.HOT)
                used = [i for i, u in enumerate(occ) if u]
                free = [i for i, u in enumerate(occ) if not u]
                if used and free:
                    st.relocate(Tier.HOT, [(max(used), min(free))])

    workers = [threading.Thread(target=request_loop, args=(f"s{i}", i)) for i in range(3)]
    movers = [threading.Thread(target=mover, args=(99,))]
    for t in workers + movers:
        t.start()
    for t in workers:
        t.join(60)
        assert not t.is_alive(), "a request thread is stuck"
    stop.set()
    for t in movers:
        t.join(30)
        assert not t.is_alive()
    st.check_integrity()
    if faults:
        assert st.stats()["tiers"]["cold"]["io_errors"] > 0
    st.close()
    assert not errors, errors[:5]
