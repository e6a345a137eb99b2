"""TransferEngine, WRITE mode (P pushes each layer into D's blocks), with real byte movement."""

from __future__ import annotations

import time

import pytest

from pdserve.config import TransferMode
from pdserve.control.messages import Release, RemoteBlocks, WriteDone
from pdserve.transfer.layout import KvLayout, LayerPlacement
from pdserve.transfer.specs import CancelSpec, RecvSpec, SendSpec
from tests.unit.connector.harness import (
    D_ADDRESS,
    D_IDENTITY,
    NUM_BLOCKS,
    NUM_LAYERS,
    P_ADDRESS,
    P_IDENTITY,
    PROMPT_HASH,
    Pair,
)

WRITE = TransferMode.WRITE
P_BLOCKS = (0, 1, 2, 3)
D_BLOCKS = (3, 4, 5, 6)


def recv_spec(request_id="req-d", transfer_id="t1", blocks=D_BLOCKS, first_block=1, prompt_hash=PROMPT_HASH,
              **kw) -> RecvSpec:
    return RecvSpec(request_id, transfer_id, WRITE, P_ADDRESS, blocks, first_block, None, None, prompt_hash, **kw)


def send(pair: Pair, request_id="req-p", transfer_id="t1", blocks=P_BLOCKS, layers=range(NUM_LAYERS),
         prompt_hash=PROMPT_HASH) -> None:
    pair.p.engine.begin_step()
    pair.p.engine.add_send(SendSpec(request_id, transfer_id, D_ADDRESS, blocks, prompt_hash))
    for layer in layers:
        pair.p.engine.layer_ready(layer)


def assert_moved(pair: Pair, p_before, d_before, first_block: int, p_blocks=P_BLOCKS, d_blocks=D_BLOCKS) -> None:
    """D's blocks from first_block on hold P's bytes; every other D block is untouched; P unchanged."""
    moved = {d: p for p, d in list(zip(p_blocks, d_blocks))[first_block:]}
    for layer in range(NUM_LAYERS):
        for block in range(NUM_BLOCKS):
            expected = p_before[(layer, moved[block])] if block in moved else d_before[(layer, block)]
            assert pair.d.read_block(layer, block) == expected, f"layer {layer} block {block}"
    assert pair.p.snapshot() == p_before


def ok_done(transfer_id="t1") -> WriteDone:
    return WriteDone(transfer_id, True, "", PROMPT_HASH)


@pytest.mark.parametrize("first_block", [0, 1, 3, 4])
def test_write_moves_exactly_the_blocks_from_first_block_on(first_block):
    with Pair(WRITE) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        added = time.time()
        pair.d.engine.add_recv(recv_spec(first_block=first_block))
        pair.pump_until(lambda: pair.d.notifier.messages(RemoteBlocks), sides=(pair.d,))  # after the handshake
        [announced] = pair.d.notifier.sent
        blocks = announced.message
        assert (blocks.transfer_id, blocks.block_ids, blocks.first_block, blocks.prompt_hash) == (
            "t1", list(D_BLOCKS), first_block, PROMPT_HASH)
        assert 5.0 - (time.time() - added) - 0.5 <= blocks.write_for <= 5.0, "P's write window is D's transfer deadline"
        assert (announced.address, announced.recipient) == (P_ADDRESS, P_IDENTITY)
        send(pair)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert not pair.d.failed_recving
        assert [(s.message, s.recipient) for s in pair.p.notifier.sent] == [(ok_done(), D_IDENTITY)]
        assert_moved(pair, p_before, d_before, first_block)
        assert pair.d.engine.stats.num_completed == 1 and pair.p.engine.stats.num_completed == 1
        assert not pair.p.engine.has_active() and not pair.d.engine.has_active()


def test_p_reports_sending_only_once_the_request_is_finished_and_only_once():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(recv_spec())
        send(pair)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        pair.pump_for(0.05)
        assert pair.p.sending == set(), "P freed blocks of a request vLLM has not finished"
        pair.p.finished_req_ids.add("req-p")
        pair.pump()
        assert pair.p.sending == {"req-p"}
        pair.p.sending.clear()
        pair.p.finished_req_ids.add("req-p")
        pair.pump_for(0.02)
        assert pair.p.sending == set(), "reported twice"


