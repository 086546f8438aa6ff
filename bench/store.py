"""Block store data paths against plain copies and raw I/O of the same bytes, side by side.

A 2048-token SmolLM2-sized KV: 128 blocks of (30, 2, 3, 16, 64) fp32 = 94 MB.
- warm -> hot through `ensure_resident` vs one `copy_` into a preallocated buffer
- cold -> hot through `ensure_resident` (O_DIRECT where allowed) vs a raw sequential O_DIRECT
  read of the same number of bytes in the same chunk size
- cold write (`put_many`, incl. fsync and index commit) vs a raw O_DIRECT write + fsync
- codec encode / decode times and relative L2 error on synthetic KV
- bookkeeping per block (match_prefix + ensure_resident of resident blocks + release)

Run: OMP_NUM_THREADS=1 .venv/bin/python -m bench.store   (state under var/bench, on the disk)
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import time
from pathlib import Path

import structlog
import torch

from bench.common import Goal, Result, print_table, timeit, write_result
from kvagentd.kvcache.base import KVGeometry, Tier
from kvagentd.kvcache.codec import make_codec
from kvagentd.kvcache.cold.store import ColdStore
from kvagentd.kvcache.fileio import FileIO
from kvagentd.kvcache.keys import make_namespace
from kvagentd.kvcache.store import TieredKVStore

N_BLOCKS = 128
GEOM = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=16, dtype=torch.float32)
BENCH_DIR = Path(__file__).resolve().parent.parent / "var" / "bench" / "store"
CHUNK = 8 << 20
COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python -m bench.store"


def _synthetic(n: int) -> torch.Tensor:
    """KV-like data: Gaussian, K channels with different ranges, a few outliers."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *GEOM.block_shape, generator=g)
    x[:, :, 0] *= torch.linspace(0.2, 4.0, GEOM.head_dim)
    x.view(-1)[:: 9973] *= 8.0
    return x


def _raw_read(path_bytes: list[tuple[str, int]], buf: mmap.mmap) -> None:
    flags = os.O_RDONLY | FileIO.O_DIRECT
    for path, size in path_bytes:
        fd = os.open(path, flags)
        try:
            off = 0
            while off < size:
                n = os.preadv(fd, [memoryview(buf)[:min(CHUNK, size - off)]], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)


