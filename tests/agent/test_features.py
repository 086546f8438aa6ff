from __future__ import annotations

import math

import numpy as np
import pytest

from kvagentd.agent.features import Window, extract, iso_zone, rms_velocity_mm_s
from kvagentd.config import AssetConfig

FS = 12000.0


@pytest.mark.parametrize("freq", [29.95, 50.0, 123.4, 600.0])
@pytest.mark.parametrize("amp_mm_s", [0.5, 4.0])
def test_sine_velocity_from_acceleration_gives_amplitude_over_sqrt2(freq, amp_mm_s):
    t = np.arange(int(FS)) / FS
    w = 2 * np.pi * freq
    # v(t) = A sin(wt) mm/s  ->  a(t) = A w cos(wt) / 1000 m/s^2
    acc = amp_mm_s * w * np.cos(w * t + 0.3) / 1000.0
    rms = rms_velocity_mm_s(acc, FS, "acceleration")
    assert rms == pytest.approx(amp_mm_s / math.sqrt(2), rel=0.02)


def test_sine_given_as_velocity():
    t = np.arange(int(FS)) / FS
    v = 3.0 * np.sin(2 * np.pi * 80.0 * t)
    assert rms_velocity_mm_s(v, FS, "velocity") == pytest.approx(3.0 / math.sqrt(2), rel=0.02)


def test_out_of_band_components_are_excluded():
    t = np.arange(int(FS)) / FS
    v = 3.0 * np.sin(2 * np.pi * 80.0 * t) + 5.0 * np.sin(2 * np.pi * 3.0 * t) \
        + 5.0 * np.sin(2 * np.pi * 2500.0 * t)
    assert rms_velocity_mm_s(v, FS, "velocity") == pytest.approx(3.0 / math.sqrt(2), rel=0.02)


def test_gaussian_noise_kurtosis_is_about_three():
    x = np.random.default_rng(7).normal(0.0, 1.0, int(FS))
    f = extract(Window(x, FS, "acceleration", 0.0), AssetConfig())
    assert f.kurtosis == pytest.approx(3.0, abs=0.15)
    assert f.crest == pytest.approx(f.peak / x.std(), rel=0.01)


@pytest.mark.parametrize("rms,zone", [
    (0.0, "A"), (1.399, "A"), (1.4, "B"), (2.79, "B"), (2.8, "C"), (4.49, "C"), (4.5, "D"),
    (100.0, "D")])
def test_zone_boundaries(rms, zone):
    assert iso_zone(rms, (1.4, 2.8, 4.5)) == zone


def test_zone_from_per_asset_limits():
    t = np.arange(int(FS)) / FS
    v = 3.5 * math.sqrt(2) * np.sin(2 * np.pi * 30 * t)  # 3.5 mm/s RMS
    rigid = extract(Window(v, FS, "velocity", 0.0), AssetConfig())
    flexible = extract(Window(v, FS, "velocity", 0.0),
                       AssetConfig(zone_limits_mm_s=(2.3, 4.5, 7.1)))
    assert rigid.zone == "C" and flexible.zone == "B"
