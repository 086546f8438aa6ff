"""A bounded store of raw sensor windows, so reports can show the spectrum behind an event.

`offer(asset, event_id, t, window, anomaly)` keeps the window when
- it is an anomaly and the asset's last kept anomaly is at least `anomaly_interval_s` old, or
- it is normal and the asset's last kept normal window is at least `normal_interval_s` old;
and returns whether it kept it. Files: `<dir>/<asset>/<event id>-<a|n>.npz` (float32 samples,
sample rate, kind, t0). When the store passes `max_bytes`, the oldest normal windows go first,
then the oldest anomalies. The index is rebuilt from the directory at start, so the bound
holds across restarts. `get(event_id)` returns the window or None.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from kvagentd.agent.features import Window

log = structlog.get_logger(__name__)

_NAME_RE = re.compile(r"^(?P<id>\d+)-(?P<kind>[an])\.npz$")


@dataclass(frozen=True, slots=True)
class Stored:
    event_id: int
    asset: str
    anomaly: bool
    path: Path
    size: int


class WindowStore:
    def __init__(self, directory: Path, *, max_bytes: int, anomaly_interval_s: float,
                 normal_interval_s: float) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.anomaly_interval_s = anomaly_interval_s
        self.normal_interval_s = normal_interval_s
        self._lock = threading.Lock()
        self._items: dict[int, Stored] = {}
        self._last: dict[tuple[str, bool], float] = {}
        self.evicted = 0
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.glob("*.npz"):
                m = _NAME_RE.match(f.name)
                if m:
                    eid = int(m.group("id"))
                    self._items[eid] = Stored(eid, sub.name, m.group("kind") == "a", f,
                                              f.stat().st_size)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._items.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def offer(self, asset: str, event_id: int, t: float, window: Window, anomaly: bool) -> bool:
        interval = self.anomaly_interval_s if anomaly else self.normal_interval_s
        with self._lock:
            last = self._last.get((asset, anomaly))
            if last is not None and t - last < interval:
                return False
            self._last[(asset, anomaly)] = t
        sub = self.dir / asset
        sub.mkdir(exist_ok=True)
        path = sub / f"{event_id}-{'a' if anomaly else 'n'}.npz"
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, samples=np.asarray(window.samples, dtype=np.float32),
                 sample_rate=window.sample_rate, kind=window.kind, t0=window.t0)
        tmp.replace(path)
        with self._lock:
            self._items[event_id] = Stored(event_id, asset, anomaly, path, path.stat().st_size)
            self._evict()
        return True

    def _evict(self) -> None:
        # Caller holds the lock. Oldest normal windows first, then oldest anomalies.
        total = sum(s.size for s in self._items.values())
        if total <= self.max_bytes:
            return
        order = sorted(self._items.values(), key=lambda s: (s.anomaly, s.event_id))
        for s in order:
            if total <= self.max_bytes:
                break
            s.path.unlink(missing_ok=True)
            del self._items[s.event_id]
            total -= s.size
            self.evicted += 1

    def get(self, event_id: int) -> Window | None:
        with self._lock:
            s = self._items.get(event_id)
        if s is None:
            return None
        try:
            with np.load(s.path, allow_pickle=False) as z:
                kind = str(z["kind"])
                return Window(z["samples"].astype(np.float64), float(z["sample_rate"]),
                              "velocity" if kind == "velocity" else "acceleration",
                              float(z["t0"]))
        except (OSError, ValueError, KeyError) as exc:
            log.warning("windows.unreadable", path=str(s.path), error=str(exc))
            return None

    def events(self, asset: str) -> list[int]:
        """Ids of the stored windows of `asset`, oldest first."""
        with self._lock:
            return sorted(s.event_id for s in self._items.values() if s.asset == asset)