def _raw_write(path: str, buf: mmap.mmap, total: int, io_unit: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FileIO.O_DIRECT, 0o600)
    try:
        off = 0
        while off < total:
            n = min(io_unit, total - off)
            os.pwrite(fd, memoryview(buf)[off % len(buf):off % len(buf) + n], off)
            off += n
        os.fdatasync(fd)
    finally:
        os.close(fd)
    os.unlink(path)


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    torch.manual_seed(0)
    if BENCH_DIR.exists():
        shutil.rmtree(BENCH_DIR)
    BENCH_DIR.mkdir(parents=True)
    ns = make_namespace("bench-smollm2", GEOM.dtype, GEOM.block_tokens)
    bb = GEOM.block_bytes
    kv = _synthetic(N_BLOCKS)
    total = N_BLOCKS * bb
    figures: dict[str, object] = {"blocks": N_BLOCKS, "bytes": total, "block_shape": GEOM.block_shape,
                                  "loadavg_start": os.getloadavg()}
    rows = []

    store = TieredKVStore(GEOM, ns, hot_bytes=N_BLOCKS * bb, warm_bytes=N_BLOCKS * bb,
                          cold=lambda listener: ColdStore(
                              BENCH_DIR / "cold", GEOM, ns, codec="raw", capacity_bytes=8 << 30,
                              segment_bytes=256 << 20, io_unit_bytes=128 << 10,
                              read_batch_bytes=CHUNK, listener=listener),
                          persist_on_shutdown=False)
    cold = store.cold
    assert isinstance(cold, ColdStore)
    tokens = list(range(N_BLOCKS * GEOM.block_tokens))
    slots = store.allocate_hot(N_BLOCKS, "bench")
    store.hot_arena()[torch.tensor(slots)] = kv
    keys = store.commit("bench", tokens, slots, 0)
    store.release("bench")

    # -- warm -> hot --------------------------------------------------------------------------
    def store_warm_to_hot() -> None:
        store.release("w")
        store.demote(keys, Tier.WARM)
        t0 = time.perf_counter()
        r = store.ensure_resident(keys, "w")
        times.append(time.perf_counter() - t0)
        assert r.missing_from is None and r.loaded["warm"] == N_BLOCKS

    times: list[float] = []
    src, dst = torch.empty_like(kv), torch.empty_like(kv)
    src.copy_(kv)
    plain = timeit(lambda: dst.copy_(src), repeat=7)
    for _ in range(8):
        store_warm_to_hot()
    st_w2h = sorted(times[1:])[len(times[1:]) // 2]
    store.release("w")
    rows.append(["warm->hot copy", f"{st_w2h * 1e3:.1f} ms", f"{plain * 1e3:.1f} ms (plain copy_)",
                 f"{plain / st_w2h:.2f}"])
    figures.update(warm_to_hot_store_s=st_w2h, warm_to_hot_plain_s=plain)

    # -- cold write ----------------------------------------------------------------------------
    rec = cold.record_bytes
    wtimes, rtimes = [], []
    staging = mmap.mmap(-1, CHUNK)
    staging.write(kv.view(-1).view(torch.uint8)[:CHUNK].numpy().tobytes())
    for rep in range(5):
        extra = ColdStore(BENCH_DIR / f"w{rep}", GEOM, ns, codec="raw", capacity_bytes=8 << 30,
                          segment_bytes=256 << 20, io_unit_bytes=128 << 10)
        wkeys = [bytes([rep]) + k[1:] for k in keys]
        blocks = [store.hot_arena()[s] for s in slots]  # as a demotion writes them: from a pool
        t0 = time.perf_counter()
        ok = extra.put_many(wkeys, blocks)
        wtimes.append(time.perf_counter() - t0)
        assert all(ok)
        extra.close()
        shutil.rmtree(BENCH_DIR / f"w{rep}")
        t0 = time.perf_counter()
        _raw_write(str(BENCH_DIR / "raw.bin"), staging, N_BLOCKS * rec, 128 << 10)
        rtimes.append(time.perf_counter() - t0)
    st_w, raw_w = sorted(wtimes)[2], sorted(rtimes)[2]
    rows.append(["cold write + fsync", f"{st_w * 1e3:.1f} ms", f"{raw_w * 1e3:.1f} ms (O_DIRECT write+fsync)",
                 f"{raw_w / st_w:.2f}"])
    figures.update(cold_write_store_s=st_w, cold_write_raw_s=raw_w, o_direct=cold.o_direct_active)

    # -- cold -> hot ---------------------------------------------------------------------------
    store.demote(keys, Tier.COLD)  # writes the records once
    segs = sorted((BENCH_DIR / "cold").glob("seg-*.kvs"))
    seg_bytes = [(str(p), p.stat().st_size) for p in segs]
    rbuf = mmap.mmap(-1, CHUNK)
    ctimes, rawtimes, ritimes = [], [], []
    outs = [torch.empty(GEOM.block_shape) for _ in range(N_BLOCKS)]
    for _ in range(10):
        store.release("c")
        store.demote(keys, Tier.COLD)  # in_cold: frees the slots, no write
        t0 = time.perf_counter()
        r = store.ensure_resident(keys, "c")
        ctimes.append(time.perf_counter() - t0)
        assert r.missing_from is None and r.loaded["cold"] == N_BLOCKS
        t0 = time.perf_counter()
        _raw_read(seg_bytes, rbuf)
        rawtimes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert all(cold.read_into(keys, outs))
        ritimes.append(time.perf_counter() - t0)
    assert all(torch.equal(store.hot_arena()[s], kv[i]) for i, s in enumerate(r.slots[:4]))
    st_c, raw_c, ri_c = (sorted(x[1:])[len(x[1:]) // 2] for x in (ctimes, rawtimes, ritimes))
    rows.append(["cold->hot (ensure_resident)", f"{st_c * 1e3:.1f} ms",
                 f"{raw_c * 1e3:.1f} ms (O_DIRECT read)", f"{raw_c / st_c:.2f}"])
    rows.append(["cold read_into (no store)", f"{ri_c * 1e3:.1f} ms", f"{raw_c * 1e3:.1f} ms",
                 f"{raw_c / ri_c:.2f}"])
    figures.update(cold_to_hot_store_s=st_c, cold_read_into_s=ri_c, cold_read_raw_s=raw_c,
                   cold_read_bytes=sum(s for _, s in seg_bytes))

    # -- bookkeeping ---------------------------------------------------------------------------
    store.release("c")
    store.promote(keys, Tier.HOT)

    def bookkeeping() -> None:
        m = store.match_prefix(tokens)
        store.ensure_resident(m.keys, "b")
        store.record_access(m.keys, "b")
        store.release("b")

    per_block = timeit(bookkeeping, repeat=9) / N_BLOCKS
    figures["bookkeeping_per_block_s"] = per_block
    rows.append(["bookkeeping per block", f"{per_block * 1e6:.1f} us",
                 "match + ensure_resident (resident) + record_access + release", ""])
    print_table(["path (94 MB)", "store", "reference", "ratio"], rows, title="Data paths")

    # -- codecs: 1 thread and all cores of this CPU, next to a plain copy of the same bytes ----
    crow = []
    out = torch.empty_like(kv)
    threads_before = torch.get_num_threads()
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        copy_s = timeit(lambda: out.copy_(kv), repeat=7)
        figures[f"copy_{threads}t_s"] = copy_s
        for name in ("raw", "int8", "fp8"):
            c = make_codec(name, GEOM)
            payload = torch.empty(N_BLOCKS, c.payload_nbytes, dtype=torch.uint8)
            enc = timeit(lambda c=c, payload=payload: c.encode(kv, payload), repeat=7)
            dec = timeit(lambda c=c, payload=payload: c.decode(payload, out), repeat=7)
            k_err = ((out[:, :, 0] - kv[:, :, 0]).norm() / kv[:, :, 0].norm()).item()
            v_err = ((out[:, :, 1] - kv[:, :, 1]).norm() / kv[:, :, 1].norm()).item()
            figures[f"codec_{name}_{threads}t"] = {
                "encode_s": enc, "decode_s": dec, "rel_l2_k": k_err, "rel_l2_v": v_err,
                "bytes_per_block": c.payload_nbytes, "encode_x_copy": enc / copy_s,
                "decode_x_copy": dec / copy_s}
            crow.append([name, threads, f"{enc * 1e3:.1f} ms ({enc / copy_s:.1f}x copy)",
                         f"{dec * 1e3:.1f} ms ({dec / copy_s:.1f}x copy)", f"{k_err:.4f}",
                         f"{v_err:.4f}", f"{c.payload_nbytes / bb:.3f}"])
    torch.set_num_threads(threads_before)
    all_t = max({1, os.cpu_count() or 1})
    print_table(["codec", "threads", "encode 128 blocks", "decode", "rel L2 K", "rel L2 V", "size"],
                crow, title="Codecs (synthetic KV; copy of the same 94 MB for scale)")

    store.close()
    shutil.rmtree(BENCH_DIR, ignore_errors=True)
    figures["loadavg_end"] = os.getloadavg()
    print(f"\nload average at start / end: {figures['loadavg_start']} / {figures['loadavg_end']}")
    goals = [
        Goal("warm->hot vs plain copy", plain / st_w2h, ">=", 0.7),
        Goal("cold read vs raw O_DIRECT read", raw_c / st_c, ">=", 0.8),
        Goal("cold write vs raw write+fsync", raw_w / st_w, ">=", 0.7),
    ]
    for name in ("int8", "fp8"):
        f = figures[f"codec_{name}_{all_t}t"]
        goals.append(Goal(f"{name} encode ({all_t} threads)", f["encode_s"] * 1e3, "<=", 50, " ms"))
        goals.append(Goal(f"{name} decode ({all_t} threads)", f["decode_s"] * 1e3, "<=", 50, " ms"))
    write_result(Result("store", COMMAND, figures, goals))
    return 0 if all(g.passed for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
