"""Random sequences of store operations keep every invariant and never serve wrong KV."""

from __future__ import annotations

import shutil
import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvagentd.kvcache.base import KVGeometry, Tier
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

from .conftest import fill_value

GEOM = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=2, dtype=torch.float32)
NS = make_namespace("prop-model", torch.float32, 2)
PREFIXES = [[7, 7, 7, 7], [7, 7, 7, 7, 1, 1], [7, 7, 8, 8], [3, 3, 3, 3, 3, 3], [9, 9]]
SESSIONS = ["s0", "s1", "s2"]
TIERS = [Tier.HOT, Tier.WARM, Tier.COLD]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvprop-")
        bb = GEOM.block_bytes
        self.store = TieredKVStore(
            GEOM, NS, hot_bytes=4 * bb, warm_bytes=3 * bb,
            cold=lambda listener: ColdStore(self.dir, GEOM, NS, capacity_bytes=1 << 22,
                                            segment_bytes=64 << 10, io_unit_bytes=4096,
                                            listener=listener))
        self.cold = self.store.cold
        self.tokens: dict[str, list[int]] = {}

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(session=st.sampled_from(SESSIONS), prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, 3), max_size=4))
    def run_request(self, session, prefix, tail):
        """The engine's path: match, ensure resident, compute the rest, commit, release."""
        toks = self.tokens.get(session, []) + prefix + tail
        s = self.store
        m = s.match_prefix(toks)
        r = s.ensure_resident(m.keys, session)
        got = len(r.slots)
        for slot, key in zip(r.slots, m.keys):
            assert s.hot_arena()[slot].flatten()[0].item() == fill_value(key)
        n_full = len(toks) // GEOM.block_tokens
        need = n_full - got
        if need > 0:
            slots = s.allocate_hot(need, session)
            if slots is not None:
                keys = s.block_keys(toks)[got:n_full]
                for sl, k in zip(slots, keys):
                    s.hot_arena()[sl].fill_(fill_value(k))
                s.commit(session, toks, slots, got)
                s.record_access(keys, session)
        s.release(session)
        self.tokens[session] = toks[:8]

    @rule(prefix=st.sampled_from(PREFIXES), tier=st.sampled_from(TIERS))
    def promote(self, prefix, tier):
        self.store.promote(self.store.match_prefix(prefix).keys, tier)

    @rule(prefix=st.sampled_from(PREFIXES), tier=st.sampled_from(TIERS))
    def demote(self, prefix, tier):
        self.store.demote(self.store.match_prefix(prefix).keys, tier)

    @rule(session=st.sampled_from(SESSIONS))
    def drop(self, session):
        keys = self.store.keys_of_session(session)
        self.store.drop_session(session, keys)
        self.tokens.pop(session, None)
        assert not self.store.keys_of_session(session)

    @rule(prefix=st.sampled_from(PREFIXES))
    def pin_evict_unpin(self, prefix):
        keys = self.store.match_prefix(prefix).keys
        self.store.pin(keys[:1])
        self.store.evict(keys)
        assert self.store.match_prefix(prefix).num_tokens >= min(1, len(keys)) * GEOM.block_tokens
        self.store.unpin(keys[:1])

    @precondition(lambda self: True)
    @rule(tier=st.sampled_from([Tier.HOT, Tier.WARM]), data=st.data())
    def relocate(self, tier, data):
        occ = self.store.occupancy(tier)
        used = [i for i, u in enumerate(occ) if u]
        free = [i for i, u in enumerate(occ) if not u]
        if used and free:
            self.store.relocate(tier, [(data.draw(st.sampled_from(used)), data.draw(st.sampled_from(free)))])

    @rule()
    def persist(self):
        self.store.persist()
        for b in self.store.snapshot():
            if b.sessions and b.tier is not None:
                assert self.cold.contains(b.key)

    @invariant()
    def integrity(self):
        self.store.check_integrity()


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestStoreMachine = StoreMachine.TestCase
