import pytest

from pdserve.bench.goodput import Bound, Goodput, goodput, ratio

RATES = [1.0, 1.5, 2.0, 2.5, 3.0]


def test_interpolates_between_last_pass_and_first_fail():
    # passes at 2.0 with 0.95, fails at 2.5 with 0.75: 2.0 + (0.95-0.9)/(0.95-0.75)*0.5 = 2.125
    g = goodput(RATES, [1.0, 1.0, 0.95, 0.75, 0.3])
    assert g.bound is Bound.EXACT and g.step == 2.0
    assert g.value == pytest.approx(2.125)
    assert str(g) == "2.12"


def test_exactly_at_target_passes():
    g = goodput(RATES, [1.0, 0.9, 0.8, 0.5, 0.1])
    assert g.step == 1.5 and g.value == pytest.approx(1.5)


def test_unsorted_input_is_sorted():
    g = goodput([3.0, 1.0, 2.0], [0.2, 1.0, 0.6])
    # 1.0 + (1.0-0.9)/(1.0-0.6)*1.0 = 1.25
    assert g.value == pytest.approx(1.25)


def test_all_pass_is_a_lower_bound():
    g = goodput(RATES, [1.0] * 5)
    assert g == Goodput(3.0, 3.0, Bound.LOWER, False, 1.0)
    assert str(g) == "≥3.00"


def test_none_pass_is_zero_and_an_upper_bound():
    g = goodput(RATES, [0.8, 0.5, 0.2, 0.1, 0.0])
    assert g.value == 0.0 and g.bound is Bound.UPPER
    assert str(g) == "<1 (0)"


def test_stops_at_first_failure_and_flags_non_monotonic():
    g = goodput(RATES, [1.0, 0.7, 0.95, 0.5, 0.2])
    assert g.step == 1.0 and g.non_monotonic
    assert g.value == pytest.approx(1.0 + 0.1 / 0.3 * 0.5)


def test_rejects_mismatched_input():
    with pytest.raises(ValueError):
        goodput([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        goodput([], [])


def test_ratio_text_is_one_sided_where_a_bound_makes_it_so():
    exact = Goodput(2.0, 2.0, Bound.EXACT)
    assert str(ratio(Goodput(3.0, 3.0, Bound.EXACT), exact)) == "1.50"
    assert str(ratio(Goodput(3.0, 3.0, Bound.LOWER), exact)) == "≥1.50"
    assert str(ratio(exact, Goodput(4.0, 4.0, Bound.LOWER))) == "≤0.50"
    assert str(ratio(Goodput(3.0, 3.0, Bound.LOWER), Goodput(4.0, 4.0, Bound.LOWER))) == "~0.75"
    # a denominator below the lowest rate (1.3) makes the ratio a lower bound 2.0 / 1.3, never infinite
    below = Goodput(0.0, 0.0, Bound.UPPER, lowest_rate=1.3)
    assert str(ratio(exact, below)) == "≥1.54" and ratio(exact, below).value == pytest.approx(2.0 / 1.3)
    assert str(ratio(Goodput(0.0, 0.0, Bound.UPPER, lowest_rate=1.0), exact)) == "≤0.50"
    assert str(ratio(Goodput(0.0, 0.0, Bound.UPPER), Goodput(0.0, 0.0, Bound.UPPER))) == "n/a"
