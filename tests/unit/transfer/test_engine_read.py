"""TransferEngine, READ mode (P holds its blocks, D pulls them and releases), with real bytes."""

from __future__ import annotations

import time

import pytest

from pdserve.config import TransferMode
from pdserve.control.address import PeerAddress
from pdserve.control.messages import ReadAck, ReadDone, Release, RemoteBlocks
from pdserve.transfer.specs import CancelSpec, HoldSpec, RecvSpec
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

READ = TransferMode.READ
P_BLOCKS = (5, 6, 7, 0)
D_BLOCKS = (1, 2, 3, 4)
D_REPLY = PeerAddress(D_ADDRESS.host, 0, D_ADDRESS.notify_port)  # where P sends its ReadAck


def recv_spec(request_id="req-d", transfer_id="t1", first_block=0, hold_s=30.0, remote=P_BLOCKS,
              prompt_hash=PROMPT_HASH, blocks=D_BLOCKS, **kw) -> RecvSpec:
    return RecvSpec(request_id, transfer_id, READ, P_ADDRESS, blocks, first_block, remote, time.time() + hold_s,
                    prompt_hash, **kw)


def hold(pair: Pair, request_id="req-p", transfer_id="t1", hold_s=30.0, blocks=P_BLOCKS,
         prompt_hash=PROMPT_HASH) -> None:
    pair.p.engine.begin_step()
    pair.p.engine.add_hold(HoldSpec(request_id, transfer_id, blocks, time.time() + hold_s, prompt_hash))


def read_done(transfer_id="t1", blocks=P_BLOCKS, prompt_hash=PROMPT_HASH) -> ReadDone:
    """What D sends P once it has read `blocks`."""
    return ReadDone(transfer_id, list(blocks), prompt_hash, D_ADDRESS.host, D_ADDRESS.notify_port)


def ask(pair: Pair, message: ReadDone, sender: str = D_IDENTITY, timeout_s: float = 2.0) -> ReadAck:
    """Hand P a ReadDone from `sender` and return the ReadAck P answers it with."""
    before = len(pair.p.notifier.messages(ReadAck))
    pair.p.engine.on_message(sender, message)
    pair.pump_until(lambda: len(pair.p.notifier.messages(ReadAck)) > before, timeout_s, sides=(pair.p,))
    [answer] = pair.p.notifier.messages(ReadAck)[before:]
    return answer


@pytest.mark.parametrize("first_block", [0, 2, 4])
def test_read_pulls_exactly_the_blocks_from_first_block_on_then_p_confirms(first_block):
    with Pair(READ) as pair:
        p_before, d_before = pair.p.snapshot(), pair.d.snapshot()
        hold(pair)
        pair.p.finished_req_ids.add("req-p")  # P's request finished when it returned delay_free
        pair.pump()
        pair.d.engine.add_recv(recv_spec(first_block=first_block))
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert not pair.d.failed_recving
        assert [(s.address, s.message, s.recipient) for s in pair.d.notifier.sent] == [
            (P_ADDRESS, read_done(), P_IDENTITY)], "D reads, confirms once, and sends nothing else"
        assert [(s.address, s.message, s.recipient) for s in pair.p.notifier.sent] == [
            (D_REPLY, ReadAck("t1", True, ""), D_IDENTITY)]
        moved = {d: p for p, d in list(zip(P_BLOCKS, D_BLOCKS))[first_block:]}
        for layer in range(NUM_LAYERS):
            for block in range(NUM_BLOCKS):
                expected = p_before[(layer, moved[block])] if block in moved else d_before[(layer, block)]
                assert pair.d.read_block(layer, block) == expected, f"layer {layer} block {block}"
        assert pair.p.snapshot() == p_before
        assert pair.p.engine.stats.num_completed == 1 and pair.d.engine.stats.num_completed == 1


