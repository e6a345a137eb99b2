"""Statistics the report uses, from scipy and numpy: binomial CIs, percentiles, the block bootstrap.

* Attainment at a rate is a proportion of pooled requests: Wilson score interval
  (``scipy.stats.binomtest(...).proportion_ci(method="wilson")``).
* Goodputs and goodput ratios are functions of whole attainment curves: percentile bootstrap
  (``scipy.stats.bootstrap``) over blocks of consecutive requests, so that the correlation of
  neighbours in one queue stays inside a block. Resampling the same blocks for every
  configuration and rate is what makes a comparison *paired*: every configuration received the
  same request stream (arrivals.py), so block b is the same requests everywhere.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from pdserve.bench.extra import require

stats = require("scipy.stats")

CONFIDENCE = 0.95
NUM_RESAMPLES = 1000
BOOTSTRAP_SEED = 20261201  # the report is reproducible


@dataclass(frozen=True)
class Interval:
    """A two-sided confidence interval."""

    low: float
    high: float

    def __str__(self) -> str:
        return f"[{_num(self.low)}, {_num(self.high)}]"


@dataclass(frozen=True)
class Proportion:
    """``num_met`` of ``num`` with its Wilson interval (None for no requests)."""

    num_met: int
    num: int

    @property
    def fraction(self) -> float:
        return self.num_met / self.num if self.num else 0.0

    @property
    def ci(self) -> Interval | None:
        return wilson(self.num_met, self.num)


def wilson(num_met: int, num: int, confidence: float = CONFIDENCE) -> Interval | None:
    """Wilson score interval of a binomial proportion; None when ``num`` is 0."""
    if num == 0:
        return None
    ci = stats.binomtest(num_met, num).proportion_ci(confidence_level=confidence, method="wilson")
    return Interval(float(ci.low), float(ci.high))


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def bootstrap_blocks(num_blocks: int, statistic: Callable[[np.ndarray], np.ndarray],
                     num_resamples: int = NUM_RESAMPLES, confidence: float = CONFIDENCE) -> list[Interval]:
    """Percentile-bootstrap intervals of each entry of ``statistic(block_indices)``.

    ``statistic`` receives an array of ``num_blocks`` block indices drawn with replacement and
    returns a vector; one interval per entry (NaN bounds where the statistic was undefined)."""
    if num_blocks < 2:
        raise ValueError("a bootstrap needs at least two blocks")
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)  # a constant statistic is fine
        result = stats.bootstrap((np.arange(num_blocks),), statistic, vectorized=False, paired=False,
                                 n_resamples=num_resamples, confidence_level=confidence, method="percentile",
                                 rng=np.random.default_rng(BOOTSTRAP_SEED))
    lows = np.atleast_1d(result.confidence_interval.low)
    highs = np.atleast_1d(result.confidence_interval.high)
    return [Interval(float(lo), float(hi)) for lo, hi in zip(lows, highs)]


def _num(value: float) -> str:
    return "n/a" if math.isnan(value) else ("∞" if math.isinf(value) else f"{value:.2f}")
