import math

import pytest

from pdserve.bench.stats import mean_ci95, percentile, t_quantile_975


def test_ci_two_seeds_by_hand():
    # mean 0.85, s = sqrt(((0.05)^2*2)/1) = 0.0707107, t(0.975,1) = 12.706
    ci = mean_ci95([0.8, 0.9])
    assert ci.mean == pytest.approx(0.85)
    assert ci.half_width == pytest.approx(12.706 * 0.0707107 / math.sqrt(2), rel=1e-5)
    assert ci.half_width == pytest.approx(0.6353, abs=1e-4)
    assert ci.num_samples == 2


def test_ci_three_samples_by_hand():
    # 1,2,3: mean 2, s 1, t(0.975,2) = 4.303 -> 4.303/sqrt(3) = 2.4843
    ci = mean_ci95([1.0, 2.0, 3.0])
    assert ci.mean == 2.0
    assert ci.half_width == pytest.approx(2.4843, abs=1e-4)
    assert (ci.low, ci.high) == pytest.approx((2.0 - 2.4843, 2.0 + 2.4843), abs=1e-4)


def test_ci_single_sample_has_no_width_and_identical_samples_zero():
    one = mean_ci95([0.7])
    assert one.half_width is None and one.low == one.high == 0.7 and str(one) == "0.70"
    assert mean_ci95([0.5, 0.5, 0.5]).half_width == 0.0
    with pytest.raises(ValueError):
        mean_ci95([])


def test_t_quantiles():
    assert t_quantile_975(1) == 12.706
    assert t_quantile_975(30) == 2.042
    assert t_quantile_975(40) == pytest.approx(2.021, abs=1e-3)
    assert t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_percentile_matches_linear_interpolation():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 50) == 25.0
    assert percentile(values, 90) == pytest.approx(37.0)
    assert percentile(values, 0) == 10.0 and percentile(values, 100) == 40.0
    assert math.isnan(percentile([], 50))
