"""Content-addressed block keys.

A namespace binds keys to one model (weights + tokenizer fingerprint), one dtype, one
`block_tokens` and the layout version, so blocks of another model can never match. A block key
is a 16-byte BLAKE2b digest of (parent key, token ids of the block); the first block's parent is
the namespace. Keys are stable across processes and machines (no Python `hash()`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from kvagentd.kvcache.base import LAYOUT_VERSION, BlockKey

KEY_BYTES = 16


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def make_namespace(model_fingerprint: str, dtype: torch.dtype | str, block_tokens: int) -> bytes:
    """16-byte namespace of a model fingerprint, KV dtype, block size and layout version."""
    text = f"kvagentd-kv|layout={LAYOUT_VERSION}|model={model_fingerprint}|" \
           f"dtype={_dtype_name(dtype)}|block_tokens={int(block_tokens)}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def block_keys(namespace: bytes, token_ids: Sequence[int], block_tokens: int) -> list[BlockKey]:
    """Keys of every full block of `token_ids`: key_i = H(key_{i-1} || ids of block i)."""
    n_full = len(token_ids) // block_tokens
    if n_full == 0:
        return []
    ids = np.asarray(token_ids[: n_full * block_tokens], dtype="<i8")
    raw = ids.tobytes()
    step = block_tokens * 8
    keys: list[BlockKey] = []
    parent = namespace
    for i in range(n_full):
        h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
        h.update(raw[i * step:(i + 1) * step])
        parent = h.digest()
        keys.append(parent)
    return keys


def key_hex(key: BlockKey) -> str:
    return key.hex()


def parse_key(text: str) -> BlockKey:
    """Inverse of `key_hex`; raises ValueError on anything but 32 hex digits."""
    key = bytes.fromhex(text)
    if len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES * 2} hex digits, got {len(text)}")
    return key
