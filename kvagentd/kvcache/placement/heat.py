"""Block heat: H = sum over a block's last W access ticks of 1 / (now - t_i), now - t_i >= 1.

Ticks count inference events (one recorded event = one tick), not wall time. Storage is dense
and vectorized over the rows of placement's `AccessStats`, in two levels, since most blocks are
used a few times: every row has `INLINE` slots of its own (float32, 16 bytes), and a row used
more often than that gets a ring of W slots from a pool (`_wide`, 4 W bytes each, given back
when the row is cleared). A row's ring fills from slot 0 and wraps only once it holds W ticks,
so the heat of a row with n < W ticks reads only its first n slots: rows are read in buckets of
how many ticks they hold, and the slots of a bucket's width beyond a row's n are masked,
whatever they hold (a freed row is forgotten by its count alone). So a million rows cost about
28 MB plus 800 bytes (W = 200) for each row used more than `INLINE` times, not 800 MB, and
growing the table copies 28 bytes a row. Recording an event is O(k) for k accesses and
computing the heat of k rows at most O(k x W); no operation looks at every row. Ticks are
stored relative to a base that moves forward before float32 loses integer precision (2^24).
Kept only by the policies that rank by heat.
"""

from __future__ import annotations

import numpy as np

_REBASE_AT = float(1 << 23)  # relative ticks stay < 2^24: exact in float32
_BUCKETS = (4, 32)  # rows holding at most this many ticks are read on that many slots
INLINE = 4  # ticks a row holds in its own slots before it takes a ring from the pool


class HeatMap:
    """Access-tick ring buffers by row. Not thread-safe: placement's thread owns it."""

    def __init__(self, window: int = 200, *, capacity: int = 1024) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._inline = min(INLINE, window)
        cap = max(16, capacity)
        self._small = np.zeros((cap, self._inline), dtype=np.float32)
        self._wide_of = np.full(cap, -1, dtype=np.int32)  # the row's ring in `_wide` (-1: none)
        self._wide = np.zeros((0, window), dtype=np.float32)
        self._wide_free: list[int] = []
        self._slots = np.arange(window, dtype=np.int32)  # slot indices, for masking
        self._pos = np.zeros(cap, dtype=np.int32)  # next ring slot per row
        self._n = np.zeros(cap, dtype=np.int32)  # ticks held per row (<= window)
        self._base = 0  # absolute tick of relative 0

    @property
    def capacity(self) -> int:
        return int(self._small.shape[0])

    @property
    def rings(self) -> int:
        """Rows holding a ring of the pool (used more than `INLINE` times)."""
        return int(self._wide.shape[0]) - len(self._wide_free)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self._small, self._wide_of, self._wide, self._pos,
                                           self._n))

    def ensure(self, rows: int) -> None:
        """Room for rows [0, rows)."""
        old = self.capacity
        if rows <= old:
            return
        new = max(rows, 2 * old)
        small = np.zeros((new, self._inline), dtype=np.float32)
        small[:old] = self._small
        self._small = small
        self._wide_of = np.concatenate([self._wide_of, np.full(new - old, -1, np.int32)])
        self._pos = np.concatenate([self._pos, np.zeros(new - old, np.int32)])
        self._n = np.concatenate([self._n, np.zeros(new - old, np.int32)])

    def _give_rings(self, rows: np.ndarray) -> None:
        """Rings of the pool for distinct `rows` that hold only inline slots, their ticks
        copied over (a row that never wrapped holds them in slots [0, n))."""
        k = rows.size
        while len(self._wide_free) < k:
            old = int(self._wide.shape[0])
            new = max(2 * old, old + k, 64)
            wide = np.zeros((new, self.window), dtype=np.float32)
            wide[:old] = self._wide
            self._wide = wide
            self._wide_free.extend(range(new - 1, old - 1, -1))
        slots = np.asarray(self._wide_free[-k:][::-1], dtype=np.int32)
        del self._wide_free[-k:]
        self._wide_of[rows] = slots
        self._wide[slots, :self._inline] = self._small[rows]

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
        last = np.ones(rs.size, dtype=bool)
        last[:-1] = rs[1:] != rs[:-1]
        n_after = self._n[rs[last]] + occ[last] + 1  # ticks each row will have had
        grow = rs[last][(n_after > self._inline) & (self._wide_of[rs[last]] < 0)]
        if grow.size and self.window > self._inline:  # else the inline slots are the ring
            self._give_rings(grow)
        pos = (self._pos[rs] + occ) % self.window
        val = (ts - self._base).astype(np.float32)
        w = self._wide_of[rs]
        ring = w >= 0
        self._wide[w[ring], pos[ring]] = val[ring]
        self._small[rs[~ring], pos[~ring]] = val[~ring]  # pos < INLINE
        self._pos[rs[last]] = (pos[last] + 1) % self.window
        self._n[rs[last]] = np.minimum(n_after, self.window)

    def clear(self, rows: np.ndarray) -> None:
        """Forget the history of `rows` (their blocks are gone; the rows will be reused)."""
        rows = rows[rows < self.capacity]
        w = self._wide_of[rows]
        held = np.unique(w[w >= 0])
        if held.size:
            self._wide_free.extend(held.tolist())
            self._wide_of[rows] = -1
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
        ring = self._wide_of[rows[idx]] >= 0
        inline = (held > 0) & ~ring  # held <= INLINE (or the window, if that is smaller)
        if inline.any():
            self._sum(out, idx[inline], self._small[rows[idx[inline]]], held[inline], now32)
        lo = 0
        for width in sorted({min(b, self.window) for b in (*_BUCKETS, self.window)}):
            pick = ring & (held > lo) & (held <= width)  # held <= window always
            lo = width
            if pick.any():
                sel = idx[pick]
                self._sum(out, sel, self._wide[self._wide_of[rows[sel]], :width], held[pick],
                          now32)
        return out

    def _sum(self, out: np.ndarray, sel: np.ndarray, ticks: np.ndarray, held: np.ndarray,
             now32: np.float32) -> None:
        """out[sel] = the heat of rings `ticks` (one row each) holding `held` ticks."""
        b = now32 - ticks
        np.maximum(b, 1.0, out=b)
        np.reciprocal(b, out=b)
        b[self._slots[:b.shape[1]] >= held[:, None]] = 0.0  # slots not written yet
        out[sel] = b.sum(axis=1)

    def _rebase(self, tick: int) -> None:
        # NOTE: entries pushed below -2^24 lose precision, but each then contributes < 6e-8
        shift = tick - self._base - 1024
        self._small -= np.float32(shift)
        self._wide -= np.float32(shift)
        self._base += shift
