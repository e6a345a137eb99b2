"""ChunkCosts: a prompt token's cost in steps that also decode streams, and their headroom."""

from __future__ import annotations

import pytest

from pdserve.placement.chunk_costs import ChunkCosts
from pdserve.placement.chunk_headroom import MIN_HEADROOM, MIN_SAMPLES
from pdserve.placement.chunk_size import MIN_CHUNK, STEP_HEADROOM
from pdserve.placement.step_costs import Coefficients, StepCosts


def fitted(per_token_s: float = 0.001) -> StepCosts:
    """Step costs fitted on whole-prompt and decode steps: 5 ms + per_token_s a token + 2 ms a decode."""
    costs = StepCosts()
    for tokens, decodes in [(0, 2), (64, 1), (256, 0), (0, 4), (128, 2), (512, 0), (32, 3), (16, 1)] * 3:
        costs.observe(0.005 + per_token_s * tokens + 0.002 * decodes, tokens, decodes)
    return costs


def test_a_chunk_step_teaches_what_a_token_added_beyond_the_decodes_share():
    learnt, costs = ChunkCosts(), fitted()
    assert learnt.costs(costs.coefficients()) == costs.coefficients()  # nothing measured yet: the fit
    learnt.on_step(0.005 + 0.002 * 2 + 0.003 * 40, costs, decodes=2, prefill_tokens=40)  # 3 ms a token
    assert learnt.prefill_token_s == pytest.approx(0.003, rel=0.01)
    assert learnt.costs(costs.coefficients()).per_prefill_token_s == pytest.approx(0.003, rel=0.01)
    learnt.on_step(0.005 + 0.002 * 2 + 0.001 * 40, costs, decodes=2, prefill_tokens=40)  # one cheaper step
    assert 0.0025 < learnt.prefill_token_s < 0.003  # an average over steps, not the last one


def test_cheaper_chunk_tokens_never_undercut_the_fit_and_small_or_unfitted_steps_teach_nothing():
    learnt = ChunkCosts()
    learnt.on_step(0.005, fitted(), decodes=2, prefill_tokens=40)  # no cost beyond the decodes
    assert learnt.costs(Coefficients(0.005, 0.001, 0.002)).per_prefill_token_s == 0.001
    quiet = ChunkCosts()
    quiet.on_step(0.5, fitted(), decodes=2, prefill_tokens=MIN_CHUNK - 1)
    quiet.on_step(0.5, StepCosts(), decodes=2, prefill_tokens=64)  # no fit yet
    assert quiet.prefill_token_s is None and quiet.headroom.headroom() == STEP_HEADROOM
    assert quiet.costs(None) is None


def test_steps_that_scatter_past_their_prediction_lower_the_headroom():
    learnt, costs = ChunkCosts(), fitted()
    for i in range(4 * MIN_SAMPLES):  # the same chunk, every other step 40 % slower
        learnt.on_step((0.009 + 0.002 * 40) * (1.4 if i % 2 else 1.0), costs, decodes=2, prefill_tokens=40)
    assert MIN_HEADROOM < learnt.headroom.headroom() < 0.85 * STEP_HEADROOM  # p90 of measured/predicted ~1.24
