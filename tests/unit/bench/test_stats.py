import math

import numpy as np
import pytest

from pdserve.bench.stats import Interval, Proportion, bootstrap_blocks, percentile, wilson

Z975 = 1.959963984540054


def wilson_by_hand(k, n):
    p = k / n
    centre = (p + Z975**2 / (2 * n)) / (1 + Z975**2 / n)
    half = Z975 * math.sqrt(p * (1 - p) / n + Z975**2 / (4 * n * n)) / (1 + Z975**2 / n)
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(7, 10), (0, 5), (5, 5), (93, 105), (1, 120)])
def test_wilson_interval_matches_the_formula(k, n):
    ci = wilson(k, n)
    assert (ci.low, ci.high) == pytest.approx(wilson_by_hand(k, n), abs=1e-9)


def test_wilson_known_values():
    assert (wilson(7, 10).low, wilson(7, 10).high) == pytest.approx((0.39678, 0.89221), abs=1e-5)
    assert wilson(0, 5).low == pytest.approx(0.0, abs=1e-12) and wilson(0, 5).high == pytest.approx(0.43448, abs=1e-5)
    assert wilson(0, 0) is None
    p = Proportion(7, 10)
    assert p.fraction == 0.7 and str(p.ci) == "[0.40, 0.89]"


def test_percentile_is_numpys_linear_interpolation():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 50) == 25.0
    assert percentile(values, 90) == pytest.approx(37.0)
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert math.isnan(percentile([], 50))


def test_block_bootstrap_of_a_mean_matches_the_normal_approximation():
    data = np.array([0.0, 1.0] * 200)  # 400 blocks, mean 0.5, standard error 0.5 / sqrt(400) = 0.025
    (ci,) = bootstrap_blocks(len(data), lambda idx: np.array([data[idx].mean()]))
    assert ci.low == pytest.approx(0.5 - Z975 * 0.025, abs=0.008)
    assert ci.high == pytest.approx(0.5 + Z975 * 0.025, abs=0.008)


def test_block_bootstrap_is_reproducible_and_exact_for_a_constant():
    stat = lambda idx: np.array([3.0, float(idx.sum())])  # noqa: E731
    first, second = bootstrap_blocks(20, stat), bootstrap_blocks(20, stat)
    assert first == second
    assert first[0] == Interval(3.0, 3.0)
    with pytest.raises(ValueError):
        bootstrap_blocks(1, stat)
    assert str(Interval(1.0, math.inf)) == "[1.00, ∞]" and str(Interval(math.nan, 1.0)) == "[n/a, 1.00]"
