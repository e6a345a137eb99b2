"""PDScheduler on P: when SendSpecs, HoldSpecs and CancelSpecs are emitted, what vLLM is told."""

from __future__ import annotations

import time

import pytest

from pdserve.config import Role, TransferMode
from pdserve.params import parse_transfer_params
from pdserve.transfer.specs import HoldSpec, SendSpec
from tests.unit.connector.harness import D_ADDRESS, P_ADDRESS
from tests.unit.connector.request_status import RequestStatus
from tests.unit.connector.scheduler.scheduler_fakes import (
    ROUTER_ID,
    ConnectorOutput,
    FakeBlocks,
    FakeRequest,
    SchedulerOutput,
    make_scheduler,
    producer_params,
)

WRITE, READ = TransferMode.WRITE, TransferMode.READ


def run_step(s, request, scheduled: int):
    meta = s.scheduler.build_connector_meta(SchedulerOutput({request.request_id: scheduled} if scheduled else {}))
    request.num_computed_tokens += scheduled  # vLLM advances it after build_connector_meta
    return meta


@pytest.mark.parametrize("prompt, chunks, num_blocks", [(40, [16, 16, 8], 3), (32, [32], 2), (33, [20, 13], 3)])
def test_write_emits_one_send_in_the_step_that_completes_the_prompt(prompt, chunks, num_blocks):
    s = make_scheduler("kv_producer", WRITE)
    request = FakeRequest(ROUTER_ID, producer_params(), prompt)
    s.kv.blocks[ROUTER_ID] = [7, 3, 9, 12, 15]
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    sends = [run_step(s, request, n).sends for n in chunks]
    assert all(not step for step in sends[:-1]), "a send before the prompt's last chunk was scheduled"
    assert sends[-1] == [SendSpec(ROUTER_ID, "tx-1", D_ADDRESS, tuple([7, 3, 9, 12, 15][:num_blocks]),
                                  request.prompt_hash)]
    assert run_step(s, request, 1).sends == [] and run_step(s, request, 1).sends == []
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.scheduler.request_finished(request, ([7, 3, 9, 12],)) == (True, None)
    assert s.scheduler.has_pending_push_work()
    s.scheduler.update_connector_output(ConnectorOutput(finished_sending=set()))
    assert s.scheduler.has_pending_push_work()
    s.scheduler.update_connector_output(ConnectorOutput(finished_sending={ROUTER_ID}))
    assert not s.scheduler.has_pending_push_work()


def test_write_uses_explicit_peer_fields_over_the_request_id():
    s = make_scheduler("kv_producer", WRITE)
    params = producer_params(remote_host="10.0.0.2", remote_handshake_port=7000, remote_notify_port=7001)
    request = FakeRequest(ROUTER_ID, params, 16)
    s.kv.blocks[ROUTER_ID] = [1]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    [send] = run_step(s, request, 16).sends
    assert (send.peer.host, send.peer.handshake_port, send.peer.notify_port) == ("10.0.0.2", 7000, 7001)


def test_write_request_ending_before_its_prompt_completed_cancels():
    s = make_scheduler("kv_producer", WRITE)
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.kv.blocks[ROUTER_ID] = [1, 2, 3]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    run_step(s, request, 16)
    request.status = RequestStatus.FINISHED_ABORTED
    assert s.scheduler.request_finished(request, ([1, 2, 3],)) == (False, None)
    assert s.scheduler.has_pending_push_work(), "the cancel must get out"
    meta = run_step(s, request, 0)
    assert meta.sends == [] and meta.idle
    [cancel] = meta.cancels
    assert (cancel.transfer_id, cancel.peer) == ("tx-1", D_ADDRESS) and cancel.reason
    assert not s.scheduler.has_pending_push_work()
    assert run_step(s, request, 16).sends == [], "a finished request must never be sent"


@pytest.mark.parametrize("params", [None, {"do_remote_decode": False}, {"other": 1}])
def test_requests_without_remote_decode_are_left_alone(params):
    s = make_scheduler("kv_producer", WRITE)
    request = FakeRequest(ROUTER_ID, params, 16)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1]), 0)
    meta = run_step(s, request, 16)
    assert (meta.sends, meta.cancels, meta.holds) == ([], [], [])
    assert s.scheduler.request_finished(request, ([1],)) == (False, None)
    assert not s.scheduler.has_pending_push_work()


