"""Report figures (matplotlib, Agg; pure functions of their inputs, each writes one PNG).

- `trend_figure`: per asset over a period, on a clock-time axis (UTC): RMS velocity (minute
  mean and max) over coloured ISO zone bands, kurtosis, and the envelope ratio at each defect
  line (minute max, log scale) with its detection threshold; fault episodes shaded and labelled
  in every panel, an optional marked moment (a replayed event).
- `spectrum_figure`: the squared-envelope spectrum of one window as ratio to the noise floor,
  with the defect lines of the asset (and their harmonics) marked, the lines found labelled,
  the threshold drawn, and an optional normal window of the same asset in grey for comparison.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

ZONE_COLOURS = (("A", "#cfe8cf"), ("B", "#fff2b3"), ("C", "#ffd3a6"), ("D", "#f7b4b4"))
LINE_COLOURS = {"BPFO": "tab:blue", "BPFI": "tab:red", "2xBSF": "tab:green", "FTF": "tab:purple"}
FAULT_COLOURS = {"outer_race": "tab:blue", "inner_race": "tab:red", "ball": "tab:green",
                 "cage": "tab:purple", "imbalance": "tab:orange", "misalignment": "tab:brown",
                 "looseness": "tab:pink", "unknown": "tab:gray"}


def _figure(width: float, height: float) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def _dates(ts: Sequence[float]) -> list[dt.datetime]:
    return [dt.datetime.fromtimestamp(float(t), tz=dt.UTC) for t in ts]


def trend_figure(path: Path | BinaryIO, minutes: Sequence[Mapping[str, Any]],
                 episodes: Sequence[Mapping[str, Any]], limits: tuple[float, float, float], *,
                 title: str, thresholds: Mapping[str, float] | None = None,
                 mark: tuple[float, str] | None = None) -> None:
    """See module docstring. `minutes`: `EventLog.minutes` rows; `episodes`: dicts with
    `fault`, `start`, `end`; `mark`: (time, label)."""
    import matplotlib.dates as mdates

    rows = [m for m in minutes if m.get("ticks")]
    t = _dates([m["t"] + 30.0 for m in rows])
    fig = _figure(11, 8.5)
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]})
    rms_mean = [m["rms_mean"] for m in rows]
    rms_max = [m["rms_max"] for m in rows]
    top = max([*rms_max, limits[0]], default=limits[0]) * 1.25
    lo = 0.0
    for (zone, colour), hi in zip(ZONE_COLOURS, (*limits, max(top, limits[2] * 1.1))):
        if lo < top:
            ax1.axhspan(lo, min(hi, top), color=colour, zorder=0)
            ax1.text(1.002, (lo + min(hi, top)) / 2, f"zone {zone}", transform=ax1.get_yaxis_transform(),
                     fontsize=8, va="center")
        lo = hi
    ax1.plot(t, rms_max, lw=0.6, color="tab:blue", alpha=0.35, label="max per minute")
    ax1.plot(t, rms_mean, lw=1.0, color="tab:blue", label="mean per minute")
    ax1.set_ylim(0, top)
    ax1.set_ylabel("RMS velocity\n10-1000 Hz (mm/s)")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(title)
    ax2.plot(t, [m["kurt_max"] for m in rows], lw=0.6, color="tab:gray", alpha=0.5,
             label="max per minute")
    ax2.plot(t, [m["kurt_mean"] for m in rows], lw=1.0, color="black", label="mean per minute")
    ax2.axhline(3.0, ls=":", color="gray", lw=0.8)
    ax2.text(0.002, 3.0, " 3 = Gaussian (no impacts)", transform=ax2.get_yaxis_transform(),
             fontsize=7, va="bottom", color="gray")
    ax2.set_ylabel("kurtosis")
    ax2.legend(loc="upper left", fontsize=8)
    names = sorted({k for m in rows for k in (m.get("ratios") or {})},
                   key=lambda k: list(LINE_COLOURS).index(k) if k in LINE_COLOURS else 9)
    drawn = 0
    for name in names:
        vals = [(m.get("ratios") or {}).get(name) for m in rows]
        ax3.plot(t, [np.nan if v is None else v for v in vals], lw=0.9,
                 color=LINE_COLOURS.get(name), label=name)
        thr = (thresholds or {}).get(name)
        if thr:
            ax3.axhline(thr, ls="--", lw=0.6, color=LINE_COLOURS.get(name, "gray"), alpha=0.6)
            drawn += 1
    ax3.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    ax3.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax3.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax3.yaxis.set_minor_formatter(FormatStrFormatter(""))
    ax3.set_ylabel("envelope line / noise floor\n(max per minute"
                   + ("; dashed: threshold)" if drawn else ")"))
    if names:
        ax3.legend(loc="upper left", fontsize=8, ncol=len(names))
    for ep in episodes:
        s, e = _dates([ep["start"], max(ep["end"], ep["start"] + 60.0)])
        colour = FAULT_COLOURS.get(str(ep["fault"]), "tab:gray")
        for ax in (ax1, ax2, ax3):
            ax.axvspan(s, e, color=colour, alpha=0.18, lw=0)
        ax1.text(s, top * 0.97, f" {str(ep['fault']).replace('_', ' ')}", fontsize=8,
                 va="top", color=colour, clip_on=True)
    if mark is not None:
        (mt,) = _dates([mark[0]])
        for ax in (ax1, ax2, ax3):
            ax.axvline(mt, color="black", lw=1.0)
        late = bool(rows) and mark[0] > (rows[0]["t"] + rows[-1]["t"]) / 2
        ax1.text(mt, top * 0.85, f" {mark[1]} " if not late else f"{mark[1]} ", fontsize=8,
                 va="top", ha="right" if late else "left",
                 bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    locator = mdates.AutoDateLocator()
    ax3.xaxis.set_major_locator(locator)
    ax3.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, tz=dt.UTC))
    ax3.set_xlabel("time (UTC)")
    if not rows:
        ax1.text(0.5, 0.5, "no measurements in this period", transform=ax1.transAxes,
                 ha="center")
    fig.tight_layout()
    fig.savefig(path, format="png")


def spectrum_figure(path: Path | BinaryIO, freqs: np.ndarray, ratio: np.ndarray,
                    lines: Mapping[str, float], found: Sequence[Mapping[str, Any]], *,
                    title: str, threshold: float | None = None,
                    normal: tuple[np.ndarray, np.ndarray] | None = None,
                    max_hz: float = 500.0) -> None:
    """See module docstring. `lines`: name -> kinematic Hz of each defect line (harmonics are
    drawn up to `max_hz`); `found`: the diagnosis's cited lines (`line`, `found_hz`, `ratio`,
    `significant`)."""
    fig = _figure(11, 4.8)
    ax = fig.subplots(1, 1)
    sel = (freqs > 0) & (freqs <= max_hz)
    if normal is not None:
        nsel = (normal[0] > 0) & (normal[0] <= max_hz)
        ax.plot(normal[0][nsel], normal[1][nsel], lw=0.7, color="gray", alpha=0.7,
                label="a normal window of this asset")
    ax.plot(freqs[sel], ratio[sel], lw=0.8, color="black", label="this window")
    for name, f0 in lines.items():
        colour = LINE_COLOURS.get(name, "tab:gray")
        h = 1
        # NOTE: cage-rate harmonics would fill the plot: FTF is drawn once.
        while f0 > 0 and h * f0 <= max_hz and (h == 1 or name != "FTF"):
            ax.axvline(h * f0, color=colour, lw=0.8 if h == 1 else 0.5, ls="-" if h == 1 else ":",
                       alpha=0.8, label=name if h == 1 else None)
            h += 1
    for ln in found:
        if ln.get("significant"):
            ax.annotate(f"{ln['line']} {float(ln['ratio']):.1f}x",
                        (float(ln["found_hz"]), float(ln["ratio"])), xytext=(3, 3),
                        textcoords="offset points", fontsize=8)
    if threshold:
        ax.axhline(threshold, ls="--", color="tab:red", lw=0.8, label="detection threshold")
    ax.set_xlim(0, max_hz)
    ax.set_ylim(0, max(float(np.max(ratio[sel])) * 1.15 if sel.any() else 1.0,
                       (threshold or 0) * 1.3, 5.0))
    ax.set_xlabel("frequency (Hz)")
    ax.set_ylabel("squared-envelope spectrum / noise floor")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
