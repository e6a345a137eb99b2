"""A plain-text progress bar on stderr: points done, the current step, elapsed and time left.

On a terminal the bar redraws in place; otherwise (a log file, CI) it prints one line per event.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total_s: float, num_points: int, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.num_points = num_points
        self._total_s = max(total_s, 1.0)
        self._done_s = 0.0  # expected seconds of finished work
        self._num_done = 0
        self._started = time.monotonic()
        self._live = stream.isatty()
        self._step = ""

    def event(self, text: str) -> None:
        """A step starts (deployment up, warm-up, a point): shown until the next event."""
        self._step = text
        self._draw(0.0, force_line=True)

    def tick(self, step_fraction_s: float) -> None:
        """Called while a step runs with the expected seconds of it already done."""
        if self._live:
            self._draw(step_fraction_s)

    def finish_point(self, expected_s: float) -> None:
        self._num_done += 1
        self.finish_work(expected_s)

    def finish_work(self, expected_s: float) -> None:
        self._done_s += expected_s

    def close(self, text: str = "done") -> None:
        self._step = text
        self._draw(0.0, force_line=True)
        if self._live:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, extra_s: float, force_line: bool = False) -> None:
        fraction = min(1.0, (self._done_s + extra_s) / self._total_s)
        elapsed = time.monotonic() - self._started
        left = elapsed / fraction - elapsed if fraction > 0.02 else self._total_s - elapsed
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        line = (f"[{bar}] {self._num_done}/{self.num_points} points | {_clock(elapsed)} elapsed, "
                f"~{_clock(max(left, 0.0))} left | {self._step}")
        if self._live:
            self.stream.write("\r\x1b[K" + line)
        elif force_line:
            self.stream.write(line + "\n")
        self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"
