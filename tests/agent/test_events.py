"""The event log: minute summaries, retention, schema upgrade; the raw-window store's bound."""

from __future__ import annotations

import sqlite3

import numpy as np

from kvagentd.agent.events import EventLog
from kvagentd.agent.features import Window
from kvagentd.agent.windows import WindowStore

T0 = 1_800_000_000.0


def _tick(log: EventLog, t: float, fault: str = "none", rms: float = 1.0) -> int:
    d = {"fault": fault, "severity": "none" if fault == "none" else "low",
         "ratios": {"BPFO": 9.0 if fault != "none" else 2.0}}
    return log.append(t=t, asset="p", features={"rms_mm_s": rms, "kurtosis": 3.0, "zone": "A"},
                      zone="A", anomaly=fault != "none", diagnosis=d)


def test_minutes_summarize_ticks_and_survive_pruning(tmp_path):
    log = EventLog(tmp_path / "e.sqlite")
    # Three days of 30 s ticks; both windows of every other minute show a fault.
    for i in range(3 * 86400 // 30):
        _tick(log, T0 + 30 * i, "outer_race" if i % 4 < 2 else "none", rms=1.0 + (i % 2))
    log.append(t=T0 + 5, asset="p", kind="bad_data", note="silent")
    m = log.minutes("p", T0, T0 + 120)
    assert len(m) == 2 and m[0]["ticks"] == 2 and m[0]["bad"] == 1
    assert m[0]["anomalies"] == 2 and m[0]["rms_mean"] == 1.5 and m[0]["ratios"]["BPFO"] == 9.0
    assert m[0]["faults"] == {"outer_race": 2} and m[1]["faults"] == {"none": 2}
    before = log.count()
    now = T0 + 3 * 86400
    done = log.prune(now, raw_s=86400.0, keep_s=2 * 86400.0)
    left = log.query(asset="p", limit=10_000_000, newest_first=False)
    assert done["rows"] == before - len(left)
    recent = [r for r in left if r["t"] >= now - 86400]
    older = [r for r in left if r["t"] < now - 86400]
    assert len(recent) == 86400 // 30  # the last day: every row
    assert all(r["anomaly"] for r in older)  # then anomalies only, one per minute
    assert len(older) == len({int(r["t"] // 60) for r in older}) == 720
    assert min(r["t"] for r in left) >= now - 2 * 86400
    assert len(log.minutes("p", T0, now)) == 2 * 1440  # minutes before keep_s are gone


def test_old_databases_gain_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, t REAL NOT NULL, "
               "asset TEXT NOT NULL, kind TEXT NOT NULL, features TEXT, zone TEXT, anomaly "
               "INTEGER NOT NULL DEFAULT 0, assessment TEXT, session TEXT, latency_s REAL, "
               "note TEXT NOT NULL DEFAULT '')")
    db.execute("INSERT INTO events (t, asset, kind, session) VALUES (1.0, 'p', 'tick', 'p-7')")
    db.commit()
    db.close()
    log = EventLog(path)
    (row,) = log.query()
    assert row["fault"] is None and row["diagnosis"] is None and row["session"] == "p-7"
    log.set_meta("session:p", "9")
    assert log.get_meta("session:p") == "9"


def test_window_store_keeps_due_windows_within_its_bound(tmp_path):
    w = Window(np.random.default_rng(0).normal(size=12000), 12000.0, "acceleration", 0.0)
    store = WindowStore(tmp_path, max_bytes=10 * 48_500, anomaly_interval_s=60.0,
                        normal_interval_s=3600.0)
    kept = [store.offer("p", i, T0 + 3 * i, w, anomaly=i >= 100) for i in range(400)]
    assert kept[0] and not any(kept[1:100])  # one normal window an hour
    assert sum(kept[100:]) == 300 * 3 // 60  # an anomaly a minute
    assert store.bytes <= 10 * 48_500 and len(store) >= 9 and store.evicted >= 6
    assert 0 not in store.events("p")  # the normal window went first
    got = store.get(store.events("p")[-1])
    assert got is not None and np.allclose(got.samples, w.samples, atol=1e-6)
    assert store.get(12345) is None
    again = WindowStore(tmp_path, max_bytes=10 * 48_500, anomaly_interval_s=60.0,
                        normal_interval_s=3600.0)
    assert again.events("p") == store.events("p")  # the index is rebuilt from the files
