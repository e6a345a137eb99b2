"""PrefillShare: how much of the last few seconds an instance spent in steps that computed prompt
tokens, and how many streams its latest step decoded.

P measures itself with it and publishes both in its load: a P with serve_decode weighs them
before taking decode legs (serve_gate.py). A stream P served whole would wait out those steps, and
they are the time D's legs need. Steps are recorded as they end (one engine core: they do not
overlap). Free of vLLM.
"""

from __future__ import annotations

import time
from collections import deque

SPAN_S = 5.0  # the span the share is measured over: a few of the serve gate's decisions


class PrefillShare:
    def __init__(self, span_s: float = SPAN_S, clock=time.monotonic):
        if not span_s > 0:
            raise ValueError(f"span_s must be positive, got {span_s}")
        self._span_s = span_s
        self._clock = clock
        self._prefill: deque[tuple[float, float]] = deque()  # (started, ended) of steps with prompt tokens
        self._streams = (0.0, 0)  # (ended, decodes) of the latest step

    def on_step(self, started: float, seconds: float, prefill_tokens: int, decodes: int) -> None:
        """A step that began at `started` (this clock), took `seconds`, computed `prefill_tokens`
        prompt tokens and decoded `decodes` streams."""
        if seconds < 0:
            return
        if prefill_tokens > 0:
            self._prefill.append((started, started + seconds))
        self._streams = (started + seconds, decodes)
        self._forget(self._clock())

    def share(self) -> float:
        """The fraction of the last span spent in steps with prompt tokens, in [0, 1]."""
        now = self._clock()
        self._forget(now)
        start = now - self._span_s
        busy = sum(min(ended, now) - max(began, start) for began, ended in self._prefill)
        return min(1.0, max(0.0, busy / self._span_s))

    def streams(self) -> int:
        """Streams the latest step decoded (0: no step in the span)."""
        ended, decodes = self._streams
        return decodes if ended > self._clock() - self._span_s else 0

    def _forget(self, now: float) -> None:
        while self._prefill and self._prefill[0][1] <= now - self._span_s:
            self._prefill.popleft()
