"""Warnings about rejected messages, rate-limited so that a flood cannot flood the log too.

Per interval the first `burst` rejections are logged in full; the rest are only counted, by
reason, and summed up in one line when the interval is over. Callers keep exact counts of their
own (`Server.num_rejected`); this only decides what reaches the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable


class RateLimitedWarnings:
    """Used from any thread. `warn` for each rejection; `flush` from a loop that runs anyway (the
    server's poll loop), so a summary appears even when the flood has stopped."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.what = what  # "<server name> server rejected", the start of every line
        self.burst = burst
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._num_logged = 0  # full lines in this interval
        self._suppressed: Counter[str] = Counter()  # reason -> count not logged in this interval

    def warn(self, reason: str, detail: str) -> None:
        """One rejection: `reason` is a short category to count by, `detail` the full story."""
        with self._lock:
            self._roll(self._clock())
            if self._num_logged < self.burst:
                self._num_logged += 1
                self.logger.warning("%s %s", self.what, detail)
            else:
                self._suppressed[reason] += 1

    def flush(self) -> None:
        """Log the summary of an interval that is over (no-op otherwise)."""
        with self._lock:
            self._roll(self._clock())

    def _roll(self, now: float) -> None:
        if now - self._window_start < self.interval_s:
            return
        if self._suppressed:
            counts = ", ".join(f"{reason}: {n}" for reason, n in sorted(self._suppressed.items()))
            self.logger.warning(
                "%s %d more messages in the last %.0f s (not logged one by one): %s",
                self.what, sum(self._suppressed.values()), now - self._window_start, counts,
            )
        self._window_start = now
        self._num_logged = 0
        self._suppressed.clear()
