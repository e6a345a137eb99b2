"""PDScheduler on D: what it promises vLLM and which RecvSpec / CancelSpec it emits."""

from __future__ import annotations

import pytest

from pdserve.config import TransferMode
from pdserve.connector.scheduler.prompt_digest import prompt_digest
from pdserve.transfer.specs import CancelSpec, RecvSpec
from tests.unit.connector.harness import P_ADDRESS
from tests.unit.connector.request_status import RequestStatus
from tests.unit.connector.scheduler.scheduler_fakes import (
    ROUTER_ID,
    ConnectorOutput,
    FakeBlocks,
    FakeRequest,
    SchedulerOutput,
    consumer_params,
    make_scheduler,
)

WRITE, READ = TransferMode.WRITE, TransferMode.READ


def meta_of(s):
    return s.scheduler.build_connector_meta(SchedulerOutput({}))


@pytest.mark.parametrize("computed", [0, 16, 32])
def test_remote_prefill_promises_the_rest_of_the_prompt_asynchronously(computed):
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    first = s.scheduler.get_num_new_matched_tokens(request, computed)
    assert first == (40 - computed, True)
    assert s.scheduler.get_num_new_matched_tokens(request, computed) == first
    meta = meta_of(s)
    assert (meta.recvs, meta.cancels) == ([], []), "asking must not start anything"


@pytest.mark.parametrize("params", [None, {"do_remote_prefill": False, "transfer_id": "x"}, {"remote_dp_size": 1}])
def test_local_requests_get_nothing_and_emit_nothing(params):
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, params, 40)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 0)
    assert s.scheduler.request_finished(request, ([1, 2, 3],)) == (False, None)
    meta = meta_of(s)
    assert (meta.recvs, meta.cancels) == ([], [])


@pytest.mark.parametrize("computed, first_block", [(0, 0), (16, 1), (32, 2)])
def test_allocation_emits_exactly_one_recv_skipping_the_local_prefix(computed, first_block):
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    count, _ = s.scheduler.get_num_new_matched_tokens(request, computed)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([8, 1, 5, 2]), count)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([8, 1, 5, 2]), count)
    assert meta_of(s).recvs == [RecvSpec(ROUTER_ID, "tx-1", WRITE, P_ADDRESS, (8, 1, 5), first_block, None, None,
                                         request.prompt_hash)]
    assert meta_of(s).recvs == []
    assert s.scheduler.get_num_new_matched_tokens(request, computed) == (0, False), \
        "a request already receiving must not be promised a second load"
    s.scheduler.update_connector_output(ConnectorOutput(finished_recving={ROUTER_ID}))
    assert s.scheduler.request_finished(request, ([8, 1, 5, 2],)) == (False, None)
    assert meta_of(s).cancels == [], "a transfer that is over needs no cancel"


def test_request_aborted_while_receiving_cancels_the_transfer_once():
    """vLLM keeps the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the worker
    reports it received; the worker must stop the transfer (Release to P) for that to happen."""
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    count, _ = s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([8, 1, 5]), count)
    assert len(meta_of(s).recvs) == 1
    request.status = RequestStatus.FINISHED_ABORTED
    assert s.scheduler.request_finished(request, ([8, 1, 5],)) == (False, None)
    [cancel] = meta_of(s).cancels
    assert (cancel.transfer_id, cancel.peer) == ("tx-1", P_ADDRESS) and "on the way" in cancel.reason
    assert meta_of(s).cancels == []


def read_params(**extra) -> dict:
    """What P's response hands D in READ mode, for a 40-token prompt of tokens 0..39."""
    return consumer_params(**{"remote_block_ids": [4, 5, 6], "remote_host": "127.0.0.1", "remote_handshake_port": 6301,
                              "remote_notify_port": 6401, "hold_expires_at": 1234.5,
                              "prompt_hash": prompt_digest(range(40)), **extra})


def test_read_recv_carries_p_blocks_hold_expiry_and_prompt_digest():
    s = make_scheduler("kv_consumer", READ)
    request = FakeRequest("cmpl-plain-0", read_params(), 40)
    count, is_async = s.scheduler.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (40, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), count)
    assert meta_of(s).recvs == [RecvSpec("cmpl-plain-0", "tx-1", READ, P_ADDRESS, (1, 2, 3), 0, (4, 5, 6), 1234.5,
                                         request.prompt_hash)]