def test_p_reports_sending_when_the_request_finished_before_the_write_completed():
    with Pair(WRITE) as pair:
        pair.p.finished_req_ids.add("req-p")  # vLLM finished the request (delay_free) before the copy
        send(pair)
        pair.pump(sides=(pair.p,))
        assert pair.p.sending == set(), "reported before D even announced its blocks"
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: "req-p" in pair.p.sending and "req-d" in pair.d.recving)
        assert not pair.d.failed_recving


def test_write_done_only_after_every_layer_was_written():
    with Pair(WRITE) as pair:
        p_before = pair.p.snapshot()
        pair.d.engine.add_recv(recv_spec(first_block=0))
        send(pair, layers=[0])
        pair.pump_until(lambda: all(pair.d.read_block(0, d) == p_before[(0, p)] for p, d in zip(P_BLOCKS, D_BLOCKS)))
        pair.pump_for(0.05)
        assert pair.p.notifier.messages(WriteDone) == []
        assert pair.d.recving == set()
        pair.p.engine.layer_ready(1)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert not pair.d.failed_recving
        assert all(pair.d.read_block(1, d) == p_before[(1, p)] for p, d in zip(P_BLOCKS, D_BLOCKS))


def test_remote_blocks_before_add_send_are_held_and_applied():
    with Pair(WRITE) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec())
        for _ in range(3):
            pair.pump()  # P sees RemoteBlocks for a transfer it does not know yet
        assert pair.d.recving == set() and pair.p.notifier.sent == []
        send(pair)
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert not pair.d.failed_recving
        assert_moved(pair, p_before, d_before, 1)


def test_layers_ready_before_remote_blocks_are_written_when_they_arrive():
    with Pair(WRITE) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        send(pair)  # the whole forward pass ran before D announced anything
        pair.pump_for(0.05)
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert not pair.d.failed_recving
        assert_moved(pair, p_before, d_before, 1)


def test_late_messages_after_success_are_ignored():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(recv_spec())
        send(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        d_after = pair.d.snapshot()
        p_sent, d_sent = len(pair.p.notifier.sent), len(pair.d.notifier.sent)
        pair.p.sending.clear(), pair.d.recving.clear()
        pair.p.engine.on_message(D_IDENTITY, RemoteBlocks("t1", [0, 1, 2, 3], 0, PROMPT_HASH, 5.0))
        pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        pair.d.engine.on_message(P_IDENTITY, WriteDone("t1", False, "late"))
        pair.d.engine.on_message(P_IDENTITY, ok_done())
        pair.p.finished_req_ids.add("req-p")
        pair.pump_for(0.05)
        assert (pair.p.sending, pair.d.recving, pair.d.failed_recving) == (set(), set(), set())
        assert len(pair.d.notifier.sent) == d_sent
        assert all(not s.message.ok for s in pair.p.notifier.sent[p_sent:]), \
            "P may answer the late Release that it will not write again, nothing else"
        assert pair.d.snapshot() == d_after, "a late RemoteBlocks started a new write"
        assert not pair.p.engine.has_active() and not pair.d.engine.has_active()
        assert (pair.d.engine.stats.num_completed, pair.d.engine.stats.num_failed) == (1, 0)


def test_a_failed_receive_is_not_revived_by_a_late_success():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(recv_spec())
        pair.d.engine.on_message(P_IDENTITY, WriteDone("t1", False, "boom"))
        pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        assert pair.d.failed_recving == {"req-d"}
        pair.d.recving.clear(), pair.d.failed_recving.clear()
        pair.d.engine.on_message(P_IDENTITY, ok_done())
        pair.pump_for(0.03, sides=(pair.d,))
        assert (pair.d.recving, pair.d.failed_recving) == (set(), set())
        assert (pair.d.engine.stats.num_completed, pair.d.engine.stats.num_failed) == (0, 1)


def test_duplicate_transfer_id_fails_the_second_and_leaves_the_first_alone():
    with Pair(WRITE) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec("req-a"))
        pair.d.engine.add_recv(recv_spec("req-b", blocks=(7, 0, 1, 2)))
        pair.pump(sides=(pair.d,))
        assert pair.d.recving == {"req-b"} and pair.d.failed_recving == {"req-b"}
        pair.pump_until(lambda: pair.d.notifier.messages(RemoteBlocks), sides=(pair.d,))
        pair.pump_for(0.03, sides=(pair.d,))
        assert len(pair.d.notifier.messages(RemoteBlocks)) == 1, "the duplicate announced blocks"
        send(pair)
        pair.pump_until(lambda: "req-a" in pair.d.recving)
        assert pair.d.failed_recving == {"req-b"}
        assert_moved(pair, p_before, d_before, 1)


