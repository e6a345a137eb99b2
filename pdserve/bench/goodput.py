"""DistServe goodput: the highest request rate whose SLO attainment stays at or above a target.

Given attainment measured at increasing rates, walk up until the first rate that misses the
target; goodput is the last passing rate, linearly interpolated towards the first failing one
(the rate where the straight line between the two crosses the target). Edge cases:

* every rate passes: goodput is the highest measured rate, flagged as a lower bound (``≥``);
* the lowest rate already fails: goodput is 0, flagged as an upper bound (``< lowest rate``):
  nothing is assumed about attainment below the measured range (an unloaded system may miss
  the SLO too), so there is no interpolation from 0;
* a rate above the first failure passes again: ignored (goodput stops at the first failure),
  but flagged ``non_monotonic`` so the report can say so.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence


class Bound(enum.Enum):
    EXACT = "exact"  # target crossed inside the measured range
    LOWER = "lower"  # every rate passed: true goodput is at least this
    UPPER = "upper"  # no rate passed: true goodput is below the lowest rate


@dataclass(frozen=True)
class Goodput:
    """``value`` interpolated; ``step`` the last passing measured rate (0 if none)."""

    value: float
    step: float
    bound: Bound
    non_monotonic: bool = False
    lowest_rate: float = 0.0

    def __str__(self) -> str:
        if self.bound is Bound.LOWER:
            return f"≥{self.value:.2f}"
        if self.bound is Bound.UPPER:
            return f"<{self.lowest_rate:g} (0)"
        return f"{self.value:.2f}"


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = 0.9) -> Goodput:
    """Goodput from attainment (fractions) at ``rates``; the pairs are sorted by rate here."""
    if len(rates) != len(attainments) or not rates:
        raise ValueError("goodput needs one attainment per rate and at least one rate")
    points = sorted(zip(rates, attainments))
    lowest = points[0][0]
    first_fail = next((i for i, (_, a) in enumerate(points) if a < target), None)
    if first_fail is None:
        return Goodput(points[-1][0], points[-1][0], Bound.LOWER, lowest_rate=lowest)
    non_monotonic = any(a >= target for _, a in points[first_fail + 1 :])
    if first_fail == 0:
        return Goodput(0.0, 0.0, Bound.UPPER, non_monotonic, lowest)
    (r_pass, a_pass), (r_fail, a_fail) = points[first_fail - 1], points[first_fail]
    value = r_pass + (a_pass - target) / (a_pass - a_fail) * (r_fail - r_pass)
    return Goodput(value, r_pass, Bound.EXACT, non_monotonic, lowest)


@dataclass(frozen=True)
class Ratio:
    """A goodput ratio; ``relation`` says which way a bound makes it one-sided ("" = exact)."""

    value: float  # NaN when undefined (both goodputs below the measured range)
    relation: str = ""  # "≥", "≤", "~" (both lower bounds: direction unknown) or ""

    def __str__(self) -> str:
        return "n/a" if math.isnan(self.value) else f"{self.relation}{self.value:.2f}"


def ratio(numerator: Goodput, denominator: Goodput) -> Ratio:
    """numerator / denominator, made one-sided by the bounds.

    A denominator that is 0 because no measured rate passed is only known to be below the lowest
    rate, so the ratio is at least numerator / lowest rate ("≥ g", never "∞"); a numerator below
    the range gives at most lowest rate / denominator."""
    if denominator.bound is Bound.UPPER:
        if numerator.bound is Bound.UPPER:
            return Ratio(math.nan)
        return Ratio(numerator.value / denominator.lowest_rate, "≥")
    if numerator.bound is Bound.UPPER:
        return Ratio(numerator.lowest_rate / denominator.value, "≤")
    value = numerator.value / denominator.value
    num_low, den_low = numerator.bound is Bound.LOWER, denominator.bound is Bound.LOWER
    if num_low and den_low:
        return Ratio(value, "~")
    return Ratio(value, "≥" if num_low else "≤" if den_low else "")