@pytest.mark.parametrize("params, tokens, field", [
    (read_params(remote_block_ids=[4, 5]), range(40), "remote_block_ids"),  # P computed fewer blocks
    (read_params(remote_block_ids=[4, 5, 6, 7]), range(40), "remote_block_ids"),
    (read_params(), range(1, 41), "prompt_hash"),  # same length, other tokens
    (read_params(prompt_hash=None), range(40), "prompt_hash"),
])
def test_read_params_for_another_prompt_fail_the_request_instead_of_reading(params, tokens, field):
    """Finding 5 (D side): P's blocks must be exactly this prompt's blocks of this prompt's tokens.
    P still holds its blocks under these params: D tells it at once to let go (one cancel)."""
    s = make_scheduler("kv_consumer", READ)
    request = FakeRequest("cmpl-plain-0", params, 40, prompt_token_ids=list(tokens))
    count, is_async = s.scheduler.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (40, True), "the request must wait for the failure report, not prefill silently"
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), count)
    meta = meta_of(s)
    [recv] = meta.recvs
    assert field in recv.error and recv.peer is None and recv.remote_block_ids is None
    [cancel] = meta.cancels
    assert (cancel.transfer_id, cancel.peer) == ("tx-1", P_ADDRESS) and field in cancel.reason
    assert s.scheduler.request_finished(request, ([1, 2, 3],)) == (False, None)
    assert meta_of(s).cancels == [], "released twice"


def test_zero_external_tokens_cancels_the_transfer():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 0)
    meta = meta_of(s)
    assert meta.recvs == []
    [cancel] = meta.cancels
    assert (cancel.transfer_id, cancel.peer) == ("tx-1", P_ADDRESS) and cancel.reason
    assert s.scheduler.request_finished(request, ([1, 2, 3],)) == (False, None)
    assert meta_of(s).cancels == [], "cancelled twice"


def test_request_aborted_before_it_was_ever_scheduled_releases_p():
    """Finding 11: the router sent D the request but it was aborted while still queued, so no
    hook but request_finished ever saw it; P may hold (READ) or wait to write (WRITE) its KV."""
    for mode, params in ((WRITE, consumer_params()), (READ, read_params())):
        s = make_scheduler("kv_consumer", mode)
        request = FakeRequest(ROUTER_ID, params, 40, status=RequestStatus.FINISHED_ABORTED)
        assert s.scheduler.request_finished(request, ([],)) == (False, None)
        [cancel] = meta_of(s).cancels
        assert (cancel.transfer_id, cancel.peer) == ("tx-1", P_ADDRESS) and cancel.reason, mode
        assert meta_of(s).recvs == [] and meta_of(s).cancels == []


def test_request_aborted_before_scheduling_with_malformed_params_cancels_nothing_and_never_raises():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(transfer_id=""), 40, status=RequestStatus.FINISHED_ABORTED)
    assert s.scheduler.request_finished(request, ([],)) == (False, None)
    assert meta_of(s).cancels == []


def test_request_finished_before_allocation_cancels():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    assert s.scheduler.request_finished(request, ([],)) == (False, None)
    [cancel] = meta_of(s).cancels
    assert cancel == CancelSpec("tx-1", P_ADDRESS, cancel.reason) and cancel.reason
    assert meta_of(s).cancels == []


@pytest.mark.parametrize("mode, params, request_id, field", [
    (WRITE, consumer_params(transfer_id=7), ROUTER_ID, "transfer_id"),
    (WRITE, consumer_params(transfer_id=""), ROUTER_ID, "transfer_id"),
    (WRITE, consumer_params(), "cmpl-plain-request-0", "peer"),
    (WRITE, consumer_params(remote_host="h", remote_handshake_port=0, remote_notify_port=1), ROUTER_ID,
     "remote_handshake_port"),
    (WRITE, consumer_params(remote_block_ids="1,2"), ROUTER_ID, "remote_block_ids"),
    (READ, consumer_params(), ROUTER_ID, "remote_block_ids"),
    (WRITE, consumer_params(), "cmpl-___prefill_addr_host:h,handshake:x,notify:1___decode_addr_host:h,"
                               f"handshake:2,notify:3_{'a' * 32}", "bad port"),
])
def test_malformed_params_fail_the_request_with_a_message_instead_of_raising(mode, params, request_id, field):
    s = make_scheduler("kv_consumer", mode)
    request = FakeRequest(request_id, params, 40)
    count, is_async = s.scheduler.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (40, True), "the request must wait for the failure report, not prefill silently"
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), count)
    [recv] = meta_of(s).recvs
    assert recv.request_id == request_id and field in recv.error
    assert s.scheduler.request_finished(request, ([1, 2, 3],)) == (False, None)


def test_producer_params_on_the_consumer_are_ignored():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, {"do_remote_decode": True, "transfer_id": "tx-1"}, 40)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
