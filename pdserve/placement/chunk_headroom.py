"""ChunkHeadroom: how full of its bound D plans a step with a local chunk, learnt from those it ran.

chunk_size.py sizes D's local chunk so that the step, as D's step costs predict it, fills a
headroom x its bound (`max_step_ms` with streams running, the response bound). Steps scatter
around the prediction, and how far depends on the machine and its load: where they scatter, a
fixed headroom lets steps overrun the bound, each a broken max-gap promise for every stream in
them.

So D keeps, for its last WINDOW steps with a local chunk, the ratio of the measured time to the
predicted one, and plans the next such step so that one running at the QUANTILE of those ratios
fills TARGET of the bound (within [MIN_HEADROOM, MAX_HEADROOM]; STEP_HEADROOM until MIN_SAMPLES
steps are in): where steps keep to the prediction that is STEP_HEADROOM, where they scatter it is
less. A quantile, not the maximum: one step that lost its core for a while must not shrink every
chunk for a window. Free of vLLM.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from pdserve.placement.chunk_size import STEP_HEADROOM

WINDOW = 40
MIN_SAMPLES = 8
QUANTILE = 0.9
TARGET = STEP_HEADROOM  # of the bound a step at QUANTILE fills
MIN_HEADROOM = 0.4
# Never above STEP_HEADROOM: the bound is the client's largest gap, and a client sees a step plus
# the API server's output processing and streaming, which a fuller step leaves no room for.
MAX_HEADROOM = STEP_HEADROOM


class ChunkHeadroom:
    def __init__(self, window: int = WINDOW):
        self._ratios: deque[float] = deque(maxlen=window)
        self._headroom = STEP_HEADROOM

    def observe(self, seconds: float, predicted_s: float) -> None:
        """A step with a local chunk took `seconds`; D's step costs predicted `predicted_s`."""
        if seconds <= 0 or predicted_s <= 0:
            return
        self._ratios.append(seconds / predicted_s)
        if len(self._ratios) >= MIN_SAMPLES:
            slow = float(np.quantile(np.fromiter(self._ratios, dtype=float), QUANTILE))
            self._headroom = min(MAX_HEADROOM, max(MIN_HEADROOM, TARGET / slow))

    def headroom(self) -> float:
        return self._headroom


__all__ = ["ChunkHeadroom", "MAX_HEADROOM", "MIN_HEADROOM", "MIN_SAMPLES", "QUANTILE", "TARGET", "WINDOW"]