@pytest.mark.parametrize("how", ["read_done", "release"])
def test_p_hold_reports_sending_only_once_d_let_go_and_the_request_finished(how):
    with Pair(READ) as pair:
        hold(pair)
        pair.pump_for(0.03)
        assert pair.p.sending == set()
        if how == "read_done":
            assert ask(pair, read_done()) == ReadAck("t1", True, "")
        else:
            pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        pair.pump_for(0.03)
        assert pair.p.sending == set(), "reported before vLLM passed the request id as finished"
        pair.p.finished_req_ids.add("req-p")
        pair.pump()
        assert pair.p.sending == {"req-p"}
        assert not pair.p.engine.has_active()


def test_read_done_confirms_only_the_blocks_held_and_only_once():
    with Pair(READ, p_timeouts={"defer_timeout": 0.1}) as pair:
        hold(pair)
        wrong = ask(pair, read_done(blocks=[1, 2, 3, 4]))
        assert not wrong.ok and "holds blocks" in wrong.error
        unknown = ask(pair, read_done("t2"))  # held for defer_timeout in case the hold comes, then refused
        assert not unknown.ok and unknown.transfer_id == "t2"
        assert ask(pair, read_done()).ok, "a wrong guess freed the hold"
        again = ask(pair, read_done())
        assert not again.ok and "is over" in again.error


def test_read_done_after_the_hold_expired_is_refused():
    with Pair(READ) as pair:
        hold(pair, hold_s=0.05)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        assert not ask(pair, read_done()).ok


def test_read_done_before_the_hold_is_known_waits_for_it():
    with Pair(READ) as pair:
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: pair.d.notifier.messages(ReadDone), sides=(pair.d,))  # P's worker has no hold yet
        hold(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-d" in pair.d.recving and "req-p" in pair.p.sending)
        assert not pair.d.failed_recving


def test_read_done_never_confirmed_fails_the_read_and_releases():
    with Pair(READ, p_timeouts={"defer_timeout": 0.2}) as pair:
        pair.d.engine.add_recv(recv_spec())  # P holds nothing for t1: it refuses after defer_timeout
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.p.notifier.messages(ReadAck) == [ReadAck("t1", False, pair.p.notifier.messages(ReadAck)[0].error)]
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert pair.d.engine.stats.num_completed == 0


def test_unreachable_prefill_fails_the_read():
    with Pair(READ, d_timeouts={"transfer_timeout": 0.3}) as pair:
        hold(pair)
        pair.d.notifier.drop = True
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.p.notifier.messages(ReadAck) == [], "P never heard of the read"


def test_late_messages_after_a_finished_hold_are_ignored():
    with Pair(READ) as pair:
        hold(pair)
        pair.p.finished_req_ids.add("req-p")
        assert ask(pair, read_done()).ok
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        pair.p.sending.clear()
        pair.p.engine.on_message(D_IDENTITY, Release("t1"))
        pair.p.engine.on_message(D_IDENTITY, RemoteBlocks("t1", [1], 0, PROMPT_HASH, 5.0))
        pair.p.finished_req_ids.add("req-p")
        pair.pump_for(0.03, sides=(pair.p,))
        assert pair.p.sending == set() and len(pair.p.notifier.sent) == 1, "only the one ReadAck"
        assert not pair.p.engine.has_active()
        assert (pair.p.engine.stats.num_completed, pair.p.engine.stats.num_failed) == (1, 0)


def test_read_of_blocks_p_already_freed_is_a_failure():
    """P frees its blocks at its hold's expiry: a read of them after that reads whatever P put
    there since, and P's refusal to confirm it must make it a failure."""
    with Pair(READ) as pair:
        hold(pair, hold_s=0.05)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        [ack] = pair.p.notifier.messages(ReadAck)
        assert not ack.ok and "is over" in ack.error
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"], "D must still let P go"
        assert pair.d.engine.stats.num_completed == 0


def test_handshake_failure_fails_the_read_and_p_frees_at_its_expiry():
    with Pair(READ) as pair:
        pair.p.handshake_error = "peer 127.0.0.1:6301 refused the handshake: dtype differs"
        hold(pair, hold_s=0.3)
        pair.p.finished_req_ids.add("req-p")
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec())
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert pair.d.notifier.sent == [], "no incarnation answered: there is nobody to address a Release to"
        assert pair.d.snapshot() == d_before
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))  # P frees at its hold's expiry


