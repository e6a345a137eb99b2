"""P serving whole requests sizes its chunks beside its own streams from what its chunk steps took."""

from __future__ import annotations

import pdserve.connector.scheduler.step_pacing as step_pacing_module
from pdserve.config import TransferMode
from pdserve.connector.scheduler import scheduler_for
from pdserve.placement.chunk_headroom import MIN_SAMPLES
from pdserve.placement.chunk_size import MIN_CHUNK
from tests.unit.connector.harness import make_config
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ConnectorOutput,
    Scheduler,
    SchedulerOutput,
    consumer_params,
)
from tests.unit.connector.scheduler.test_scheduler_placement import VllmLikeRequest
from tests.unit.connector.scheduler.test_whole_requests import SELF_ID
from tests.unit.placement.test_chunk_costs import fitted


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
    beside its streams: chunks planned from it alone run past max_step_ms. P learns a token's cost in its own chunk steps, as D does for its local prompts."""
    clock = _Clock()
    monkeypatch.setattr(step_pacing_module, "time", clock)
    limits: list[int] = []
    config = make_config("kv_producer", TransferMode.WRITE, placement="adaptive", serve_decode=True, max_step_ms=50)
    s = Scheduler(scheduler_for(config, BLOCK_SIZE, budget=512, set_chunk=limits.append))
    s.scheduler._pacer.costs = fitted(per_token_s=0.001)
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
        judged += s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: tokens})).chunk_steps_over
        clock.now += chunk_step(tokens)
        s.scheduler.update_connector_output(ConnectorOutput())
    # on /metrics, as D's chunk steps are: the limit set before a step is for the one after it, so
    # two steps ran with the fit's chunk
    assert judged[:2] == [True, True] and set(judged[2:]) == {False}  # over, then within
    s.scheduler.build_connector_meta(SchedulerOutput({"stream": 1, whole.request_id: limits[-1]}))
    assert MIN_CHUNK <= limits[-1] < first
    assert chunk_step(limits[-1]) <= 0.050  # the step keeps the bound its streams were promised
