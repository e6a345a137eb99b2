"""PDScheduler on D: what it promises vLLM and which RecvSpec / CancelSpec it emits."""

from __future__ import annotations

import pytest

from pdserve.config import TransferMode
from pdserve.connector.metadata import CancelSpec, RecvSpec
from tests.unit.connector.harness import P_ADDRESS
from tests.unit.connector.scheduler_fakes import (
    ROUTER_ID,
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
    assert s.scheduler.request_finished(request, [1, 2, 3]) == (False, None)
    meta = meta_of(s)
    assert (meta.recvs, meta.cancels) == ([], [])


@pytest.mark.parametrize("computed, first_block", [(0, 0), (16, 1), (32, 2)])
def test_allocation_emits_exactly_one_recv_skipping_the_local_prefix(computed, first_block):
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    count, _ = s.scheduler.get_num_new_matched_tokens(request, computed)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([8, 1, 5, 2]), count)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([8, 1, 5, 2]), count)
    assert meta_of(s).recvs == [RecvSpec(ROUTER_ID, "tx-1", WRITE, P_ADDRESS, (8, 1, 5), first_block, None, None)]
    assert meta_of(s).recvs == []
    assert s.scheduler.get_num_new_matched_tokens(request, computed) == (0, False), \
        "a request already receiving must not be promised a second load"
    assert s.scheduler.request_finished(request, [8, 1, 5, 2]) == (False, None)
    assert meta_of(s).cancels == [], "the engine owns a transfer that has started"


def test_read_recv_carries_p_blocks_and_hold_expiry():
    s = make_scheduler("kv_consumer", READ)
    params = consumer_params(remote_block_ids=[4, 5, 6], remote_host="127.0.0.1", remote_handshake_port=6301,
                             remote_notify_port=6401, hold_expires_at=1234.5)
    request = FakeRequest("cmpl-plain-0", params, 40)
    count, is_async = s.scheduler.get_num_new_matched_tokens(request, 0)
    assert (count, is_async) == (40, True)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), count)
    assert meta_of(s).recvs == [RecvSpec("cmpl-plain-0", "tx-1", READ, P_ADDRESS, (1, 2, 3), 0, (4, 5, 6), 1234.5)]


def test_zero_external_tokens_cancels_the_transfer():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    s.scheduler.update_state_after_alloc(request, FakeBlocks([1, 2, 3]), 0)
    meta = meta_of(s)
    assert meta.recvs == []
    [cancel] = meta.cancels
    assert (cancel.transfer_id, cancel.peer) == ("tx-1", P_ADDRESS) and cancel.reason
    assert s.scheduler.request_finished(request, [1, 2, 3]) == (False, None)
    assert meta_of(s).cancels == [], "cancelled twice"


def test_request_finished_before_allocation_cancels():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, consumer_params(), 40)
    s.scheduler.get_num_new_matched_tokens(request, 0)
    assert s.scheduler.request_finished(request, []) == (False, None)
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
    assert s.scheduler.request_finished(request, [1, 2, 3]) == (False, None)


def test_producer_params_on_the_consumer_are_ignored():
    s = make_scheduler("kv_consumer", WRITE)
    request = FakeRequest(ROUTER_ID, {"do_remote_decode": True, "transfer_id": "tx-1"}, 40)
    assert s.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
