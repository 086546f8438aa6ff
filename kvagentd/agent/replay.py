"""The replay sensor source: consecutive windows of a recorded file, looping at its end.

The file is read with `recordings.load_recording` (.npy with a JSON sidecar, .csv, .wav): its
own sample rate and unit win; the asset's `sample_rate_hz` and `replay_unit` (or the unit of
`signal`) fill in what the file does not state. A file at another rate than the asset's gives
windows that validation refuses (`rate`), never silently re-timed ones. Each window carries its
sample offset in the file and how many times the replay has wrapped around (`Window.offset`,
`Window.passes`), so events say when a replay repeats itself.
"""

from __future__ import annotations

from kvagentd.agent.features import Window
from kvagentd.agent.recordings import Recording, RecordingError, load_recording
from kvagentd.agent.sensors import BadData, SensorSource, expected_length
from kvagentd.config import AssetConfig


class ReplaySource(SensorSource):
    """Consecutive windows of `asset.replay_path`, looping at its end."""

    def __init__(self, asset: AssetConfig) -> None:
        self.asset = asset
        self.recording: Recording | None = None
        self._pos = 0
        self.passes = 0

    def start(self) -> None:
        a = self.asset
        if a.replay_path is None:
            raise BadData("io", "no replay_path")
        default_unit = a.replay_unit or ("m/s^2" if a.signal == "acceleration" else "mm/s")
        try:
            self.recording = load_recording(a.replay_path, fallback_rate_hz=a.sample_rate_hz,
                                            fallback_unit=default_unit)
        except RecordingError as exc:
            raise BadData("io", str(exc)) from exc

    def read_window(self, now: float) -> Window:
        if self.recording is None:
            self.start()
        rec = self.recording
        assert rec is not None
        n = int(round(self.asset.window_s * rec.sample_rate_hz))
        if rec.samples.size < n or n <= 0:
            raise BadData("length", f"{rec.path.name} holds {rec.samples.size} samples, a "
                                    f"window needs {expected_length(self.asset)}")
        if self._pos + n > rec.samples.size:
            self._pos = 0
            self.passes += 1
        offset = self._pos
        self._pos += n
        return Window(rec.samples[offset:offset + n], rec.sample_rate_hz, rec.kind,
                      now - self.asset.window_s, offset=offset, passes=self.passes)
