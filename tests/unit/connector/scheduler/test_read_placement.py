"""Adaptive placement in READ mode: P places each leg when it arrives, from its own queue and D's
published status; a leg left to D is cut to one token, jumps P's queue, and answers with a local
placement that D prefills itself."""

from __future__ import annotations

import time

from pdserve.config import Role, TransferMode
from pdserve.connector.scheduler import scheduler_for
from pdserve.params import parse_transfer_params
from pdserve.placement.decision import Decision, Placement, Reason
from pdserve.placement.inbox import PUBLISH_EVERY_S, WorkerNews
from pdserve.placement.messages import DecodeStatus
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS, make_config
from tests.unit.connector.scheduler.scheduler_fakes import (
    BLOCK_SIZE,
    ROUTER_ID,
    FakeBlocks,
    FakeRequest,
    Scheduler,
    SchedulerOutput,
    labels,
    producer_params,
)
from tests.unit.connector.scheduler.test_scheduler_placement import Output, VllmLikeRequest
from tests.unit.placement.samples import D_KEY, P_KEY, d_status

READ = TransferMode.READ


# ---- P's scheduler half ------------------------------------------------------------------------

def read_adaptive(kv_role: str, budget: int = 64) -> Scheduler:
    return Scheduler(scheduler_for(make_config(kv_role, READ, placement="adaptive"), BLOCK_SIZE, budget=budget))


def _teach_p(s: Scheduler, step_s: float = 0.002) -> None:
    for _ in range(10):
        s.scheduler.build_connector_meta(SchedulerOutput({"other": 64}))
        time.sleep(step_s)
        s.scheduler.update_connector_output(Output())


def test_p_holds_the_kv_of_a_leg_it_prefills_and_names_its_placement():
    s = read_adaptive("kv_producer")
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.scheduler.on_new_request(request)  # D has said nothing yet
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    request.num_computed_tokens = 40
    request.status = request.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(request, ([7, 8, 9],))
    assert held and params["remote_block_ids"] == [7, 8, 9] and params["placement"] == "remote:warming_up"
    assert parse_transfer_params(params, ROUTER_ID, Role.CONSUMER).decision == \
        Decision(Placement.REMOTE, Reason.WARMING_UP)


def test_p_cuts_a_leg_it_leaves_to_d_and_answers_without_blocks():
    s = read_adaptive("kv_producer")
    _teach_p(s)
    s.scheduler.update_connector_output(Output(), WorkerNews(statuses={D_KEY: d_status()}))
    backlog = FakeRequest("plain", None, 100_000)  # P's queue: a request served whole, sent to P directly
    s.scheduler.on_new_request(backlog)
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 100)
    s.scheduler.on_new_request(leg)
    # cut at arrival: one token, no block hash, nothing of the prompt reaches P's prefix cache
    assert (leg.prompt_token_ids, leg.num_prompt_tokens, leg.block_hashes) == ([0], 1, [])
    assert s.scheduler.get_num_new_matched_tokens(backlog, 0) == (None, False)  # the cut leg goes first
    assert s.scheduler.get_num_new_matched_tokens(leg, 0) == (0, False)
    s.scheduler.update_state_after_alloc(leg, FakeBlocks([3]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({ROUTER_ID: 1}))
    assert meta.holds == [] and meta.load.queued_tokens == 100_000
    assert s.scheduler.get_num_new_matched_tokens(backlog, 0) == (0, False)  # next pass: its turn
    leg.num_computed_tokens = 1
    leg.status = leg.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(leg, ([3],))
    assert not held and "remote_block_ids" not in params  # nothing held: no block to read
    decoded = parse_transfer_params(params, ROUTER_ID, Role.CONSUMER)
    assert decoded.local and decoded.decision == Decision(Placement.LOCAL, Reason.LOCAL_FASTER)
    assert decoded.peer == P_ADDRESS
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).holds == []