def test_remote_block_out_of_the_layout_fails_the_read_and_releases():
    with Pair(READ) as pair:
        hold(pair)
        d_before = pair.d.snapshot()
        pair.d.engine.add_recv(recv_spec(remote=(5, 6, 7, NUM_BLOCKS)))
        pair.pump_until(lambda: "req-d" in pair.d.recving)
        assert pair.d.failed_recving == {"req-d"}
        assert [m.transfer_id for m in pair.d.notifier.messages(Release)] == ["t1"]
        assert pair.d.snapshot() == d_before


def test_duplicate_read_fails_the_second_and_leaves_the_first_alone():
    with Pair(READ) as pair:
        hold(pair)
        pair.d.engine.add_recv(recv_spec("req-a"))
        pair.d.engine.add_recv(recv_spec("req-b"))
        pair.pump_until(lambda: {"req-a", "req-b"} <= pair.d.recving)
        assert pair.d.failed_recving == {"req-b"}
        assert [s.message for s in pair.d.notifier.sent] == [read_done()], \
            "the duplicate must not release the first one's hold"


def test_duplicate_hold_fails_the_second_and_leaves_the_first_alone():
    with Pair(READ) as pair:
        hold(pair, "req-p")
        hold(pair, "req-q")
        pair.p.finished_req_ids |= {"req-p", "req-q"}
        pair.pump(sides=(pair.p,))
        assert pair.p.sending == {"req-q"}, "the duplicate hold must free its blocks at once"
        assert ask(pair, read_done()).ok
        pair.p.finished_req_ids |= {"req-p"}
        pair.pump(sides=(pair.p,))
        assert pair.p.sending == {"req-p", "req-q"}


def test_recv_spec_with_error_fails_at_once():
    with Pair(READ) as pair:
        pair.d.engine.add_recv(RecvSpec("req-x", "", READ, None, D_BLOCKS, 0, None, None,
                                        error="kv_transfer_params.remote_block_ids is missing"))
        pair.pump(sides=(pair.d,))
        assert pair.d.recving == {"req-x"} and pair.d.failed_recving == {"req-x"}
        assert pair.d.notifier.sent == []


def test_cancel_on_d_releases_p_hold():
    with Pair(READ) as pair:
        hold(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.d.engine.cancel(CancelSpec("t1", P_ADDRESS, "request ended before decode allocated its blocks"))
        pair.pump_until(lambda: "req-p" in pair.p.sending)  # the Release leaves once D knows P's incarnation
        assert [(s.message, s.recipient) for s in pair.d.notifier.sent] == [(Release("t1", "127.0.0.1", D_ADDRESS.notify_port), P_IDENTITY)]
        assert pair.p.notifier.sent == [], "a released hold is not answered"


def test_a_cancel_naming_no_peer_tells_nobody_and_the_step_goes_on():
    """Malformed params name no peer: D's cancel of such a leg must not stop the rest of its step."""
    with Pair(READ) as pair:
        pair.d.engine.cancel(CancelSpec("t-bad", None, "decode rejected the prefill's kv_transfer_params"))
        hold(pair)
        pair.p.finished_req_ids.add("req-p")
        pair.d.engine.cancel(CancelSpec("t1", P_ADDRESS, "request ended before decode allocated its blocks"))
        pair.pump_until(lambda: "req-p" in pair.p.sending)
        assert [s.message.transfer_id for s in pair.d.notifier.sent] == ["t1"]
