"""A cold directory that cannot be written at start (a read-only mount, a full disk) starts
the cold tier on the shadow instead of failing; its records stay readable; once it can be
written again (and has room), the shadow is written back. Real mounts, in a subprocess."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.mounts import python_isolated, read_only, small_disk

PRELUDE = textwrap.dedent("""
    import json, os, torch
    from pathlib import Path
    from kvagentd.kvcache.base import KVGeometry
    from kvagentd.kvcache.cold import ColdTierSpec, build_cold_tier
    from kvagentd.kvcache.cold.store import ColdStore
    from kvagentd.kvcache.keys import block_keys, make_namespace
    G = KVGeometry(2, 1, 8, 4, torch.float32)
    NS = make_namespace("unwritable-test", torch.float32, 4)
    KEYS = block_keys(NS, list(range(4 * 64)), 4)

    def block(i):
        return torch.full(G.block_shape, float(i))

    def fill(cold, n):
        cs = ColdStore(cold, G, NS, capacity_bytes=64 << 20, segment_bytes=1 << 20,
                       o_direct=False)
        assert all(cs.put_many(KEYS[:n], [block(i) for i in range(n)]))
        cs.close()

    def readable(fo, n):
        outs = [torch.empty(G.block_shape) for _ in range(n)]
        ok = fo.read_into(KEYS[:n], outs)
        return all(ok) and all(torch.equal(o, block(i)) for i, o in enumerate(outs))
""")


def test_read_only_cold_directory_starts_on_the_shadow(tmp_path: Path):
    cold, shm = tmp_path / "cold", tmp_path / "shm"
    code = PRELUDE + textwrap.dedent(f"""
        import subprocess
        fill(Path({str(cold)!r}), 6)  # records written while writable, then it goes read-only
        subprocess.run(["sh", "-c", {read_only(cold)!r}], check=True)
        spec = ColdTierSpec(cold_dir=Path({str(cold)!r}), shadow_dir=Path({str(shm)!r}),
                            capacity_bytes=64 << 20, segment_bytes=1 << 20, o_direct=False,
                            shadow_bytes=8 << 20)
        fo = build_cold_tier(spec, G, NS)
        st = fo.status()
        out = dict(serving=fo.serving.value, cause=fo.cause.value, reason=st["reason"],
                   unwritable=st["ssd_unwritable"], readable=readable(fo, 6),
                   keys=len(fo.keys()))
        ok = fo.put_many(KEYS[10:12], [block(10), block(11)])
        out.update(put=ok, in_shadow=all(fo.shadow.contains(k) for k in KEYS[10:12]),
                   probe=fo.probe_once())
        fo.close()
        print(json.dumps(out))
    """)
    out = python_isolated(code, [])
    assert out["serving"] == "shadow" and out["cause"] == "read_only"
    assert "could not be written at start" in out["reason"] and out["unwritable"]
    assert out["readable"] and out["keys"] == 6
    assert out["put"] == [True, True] and out["in_shadow"]
    assert out["probe"] is False  # no failback while the directory stays read-only


def test_full_cold_disk_at_restart_starts_degraded_then_writes_back(tmp_path: Path):
    cold, shm = tmp_path / "cold", tmp_path / "shm"
    code = PRELUDE + textwrap.dedent(f"""
        cold, shm = Path({str(cold)!r}), Path({str(shm)!r})
        fill(cold, 40)
        filler = cold / "other-tenant"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, bytes(4096))
        except OSError:
            pass
        os.close(fd)
        spec = ColdTierSpec(cold_dir=cold, shadow_dir=shm, capacity_bytes=64 << 20,
                            segment_bytes=1 << 20, o_direct=False, shadow_bytes=8 << 20,
                            failback_good_probes=1)
        fo = build_cold_tier(spec, G, NS)  # a restart on the full disk
        out = dict(serving=fo.serving.value, cause=fo.cause.value, reason=fo.reason,
                   readable=readable(fo, 40))
        ok = fo.put_many(KEYS[50:52], [block(50), block(51)])
        out.update(put=ok, in_shadow=all(fo.shadow.contains(k) for k in KEYS[50:52]))
        r = fo.probe()
        out.update(probe_full=r, still=fo.serving.value)
        os.unlink(filler)  # the other tenant's file goes
        r = fo.probe()
        out.update(probe_room=r.get("restore"), after=fo.serving.value,
                   on_ssd=all(fo.primary.contains(k) for k in KEYS[50:52]),
                   readable_after=readable(fo, 40), shadow_left=len(fo.shadow.keys()))
        fo.close()
        print(json.dumps(out))
    """)
    out = python_isolated(code, [small_disk(cold, "2m")])
    assert out["serving"] == "shadow" and out["cause"] == "no_space", out
    assert out["readable"], out
    assert out["put"] == [True, True] and out["in_shadow"]
    assert out["still"] == "shadow" and not out["probe_full"].get("restore"), out
    assert out["probe_room"] == {"restored": 2, "serving": "ssd"}, out
    assert out["after"] == "ssd" and out["on_ssd"] and out["readable_after"]
    assert out["shadow_left"] == 0


def test_an_index_file_that_cannot_be_written_is_never_set_aside(make_cold, geometry, namespace,
                                                                  tmp_path, monkeypatch):
    """SQLite says "attempt to write a readonly database" (the file's mode or owner): the
    records stay, read-only, instead of being discarded as a corrupt index."""
    import sqlite3

    import torch

    from kvagentd.kvcache.cold import indexfile
    from kvagentd.kvcache.keys import block_keys

    cs = make_cold()
    keys = block_keys(namespace, list(range(4 * 3)), 4)
    blocks = [torch.full(geometry.block_shape, float(i)) for i in range(3)]
    assert all(cs.put_many(keys, blocks))
    cs.close()
    real = sqlite3.connect

    def read_only_file(path, *args, **kw):
        if str(path).endswith("index.sqlite3") and not kw.get("uri"):
            return real(f"{Path(path).as_uri()}?mode=ro", *args, uri=True, **kw)
        return real(path, *args, **kw)

    monkeypatch.setattr(indexfile.sqlite3, "connect", read_only_file)
    cs = make_cold()
    assert cs.unwritable and cs.unwritable_cause.value == "read_only"
    assert cs.index.discarded_at_open is None
    assert not list((tmp_path / "cold").glob("index.sqlite3.corrupt-*"))
    outs = [torch.empty(geometry.block_shape) for _ in keys]
    assert cs.read_into(keys, outs) == [True] * 3
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks))
    assert cs.put_many(block_keys(namespace, list(range(100, 104)), 4),
                       [blocks[0]]) == [False]
    cs.close()
    monkeypatch.undo()
    cs = make_cold()  # writable again: everything is still there
    assert cs.unwritable is None and set(cs.keys()) == set(keys)
    cs.close()