def test_duplicate_send_fails_the_second_and_leaves_the_first_alone():
    with Pair(WRITE) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec())
        pair.p.engine.begin_step()
        pair.p.engine.add_send(SendSpec("req-p", "t1", D_ADDRESS, P_BLOCKS, PROMPT_HASH))
        pair.p.engine.add_send(SendSpec("req-q", "t1", D_ADDRESS, (4, 5, 6, 7), PROMPT_HASH))
        pair.p.engine.all_layers_ready()
        pair.p.finished_req_ids |= {"req-p", "req-q"}
        pair.pump_until(lambda: "req-d" in pair.d.recving and pair.p.sending == {"req-p", "req-q"})
        assert not pair.d.failed_recving
        assert_moved(pair, p_before, d_before, 1)
        assert pair.p.notifier.messages(WriteDone) == [ok_done()]


def test_recv_spec_with_error_fails_at_once_without_telling_anyone():
    with Pair(WRITE) as pair:
        pair.d.engine.add_recv(recv_spec("req-x", transfer_id="", error="kv_transfer_params.transfer_id is bad"))
        pair.pump(sides=(pair.d,))
        assert pair.d.recving == {"req-x"} and pair.d.failed_recving == {"req-x"}
        assert pair.d.notifier.sent == []


def test_cancel_on_p_tells_d_write_failed():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec())
        pair.p.engine.cancel(CancelSpec("t1", D_ADDRESS, "prefill ended before its KV was complete"))
        pair.pump_until(lambda: "req-d" in pair.d.recving)  # WriteDone leaves once P handshook D
        assert [(s.message, s.recipient) for s in pair.p.notifier.sent] == [
            (WriteDone("t1", False, "prefill ended before its KV was complete"), D_IDENTITY)]
        assert pair.d.failed_recving == {"req-d"}
        pair.pump_for(0.03)  # D's RemoteBlocks reaches P after the cancel: ignored
        assert not pair.p.engine.has_active()
        assert pair.d.snapshot() == d_before


def test_cancel_on_d_sends_release():
    with Pair(WRITE) as pair:
        pair.d.engine.cancel(CancelSpec("t1", P_ADDRESS, "decode computes this prompt itself"))
        pair.pump_until(lambda: pair.d.notifier.sent, sides=(pair.d,))  # once D knows P's incarnation
        assert [(s.address, s.message, s.recipient) for s in pair.d.notifier.sent] == [
            (P_ADDRESS, Release("t1", "127.0.0.1", D_ADDRESS.notify_port), P_IDENTITY)]


def test_cancel_drops_a_held_early_message():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: pair.d.notifier.delivered, sides=(pair.d,))
        pair.pump(sides=(pair.p,))  # RemoteBlocks held early at P
        pair.p.engine.cancel(CancelSpec("t1", D_ADDRESS, "gone"))
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        pair.pump_for(0.03)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.snapshot() == d_before


def test_block_out_of_the_layout_fails_the_write_and_tells_d():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec(blocks=(3, 4, 5, NUM_BLOCKS + 5)))
        send(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert pair.d.failed_recving == {"req-d"}
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "out of range" in done.error
        assert pair.d.snapshot() == d_before


def test_copy_failure_in_the_transport_fails_the_write_and_tells_d():
    with Pair(WRITE) as pair:
        d_before = pair.d.snapshot()
        # D's handshake claims far more blocks than its region holds: the layout check passes,
        # the transport's bounds check must catch it.
        pair.d.advertised_layout = KvLayout(tuple(
            LayerPlacement(l.region_id, l.offset, l.block_bytes, 1000) for l in pair.d.layout.layers
        ))
        pair.d.engine.add_recv(recv_spec(blocks=(3, 4, 5, 500)))
        send(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert pair.d.failed_recving == {"req-d"}
        [done] = pair.p.notifier.messages(WriteDone)
        assert not done.ok and "copy failed" in done.error
        assert pair.d.snapshot() == d_before, "a failed batch must not copy any byte"
        assert pair.p.engine.stats.num_failed == 1
