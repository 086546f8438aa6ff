"""The simulated sensor source: a physical model of a rotating machine, deterministic for
(seed, now).

Shaft rate fr = rpm / 60. Healthy: 1x and 2x velocity harmonics (imbalance and alignment are
never perfect) and broadband acceleration noise. Faults (`asset.fault.kind`) start `onset_s`
after the source's start time and grow by `growth_per_hour` (x severity) per hour:
- `outer_race`, `inner_race`, `ball`, `cage`: a train of impacts with 1 % timing jitter, each
  ringing a structural resonance (decaying sinusoid, 3.5 kHz, 5 % damping): at BPFO; at BPFI
  amplitude-modulated at 1x (the defect turns through the load zone); at 2xBSF
  amplitude-modulated at FTF (the ball strikes both races and goes round with the cage); at
  FTF with random amplitudes (a damaged cage knocks once per revolution).
- `imbalance`: a growing 1x; `misalignment`: a growing 2x (and 3x); `looseness`: a train of
  running-speed harmonics up to 10x and half harmonics (0.5x, 1.5x, 2.5x).
Time comes from the `now` passed in, so a simulated clock works.
"""

from __future__ import annotations

import math

import numpy as np

from kvagentd.agent.diagnosis.bearing import bearing_frequencies
from kvagentd.agent.features import Window
from kvagentd.agent.sensors import SensorSource, expected_length
from kvagentd.config import AssetConfig

RESONANCE_HZ = 3500.0
RESONANCE_DAMPING = 0.05
BASE_1X_MM_S = 0.9  # RMS velocity of the healthy 1x component
BASE_2X_MM_S = 0.25
NOISE_M_S2 = 0.4  # RMS of the broadband acceleration noise
IMPACT_M_S2 = 3.0  # impact ringing amplitude at fault level 1
IMBALANCE_MM_S = 1.2  # added 1x RMS velocity per fault level
MISALIGN_MM_S = 1.0  # added 2x RMS velocity per fault level
LOOSENESS_MM_S = 0.5  # RMS velocity of each looseness harmonic per fault level
BEARING_KINDS = ("outer_race", "inner_race", "ball", "cage")


class SimulatedSource(SensorSource):
    """Deterministic machine model (see module docstring); `start_time` anchors fault onset."""

    def __init__(self, asset: AssetConfig, start_time: float) -> None:
        self.asset = asset
        self.start_time = start_time

    def fault_level(self, now: float) -> float:
        f = self.asset.fault
        age = now - self.start_time - f.onset_s
        if f.kind == "none" or age < 0:
            return 0.0
        return f.severity * (1.0 + f.growth_per_hour * age / 3600.0)

    def _harmonics(self, level: float) -> list[tuple[float, float]]:
        """(multiple of fr, RMS velocity mm/s) of the running-speed lines."""
        kind = self.asset.fault.kind
        out = [(1.0, BASE_1X_MM_S + (IMBALANCE_MM_S * level if kind == "imbalance" else 0.0)),
               (2.0, BASE_2X_MM_S + (MISALIGN_MM_S * level if kind == "misalignment" else 0.0))]
        if kind == "misalignment":
            out.append((3.0, 0.4 * MISALIGN_MM_S * level))
        if kind == "looseness" and level > 0:
            out += [(float(h), LOOSENESS_MM_S * level / math.sqrt(h - 1)) for h in range(3, 11)]
            out += [(h, 0.6 * LOOSENESS_MM_S * level) for h in (0.5, 1.5, 2.5)]
        return out

    def read_window(self, now: float) -> Window:
        a = self.asset
        fs = a.sample_rate_hz
        n = expected_length(a)
        t0 = now - a.window_s
        t = t0 + np.arange(n) / fs
        # Seeded by (seed, window start in ms): the same time gives the same window.
        rng = np.random.default_rng([a.seed, int(round(t0 * 1000)) & 0xFFFFFFFFFFFF])
        fr = a.rpm / 60.0
        level = self.fault_level(now)
        phase = rng.uniform(0, 0.2)  # small phase wander; harmonics stay coherent with time
        lines = self._harmonics(level)
        if a.signal == "acceleration":
            # d/dt of the velocity harmonics, mm/s -> m/s^2.
            x = np.zeros(n)
            for h, v_rms in lines:
                w = 2 * np.pi * h * fr
                x += math.sqrt(2) * v_rms / 1000.0 * w * np.cos(w * t + h * phase)
            x += rng.normal(0.0, NOISE_M_S2, n)
            if a.fault.kind in BEARING_KINDS and level > 0:
                x += self._impacts(t, t0, fs, level, rng)
        else:
            x = np.zeros(n)
            for h, v_rms in lines:
                x += math.sqrt(2) * v_rms * np.sin(2 * np.pi * h * fr * t + h * phase)
            x += rng.normal(0.0, NOISE_M_S2 * 0.05, n)
        return Window(samples=x.astype(np.float64), sample_rate=fs, kind=a.signal, t0=t0)

    def _impacts(self, t: np.ndarray, t0: float, fs: float, level: float,
                 rng: np.random.Generator) -> np.ndarray:
        a = self.asset
        kind = a.fault.kind
        fr = a.rpm / 60.0
        bf = bearing_frequencies(a.bearing, a.rpm)
        f_def = {"outer_race": bf.bpfo, "inner_race": bf.bpfi, "ball": 2 * bf.bsf,
                 "cage": bf.ftf}[kind]
        period = 1.0 / f_def
        ring_s = 5.0 / (RESONANCE_DAMPING * 2 * np.pi * RESONANCE_HZ)  # until e^-5
        k0 = math.floor((t0 - ring_s) / period)
        k1 = math.ceil((t0 + t.size / fs) / period)
        # Impact times come from absolute indices, so consecutive windows continue one train.
        times = np.arange(k0, k1 + 1) * period
        times = times + rng.normal(0.0, 0.01 * period, times.size)
        amps = np.full(times.size, IMPACT_M_S2 * level)
        if kind == "inner_race":
            amps *= 0.6 + 0.4 * np.cos(2 * np.pi * fr * times)
        elif kind == "ball":
            amps *= 0.5 + 0.5 * np.cos(2 * np.pi * bf.ftf * times)
        elif kind == "cage":
            amps *= rng.uniform(0.7, 1.3, times.size)
        out = np.zeros(t.size)
        ring_n = int(ring_s * fs) + 1
        tau = np.arange(ring_n) / fs
        decay = 2 * np.pi * RESONANCE_HZ * RESONANCE_DAMPING
        for ti, ai in zip(times, amps):
            i0 = math.ceil((ti - t0) * fs)
            start = max(i0, 0)
            stop = min(i0 + ring_n, t.size)
            if stop <= start:
                continue
            dt = tau[start - i0:stop - i0] + (i0 / fs - (ti - t0))
            out[start:stop] += ai * np.exp(-decay * dt) * np.sin(2 * np.pi * RESONANCE_HZ * dt)
        return out
