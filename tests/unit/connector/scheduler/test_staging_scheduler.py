"""P, READ, host staging: the step that computes a leg's last prompt chunk carries a StageSpec for
its blocks (the worker stages them before that step's output names them to D); without staging,
or in WRITE mode, nothing is planned."""

from __future__ import annotations

import dataclasses

from pdserve.config import TransferMode
from pdserve.connector.metadata import StageSpec
from pdserve.connector.scheduler import scheduler_for
from tests.unit.connector.harness import make_config
from tests.unit.connector.request_status import RequestStatus
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ROUTER_ID,
    FakeBlocks,
    FakeRequest,
    Scheduler,
    SchedulerOutput,
    producer_params,
)

READ, WRITE = TransferMode.READ, TransferMode.WRITE


def scheduler(mode: TransferMode, staging: bool) -> Scheduler:
    config = make_config("kv_producer", mode)
    if staging:
        config = dataclasses.replace(config, kv_buffer_device="cpu", kv_device="cuda")
    return Scheduler(scheduler_for(config, BLOCK_SIZE))


def run_step(s: Scheduler, request, scheduled: int):
    meta = s.scheduler.build_connector_meta(SchedulerOutput({request.request_id: scheduled} if scheduled else {}))
    request.num_computed_tokens += scheduled
    return meta


def test_the_step_computing_the_last_chunk_stages_the_prompt_blocks():
    s = scheduler(READ, staging=True)
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.kv.blocks[ROUTER_ID] = [4, 5, 6, 9]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    stages = [run_step(s, request, n).stages for n in (16, 16, 8)]
    assert stages[:2] == [[], []], "staged before the prompt was computed"
    assert stages[2] == [StageSpec(ROUTER_ID, "tx-1", (4, 5, 6))]
    assert run_step(s, request, 1).stages == [], "staged twice"
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held, _ = s.scheduler.request_finished(request, ([4, 5, 6],))
    assert held
    request.num_computed_tokens = 0  # a later request with the same id is not tracked any more
    assert run_step(s, request, 40).stages == []


def test_a_preempted_leg_is_staged_again_when_recomputed():
    s = scheduler(READ, staging=True)
    request = FakeRequest(ROUTER_ID, producer_params(), 16)
    s.kv.blocks[ROUTER_ID] = [2]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    assert len(run_step(s, request, 16).stages) == 1
    request.num_computed_tokens = 0  # preempted: vLLM recomputes it into other blocks
    s.kv.blocks[ROUTER_ID] = [7]
    assert run_step(s, request, 16).stages == [StageSpec(ROUTER_ID, "tx-1", (7,))]


def test_nothing_is_staged_without_host_staging_or_in_write_mode():
    for mode, staging in ((READ, False), (WRITE, True)):
        s = scheduler(mode, staging)
        request = FakeRequest(ROUTER_ID, producer_params(), 16)
        s.kv.blocks[ROUTER_ID] = [3]
        s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
        assert run_step(s, request, 16).stages == [], (mode, staging)