@pytest.mark.parametrize("params, request_id", [
    (producer_params(transfer_id=5), ROUTER_ID),
    (producer_params(), "cmpl-plain-request-0"),  # no peer anywhere
    (producer_params(remote_host="h", remote_handshake_port="x", remote_notify_port=1), ROUTER_ID),
])
def test_write_with_malformed_params_prefills_without_transfer_and_never_raises(params, request_id):
    s = make_scheduler("kv_producer", WRITE)
    request = FakeRequest(request_id, params, 16)
    s.kv.blocks[request_id] = [1]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    assert run_step(s, request, 16).sends == []
    assert s.scheduler.request_finished(request, ([1],)) == (False, None)


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED])
def test_read_holds_fully_prefilled_requests_and_returns_params_d_can_parse(status):
    """Finding 12: a prefill leg whose first token is EOS (FINISHED_STOPPED) computed its whole
    prompt just like one capped at max_tokens=1: its KV is held for D as well."""
    s = make_scheduler("kv_producer", READ, defer_timeout=30.0)
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([4, 5, 6]), 0)
    assert run_step(s, request, 40).sends == [], "READ never pushes"
    request.status = status
    before = time.time()
    delay_free, params = s.scheduler.request_finished(request, ([4, 5, 6],))
    assert delay_free is True
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [4, 5, 6] and params["transfer_id"] == "tx-1"
    assert (params["remote_host"], params["remote_handshake_port"], params["remote_notify_port"]) == (
        P_ADDRESS.host, P_ADDRESS.handshake_port, P_ADDRESS.notify_port)
    assert before + 29 <= params["hold_expires_at"] <= time.time() + 31
    assert params["prompt_hash"] == request.prompt_hash
    [hold] = run_step(s, request, 0).holds
    assert hold == HoldSpec(ROUTER_ID, "tx-1", (4, 5, 6), params["hold_expires_at"], request.prompt_hash)
    # what the router forwards to D parses into the same transfer
    parsed = parse_transfer_params({**params, "remote_dp_size": 1}, "cmpl-d-leg-0", Role.CONSUMER)
    assert (parsed.transfer_id, parsed.peer, parsed.remote_block_ids) == ("tx-1", P_ADDRESS, (4, 5, 6))
    assert (parsed.hold_expires_at, parsed.prompt_hash) == (params["hold_expires_at"], request.prompt_hash)
    assert s.scheduler.has_pending_push_work()
    s.scheduler.update_connector_output(ConnectorOutput(finished_sending={ROUTER_ID}))
    assert not s.scheduler.has_pending_push_work()


@pytest.mark.parametrize("status, computed", [
    (RequestStatus.FINISHED_STOPPED, 0),  # stopped before its prompt was computed
    (RequestStatus.FINISHED_STOPPED, 39),
    (RequestStatus.FINISHED_LENGTH_CAPPED, 39),
    (RequestStatus.FINISHED_ABORTED, 40),
])
def test_read_does_not_hold_requests_without_a_complete_prefill(status, computed):
    s = make_scheduler("kv_producer", READ)
    request = FakeRequest(ROUTER_ID, producer_params(), 40, num_computed_tokens=computed, status=status)
    assert s.scheduler.request_finished(request, ([4, 5, 6],)) == (False, None)
    assert run_step(s, request, 0).holds == []
    assert not s.scheduler.has_pending_push_work()


def test_read_without_blocks_or_params_holds_nothing():
    s = make_scheduler("kv_producer", READ)
    capped = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.scheduler.request_finished(FakeRequest(ROUTER_ID, producer_params(), 40, status=capped), []) == (False, None)
    assert s.scheduler.request_finished(FakeRequest(ROUTER_ID, None, 40, status=capped), [1]) == (False, None)
    bad = FakeRequest(ROUTER_ID, producer_params(transfer_id=""), 40, status=capped)
    assert s.scheduler.request_finished(bad, ([1],)) == (False, None)
    assert run_step(s, bad, 0).holds == []


def planned_send(s, prompt: int = 40):
    """A WRITE request whose send was planned: its whole prompt was scheduled in one step."""
    request = FakeRequest(ROUTER_ID, producer_params(), prompt)
    s.kv.blocks[ROUTER_ID] = [7, 3, 9]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    [send] = run_step(s, request, prompt).sends
    return request, send


def test_preempted_request_whose_send_was_planned_cancels_it_stays_held_and_is_never_sent_again():
    """Finding 3 (scheduler): vLLM frees a preempted request's blocks at once and may reuse them,
    so the planned send must stop; the request is held at its end so the cancelled send's report
    matches, and the re-prefill after the preemption plans no second send of the same transfer."""
    s = make_scheduler("kv_producer", WRITE)
    request, send = planned_send(s)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}, preempted_req_ids={ROUTER_ID}))
    [cancel] = meta.cancels
    assert (cancel.transfer_id, cancel.peer) == (send.transfer_id, D_ADDRESS) and "preempted" in cancel.reason
    assert meta.sends == []
    # vLLM reschedules the preempted request from scratch
    request.num_computed_tokens = 0
    s.kv.blocks[ROUTER_ID] = [11, 12, 13]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    steps = [run_step(s, request, 40), run_step(s, request, 1)]
    assert [m.sends for m in steps] == [[], []], "a second send of a cancelled transfer"
    assert [m.cancels for m in steps] == [[], []], "cancelled twice"
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.scheduler.request_finished(request, ([11, 12, 13],)) == (True, None), \
        "the worker reports the cancelled send as finished_sending: vLLM must still hold the request"
    assert s.scheduler.has_pending_push_work()
    s.scheduler.update_connector_output(ConnectorOutput(finished_sending={ROUTER_ID}))
    assert not s.scheduler.has_pending_push_work()


def test_preemption_before_the_send_was_planned_needs_no_cancel():
    s = make_scheduler("kv_producer", WRITE)
    request = FakeRequest(ROUTER_ID, producer_params(), 40)
    s.kv.blocks[ROUTER_ID] = [7, 3, 9]
    s.scheduler.update_state_after_alloc(request, FakeBlocks([]), 0)
    run_step(s, request, 16)
    meta = s.scheduler.build_connector_meta(SchedulerOutput({}, preempted_req_ids={ROUTER_ID}))
    assert meta.cancels == [] and meta.sends == []
    request.num_computed_tokens = 0
    s.kv.blocks[ROUTER_ID] = [11, 12, 13]
    sends = [run_step(s, request, 16).sends, run_step(s, request, 24).sends]
    assert sends == [[], [SendSpec(ROUTER_ID, "tx-1", D_ADDRESS, (11, 12, 13), request.prompt_hash)]], \
        "the send must be planned from the blocks of the re-prefill"
    assert s.scheduler.build_connector_meta(SchedulerOutput({}, preempted_req_ids={"other"})).cancels == []
