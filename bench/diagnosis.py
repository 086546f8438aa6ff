"""The measured diagnosis on real recordings (CWRU) and on the simulator's fault kinds.

For every recording of `shared/data/cwru-dev/` (see its manifest) the offline diagnosis
(`kvagentd diagnose`, the live agent's code) runs on back-to-back windows; the benchmark
reports per-class recall (the diagnosed fault is the true one), how often a fault window is
flagged as some bearing fault, the confusion matrix and the false anomalies on the healthy
recording. It then reads every file at a wrong sample rate (x1/4, x1/2, x2, x4) and counts the
windows the speed check refuses (and, at the right rate, any it refuses wrongly). Finally it
runs each simulated fault kind at a few fault levels, and Gaussian noise (the null test: no
fault may be found in it). Per-window compute time is reported.

    .venv/bin/python -m bench.diagnosis            # everything (about a minute)
    .venv/bin/python -m bench.diagnosis --quick    # smoke run: 3 windows per file
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import Counter
from typing import Any

import numpy as np

from bench.common import Goal, Result, print_table, write_result
from bench.cwru import cwru_dir, load_manifest, recording
from kvagentd.agent.diagnosis.analysis import analyze, classify
from kvagentd.agent.features import Window
from kvagentd.agent.offline import asset_for, diagnose_recording
from kvagentd.agent.recordings import Recording
from kvagentd.agent.simulator import SimulatedSource
from kvagentd.config import AssetConfig, FaultConfig

FAULT_CLASSES = ("outer_race", "inner_race", "ball")
BEARING = ("outer_race", "inner_race", "ball", "cage")
SIM_KINDS = ("none", "outer_race", "inner_race", "ball", "cage", "imbalance", "misalignment",
             "looseness")
# Fault levels at which each simulated kind is diagnosable without a learned baseline: bearing
# defects from their onset, running-speed faults once the overall level leaves zone B.
SIM_LEVELS = {"none": (0.0,), "outer_race": (1.0, 3.0), "inner_race": (1.0, 3.0),
              "ball": (1.0, 3.0), "cage": (1.0, 3.0), "imbalance": (2.0, 4.0),
              "misalignment": (3.0, 5.0), "looseness": (5.0, 8.0)}
RATE_FACTORS = (0.25, 0.5, 2.0, 4.0)


def _limit(rec: Recording, n_windows: int | None, window_s: float) -> Recording:
    if n_windows is None:
        return rec
    n = int(n_windows * window_s * rec.sample_rate_hz)
    return dataclasses.replace(rec, samples=rec.samples[:n])


def cwru(args: argparse.Namespace) -> dict[str, Any]:
    d = cwru_dir()
    if d is None:
        raise SystemExit("bench.diagnosis: no cwru-dev directory (set KVAGENTD_CWRU_DIR)")
    bearing, files = load_manifest(d)
    per_file, confusion = [], Counter()
    times: list[float] = []
    for entry in files:
        rec = _limit(recording(d, entry), args.windows, args.window_s)
        asset = asset_for(rec, rpm=float(entry["rpm"]), bearing=bearing, window_s=args.window_s)
        t0 = time.perf_counter()
        results = list(diagnose_recording(rec, asset, hop_s=args.hop))
        times.append((time.perf_counter() - t0) / max(1, len(results)))
        got = Counter(r.diagnosis.fault if r.diagnosis else "refused" for r in results)
        for k, v in got.items():
            confusion[(entry["fault"], k)] += v
        per_file.append({"file": entry["file"], "fault": entry["fault"],
                         "load_hp": entry["motor_load_hp"], "windows": len(results),
                         "correct": got.get(entry["fault"], 0), "diagnosed": dict(got)})
    classes = sorted({e["fault"] for e in files}, key=lambda c: (c == "none", c))
    recall = {}
    for c in classes:
        tot = sum(v for (t, _), v in confusion.items() if t == c)
        recall[c] = {"windows": tot, "recall": confusion[(c, c)] / tot if tot else 0.0,
                     "as_bearing_fault": sum(v for (t, p), v in confusion.items()
                                             if t == c and p in BEARING) / tot if tot else 0.0}
    healthy = sum(v for (t, p), v in confusion.items() if t == "none")
    false_alarms = sum(v for (t, p), v in confusion.items() if t == "none" and p != "none")
    predicted = sorted({p for _, p in confusion})
    return {"dir": str(d), "files": per_file, "recall": recall,
            "confusion": {t: {p: confusion[(t, p)] for p in predicted} for t in classes},
            "healthy_windows": healthy, "healthy_false_anomalies": false_alarms,
            "ms_per_window": round(1000 * float(np.median(times)), 2)}


def wrong_rates(args: argparse.Namespace) -> dict[str, Any]:
    d = cwru_dir()
    assert d is not None
    bearing, files = load_manifest(d)
    if args.quick:
        files = files[::3]
    out: dict[str, Any] = {}
    for factor in (1.0, *RATE_FACTORS):
        refused = total = alone = 0
        for entry in files:
            rec = recording(d, entry)
            rec = dataclasses.replace(rec, sample_rate_hz=rec.sample_rate_hz * factor)
            rec = _limit(rec, args.windows, args.window_s)
            asset = asset_for(rec, rpm=float(entry["rpm"]), bearing=bearing,
                              window_s=args.window_s)
            for r in diagnose_recording(rec, asset):
                total += 1
                refused += r.diagnosis is None
                # refused by the window's own check, not (only) by the recording's verdict
                alone += r.diagnosis is None and "of this recording" not in (r.refused or "")
        out[f"x{factor:g}"] = {"windows": total, "refused": refused,
                               "fraction": refused / total if total else 0.0,
                               "refused_by_window_check": alone,
                               "window_check_fraction": alone / total if total else 0.0}
    return out


def simulator(args: argparse.Namespace) -> dict[str, Any]:
    n = 5 if args.quick else 20
    out: dict[str, Any] = {}
    for kind in SIM_KINDS:
        got: Counter[str] = Counter()
        for level in SIM_LEVELS[kind]:
            asset = AssetConfig(fault=FaultConfig(kind=kind, onset_s=0.0, severity=level,  # type: ignore[arg-type]
                                                  growth_per_hour=0.0), baseline_s=0.0)
            src = SimulatedSource(asset, 0.0)
            for i in range(n):
                an = analyze(src.read_window(10.0 + 3.0 * i), asset)
                got["refused" if not an.speed.ok else classify(an, asset).fault] += 1
        total = sum(got.values())
        out[kind] = {"windows": total, "recall": got.get(kind, 0) / total,
                     "diagnosed": dict(got)}
    return out


def noise(args: argparse.Namespace) -> dict[str, Any]:
    """False anomalies and refusals on Gaussian noise (white and coloured): the null test."""
    asset = AssetConfig(baseline_s=0.0)
    rng = np.random.default_rng(2026)
    got: Counter[str] = Counter()
    n = 100 if args.quick else 1000
    for i in range(n):
        x = rng.normal(0.0, 1.0, int(asset.sample_rate_hz * asset.window_s))
        if i % 2:
            x = np.convolve(x, [1.0, 0.8, 0.3], "same")
        an = analyze(Window(x, asset.sample_rate_hz, "acceleration", 0.0), asset)
        got["refused" if not an.speed.ok else classify(an, asset).fault] += 1
    return {"windows": n, "diagnosed": dict(got),
            "false_anomalies": sum(v for k, v in got.items() if k not in ("none", "refused")),
            "refused": got.get("refused", 0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.diagnosis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 windows per file, fewer cases")
    p.add_argument("--window-s", type=float, default=1.0)
    p.add_argument("--hop", type=float, default=None, help="window step (s); default: no overlap")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    args.windows = 3 if args.quick else None

    real = cwru(args)
    print_table(["file", "true fault", "load hp", "windows", "recall", "diagnosed"],
                [[f["file"], f["fault"], f["load_hp"], f["windows"],
                  f"{f['correct'] / max(1, f['windows']):.0%}",
                  ", ".join(f"{k} {v}" for k, v in sorted(f["diagnosed"].items()))]
                 for f in real["files"]], title="CWRU recordings, per file")
    print_table(["class", "windows", "recall", "flagged as a bearing fault"],
                [[c, r["windows"], f"{r['recall']:.1%}", f"{r['as_bearing_fault']:.1%}"]
                 for c, r in real["recall"].items()], title="Per class")
    preds = sorted({p for row in real["confusion"].values() for p in row})
    print_table(["true \\ diagnosed", *preds],
                [[t, *(row.get(p, 0) for p in preds)] for t, row in real["confusion"].items()],
                title="Confusion (windows)")
    rates = wrong_rates(args)
    print_table(["sample rate read as", "windows", "refused", "by the window's own check"],
                [[k, v["windows"], f"{v['fraction']:.1%}", f"{v['window_check_fraction']:.1%}"]
                 for k, v in rates.items()],
                title="Speed check: every file read at a wrong sample rate (the rest of a "
                      "refused share: the recording's verdict)")
    sim = simulator(args)
    print_table(["simulated fault", "windows", "recall", "diagnosed"],
                [[k, v["windows"], f"{v['recall']:.0%}",
                  ", ".join(f"{a} {b}" for a, b in sorted(v["diagnosed"].items()))]
                 for k, v in sim.items()], title="Simulator")
    null = noise(args)
    print(f"\nGaussian noise, {null['windows']} windows: {null['false_anomalies']} false "
          f"anomalies, {null['refused']} refused ({null['diagnosed']})")
    print(f"analysis time per 1 s window at 12 kHz: {real['ms_per_window']} ms (median)")

    goals = [Goal(f"CWRU {c} recall", round(real["recall"][c]["recall"], 4), ">=", 0.9)
             for c in FAULT_CLASSES if c in real["recall"]]
    goals += [
        Goal("CWRU healthy: false anomalies", real["healthy_false_anomalies"], "<=", 0),
        Goal("right sample rate: windows refused", rates["x1"]["refused"], "<=", 0),
        Goal("Gaussian noise: false anomalies", null["false_anomalies"], "<=", 0),
        Goal("rate x1/4: windows refused", round(rates["x0.25"]["fraction"], 4), ">=", 0.8),
        Goal("rate x4: windows refused", round(rates["x4"]["fraction"], 4), ">=", 0.8),
    ]
    goals += [Goal(f"simulator {k} recall", round(v["recall"], 4), ">=", 0.9)
              for k, v in sim.items()]
    cmd = " ".join(["python -m bench.diagnosis", *(sys.argv[1:] if argv is None else argv)])
    write_result(Result("diagnosis", cmd, {"cwru": real, "wrong_rates": rates,
                                           "simulator": sim, "noise": null}, goals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