def test_a_leg_that_cannot_be_cut_is_prefilled_on_p():
    s = read_adaptive("kv_producer")
    _teach_p(s)
    s.scheduler.update_connector_output(Output(), WorkerNews(statuses={D_KEY: d_status()}))
    s.scheduler.on_new_request(FakeRequest("plain", None, 100_000))
    leg = VllmLikeRequest(ROUTER_ID, producer_params(), 100, prompt_embeds=object())
    s.scheduler.on_new_request(leg)
    assert leg.num_prompt_tokens == 100
    leg.num_computed_tokens = 100
    leg.status = leg.status.FINISHED_LENGTH_CAPPED
    held, params = s.scheduler.request_finished(leg, (list(range(7)),))
    assert held and params["placement"] == "remote:local_faster" and len(params["remote_block_ids"]) == 7


# ---- D's scheduler half ------------------------------------------------------------------------

def local_params(**extra) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "tx-1",
            "placement": "local:local_faster", "remote_dp_size": 1, **extra}


def test_d_prefills_what_p_left_to_it_and_reports_taking_it():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(), 100)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4, 5, 6, 7]), 0)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    # no read, and no release either: P holds nothing of it
    assert meta.recvs == [] and meta.cancels == [] and labels(meta.placements) == ["local:local_faster"]
    assert meta.status.placed_local == {P_KEY: 1} and meta.status.local_backlog_tokens == 100
    assert s.scheduler.request_finished(request, ([],)) == (False, None)
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == []


def test_a_request_p_left_to_d_that_ends_before_d_took_it_releases_nothing():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(), 100)
    assert s.scheduler.request_finished(request, ([],)) == (False, None)  # aborted while waiting
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).cancels == []


def test_d_reads_what_p_prefilled_and_counts_p_s_decision():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(placement="remote:remote_faster", remote_block_ids=[4, 5, 6, 7],
                                                  prompt_hash=FakeRequest("x", None, 64).prompt_hash), 64)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4]), 64)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert len(meta.recvs) == 1 and meta.recvs[0].remote_block_ids == (4, 5, 6, 7)
    assert labels(meta.placements) == ["remote:remote_faster"] and meta.status.placed_local == {}


def test_d_fails_a_request_whose_placement_it_cannot_read():
    s = read_adaptive("kv_consumer")
    request = FakeRequest(ROUTER_ID, local_params(placement="local:whatever"), 64)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (64, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3, 4]), 64)
    (recv,) = s.scheduler.build_connector_meta(SchedulerOutput({})).recvs
    assert "kv_transfer_params.placement must be a placement decision" in recv.error


def test_d_publishes_its_side_at_a_bounded_rate():
    s = read_adaptive("kv_consumer")
    first = s.scheduler.build_connector_meta(SchedulerOutput({}))
    assert isinstance(first.status, DecodeStatus) and first.status.decode_handshake_port == D_ADDRESS.handshake_port
    assert s.scheduler.build_connector_meta(SchedulerOutput({})).status is None  # within PUBLISH_EVERY_S
    # WRITE: D decides, and publishes its streams' load less often, for a P with serve_decode (serve_gate.py)
    write_d = Scheduler(scheduler_for(make_config("kv_consumer", TransferMode.WRITE, placement="adaptive"),
                                    BLOCK_SIZE, budget=64))
    assert isinstance(write_d.scheduler.build_connector_meta(SchedulerOutput({})).status, DecodeStatus)
    assert write_d.scheduler._decode._next_status - time.monotonic() > 10 * PUBLISH_EVERY_S
    assert write_d.scheduler.build_connector_meta(SchedulerOutput({})).status is None
    static_d = Scheduler(scheduler_for(make_config("kv_consumer", TransferMode.WRITE), BLOCK_SIZE, budget=64))
    assert static_d.scheduler.build_connector_meta(SchedulerOutput({})).status is None  # no placement, no status
