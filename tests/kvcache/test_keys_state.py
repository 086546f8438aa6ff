from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvagentd.kvcache.keys import block_keys, key_hex, make_namespace, parse_key
from kvagentd.kvcache.store.state import ALLOWED, BlockMeta, BlockState, IllegalTransition, transition


def test_keys_chain_and_only_full_blocks(namespace):
    ids = list(range(11))
    keys = block_keys(namespace, ids, 4)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    assert block_keys(namespace, ids[:8], 4) == keys
    # the second key depends on the first block's tokens (chained), not only its own
    other = block_keys(namespace, [99] + ids[1:8], 4)
    assert other[0] != keys[0] and other[1] != keys[1]


def test_keys_stable_across_processes(namespace):
    code = ("from kvagentd.kvcache.keys import block_keys, make_namespace; import torch;"
            "ns = make_namespace('test-model@1', torch.float32, 4);"
            "print(block_keys(ns, list(range(8)), 4)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"})
    assert out.stdout.split()[-1] == block_keys(namespace, list(range(8)), 4)[1].hex()


def test_namespace_separates_model_dtype_block_size():
    a = make_namespace("m1", torch.float32, 16)
    assert a != make_namespace("m2", torch.float32, 16)
    assert a != make_namespace("m1", torch.bfloat16, 16)
    assert a != make_namespace("m1", torch.float32, 32)
    assert block_keys(a, list(range(16)), 16) != block_keys(make_namespace("m2", torch.float32, 16),
                                                           list(range(16)), 16)


def test_key_hex_round_trip():
    k = bytes(range(16))
    assert parse_key(key_hex(k)) == k
    with pytest.raises(ValueError):
        parse_key("abcd")


@pytest.mark.parametrize("src", list(BlockState))
@pytest.mark.parametrize("dst", list(BlockState))
def test_every_transition_follows_the_table(src, dst):
    m = BlockMeta(b"k" * 16, state=src)
    if dst in ALLOWED[src]:
        transition(m, dst)
        assert m.state is dst
    else:
        with pytest.raises(IllegalTransition):
            transition(m, dst)
        assert m.state is src


def test_table_covers_every_state():
    assert set(ALLOWED) == set(BlockState)
    assert BlockState.MIGRATING not in ALLOWED[BlockState.MIGRATING]
