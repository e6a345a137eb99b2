"""StepCosts: a step's wall time fitted as overhead + per prompt token + per decode, outliers trimmed."""

from __future__ import annotations

import pytest

from pdserve.placement.step_costs import REFIT_EVERY, StepCosts


def test_step_costs_fit_a_linear_model():
    costs = StepCosts()
    assert costs.coefficients() is None
    for tokens, decodes in [(0, 4), (64, 2), (128, 0), (0, 10), (32, 8), (256, 1), (0, 1), (16, 16), (100, 3)] * 3:
        costs.observe(0.008 + 0.0005 * tokens + 0.002 * decodes, tokens, decodes)
    fit = costs.coefficients()
    assert costs.knows_prefill
    assert fit.overhead_s == pytest.approx(0.008, rel=0.05)
    assert fit.per_prefill_token_s == pytest.approx(0.0005, rel=0.05)
    assert fit.per_decode_s == pytest.approx(0.002, rel=0.05)
    for _ in range(5):  # a few steps that compiled a kernel or lost the core do not move the fit
        costs.observe(4.0, 64, 2)
    assert costs.coefficients().per_prefill_token_s == pytest.approx(0.0005, rel=0.05)
    fit = costs.coefficients()
    costs.observe(-1, 5, 5)  # nonsense and empty steps teach nothing
    costs.observe(0.1, 0, 0)
    assert costs.coefficients() == fit


def test_step_costs_refit_after_a_prefill_step_or_every_few_decode_steps():
    costs = StepCosts()
    for _ in range(16):
        costs.observe(0.030, 0, 4)
    fit = costs.coefficients()
    for _ in range(REFIT_EVERY - 1):  # decode-only steps: the fit waits for a few of them
        costs.observe(0.010, 0, 4)
    assert costs.coefficients() is fit
    costs.observe(0.010, 0, 4)
    faster = costs.coefficients()
    assert faster.step_seconds(0, 4) < fit.step_seconds(0, 4)
    costs.observe(0.010 + 64 * 0.001, 64, 4)  # a step with prefill tokens is refitted at once
    assert costs.coefficients() is not faster
    for tokens in (16, 32, 128, 256):
        before = costs.coefficients()
        costs.observe(0.010 + tokens * 0.001, tokens, 4)
        assert costs.coefficients() is not before
    assert costs.coefficients().per_prefill_token_s == pytest.approx(0.001, rel=0.2)
