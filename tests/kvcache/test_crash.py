"""A writer killed with SIGKILL at random moments never leaves a served torn record."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import torch

from kvagentd.kvcache.base import KVGeometry
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.keys import block_keys, make_namespace

GEOM = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4, dtype=torch.float32)
NS = make_namespace("crash-model", torch.float32, 4)
KILLS = 50


def _content(key: bytes) -> torch.Tensor:
    base = float(int.from_bytes(key[:3], "little"))
    return torch.arange(GEOM.block_numel, dtype=torch.float32).view(GEOM.block_shape) + base


def _open(directory: str) -> ColdStore:
    return ColdStore(directory, GEOM, NS, capacity_bytes=64 << 20, segment_bytes=256 << 10,
                     io_unit_bytes=8192)


def _writer(directory: str, seed: int, ready) -> None:
    torch.set_num_threads(1)
    cs = _open(directory)
    rng = random.Random(seed)
    ready.set()
    i = 0
    while True:
        n = rng.randint(1, 4)
        keys = block_keys(NS, [seed * 1_000_000 + i + j for j in range(4 * n)], 4)
        i += 4 * n
        cs.put_many(keys, [_content(k) for k in keys], session=f"s{seed}")
        if rng.random() < 0.1:
            cs.delete(keys[:1])


def test_sigkill_writer_50_times(tmp_path):
    directory = str(tmp_path / "cold")
    ctx = mp.get_context("fork")
    rng = random.Random(7)
    total = 0
    for round_ in range(KILLS):
        ready = ctx.Event()
        p = ctx.Process(target=_writer, args=(directory, round_, ready), daemon=True)
        p.start()
        assert ready.wait(30)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        cs = _open(directory)
        report = cs.verify()
        assert report["corrupt"] == 0 and report["missing"] == 0, report
        keys = cs.keys()
        outs = [torch.empty(GEOM.block_shape) for _ in keys]
        assert all(cs.read_into(keys, outs))
        for k, o in zip(keys, outs):
            assert torch.equal(o, _content(k))
        assert cs.bytes_used == report["bytes"]
        total = len(keys)
        cs.close()
    assert total > 0
