"""Cold-tier faults reach the health checks through the real store: a record that fails its
checksum and the block lost with it, an index set aside at start; `ack` clears what was seen."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from kvagentd.config import Config, load_config
from kvagentd.health import Acknowledgements, DaemonFacts, assess, gather
from kvagentd.scheduling.jobwatch import JobWatch
from kvagentd.kvcache.base import KVGeometry, Tier
from kvagentd.kvcache.cold.record import ALIGN
from kvagentd.kvcache.keys import make_namespace
from kvagentd.services import Services, Tiers, build_tiers
from tests.kvcache.conftest import compute_blocks

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4,
                      dtype=torch.float32)
NAMESPACE = make_namespace("test-model@1", torch.float32, 4)


def _config(d: Path) -> Config:
    base = load_config(None, env={})
    return dataclasses.replace(
        base, daemon=dataclasses.replace(base.daemon, state_dir=d / "state"),
        kv=dataclasses.replace(base.kv, cold_dir=d / "cold", hot_bytes=1 << 20,
                               cold_capacity_bytes=8 << 20, segment_bytes=1 << 20,
                               io_unit_bytes=8192, o_direct=False),
        maintenance=dataclasses.replace(base.maintenance, shadow_dir=d / "shm",
                                        shadow_bytes=4 << 20))


def _tiers(cfg: Config) -> Tiers:
    return build_tiers(cfg, GEOMETRY, NAMESPACE)


def _checks(cfg: Config, t: Tiers, acks: Acknowledgements) -> dict[str, object]:
    facts = gather(cfg, Services(store=t.store, cold=t.cold), started={"store"},
                   daemon=DaemonFacts("running", 1.0, 0.0, 5.0, True, 0), jobs=JobWatch(),
                   scheduler=None, now=0.0)
    return {c.name: c for c in assess(cfg, facts, acks).checks}


def test_checksum_failure_lost_block_and_discarded_index(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    t = _tiers(cfg)
    tokens = list(range(12))
    keys = compute_blocks(t.store, "s", tokens, 0, 3)
    assert keys is not None
    t.store.release("s")
    assert t.store.demote(keys, Tier.COLD) == 3
    c = _checks(cfg, t, Acknowledgements())
    for name in ("cold-tier", "read-only", "shadow-fill", "checksum-failures", "lost-blocks",
                 "cold-index"):
        assert c[name].level.value == "ok", c[name]  # type: ignore[attr-defined]
    t.store.close()

    seg = sorted((tmp_path / "cold").glob("seg-*.kvs"))[0]
    rec = os.path.getsize(seg) // 3
    with open(seg, "r+b") as f:  # flip one payload byte of the first record
        f.seek(ALIGN + 100)
        b = f.read(1)
        f.seek(ALIGN + 100)
        f.write(bytes([b[0] ^ 0x01]))
    assert rec > ALIGN
    t = _tiers(cfg)
    res = t.store.ensure_resident(keys, "s")
    assert res.missing_from == 0  # never served: recomputed instead
    t.store.release("s")
    acks = Acknowledgements()
    c = _checks(cfg, t, acks)
    cf, lost = c["checksum-failures"], c["lost-blocks"]
    assert cf.level.value == "degraded" and cf.reason.startswith("1 since start")  # type: ignore[attr-defined]
    assert lost.level.value == "degraded" and lost.reason.startswith("1 since start")  # type: ignore[attr-defined]
    facts_counters = {"checksum-failures": 1, "lost-blocks": 1, "cold-index": 0}
    acks.ack(facts_counters, 10.0)
    c = _checks(cfg, t, acks)
    assert c["checksum-failures"].level.value == "ok"  # type: ignore[attr-defined]
    assert c["lost-blocks"].level.value == "ok"  # type: ignore[attr-defined]
    t.store.close()

    (tmp_path / "cold" / "index.sqlite3").write_bytes(b"this is not a database" * 100)
    t = _tiers(cfg)
    c = _checks(cfg, t, Acknowledgements())
    idx = c["cold-index"]
    assert idx.level.value == "degraded" and "set aside" in idx.reason  # type: ignore[attr-defined]
    assert "ssd:" in idx.reason  # type: ignore[attr-defined]
    t.store.close()


def test_a_cold_tier_full_of_records_that_must_stay_is_degraded_until_acknowledged(
        tmp_path: Path) -> None:
    """A cold tier whose records are all pinned refuses new ones (not a device fault): the
    health check says so, with what to change, until an operator acknowledges it."""
    cfg = _config(tmp_path)
    cfg = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, cold_capacity_bytes=1 << 20))
    t = _tiers(cfg)
    assert t.cold is not None
    acks = Acknowledgements()
    assert _checks(cfg, t, acks)["cold-full"].level.value == "ok"  # type: ignore[attr-defined]
    for i in range(64):  # fill the cold tier, pinning what goes there
        keys = compute_blocks(t.store, f"s{i}", [1000 * i + j for j in range(32)], 0, 8)
        assert keys is not None
        t.store.release(f"s{i}")
        t.store.demote(keys, Tier.COLD)
        t.store.pin(keys)
        if t.cold.stats()["refused_full"]:
            break
    c = _checks(cfg, t, acks)["cold-full"]
    assert c.level.value == "degraded"  # type: ignore[attr-defined]
    assert "since start" in c.reason and "cold_capacity_bytes" in c.reason  # type: ignore[attr-defined]
    counters = gather(cfg, Services(store=t.store, cold=t.cold), started={"store"},
                      daemon=DaemonFacts("running", 1.0, 0.0, 5.0, True, 0), jobs=JobWatch(),
                      scheduler=None, now=0.0).counters()
    acks.ack(counters, 10.0, ["cold-full"])
    assert _checks(cfg, t, acks)["cold-full"].level.value == "ok"  # type: ignore[attr-defined]
    t.store.close()


def test_a_full_cold_disk_is_failing_at_once(tmp_path: Path) -> None:
    """The SSD answers ENOSPC: the write goes to the shadow and `cold-tier` is failing,
    unambiguous evidence that counts without a hold."""
    cfg = _config(tmp_path)
    cfg = dataclasses.replace(cfg, debug=dataclasses.replace(cfg.debug, fault_enospc=True))
    t = _tiers(cfg)
    keys = compute_blocks(t.store, "s", list(range(12)), 0, 3)
    assert keys is not None
    t.store.release("s")
    t.store.demote(keys, Tier.COLD)
    c = _checks(cfg, t, Acknowledgements())["cold-tier"]
    assert c.level.value == "failing" and c.at_once  # type: ignore[attr-defined]
    assert c.reason.startswith("the cold disk is full")  # type: ignore[attr-defined]
    t.store.close()
