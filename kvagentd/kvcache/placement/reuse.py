"""The reuse model of the `reuse` policy: how likely a block is to be used again, and when.

From `AccessStats`' counters: per category (the first block of the request that first used a
block: its application's system prompt) and use count (1, 2, 3 or more, its session's history
included), the share of blocks that were used again; per category the log-normal spread of the
time between uses; per block its own smoothed gaps. A round turns these into one score per
candidate, `reuse_density`: expected uses per second of the slot it holds, the hit density of
LHD (Beckmann et al., "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .stats import CLASSES, AccessStats


class ReuseTables(NamedTuple):
    odds: np.ndarray  # (categories, CLASSES + 1): P(used again | use count); column 0 unused
    mu: np.ndarray  # (categories,) mean log gap (seconds)
    sigma: np.ndarray  # (categories,) deviation of the log gap


def reuse_tables(stats: AccessStats) -> ReuseTables:
    """Per category in use: reuse odds by use count, and the log-gap mean and deviation (a wide
    prior where a category has none yet). Small arrays: computed once per round, over the
    categories seen so far (`OTHER` and the numbered ones), not the table's whole size."""
    k = min(len(stats.categories) + 1, stats.cat_n.size)
    odds = np.minimum((stats.reused[:k] + 0.5) / (stats.reached[:k] + 1.0), 0.995)
    n = stats.cat_n[:k]
    seen = n > 1.5
    safe = np.maximum(n, 1e-9)
    mu = np.where(seen, stats.cat_lg[:k] / safe, stats.prior_mu)
    var = np.where(seen, stats.cat_lg2[:k] / safe - mu * mu, stats.prior_var)
    return ReuseTables(odds, mu.astype(np.float32),
                       np.sqrt(np.maximum(var, 0.04)).astype(np.float32))


ReuseModel = Callable[[AccessStats, np.ndarray, ReuseTables, np.ndarray | None],
                      tuple[np.ndarray, np.ndarray, np.ndarray]]
"""Per row: reuse odds, and the mean and deviation of the log time to its next use (the rows'
records, `AccessStats.records`, when the caller has read them)."""


def reuse_model(stats: AccessStats, rows: np.ndarray, tables: ReuseTables,
                rec: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: reuse odds (its category and use count), and the mean and deviation of the log
    time to its next use (its own gaps when it has some, else its category's). `rec`: the
    rows' records, read here when not given."""
    r = stats.records(rows) if rec is None else rec
    c = r["cat"]
    q = tables.odds.ravel()[c * (CLASSES + 1) + np.minimum(r["count"] + r["base"], CLASSES)]
    own = r["gaps"] > 0
    mu = np.where(own, r["gap_mu"], tables.mu[c])
    s = np.where(own, np.sqrt(np.maximum(r["gap_var"], 0.04)), tables.sigma[c])
    return q, mu, s


_Z_LO, _Z_STEPS = -9.0, 3600  # the grid: z in [-9, 9] in steps of 0.005
_Z = np.linspace(_Z_LO, -_Z_LO, _Z_STEPS + 1)
_PHI = 0.5 * np.array([math.erfc(-z / math.sqrt(2.0)) for z in _Z])
_DPHI = np.append(np.diff(_PHI), 0.0)  # slope per grid step


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF, linearly interpolated on a 0.005 grid (|error| < 4e-6).

    The grid is uniform, so the cell is an index computed from x, not searched for (np.interp
    searches: about 10x the cost on a round's few thousand candidates)."""
    u = (x - _Z_LO) * (_Z_STEPS / (-2.0 * _Z_LO))
    np.clip(u, 0.0, float(_Z_STEPS), out=u)
    i = u.astype(np.intp)
    u -= i
    out: np.ndarray = _PHI[i] + u * _DPHI[i]
    return out


PRIOR_ODDS = 0.5  # reuse odds of a block placement has no record of a use of
LEFT_OF_STAY = 0.5
"""The share of the measured stay (`hold_s`) that a block that will not come back is charged:
a block looked at is, on average, halfway through its stay in hot. Against the whole stay
(BENCHMARKS.md, placement): 8-11 points more of the LRU -> optimum gap on edge-agent at 640
blocks, within 0.3 points on multi-turn, 0.02 points fewer hits on seed (still above LRU); the
stay left after each block's own idle time closed less than either."""


def reuse_density(stats: AccessStats, rows: np.ndarray, now: float,
                  tables: ReuseTables | None = None, hold_s: float | None = None, *,
                  model: ReuseModel = reuse_model) -> np.ndarray:
    """Expected uses per second of slot held: P(used again) / E[slot time until resolved].

    With odds q (category and use count) and a log-normal time to the next use (mean mu,
    deviation s, from the block's own gaps or its category's), a block idle for `a` seconds is
    used again with probability p = q S(a) / (1 - q + q S(a)), S the survival of that time, and
    then after t = E[T | T > a] - a more seconds. Kept until then, it holds its slot t seconds
    if it is used again, and, if it is not, until placement moves it out: what is left of its
    stay, h = `LEFT_OF_STAY` x `hold_s` (how long blocks stay in hot before placement moves
    them out, `AccessStats.hold_s`). So the density is p / (p t + (1 - p) h): a block unlikely
    to come back is charged the slot time it would waste, not its (long) expected return.
    Without `hold_s` (nothing moved out yet) the mean idle time of `rows` stands in for h (the
    candidates' time in hot so far: as much as, on average, they have left). A block long
    overdue scores near zero; a block with no recorded use (loaded, never used since) scores
    with the prior odds. `model` gives the odds and the log-normal per row (the learned
    `reuse_model`; a benchmark measures the score's ceiling with a trace generator's true
    parameters in its place)."""
    r = stats.records(rows)  # one gather: the model reads the same records
    q, mu, s = model(stats, rows, tables if tables is not None else reuse_tables(stats), r)
    q = np.where(r["count"] > 0, q, PRIOR_ODDS)
    a = np.maximum(now - r["last_t"], 1e-3)
    n = rows.size
    z = np.empty(2 * n)  # both arguments of the normal CDF, for one call
    np.subtract(np.log(a), mu, out=z[:n])
    z[:n] /= s  # (log a - mu) / s
    np.subtract(s, z[:n], out=z[n:])  # (mu + s^2 - log a) / s
    phi = _norm_cdf(z)
    surv = np.maximum(1.0 - phi[:n], 1e-12)
    qs = q * surv
    p = qs / (1.0 - q + qs)
    after = np.exp(np.minimum(mu + 0.5 * s * s, 50.0)) * phi[n:]
    wait = np.maximum(after / surv - a, 1.0)
    hold = LEFT_OF_STAY * hold_s if hold_s is not None else (float(a.mean()) if a.size else 1.0)
    out: np.ndarray = p / (p * wait + (1.0 - p) * max(hold, 1.0))
    return out
