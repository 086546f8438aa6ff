"""Block heat: H = sum over a block's last W access ticks of 1 / (now - t_i), now - t_i >= 1.

Ticks count inference events (one recorded event = one tick), not wall time. Storage is dense
and vectorized over the rows of placement's `AccessStats`: row `i` of a `(rows, W)` float32
array is the ring buffer of block `i`'s last W access ticks. A row's ring fills from slot 0 and
wraps only once it holds W ticks, so the heat of a row with n < W ticks reads only its first n
slots: rows are read in buckets of how many ticks they hold (most blocks are used a few times),
and the slots of a bucket's width beyond a row's n are masked, whatever they hold. So the
array grows as zeros (pages the system maps only once a row is written) and a freed row is
forgotten by its count alone. Recording an event is O(k) for k accesses and computing the heat
of k rows at most O(k x W); no operation looks at every row. Ticks are stored relative to a
base that moves forward before float32 loses integer precision (2^24). Kept only by the
policies that rank by heat.
"""

from __future__ import annotations

import numpy as np

_REBASE_AT = float(1 << 23)  # relative ticks stay < 2^24: exact in float32
_BUCKETS = (4, 32)  # rows holding at most this many ticks are read on that many slots


class HeatMap:
    """Access-tick ring buffers by row. Not thread-safe: placement's thread owns it."""

    def __init__(self, window: int = 200, *, capacity: int = 1024) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        cap = max(16, capacity)
        self._ticks = np.zeros((cap, window), dtype=np.float32)
        self._slots = np.arange(window, dtype=np.int32)  # slot indices, for masking
        self._pos = np.zeros(cap, dtype=np.int32)  # next ring slot per row
        self._n = np.zeros(cap, dtype=np.int32)  # ticks held per row (<= window)
        self._base = 0  # absolute tick of relative 0

    @property
    def capacity(self) -> int:
        return int(self._ticks.shape[0])

    def ensure(self, rows: int) -> None:
        """Room for rows [0, rows)."""
        old = self.capacity
        if rows <= old:
            return
        new = max(rows, 2 * old)
        ticks = np.zeros((new, self.window), dtype=np.float32)
        ticks[:old] = self._ticks
        self._ticks = ticks
        self._pos = np.concatenate([self._pos, np.zeros(new - old, np.int32)])
        self._n = np.concatenate([self._n, np.zeros(new - old, np.int32)])

    def record(self, rows: np.ndarray, ticks: np.ndarray) -> None:
        """Access `i` used row `rows[i]` at absolute tick `ticks[i]` (ticks non-decreasing;
        a row may appear several times)."""
        if rows.size == 0:
            return
        self.ensure(int(rows.max()) + 1)
        if int(ticks[-1]) - self._base >= _REBASE_AT:
            self._rebase(int(ticks[-1]))
        order = np.lexsort((ticks, rows))
        rs, ts = rows[order], ticks[order]
        first = np.ones(rs.size, dtype=bool)
        first[1:] = rs[1:] != rs[:-1]
        start = np.maximum.accumulate(np.where(first, np.arange(rs.size), 0))
        occ = np.arange(rs.size) - start
        size = np.bincount(start, minlength=rs.size)[start]  # uses of the row in the batch
        keep = occ >= size - self.window  # only the last W uses of a row fit its ring
        rs, ts, occ = rs[keep], ts[keep], (occ - np.maximum(size - self.window, 0))[keep]
        pos = (self._pos[rs] + occ) % self.window
        self._ticks[rs, pos] = (ts - self._base).astype(np.float32)
        last = np.ones(rs.size, dtype=bool)
        last[:-1] = rs[1:] != rs[:-1]
        self._pos[rs[last]] = (pos[last] + 1) % self.window
        self._n[rs[last]] = np.minimum(self._n[rs[last]] + occ[last] + 1, self.window)

    def clear(self, rows: np.ndarray) -> None:
        """Forget the history of `rows` (their blocks are gone; the rows will be reused)."""
        rows = rows[rows < self.capacity]
        self._pos[rows] = 0
        self._n[rows] = 0

    def heat(self, rows: np.ndarray, now: int) -> np.ndarray:
        """Heat of `rows` at absolute tick `now` (float32; rows never recorded have 0)."""
        out = np.zeros(rows.shape[0], dtype=np.float32)
        ok = (rows >= 0) & (rows < self.capacity)
        if not ok.any():
            return out
        now32 = np.float32(now - self._base)
        idx = np.flatnonzero(ok)
        held = self._n[rows[idx]]
        lo = 0
        for width in sorted({min(b, self.window) for b in (*_BUCKETS, self.window)}):
            pick = (held > lo) & (held <= width)  # held <= window always
            lo = width
            if pick.any():
                sel = idx[pick]
                b = now32 - self._ticks[rows[sel], :width]
                np.maximum(b, 1.0, out=b)
                np.reciprocal(b, out=b)
                b[self._slots[:width] >= held[pick][:, None]] = 0.0  # slots not written yet
                out[sel] = b.sum(axis=1)
        return out

    def _rebase(self, tick: int) -> None:
        # NOTE: entries pushed below -2^24 lose precision, but each then contributes < 6e-8
        shift = tick - self._base - 1024
        self._ticks -= np.float32(shift)
        self._base += shift
