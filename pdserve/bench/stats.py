"""Small statistics without scipy: mean with a t-distribution confidence interval, percentiles."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# Two-sided 95 % Student-t quantiles t(0.975, df), df = 1..30.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """t(0.975, df); beyond the table a Cornish-Fisher expansion (error < 1e-3 for df > 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class MeanCI:
    """Mean over repeats with a 95 % confidence interval; ``half_width`` is None for one sample."""

    mean: float
    half_width: float | None
    num_samples: int

    @property
    def low(self) -> float:
        return self.mean - (self.half_width or 0.0)

    @property
    def high(self) -> float:
        return self.mean + (self.half_width or 0.0)

    def __str__(self) -> str:
        if self.half_width is None:
            return f"{self.mean:.2f}"
        return f"{self.mean:.2f} ± {self.half_width:.2f}"


def mean_ci95(samples: Sequence[float]) -> MeanCI:
    """Mean ± t(0.975, n-1) · s / sqrt(n), s the sample standard deviation."""
    if not samples:
        raise ValueError("mean_ci95 needs at least one sample")
    n = len(samples)
    mean = statistics.fmean(samples)
    if n == 1:
        return MeanCI(mean, None, 1)
    half = t_quantile_975(n - 1) * statistics.stdev(samples) / math.sqrt(n)
    return MeanCI(mean, half, n)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
