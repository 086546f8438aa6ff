"""Trends of a few measures per asset over the last hour and day, from per-minute means.

`TrendSeries.add(t, values)` folds one window's measures into its minute; the series keeps the
last `HORIZON_S` (a day and a little). `trends(now)` gives, per measure, the current level
(mean of the last `RECENT_S`), its change against the level an hour and a day earlier (the
minutes within +-`RECENT_S` of that moment; None without data there) and the least-squares
slope over the last hour. `load(minutes)` seeds the series from stored per-minute summaries so
a restart keeps its trends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

import numpy as np

from kvagentd.agent.diagnosis.result import Trend

HORIZON_S = 25 * 3600.0
RECENT_S = 300.0


class TrendSeries:
    def __init__(self) -> None:
        # minute -> {measure: (sum, count)}
        self._minutes: OrderedDict[int, dict[str, list[float]]] = OrderedDict()

    def add(self, t: float, values: Mapping[str, float]) -> None:
        minute = int(t // 60)
        bucket = self._minutes.get(minute)
        if bucket is None:
            late = bool(self._minutes) and next(reversed(self._minutes)) > minute
            bucket = self._minutes[minute] = {}
            if late:
                self._minutes = OrderedDict(sorted(self._minutes.items()))
        for k, v in values.items():
            acc = bucket.setdefault(k, [0.0, 0.0])
            acc[0] += float(v)
            acc[1] += 1.0
        cutoff = minute - int(HORIZON_S // 60)
        while self._minutes and next(iter(self._minutes)) < cutoff:
            self._minutes.popitem(last=False)

    def load(self, minutes: Iterable[tuple[float, Mapping[str, float], int]]) -> None:
        """Seed from (minute start t, mean per measure, window count) rows."""
        for t, means, n in minutes:
            bucket = self._minutes.setdefault(int(t // 60), {})
            for k, v in means.items():
                acc = bucket.setdefault(k, [0.0, 0.0])
                acc[0] += float(v) * n
                acc[1] += float(n)
        self._minutes = OrderedDict(sorted(self._minutes.items()))

    def _level(self, measure: str, center_min: float, half_min: float) -> float | None:
        tot = cnt = 0.0
        for m, bucket in self._minutes.items():
            if abs(m - center_min) <= half_min and measure in bucket:
                tot += bucket[measure][0]
                cnt += bucket[measure][1]
        return tot / cnt if cnt else None

    def trends(self, now: float) -> dict[str, Trend]:
        if not self._minutes:
            return {}
        now_min = now / 60.0
        half = RECENT_S / 60.0
        measures = sorted({k for b in self._minutes.values() for k in b})
        out: dict[str, Trend] = {}
        for k in measures:
            level = self._level(k, now_min - half / 2, half / 2)
            if level is None:
                continue
            hour = self._level(k, now_min - 60.0, half / 2)
            day = self._level(k, now_min - 1440.0, half)
            pts = [(m, b[k][0] / b[k][1]) for m, b in self._minutes.items()
                   if k in b and now_min - 60.0 <= m <= now_min]
            slope = None
            if len(pts) >= 3:
                x = np.array([p[0] for p in pts]) / 60.0
                y = np.array([p[1] for p in pts])
                slope = float(np.polyfit(x - x.mean(), y, 1)[0])
            out[k] = Trend(level, None if hour is None else level - hour,
                           None if day is None else level - day, slope)
        return out
