"""StepCosts: what one engine step costs on this instance, learnt from the steps it runs.

A step's wall time is modelled as ``overhead + per_prefill_token * prefill_tokens +
per_decode * decodes`` (on CPUs it is close to linear in each; the research notes measured
5-12 ms of fixed cost, ~0.5-1 ms per prefill token and ~1 ms per decode sequence). The three
coefficients are a least-squares fit over the last `window` steps that drops outliers (a step
that compiled a new kernel shape, or lost its core for a while, can take seconds), refitted
after every step with prefill tokens and every REFIT_EVERY decode-only steps, so the model follows
the machine it runs on. Free of vLLM.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_PREFILL_SAMPLES = 3  # steps with prefill tokens in the window before per-token cost is trusted
MIN_SAMPLES = 8
MAX_STEP_S = 10.0
TRIM_ROUNDS = 3  # each drops the slowest TRIM_FRACTION of the steps (relative to the fit) and refits
TRIM_FRACTION = 0.1
# A refit (three trimmed least-squares solves) costs ~0.3 ms; D asks for the costs before every step
# of ~10 ms. Decode-only steps are refitted once this many arrived (a handful barely moves a 128-step
# fit); a step with prefill tokens (rare on D, the only kind that teaches the per-token cost) at once.
REFIT_EVERY = 8


@dataclass(frozen=True)
class Coefficients:
    overhead_s: float
    per_prefill_token_s: float
    per_decode_s: float

    def step_seconds(self, prefill_tokens: int, decodes: int) -> float:
        return self.overhead_s + self.per_prefill_token_s * prefill_tokens + self.per_decode_s * decodes


class StepCosts:
    def __init__(self, window: int = 128):
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=window)
        self._fit: Coefficients | None = None
        self._unfitted = 0  # steps observed since the last fit
        self._unfitted_prefill = False  # one of them computed prefill tokens

    def observe(self, seconds: float, prefill_tokens: int, decodes: int) -> None:
        """One finished step: its wall time and what it computed. Empty steps teach nothing."""
        if not 0 < seconds < MAX_STEP_S or (prefill_tokens <= 0 and decodes <= 0):
            return
        self._samples.append((seconds, prefill_tokens, decodes))
        self._unfitted += 1
        self._unfitted_prefill |= prefill_tokens > 0

    @property
    def knows_prefill(self) -> bool:
        return len(self._samples) >= MIN_SAMPLES and sum(1 for _, p, _ in self._samples if p > 0) >= MIN_PREFILL_SAMPLES

    def coefficients(self) -> Coefficients | None:
        if len(self._samples) < MIN_SAMPLES:
            return None
        if self._fit is None or self._unfitted_prefill or self._unfitted >= REFIT_EVERY:
            self._fit, self._unfitted, self._unfitted_prefill = self._solve(), 0, False
        return self._fit

    def _solve(self) -> Coefficients:
        data = np.array(self._samples, dtype=float)
        y, x = data[:, 0], np.column_stack([np.ones(len(data)), data[:, 1], data[:, 2]])
        keep = np.ones(len(y), dtype=bool)
        for _ in range(TRIM_ROUNDS):  # slow outliers only: a step is never abnormally fast
            beta = _nonnegative_fit(x[keep], y[keep])
            residual = np.where(keep, y - x @ beta, -np.inf)
            cut = np.quantile(residual[keep], 1 - TRIM_FRACTION)
            trimmed = keep & (residual < cut) | keep & (residual <= 0)
            if trimmed.sum() < MIN_SAMPLES // 2:
                break
            keep = trimmed
        beta = _nonnegative_fit(x[keep], y[keep])
        return Coefficients(*(float(b) for b in beta))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a column that would go negative is dropped)."""
    columns = list(range(x.shape[1]))
    while True:
        beta = np.zeros(x.shape[1])
        if columns:
            beta[columns] = np.linalg.lstsq(x[:, columns], y, rcond=None)[0]
        negative = [c for c in columns if beta[c] < 0]
        if not negative:
            return beta
        columns.remove(min(negative, key=lambda c: beta[c]))
