"""Which peers an engine talks to, and for how long: hosts outside `allowed_peers` are never
contacted (no handshake, no message), and a peer nobody used for `peer_idle_timeout` is forgotten."""

from __future__ import annotations

import logging

import pytest

from tests.unit.connector.harness import D_IDENTITY, P_ADDRESS, Pair
from tests.unit.transfer.transfers import READ, WRITE, hold, read_done, read_recv, remote_blocks, send, write_recv

ELSEWHERE = {"allowed_peers": ["10.0.0.0/8"]}  # the harness's peers all live on 127.0.0.1


@pytest.mark.parametrize("mode, spec", [(WRITE, write_recv), (READ, read_recv)])
def test_d_refuses_a_prefill_outside_the_allow_list_without_contacting_it(mode, spec, caplog):
    with Pair(mode, d_timeouts=ELSEWHERE) as pair:
        caplog.set_level(logging.ERROR, logger="pdserve.connector")
        pair.d.engine.add_recv(spec())
        elapsed = pair.pump_until(lambda: "req-d" in pair.d.recving, sides=(pair.d,))
        pair.pump_for(0.05, sides=(pair.d,))
        assert elapsed < 1.0
        assert pair.d.failed_recving == {"req-d"}
        assert pair.p.handshakes == 0 and pair.d.notifier.sent == []
        assert pair.d.engine.stats.num_refused == 1
        failure = next(r.getMessage() for r in caplog.records if "transfer t1" in r.getMessage())
        assert "'127.0.0.1'" in failure and "allowed_peers" in failure


def test_p_refuses_a_decode_outside_the_allow_list_and_writes_nothing():
    with Pair(WRITE, p_timeouts=ELSEWHERE) as pair:
        d_before = pair.d.snapshot()
        pair.p.engine.on_message(D_IDENTITY, remote_blocks())  # the announcement of a D P may not reach
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_until(lambda: "req-p" in pair.p.sending, sides=(pair.p,))
        assert pair.d.handshakes == 0 and pair.p.notifier.sent == []
        assert pair.p.engine.stats.num_refused == 1
        assert pair.p.engine.stats.num_completed == 0
        assert pair.d.snapshot() == d_before


def test_p_send_to_a_refused_decode_fails_at_once_even_before_any_announcement(caplog):
    """The refusal is known when the send is added: P must not keep the request's blocks for
    defer_timeout waiting for an announcement it could never act on."""
    with Pair(WRITE, p_timeouts={**ELSEWHERE, "defer_timeout": 1.5}) as pair:
        caplog.set_level(logging.ERROR, logger="pdserve.connector")
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        elapsed = pair.pump_until(lambda: "req-p" in pair.p.sending, timeout_s=3.0, sides=(pair.p,))
        assert elapsed < 1.0, f"P held the blocks {elapsed:.1f} s for a decode it may not contact"
        assert pair.d.handshakes == 0 and pair.p.notifier.sent == []
        assert pair.p.engine.stats.num_refused == 1
        failure = next(r.getMessage() for r in caplog.records if "transfer t1" in r.getMessage())
        assert "allowed_peers" in failure


def test_p_never_answers_a_read_done_whose_reply_address_is_outside_the_allow_list():
    with Pair(READ, p_timeouts=ELSEWHERE) as pair:
        hold(pair.p)
        pair.p.engine.on_message(D_IDENTITY, read_done())  # asks for the answer at 127.0.0.1
        pair.pump_for(0.05, sides=(pair.p,))
        assert pair.p.notifier.sent == [] and pair.d.handshakes == 0


def test_idle_peers_are_forgotten_and_handshaken_again_when_needed():
    with Pair(WRITE, d_timeouts={"peer_idle_timeout": 0.2}) as pair:
        pair.d.engine.add_recv(write_recv("req-d0", "t0"))
        send(pair.p, "req-p0", "t0")
        pair.pump_until(lambda: "req-d0" in pair.d.recving)
        assert pair.d.engine.num_peers == 1
        pair.pump_until(lambda: pair.d.engine.num_peers == 0, timeout_s=2.0, sides=(pair.d,))
        assert pair.d.notifier.forgotten == [P_ADDRESS], "queued messages for an evicted peer must go too"
        pair.d.engine.add_recv(write_recv("req-d1", "t1"))
        send(pair.p, "req-p1", "t1")
        pair.pump_until(lambda: "req-d1" in pair.d.recving)
        assert pair.d.failed_recving == set()
        assert pair.p.handshakes == 2


def test_a_peer_with_a_transfer_in_flight_is_not_evicted():
    with Pair(WRITE, d_timeouts={"peer_idle_timeout": 0.1, "transfer_timeout": 3.0}) as pair:
        pair.d.engine.add_recv(write_recv())  # P never prefills: the transfer stays in flight
        pair.pump_for(0.7, sides=(pair.d,))  # past two liveness checks, long past the idle timeout
        assert pair.d.engine.num_peers == 1 and pair.d.notifier.forgotten == []
        assert pair.d.engine.has_active()


def _incompatible(pair) -> None:
    """P and D answer each other's handshake with a refusal (their KV layouts differ)."""
    for side in (pair.p, pair.d):
        side.handshake_error, side.refuses = f"{side.identity} has an incompatible KV cache (block_size)", True


@pytest.mark.parametrize("unanswered", [False, True])
def test_p_frees_a_write_send_at_once_when_the_decode_refuses_the_handshake(unanswered):
    """An incompatible D will never announce blocks: P must not hold the prompt's KV for
    defer_timeout. With `unanswered`, D's own Release is lost and P's refusal alone must do it."""
    with Pair(WRITE, p_timeouts={"defer_timeout": 4.0}, d_timeouts={"transfer_timeout": 4.0}) as pair:
        _incompatible(pair)
        pair.d.notifier.drop = unanswered
        pair.d.engine.add_recv(write_recv())
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        elapsed = pair.pump_until(lambda: "req-p" in pair.p.sending and "req-d" in pair.d.recving, timeout_s=6.0)
        assert elapsed < 1.0, f"P held the blocks {elapsed:.1f} s for a decode that refused it"
        assert pair.d.failed_recving == {"req-d"}
        assert pair.p.engine.stats.num_completed == 0


def test_d_refused_by_p_releases_p_read_hold_at_once():
    """READ: P refused D's handshake; D fails its read and still tells that P incarnation to let
    go of the held blocks, instead of leaving them held until the hold expires."""
    with Pair(READ) as pair:
        _incompatible(pair)
        hold(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.d.engine.add_recv(read_recv())
        elapsed = pair.pump_until(lambda: "req-p" in pair.p.sending and "req-d" in pair.d.recving, timeout_s=6.0)
        assert elapsed < 1.0, f"P held the blocks {elapsed:.1f} s for a decode it refused"
        assert pair.d.failed_recving == {"req-d"}
        releases = [s for s in pair.d.notifier.delivered if type(s.message).__name__ == "Release"]
        assert [s.recipient for s in releases] == [pair.p.identity]


def test_an_unanswered_handshake_keeps_the_write_send_waiting():
    """A peer that did not answer (timeout, not a refusal) may still come: P keeps its send until
    D announces or defer_timeout, as before."""
    with Pair(WRITE, p_timeouts={"defer_timeout": 4.0}) as pair:
        pair.d.handshake_error = "no reply from 127.0.0.1:6302 to HandshakeRequest within 10 s"
        send(pair.p)
        pair.p.finished_req_ids.add("req-p")
        pair.pump_for(0.5, sides=(pair.p,))
        assert "req-p" not in pair.p.sending
