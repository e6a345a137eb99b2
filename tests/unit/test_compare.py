import math

import pytest

from pdserve.compare import Step, compare_greedy, parse_choice


def gen(*steps):
    return [Step(t, lp, (lp, lp - gap)) for t, lp, gap in steps]


def test_identical_runs_agree():
    ref = [gen((1, -0.5, 1.0), (2, -0.2, 2.0))]
    result = compare_greedy(ref, ref)
    assert result.ok and result.max_logprob_diff == 0 and "agree" in result.summary()


def test_small_logprob_noise_is_tolerated_large_is_not():
    ref = [gen((1, -0.5, 1.0), (2, -0.2, 2.0))]
    assert compare_greedy(ref, [gen((1, -0.6, 1.0), (2, -0.2, 2.0))]).ok
    bad = compare_greedy(ref, [gen((1, -0.8, 1.0), (2, -0.2, 2.0))])
    assert not bad.ok and "differs by 0.300" in bad.mismatches[0]


def test_parting_at_a_near_tie_is_allowed_and_stops_the_comparison():
    ref = [gen((1, -0.5, 1.0), (2, -0.7, 0.1), (3, -0.1, 5.0))]
    cand = [gen((1, -0.5, 1.0), (9, -0.7, 0.1), (4, -0.1, 5.0))]  # later steps differ too: not compared
    result = compare_greedy(ref, cand)
    assert result.ok and result.prompts[0].parted_at == 1 and result.prompts[0].num_compared == 1


def test_parting_at_a_clear_step_is_a_mismatch():
    ref = [gen((1, -0.5, 1.0), (2, -0.2, 0.5))]
    result = compare_greedy(ref, [gen((1, -0.5, 1.0), (7, -0.2, 0.5))])
    assert not result.ok and "step 1: token 7 != 2" in result.mismatches[0]


def test_tolerance_is_a_parameter_and_lengths_must_match():
    ref = [gen((1, -0.5, 1.0), (2, -0.2, 0.5))]
    assert compare_greedy(ref, [gen((1, -0.5, 1.0), (7, -0.2, 0.5))], tol=0.6).ok
    assert not compare_greedy(ref, [gen((1, -0.5, 1.0))]).ok
    with pytest.raises(ValueError):
        compare_greedy(ref, [])


def test_parse_choice_takes_top2_of_the_logprob_dict():
    choice = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -1.0],
                                                 "top_logprobs": [{"a": -0.1, "b": -2.0, "c": -3.0}, {"x": -1.0}]}}
    steps = parse_choice(choice)
    assert steps[0] == Step(5, -0.1, (-0.1, -2.0))
    assert steps[1].token_id == 6 and steps[1].top2[1] == -math.inf
