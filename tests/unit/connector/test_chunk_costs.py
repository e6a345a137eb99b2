"""ChunkCosts: a prompt token's cost in steps that also decode streams, and their headroom."""

from __future__ import annotations

import pytest

import pdserve.connector.scheduler as scheduler_module
from pdserve.config import TransferMode
from pdserve.connector.chunk_costs import ChunkCosts
from pdserve.connector.chunk_headroom import MIN_HEADROOM, MIN_SAMPLES
from pdserve.connector.local_chunk import MIN_CHUNK, OVER, STEP_HEADROOM, WITHIN
from pdserve.connector.scheduler import PDScheduler
from pdserve.connector.step_costs import Coefficients, StepCosts
from tests.unit.connector.harness import make_config
from tests.unit.connector.scheduler_fakes import (BLOCK_SIZE, ConnectorOutput, Scheduler, SchedulerOutput,
                                                  consumer_params)
from tests.unit.connector.test_scheduler_placement import VllmLikeRequest
from tests.unit.connector.test_whole_requests import SELF_ID


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


class _Clock:
    """Stands in for the scheduler's `time` module: steps take what the test says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_p_serving_streams_plans_its_chunks_from_what_its_chunk_steps_took(monkeypatch):
    """P's fit comes mostly from whole-prompt steps, where a token costs less than in a small chunk
    beside its streams: chunks planned from it alone ran past max_step_ms (41-60 ms against 50 ms on
    a 2-core Xeon). P learns a token's cost in its own chunk steps, as D does for its local prompts."""
    clock = _Clock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    limits: list[int] = []
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=True, max_step_ms=50)
    s = Scheduler(PDScheduler(config, BLOCK_SIZE, budget=512, set_chunk=limits.append))
    s.scheduler._costs = fitted(per_token_s=0.001)
    whole = VllmLikeRequest(SELF_ID + "-d", consumer_params(), 4000)
    assert s.scheduler.get_num_new_matched_tokens(whole, 0) == (0, False)

    def chunk_step(tokens: int) -> float:  # a chunk beside one stream, at 2 ms a token
        return 0.005 + 0.002 + 0.002 * tokens

    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: 64}))
    first = limits[-1]
    assert chunk_step(first) > 0.050  # planned from the fit at 1 ms a token: past the bound at 2 ms
    judged = []
    for _ in range(2 * MIN_SAMPLES):
        tokens = limits[-1]
        judged += s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: tokens})).chunk_steps
        clock.now += chunk_step(tokens)
        s.scheduler.update_connector_output(ConnectorOutput())
    # on /metrics, as D's chunk steps are: the limit set before a step is for the one after it, so
    # two steps ran with the fit's chunk
    assert judged[:2] == [OVER, OVER] and set(judged[2:]) == {WITHIN}
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: limits[-1]}))
    assert MIN_CHUNK <= limits[-1] < first
    assert chunk_step(limits[-1]) <= 0.050  # the step keeps the bound its streams were promised
